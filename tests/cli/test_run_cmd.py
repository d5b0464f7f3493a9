"""`hpcrl run` on its terminal: set-up progress, a line per step, the summary, and nothing but hpcrl's
lines; vLLM's log, other libraries' warnings and what any process writes to its stderr in the run's file.

Real vLLM (CPU) and the tiny model, for a few steps. The quickstart's run (`terminal_run`, shared by the
first tests) runs on a pseudo-terminal, as a user sees it: isatty is true, the progress line rewrites
itself. The other runs write to a pipe, where every step gets its own line.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
RUN_TIMEOUT_S = 580
#: Columns of the pseudo-terminal: wider than any progress line, which a narrower one would cut.
COLUMNS = 200
#: hpcrl's log file formats a record "<time> <group>: <message>" (hpcrl.logs.FileFormatter) ...
RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} run: (.*)$")
#: ... and another library's message also names its level, logger and process.
OTHER_LIBRARY = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+ \(\S+ pid \d+\): ")
#: Lines other libraries give on every run of the embedded default on CPU, outside their logging: printed
#: by vLLM's EngineCore before it configures its logging, and Python's warnings (with their source line).
THIRD_PARTY_NOISE = ["Triton is installed, but doesn't include CPU backend. Disabling Triton.",
                     "FutureWarning: `torch.distributed.reduce_op` is deprecated"]


def hpcrl_run(*args: str, umask: int | None = None) -> subprocess.CompletedProcess:
    """`python -m hpcrl run configs/tiny_grpo.toml ARGS` from the repository; stdout and stderr in one pipe."""
    argv = [sys.executable, "-m", "hpcrl", "run", "configs/tiny_grpo.toml", *args]
    return subprocess.run(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=RUN_TIMEOUT_S, preexec_fn=None if umask is None else lambda: os.umask(umask))


def on_a_terminal(argv: list[str], *, umask: int) -> tuple[int, str]:
    """Run `argv` from the repository with a pseudo-terminal as its stdin, stdout and stderr (so its
    processes, vLLM's included, write to it); its exit status and everything written there."""
    leader, follower = os.openpty()
    fcntl.ioctl(leader, termios.TIOCSWINSZ, struct.pack("HHHH", 50, COLUMNS, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen(argv, cwd=REPO, stdin=follower, stdout=follower, stderr=follower, env=env,
                            preexec_fn=lambda: os.umask(umask))
    os.close(follower)
    written = bytearray()
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while True:  # until every process holding the terminal has closed it
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{argv} still writing after {RUN_TIMEOUT_S} s:\n{written[-3000:].decode()}")
            if select.select([leader], [], [], left)[0]:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # EIO: no process holds the terminal any more
                    break
                if not chunk:
                    break
                written += chunk
        return proc.wait(timeout=max(1.0, deadline - time.monotonic())), written.decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(leader)


def terminal_lines(written: str) -> list[str]:
    """What a terminal showed, line by line: each line, and each state of a line rewritten in place
    ("\\r\\x1b[2K" clears it, hpcrl.logs.TerminalHandler), but empty ones."""
    text = written.replace("\r\n", "\n").replace("\r\x1b[2K", "\n").replace("\r", "\n")
    return [line for line in text.split("\n") if line.strip()]


def hpcrl_lines(log: str) -> set[str]:
    """The lines of hpcrl's records in a run's log file: a record is "<time> run: <message>" and its
    message's further lines; another library's message starts with its level, logger and process."""
    lines: set[str] = set()
    ours = False
    for line in log.splitlines():
        record = RECORD.match(line)
        if record:
            ours = not OTHER_LIBRARY.match(record.group(1))
            if ours:
                lines.add(record.group(1))
        elif ours:
            lines.add(line)
    return lines


def is_hpcrl_line(shown: str, ours: set[str]) -> bool:
    """Whether a line a terminal showed is one of hpcrl's lines, `ours`: the same, but that the terminal
    gives hpcrl's warnings a "WARNING: " (another library's names its logger too), and that a live
    progress line is cut to the terminal's width."""
    line = re.sub(r"^(WARNING|ERROR): ", "", shown)
    return line in ours or (len(line) == COLUMNS - 1 and any(our.startswith(line) for our in ours))


@dataclass(frozen=True)
class TerminalRun:
    returncode: int
    terminal: str
    """Everything written to the pseudo-terminal."""
    run_dir: Path
    sets: list[str]

    @property
    def log(self) -> str:
        return (self.run_dir / "logs" / "run" / "rank0.log").read_text()


@pytest.fixture(scope="module")
def terminal_run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> TerminalRun:
    """The quickstart's `hpcrl run configs/tiny_grpo.toml` for 3 steps on a pseudo-terminal, under umask 002
    (common on HPC project directories, as its run directory must stay private)."""
    run_dir = tmp_path_factory.mktemp("terminal") / "run"
    sets = ["--set", f"run.run_dir={run_dir}", "--set", f"model.path={tiny_model}", "--set",
            "trainer.checkpoint_interval=0"]
    argv = [sys.executable, "-m", "hpcrl", "run", "configs/tiny_grpo.toml", "--steps", "3", *sets]
    returncode, terminal = on_a_terminal(argv, umask=0o002)
    return TerminalRun(returncode, terminal, run_dir, sets)


def test_a_successful_run_prints_only_hpcrl_lines_on_its_terminal_and_other_libraries_noise_in_its_log(
        terminal_run: TerminalRun):
    assert terminal_run.returncode == 0, terminal_run.terminal[-3000:]
    shown = terminal_lines(terminal_run.terminal)
    log = terminal_run.log
    ours = hpcrl_lines(log)
    not_hpcrl = [line for line in shown if not is_hpcrl_line(line, ours)]
    assert not_hpcrl == [], "\n".join(not_hpcrl)
    assert [line.split("/")[0] for line in shown if line.startswith("step ")] == ["step    1", "step    2",
                                                                                  "step    3"]
    assert "reward curve" in terminal_run.terminal and "done in" in terminal_run.terminal
    for noise in THIRD_PARTY_NOISE:  # kept in the log: vLLM's EngineCore's stderr is the log file
        assert noise in log, log[-3000:]
    assert re.search(r"run: WARNING vllm\.\S+ \(MainProcess pid \d+\): ", log), log[-3000:]  # vLLM's warnings
    assert "run: INFO vllm." in log  # vLLM's own lines, at INFO
    assert re.search(r"run: INFO vllm\.\S+ \(EngineCore\S* pid \d+\): ", log), log[-3000:]  # and its engine process's
    assert "run: step    3/200" in log and "run: done in" in log
    assert "terminate called" not in log + terminal_run.terminal  # issue 19's abort at exit


def test_hpcrl_run_keeps_its_run_directory_private_and_runs_the_plan_that_hpcrl_plan_prints(
        terminal_run: TerminalRun):
    assert terminal_run.returncode == 0, terminal_run.terminal[-3000:]
    run_dir = terminal_run.run_dir
    # its config, logs, metrics and the step-3 checkpoint: no bit for group or others, under umask 002
    written = [run_dir, *run_dir.rglob("*")]
    assert {"config.toml", "rank0.log", "metrics.jsonl", "MANIFEST.json"} <= {p.name for p in written}
    assert [str(p) for p in written if not p.is_symlink() and p.lstat().st_mode & 0o077] == []  # a link's mode is unused
    # The weight-transfer plan the run executed is the one `hpcrl plan --transfer` describes (issue #27).
    plan = subprocess.run([sys.executable, "-m", "hpcrl", "plan", "--transfer", "configs/tiny_grpo.toml",
                           *terminal_run.sets], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert plan.returncode == 0, plan.stderr
    printed = plan.stdout.splitlines()[0]
    log = terminal_run.log
    assert printed.startswith("weight transfer plan ") and f" run: {printed}\n" in log, log[-3000:]


def test_hpcrl_run_reports_its_start_up_parts_in_the_log_and_the_first_steps_metrics(terminal_run: TerminalRun):
    """Issue #19: vLLM, the trainer and the reward pool start at once; each part's seconds, the weight-transfer
    group's and the first sync's go with the first step, and startup_total_s is the launch -> first step."""
    assert terminal_run.returncode == 0, terminal_run.terminal[-3000:]
    first, *later = [json.loads(line) for line in (terminal_run.run_dir / "metrics.jsonl").read_text().splitlines()]
    parts = ["inference", "trainer", "reward", "weights", "first_sync", "first_generate"]
    assert sorted(k for k in first if k.startswith("startup_")) == sorted([f"startup_{p}_s" for p in parts]
                                                                         + ["startup_total_s"])
    assert len(later) == 2 and not any(k.startswith("startup_") for step in later for k in step)
    assert all(first[f"startup_{p}_s"] > 0 for p in parts), first
    assert first["startup_total_s"] > max(first[f"startup_{p}_s"] for p in parts)  # that they overlap: test_inprocess
    line = re.search(r"start-up: ([\d.]+) s from launch to the first step \(([^)]*)\)", terminal_run.terminal)
    assert line is not None, terminal_run.terminal[-3000:]
    assert float(line.group(1)) == pytest.approx(first["startup_total_s"], abs=0.05)
    assert "inference" in line.group(2) and "first sync" in line.group(2)


@pytest.mark.timeout(300)
def test_hpcrl_run_verbose_shows_other_libraries_noise_and_exits_0_without_aborting_at_exit(tiny_model,
                                                                                          tmp_path: Path):
    """Issue #19: a run printed "done in", then died of SIGABRT in the interpreter's teardown (exit code 134,
    "terminate called without an active exception"; docs/FACTS.md, "Teardown"). One step is the cheapest
    run that makes and closes every part (about 35 s here). Verbose: other libraries' warnings and their
    processes' stderr show on its terminal (a pipe, where each step is its own line). Every other `hpcrl run`
    of the suite also fails on an exit code other than 0 (the quiet terminal run above, which also looks for
    "terminate called" in its log, tests/rl/test_inprocess.py, tests/algorithms/test_learning.py)."""
    run_dir = tmp_path / "run"
    done = hpcrl_run("--steps", "1", "--set", f"run.run_dir={run_dir}", "-v",
                     "--set", f"model.path={tiny_model}", "--set", "trainer.checkpoint_interval=0")
    kept = done.stdout + (run_dir / "logs" / "run" / "rank0.log").read_text()  # stderr: the log, but with -v
    assert "terminate called" not in kept, kept[-3000:]
    assert done.returncode == 0, f"exited {done.returncode}:\n{done.stdout[-3000:]}"
    assert "done in" in done.stdout and re.search(r"^step    1/200 ", done.stdout, re.MULTILINE)
    for noise in THIRD_PARTY_NOISE:
        assert noise in done.stdout, done.stdout[-3000:]
    assert re.search(r"^WARNING vllm\.\S+: ", done.stdout, re.MULTILINE), done.stdout[-3000:]
