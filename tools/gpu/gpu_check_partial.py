"""The partial check of tools/gpu/gpu_check.py: what a node that cannot run the full check still measures.

    python tools/gpu/gpu_check.py --partial [--preset llama3-1b] [--out FILE]     # see gpu_check.py

On a node with fewer than 4 GPUs, without vLLM or without a checkpoint (or with --partial), gpu_check.py
runs these steps on the first visible GPU (--device cpu: the same on CPU, to test this tool), each
timed and each with its own time limit inside --budget-s, the most wanted first:

  trainer_step_b{B}      for each of --batches (4 and 8): tools/bench/bench_trainer.py, hpcrl's
                         TrainerEngine.train_step (FSDP2 world 1, bf16, --preset's shapes with random
                         weights, --seq-len 2048), then the same tool with --plain (a plain torchtitan
                         loop of the same model: forward, cross-entropy, backward, AdamW): step ms,
                         tokens/s and peak memory of each, and engine_vs_plain, the ratio of their
                         step times (issue 30's target: <= 1.05)
  pack_unpack_bandwidth  tools/bench/bench_pack.py: hpcrl.transfer.execute pack and unpack GB/s of each packing
                         path against a device copy of the same bytes (target: >= 50 % of the copy);
                         fails where a path is not bit-exact (on CPU: its smallest plan, 2 repeats)
  gloo_device_transfer   two processes on the one device: a trainer rank (hpcrl's TrainerSender, float32
                         master weights of --preset) sends over gloo to a receiver without vLLM
                         (execute.receive), tensors on the device at both ends, twice (cold, warm);
                         every tensor element-exact against the sender's values; GB/s
  tests                  pytest on TESTS (what runs without vLLM and pyzmq), not slow: passed,
                         failed, skipped

A benchmark tool or flag this checkout lacks (another branch of issue 30 brings it) is reported as
not run, with why, as is a step --skip names or the budget no longer leaves time for. The targets
are figures ({..., "met": true | false} under "target"), not checks: a missed target is reported,
and fails nothing; a wrong result (a transfer or a packing path not exact, a failed test) does.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpu_check_steps import Check, Child, ChildError, Skipped, StepFailed, Stuck, end_sessions

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "tools" / "bench"  # the benchmarks this check runs

#: Seconds each step may take at most (always also within what is left of --budget-s). Sized from the
#: first GPU session (a 1B step 0.15-0.36 s, so 2 x 7 steps per batch are seconds; the rest is process
#: start-up) with room for slow start-ups; the tests take 143 s on a 2-core CPU machine, less on a node.
LIMITS_S = {"trainer_step": 150, "pack_unpack_bandwidth": 75, "gloo_device_transfer": 90, "tests": 150}
#: Seconds of the budget kept back for ending what is still running.
RESERVE_S = 15
#: A step that would get fewer seconds than this is not started (it could only time out).
MIN_STEP_S = 20
#: The issue-30 targets these steps are measured against.
ENGINE_VS_PLAIN_MAX = 1.05
PACK_VS_COPY_MIN = 0.5

#: What the tests step runs (those of them in the checkout): the trainer (FSDP2, loss, model parity, the
#: fused logprob's CUDA test), the gloo transfer between processes, the packing paths (Triton's on CUDA),
#: the device choice of roles, this tool's pure parts. None needs vLLM or pyzmq; -k leaves out UCX and the
#: fake PyNccl (it needs vLLM); the NCCL refusal test skips itself on a CUDA host.
TESTS = ("tests/trainer", "tests/transfer/test_execute.py", "tests/transfer/test_packing.py",
         "tests/roles/test_base.py", "tests/tools/test_gpu_check.py")
TESTS_SELECT = ("-m", "not slow and not slurm and not faults", "-k", "not ucx and not fake and not pynccl")


def step_names(batches: list[int]) -> list[str]:
    """The partial check's steps, in the order they run."""
    return ["preflight", *[f"trainer_step_b{b}" for b in batches], "pack_unpack_bandwidth", "gloo_device_transfer",
            "tests"]


def pytest_counts(output: str) -> dict[str, int]:
    """passed / failed / error / skipped counts from pytest's -v output: its closing summary line when
    it got that far, else the verdict at the end of each test's line (a run cut short)."""
    final = [line for line in output.splitlines() if re.match(r"^=+ .*\b(passed|failed|error|skipped|deselected|"
                                                              r"no tests ran)\b.* in [\d.]+s", line)]
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    if final:
        for number, word in re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)", final[-1]):
            key = {"errors": "error", "xfailed": "skipped", "xpassed": "passed"}.get(word, word)
            counts[key] += int(number)
        return counts
    for word in re.findall(r"^\S+::\S+ (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", output, re.MULTILINE):
        counts[{"XFAIL": "skipped", "XPASS": "passed"}.get(word, word.lower())] += 1
    return counts


