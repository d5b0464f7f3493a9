"""JobSpec -> the text of the batch script (pure: same inputs, same bytes).

    #!/bin/bash
    #SBATCH --job-name=... --output=... (job-wide options, first block only)
    # component 0: head          <- one block per component, separated by `#SBATCH hetjob`
    #SBATCH --partition=... --nodes=... --ntasks-per-node=...
    #SBATCH hetjob
    # component 1: trainer
    ...
    module load / setup lines / exports of the cluster profile
    exec <command>               <- the head, in the batch step of component 0

The command is the submitit runner (`python -u -m submitit.core._submit FOLDER`) when submitted
through hpcrl.slurm.executor, or `python -m hpcrl.launch.head RUN_DIR` in the hand-usable
templates of sbatch/. Golden files in sbatch/golden/ pin the output for the shipped configs.
Submitting is elsewhere (executor.py): rendering never touches Slurm.
"""

from __future__ import annotations

import shlex

from hpcrl.slurm.spec import JobSpec


def _flag(option: str, value: str) -> str:
    return f"#SBATCH --{option}" if value == "" else f"#SBATCH --{option}={shlex.quote(value)}"


def render_script(spec: JobSpec, *, run_dir: str, command: str, stdout: str, stderr: str) -> str:
    """The batch script of `spec`; `command` is exec'd by the batch step (the head)."""
    names = ", ".join(g.name for g in spec.groups)
    kind = (f"{len(spec.blocks)} components ({names})" if spec.layout == "hetjob"
            else f"one allocation split among {names}")
    lines = [
        "#!/bin/bash",
        f"# hpcrl run {spec.job_name}: layout {spec.layout}, cluster {spec.cluster}, {kind}.",
        "# Rendered by hpcrl.slurm.render; `hpcrl submit --dry-run` writes it without submitting.",
        _flag("job-name", spec.job_name),
        _flag("output", stdout),
        _flag("error", stderr),
        _flag("open-mode", "append"),
        # B: the signal goes to the batch step, which is the head (exec below); it tells the groups.
        _flag("signal", f"B:USR2@{spec.signal_delay_s}"),
    ]
    for i, block in enumerate(spec.blocks):
        if i:
            lines.append("#SBATCH hetjob")
        lines.append(f"# {block.title}")
        lines += [_flag(option, value) for option, value in block.options]
    for note in spec.notes:
        lines.append(f"# note: {note}")
    lines += ["", "set -e"]
    if spec.modules or spec.setup or spec.env:
        lines += ["", "# environment (cluster profile)"]
        lines += [f"module load {shlex.quote(m)}" for m in spec.modules]
        lines += list(spec.setup)
        lines += [f"export {name}={shlex.quote(value)}" for name, value in spec.env]
    lines += [
        "",
        "# the head runs here (batch step, component 0) and starts one srun step per group",
        f"export HPCRL_RUN_DIR={shlex.quote(run_dir)}",
        f"exec {command}",
        "",
    ]
    return "\n".join(lines)
