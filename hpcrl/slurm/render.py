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

from hpcrl.config.schema import one_line
from hpcrl.slurm.spec import JobSpec


def _flag(option: str, value: str) -> str:
    # The config refuses control characters in what reaches a flag; a spec made otherwise is checked here:
    # a newline in an #SBATCH line would run the rest of the value as a shell command of the script.
    one_line(value, f"#SBATCH --{option}")
    return f"#SBATCH --{option}" if value == "" else f"#SBATCH --{option}={shlex.quote(value)}"


#: The head's command in the hand-usable templates of sbatch/ (see render_template).
TEMPLATE_COMMAND = '"${HPCRL_PYTHON:-python3}" -u -m hpcrl.launch.head "$HPCRL_RUN_DIR"'


def render_script(spec: JobSpec, *, run_dir: str | None, command: str, stdout: str, stderr: str,
                  python: str) -> str:
    """The batch script of `spec`; `command` runs the head, `python` its guard (hpcrl.launch.guard).

    The head runs as the script's child, not exec'd: when it dies by a signal (kill -9, the OOM
    killer) the script is still there to have the guard requeue the run. The script forwards
    SIGUSR2 (the time limit; `--signal=B:` reaches only the batch shell) to the head; SIGTERM
    (scancel) reaches the head directly, the whole batch step being signalled, and the script
    ignores it until the head has ended. With run_dir None the script takes HPCRL_RUN_DIR from the
    environment (templates).
    """
    one_line(spec.cluster, "cluster.name")
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
        # B: the signal goes to the batch shell, which passes it to the head; it tells the groups.
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
        f"export HPCRL_RUN_DIR={shlex.quote(run_dir)}" if run_dir is not None else
        ': "${HPCRL_RUN_DIR:?set HPCRL_RUN_DIR to a run directory made by hpcrl submit --dry-run}"',
        f"{command} &",
        "head=$!",
        'trap \'kill -USR2 "$head" 2>/dev/null\' USR2',
        "trap : TERM INT",
        'while wait "$head"; code=$?; kill -0 "$head" 2>/dev/null; do :; done  # a trapped signal ends wait early',
        "# the head died by a signal (kill -9, OOM killer)? requeue the run, up to cluster.max_requeues",
        f'exec {python} -m hpcrl.launch.guard "$HPCRL_RUN_DIR" "$code"',
        "",
    ]
    return "\n".join(lines)


def render_template(spec: JobSpec) -> str:
    """A script for plain `sbatch`, run by the head's own entry point instead of submitit.

    Usage (documented at the top of sbatch/hetjob.sbatch and sbatch/split.sbatch):
        hpcrl submit CONFIG --cluster local --dry-run      # prepares RUN_DIR (launch.json, logs/)
        HPCRL_RUN_DIR=RUN_DIR HPCRL_PYTHON=$(which python) sbatch sbatch/hetjob.sbatch
    """
    usage = [
        "# Hand-usable template (no Python needed on the login node to submit it):",
        "#   1. prepare a run directory once:  hpcrl submit CONFIG --cluster local --dry-run",
        "#      (or copy one: config.toml, launch.json and logs/<group>/ are all the head reads)",
        "#   2. HPCRL_RUN_DIR=/abs/run/dir HPCRL_PYTHON=/path/to/venv/bin/python sbatch THIS_FILE",
        "# Environment: HPCRL_RUN_DIR (required, absolute), HPCRL_PYTHON (default python3; must import",
        "# hpcrl), HPCRL_HEAD_HOST (address the groups reach the head at; default: its host name).",
        "# The #SBATCH blocks below are for configs/tiny_grpo.toml on launch/local.toml; edit nodes,",
        "# tasks and partitions to match launch.json's groups (hpcrl plan CONFIG prints them).",
    ]
    text = render_script(spec, run_dir=None, command=TEMPLATE_COMMAND, stdout="hpcrl-%j.out", stderr="hpcrl-%j.out",
                         python='"${HPCRL_PYTHON:-python3}"')
    first, rest = text.split("\n", 1)
    return "\n".join([first, *usage, rest])