def worst_ratio(figures: Any, fragment: str) -> float | None:
    """The smallest number under a key containing `fragment`, anywhere in a benchmark's JSON."""
    found: list[float] = []

    def walk(value: Any, key: str = "") -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, str(k))
        elif isinstance(value, list):
            for v in value:
                walk(v, key)
        elif isinstance(value, int | float) and not isinstance(value, bool) and fragment in key:
            found.append(float(value))

    walk(figures)
    return min(found) if found else None


class PartialRun:
    """The steps of the partial check (the module docstring), each a process or two of its own."""

    def __init__(self, args: argparse.Namespace, check: Check, work: Path) -> None:
        self.args, self.check, self.work = args, check, work
        self.gpu = args.device == "cuda"
        self.not_run: list[dict[str, str]] = []  # parts of steps that ran (a benchmark flag missing)
        self.procs: list[subprocess.Popen] = []
        self.children: list[Child] = []
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        self.env = {**os.environ, "PYTHONPATH": path}
        self.logs: dict[str, str] = {}

    def run(self) -> None:
        steps: list[tuple[str, Any, float]] = [
            (f"trainer_step_b{b}", lambda d, b=b: self.trainer_step(b, d), LIMITS_S["trainer_step"])
            for b in self.args.batches]
        steps.insert(1, ("pack_unpack_bandwidth", self.pack_bandwidth, LIMITS_S["pack_unpack_bandwidth"]))
        steps += [("gloo_device_transfer", self.gloo_transfer, LIMITS_S["gloo_device_transfer"]),
                  ("tests", self.tests, LIMITS_S["tests"])]
        for name, run, limit in steps:
            left = self.check.deadline - time.monotonic()
            if name in self.args.skip:
                self.check.record(name, None, 0.0, error="not run: --skip")
            elif left < MIN_STEP_S:
                self.check.record(name, None, 0.0, error=f"not run: {left:.0f} s of the budget left")
            else:
                self.check.step(name, run, limit)

    # -- processes ----------------------------------------------------------------------------------
    def tool(self, script: str, label: str, argv: list[str], deadline: float) -> dict:
        """Run tools/bench/`script` with `argv` in its own session until `deadline`; the JSON it wrote to
        `--json PATH`, or printed on stdout where its --json is a switch (json_flag)."""
        log, out = self.work / f"{label}.log", self.work / f"{label}.json"
        self.logs[label] = str(log)
        out.unlink(missing_ok=True)
        to_file = json_flag(BENCH / script) == "path"
        command = [sys.executable, str(BENCH / script), *argv, "--json", *([str(out)] if to_file else [])]
        with open(log, "wb") as sink, open(os.devnull if to_file else out, "wb") as printed:
            proc = subprocess.Popen(command, stdout=sink if to_file else printed, stderr=sink, cwd=REPO, env=self.env,
                                    start_new_session=True)
        self.procs.append(proc)
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            end_sessions([proc.pid], grace_s=5.0)
            raise StepFailed(f"{label} ran past its time limit; its log {log} ends: {tail(log)}") from None
        if code != 0 or not out.is_file():
            raise StepFailed(f"{label} exited with code {code}; its log {log} ends: {tail(log)}")
        text = out.read_text()
        try:
            return json.JSONDecoder().raw_decode(text, text.index("{"))[0]
        except ValueError:
            raise StepFailed(f"{label} wrote no JSON to {out}; its log {log} ends: {tail(log)}") from None

    def bench_args(self, batch: int) -> list[str]:
        a = self.args
        return ["--preset", a.preset, "--device", a.device, "--batch", str(batch), "--seq-len", str(a.seq_len),
                "--steps", str(a.bench_steps), "--warmup", str(a.bench_warmup)]

    # -- the steps ----------------------------------------------------------------------------------
    def trainer_step(self, batch: int, deadline: float) -> dict:
        """hpcrl's train_step and the plain loop of the same model: one process with --compare (one
        start-up, each side alone on the GPU with its own peak memory), else one each (--plain)."""
        flags = options(BENCH / "bench_trainer.py")
        label = f"trainer_b{batch}"
        figures: dict[str, Any] = {"preset": self.args.preset, "batch": batch, "seq_len": self.args.seq_len}
        if "--compare" in flags:
            both = self.tool("bench_trainer.py", label, [*self.bench_args(batch), "--compare"], deadline)
            engine = {k: v for k, v in both.items() if k not in ("plain", "engine_over_plain")}
            loop = both["plain"]
        else:
            plain = "--plain" in flags
            halfway = time.monotonic() + (deadline - time.monotonic()) / 2 if plain else deadline
            engine = self.tool("bench_trainer.py", f"{label}_engine", self.bench_args(batch), halfway)
            if not plain:
                self.not_run.append({"step": f"trainer_step_b{batch} (plain loop)",
                                     "why": "tools/bench/bench_trainer.py has neither --compare nor --plain in this checkout"})
                return figures | {"engine": engine}
            loop = self.tool("bench_trainer.py", f"{label}_plain", [*self.bench_args(batch), "--plain"], deadline)
        figures["engine"] = engine
        ratio = engine["step_ms"] / loop["step_ms"]
        figures |= {"plain": loop, "engine_vs_plain": round(ratio, 3),
                    "target": {"engine_vs_plain_max": ENGINE_VS_PLAIN_MAX, "met": ratio <= ENGINE_VS_PLAIN_MAX}}
        return figures

    def pack_bandwidth(self, deadline: float) -> dict:
        """tools/bench/bench_pack.py; fails where a packing path is not bit-exact against the block loop or
        raised. The target is met when, in every plan, some path other than the loop (the reference,
        one copy per block) packs and unpacks at >= PACK_VS_COPY_MIN of the device copy."""
        if not (BENCH / "bench_pack.py").is_file():
            raise Skipped("tools/bench/bench_pack.py is not in this checkout")
        flags = options(BENCH / "bench_pack.py")
        small = [] if self.gpu else [*(["--plans", "8x8"] if "--plans" in flags else []),
                                     *(["--repeats", "2"] if "--repeats" in flags else [])]
        figures = self.tool("bench_pack.py", "pack", ["--device", self.args.device, *small], deadline)
        plans = figures.get("plans")
        if not isinstance(plans, list):  # an unknown layout: the smallest ratio anywhere
            worst = worst_ratio(figures, "vs_copy")
            return figures | ({"target": {"pack_vs_copy_min": PACK_VS_COPY_MIN, "worst": worst,
                                          "met": worst >= PACK_VS_COPY_MIN}} if worst is not None else {})
        bad = [f"{p.get('plan')} {path}: {row.get('error') or 'not exact'}" for p in plans
               for path, row in p.get("paths", {}).items() if row.get("error") or row.get("exact") is False]
        best = [max((min(row["pack_vs_copy"], row["unpack_vs_copy"]) for path, row in p.get("paths", {}).items()
                     if path != "loop" and "pack_vs_copy" in row), default=0.0) for p in plans]
        figures = figures | {"target": {"pack_vs_copy_min": PACK_VS_COPY_MIN, "worst": min(best, default=0.0),
                                        "met": bool(best) and min(best) >= PACK_VS_COPY_MIN}}
        if bad:
            raise StepFailed("; ".join(bad), figures)
        return figures

    def gloo_transfer(self, deadline: float) -> dict:
        """A sender and a receiver on the one device (gpu_check_ranks.py), over gloo: cold, then warm."""
        from gpu_check_ranks import gb_per_s

        from hpcrl.rendezvous.meet import serve_store

        store = serve_store()  # its secret: HPCRL_STORE_SECRET_DIR, for the two children
        self.env = {**self.env, "HPCRL_STORE_SECRET_DIR": os.environ["HPCRL_STORE_SECRET_DIR"]}
        sender, receiver = (self.spawn(kind) for kind in ("sender", "receiver"))
        start = dict(preset=self.args.preset, device=self.args.device, port=store.port,
                     wire_dtype="bfloat16" if self.gpu else "float32",
                     timeout_s=max(10.0, deadline - time.monotonic()))
        try:
            self.ask({sender: ("start", start), receiver: ("start", start)}, deadline)
            runs = []
            for _ in range(2):
                done = self.ask({sender: ("send", {}), receiver: ("receive", {})}, deadline)
                runs.append({"bytes": done["receiver"]["bytes"], "seconds": round(done["receiver"]["seconds"], 3),
                             "send_s": round(done["sender"]["seconds"], 3),
                             "gb_per_s": gb_per_s(done["receiver"]["bytes"], done["receiver"]["seconds"]),
                             "tensors": done["receiver"]["tensors"], "wrong": done["receiver"]["wrong"]})
                if done["sender"]["bytes"] != done["receiver"]["bytes"]:
                    raise StepFailed(f"sent {done['sender']['bytes']} bytes, received {done['receiver']['bytes']}",
                                     {"runs": runs})
            figures = {"preset": self.args.preset, "wire_dtype": start["wire_dtype"], "device": self.args.device,
                       "runs": runs, "element_exact": not any(r["wrong"] for r in runs)}
            if not figures["element_exact"]:
                wrong = sorted({n for r in runs for n in r["wrong"]})
                raise StepFailed(f"{len(wrong)} tensor(s) differ from what was sent, e.g. {', '.join(wrong[:3])}",
                                 figures)
            return figures
        finally:
            self.stop_children()

    def tests(self, deadline: float) -> dict:
        from importlib.util import find_spec

        log = self.work / "tests.log"
        self.logs["tests"] = str(log)
        timeout = ["--timeout", "120"] if find_spec("pytest_timeout") else []
        # addopts cleared: --strict-markers would make the timeout marks errors where pytest-timeout is missing.
        paths = [path for path in TESTS if (REPO / path).exists()]
        command = [sys.executable, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider", "-o", "addopts=",
                   *timeout, *TESTS_SELECT, *paths]
        with open(log, "wb") as sink:
            proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, cwd=REPO, env=self.env,
                                    start_new_session=True)
        self.procs.append(proc)
        try:
            code: int | None = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            end_sessions([proc.pid], grace_s=5.0)
            code = None
        output = log.read_text(errors="replace")
        figures: dict[str, Any] = {"paths": paths, "select": list(TESTS_SELECT), **pytest_counts(output),
                                   "failures": re.findall(r"^(?:FAILED|ERROR) (\S+)", output, re.MULTILINE)[:10]}
        if figures["failed"] or figures["error"]:
            raise StepFailed(f"{figures['failed']} failed, {figures['error']} error(s), e.g. "
                             f"{', '.join(figures['failures'][:3]) or tail(log)}", figures)
        if code is None:
            raise Skipped(f"cut at the step's time limit after {figures['passed']} passed "
                          f"and {figures['skipped']} skipped, none failed", figures)
        if code != 0:
            raise StepFailed(f"pytest exited with code {code}; {log} ends: {tail(log)}", figures)
        return figures

    # -- driven processes (gpu_check_ranks.py) ------------------------------------------------------
    def spawn(self, kind: str) -> Child:
        log = self.work / f"{kind}.log"
        self.logs[kind] = str(log)
        child = Child(kind, kind, self.env, log)
        self.children.append(child)
        return child

    def ask(self, commands: dict[Child, tuple[str, dict]], deadline: float) -> dict[str, Any]:
        """Send every command at once (a transfer needs both ends), then every reply by process name; the
        first error ends the wait (the other end may wait on the failed one until its own timeout).
        A process gone or late fails the step only: the step ends both processes whatever happens."""
        try:
            pending = {child: (cmd, child.send(cmd, args)) for child, (cmd, args) in commands.items()}
            results: dict[str, Any] = {}
            while pending:
                for child, (cmd, request) in list(pending.items()):
                    reply = child.poll(request, cmd, timeout=0.2)
                    if reply is None:
                        if time.monotonic() > deadline:
                            raise StepFailed(f"{child.name} did not finish {cmd!r} in time; its log: {child.log_path}")
                        continue
                    del pending[child]
                    if not reply["ok"]:
                        raise ChildError(f"{child.name}: {reply['error']}", reply.get("traceback", ""))
                    results[child.name] = reply["result"]
            return results
        except Stuck as err:
            raise StepFailed(str(err)) from None

    def stop_children(self) -> None:
        children, self.children = self.children, []
        for child in children:
            if child.proc.poll() is None:
                try:
                    child.send("exit", {})
                except Stuck:
                    pass
        end_sessions([child.proc.pid for child in children], grace_s=10.0)
        for child in children:
            try:
                child.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def teardown(self) -> None:
        """End whatever a step left running (the budget ran out inside it)."""
        self.stop_children()
        end_sessions([p.pid for p in self.procs if p.poll() is None], grace_s=5.0)


def options(script: Path) -> set[str]:
    """The --options a tool's source names. Read, not run: `--help` would cost a process start and,
    where a sitecustomize loads torch (the lent GPU machine), a torch import."""
    return set(re.findall(r"""add_argument\(\s*["'](--[\w-]+)["']""", script.read_text()))


def json_flag(script: Path) -> str:
    """"path" where the tool's --json takes a file name (tools/bench/bench_trainer.py), "switch" where it
    prints its JSON on stdout (tools/bench/bench_pack.py)."""
    found = re.search(r"""add_argument\(\s*["']--json["']([^)]*)\)""", script.read_text())
    return "switch" if found and "store_true" in found.group(1) else "path"


def tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])[-600:]
