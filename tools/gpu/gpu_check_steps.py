"""The steps of tools/gpu/gpu_check.py after preflight, and the driver of the processes that run them.

    run = Run(args, mode, check, work, blocks, gpu_name); run.run(); run.teardown()

`Run` starts two trainer ranks and one vLLM replica (tools/gpu/gpu_check_ranks.py, each in its own
session, with its own CUDA_VISIBLE_DEVICES and log file), sends them commands (all ranks of a
collective at once) and gathers their replies, every wait with a deadline; `Check` times and
records each step. A process that times out or dies leaves the others in an unknown state, so
the remaining steps are recorded as not run; at the end every process of every session is ended
(TERM, then KILL) and the shared memory they held is removed. The comparisons the steps make are
the pure functions at the top (unit-tested in tests/tools/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpu_check_ranks import TENSOR_PARALLEL, TRAINER_RANKS, gb_per_s

REPO = Path(__file__).resolve().parents[2]
RANKS_SCRIPT = Path(__file__).resolve().parent / "gpu_check_ranks.py"

#: Dense bf16 peak FLOP/s per GPU from the vendors' spec sheets (without sparsity), most specific name
#: first: H100 SXM 989.4 T, H100 PCIe 756 T, H100 NVL 835.5 T, H200 / GH200 as H100 SXM, B200 2.25 P,
#: A100 (SXM and PCIe) 312 T, L40S 362 T.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    (r"H100\s+PCIe", 756e12), (r"H100\s+NVL", 835.5e12), (r"GH200", 989.4e12), (r"H200", 989.4e12),
    (r"H100", 989.4e12), (r"H800", 989.4e12), (r"B200", 2250e12), (r"A100", 312e12), (r"A800", 312e12),
    (r"L40S", 362e12),
)

#: Seconds each step may take at most (always also within what is left of --budget-s).
LIMITS_S = {"start": 420, "grpo_steps": 180, "trainer_checkpoint": 120, "vllm_reference": 180,
            "logprob_mismatch": 60, "pack_unpack_bandwidth": 60, "transfer": 180, "oracle": 120,
            "negative_control": 120}
#: Seconds kept back from the budget for stopping every process.
TEARDOWN_S = 45
#: After one process reports an error, how long the others of the same command still get.
ERROR_GRACE_S = 20
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Water boils at a temperature of",
           "1, 2, 3, 4, 5,")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Mode:
    """What differs between the GPU run and the CPU self-test (--device cpu)."""

    device: str
    dtype: str
    """Trainer compute dtype, vLLM dtype and wire dtype (vLLM on CPU serves float32)."""
    transports: tuple[str, ...]
    """In the order they run; the first also carries the negative control. gloo, the comparison, goes
    first on GPUs: a failed collective_rpc leaves vLLM unusable (Run.gather), and an NCCL failure
    should not cost the gloo figures."""

    @classmethod
    def of(cls, device: str) -> Mode:
        if device == "cpu":
            return cls(device="cpu", dtype="float32", transports=("gloo",))
        return cls(device="cuda", dtype="bfloat16", transports=("gloo", "nccl"))


# ------------------------------------------------------------------------------------------- checks

def peak_bf16_flops(gpu_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of one GPU by its name (torch.cuda.get_device_name), None if unknown."""
    for pattern, flops in PEAK_BF16_FLOPS:
        if re.search(rf"\b{pattern}\b", gpu_name, re.IGNORECASE):
            return flops
    return None


def mfu(*, parameters: int, tokens: int, step_s: float, peak_flops: float, gpus: int) -> float:
    """Model FLOPs utilisation: 6 x parameters x tokens (forward + backward) / step time / peak of all GPUs."""
    return 6.0 * parameters * tokens / step_s / (peak_flops * gpus)


def digest_mismatch(digests: list[dict[str, str]], reference: list[dict[str, str]]) -> list[list[str]]:
    """Per TP rank, the parameters whose sha256 differs from the reference's (or that one side lacks)."""
    if len(digests) != len(reference):
        raise ValueError(f"{len(digests)} TP ranks reported digests, the reference has {len(reference)}")
    return [sorted(n for n in set(mine) | set(ref) if mine.get(n) != ref.get(n))
            for mine, ref in zip(digests, reference)]


def moved_pointers(before: list[dict[str, int]], after: list[dict[str, int]]) -> list[list[str]]:
    """Per TP rank, the parameters whose data_ptr changed (CUDA graphs would read the old memory)."""
    return [sorted(n for n in set(b) | set(a) if b.get(n) != a.get(n)) for b, a in zip(before, after)]


def unplanned(digests: list[dict[str, str]], planned: list[str]) -> list[str]:
    """vLLM parameters that no transfer writes (packed-kernel entries of the CPU build aside)."""
    names = {n for rank in digests for n in rank if not n.endswith("@kernel")}
    return sorted(names - set(planned))


def negative_control(mismatch: list[list[str]], corrupted: str) -> tuple[bool, str]:
    """Did the oracle catch the one corrupted parameter, and only it? (passed, what it saw)."""
    flagged = sorted({n for rank in mismatch for n in rank})
    if not flagged:
        return False, f"the oracle missed the corrupted {corrupted}: every parameter matched the reference"
    if flagged != [corrupted]:
        return False, f"the oracle flagged {', '.join(flagged[:5])}, expected only the corrupted {corrupted}"
    ranks = [r for r, names in enumerate(mismatch) if names]
    return True, f"the oracle flagged {corrupted} on TP rank(s) {ranks}, and nothing else"


def logprob_mismatch(trainer: list[list[float]], vllm: list[list[float]]) -> dict[str, Any]:
    """Max and mean |trainer - vLLM| over completion tokens. `trainer`: logprobs of every token after
    the first of prompt + completion (TrainerEngine.sequence_logprobs); `vllm`: of the completion."""
    diffs = []
    for row, (full, completion) in enumerate(zip(trainer, vllm, strict=True)):
        if len(full) < len(completion):
            raise ValueError(f"sequence {row}: {len(full)} trainer logprobs for {len(completion)} completion tokens")
        tail = full[len(full) - len(completion):]
        diffs += [abs(a - b) for a, b in zip(tail, completion)]
    if not diffs:
        return {"tokens": 0, "max_abs": None, "mean_abs": None}
    return {"tokens": len(diffs), "max_abs": max(diffs), "mean_abs": sum(diffs) / len(diffs)}


# ------------------------------------------------------------------------------------------- driver

class StepFailed(Exception):
    """A check did not hold; the run goes on."""

    def __init__(self, message: str, figures: dict | None = None) -> None:
        super().__init__(message)
        self.figures = figures or {}


class Stuck(Exception):
    """A process timed out or died: the state of the others is unknown, so the remaining steps are not run."""


class Skipped(Exception):
    """A step could not run (an earlier one failed, a tool is missing), or stopped short of its end
    with nothing wrong (`figures`: what it got so far)."""

    def __init__(self, message: str, figures: dict | None = None) -> None:
        super().__init__(message)
        self.figures = figures or {}


class BudgetSpent(BaseException):
    """The overall time budget ran out (SIGALRM): stop wherever the run is."""


def end_sessions(sids: list[int], grace_s: float) -> None:
    """SIGTERM every process of these sessions (vLLM cleans up on TERM), SIGKILL what is left after `grace_s`."""
    from hpcrl.roles.reaper import live, session_pids

    def members() -> list[int]:
        return live([pid for sid in sids for pid in session_pids(sid)])

    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for pid in members():
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + wait_s
        while members() and time.monotonic() < deadline:
            time.sleep(0.1)


class Child:
    """A driven process (gpu_check_ranks.py) in its own session, its log a file, its replies a queue."""

    def __init__(self, name: str, kind: str, env: dict[str, str], log_path: Path) -> None:
        self.name, self.log_path, self.next_id = name, log_path, 0
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, str(RANKS_SCRIPT), kind],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
                                         cwd=REPO, start_new_session=True)
        self.replies: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read, name=f"gpu-check-{name}", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.replies.put(json.loads(line))

    def _tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(lines[-3:])[-600:]

    def send(self, cmd: str, args: dict) -> int:
        self.next_id += 1
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps({"id": self.next_id, "cmd": cmd, "args": args}) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            try:
                code = self.proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                code = None
            raise Stuck(f"{self.name} is gone (exit code {code}) before {cmd!r}; its log {self.log_path} ends: "
                        f"{self._tail()}") from None
        return self.next_id

    def poll(self, request: int, cmd: str, timeout: float) -> dict | None:
        """The reply to `request`, or None if none came within `timeout`; Stuck if the process is gone."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                reply = self.replies.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                if self.proc.poll() is not None:
                    raise Stuck(f"{self.name} exited with code {self.proc.returncode} during {cmd!r}; its log "
                                f"{self.log_path} ends: {self._tail()}") from None
                return None
            if reply["id"] == request:  # else a late answer to a command that timed out: dropped
                return reply


class ChildError(Exception):
    """A driven process answered a command with an error (it is alive and took the next command)."""

    def __init__(self, message: str, detail: str) -> None:
        super().__init__(message)
        self.detail = detail


class Check:
    """The steps of one run: each timed and recorded, within the overall budget."""

    def __init__(self, budget_s: float, started: float, reserve_s: float = TEARDOWN_S) -> None:
        self.deadline = started + budget_s - reserve_s
        self.steps: list[dict] = []
        self.stuck = ""

    def record(self, name: str, ok: bool | None, seconds: float, figures: dict | None = None, error: str | None = None,
               detail: str | None = None) -> None:
        self.steps.append({"name": name, "ok": ok, "seconds": round(seconds, 2), "figures": figures or {},
                           "error": error, "traceback": detail})
        state = {True: "ok", False: "FAILED", None: "not run"}[ok]
        shown = f": {error}" if error else ""
        print(f"gpu_check: {name} {state} ({seconds:.1f} s){shown}", file=sys.stderr, flush=True)

    def step(self, name: str, run: Callable[[float], dict], limit_s: float, since: float | None = None) -> None:
        start = time.monotonic()
        if self.stuck:
            self.record(name, None, 0.0, error=f"not run: {self.stuck}")
            return
        deadline = min((since or start) + limit_s, self.deadline)
        try:
            figures = run(deadline)
        except StepFailed as err:
            self.record(name, False, time.monotonic() - start, err.figures, str(err))
        except Skipped as err:
            self.record(name, None, time.monotonic() - start, err.figures, error=f"not run: {err}")
        except Stuck as err:
            self.stuck = f"{name} failed"
            self.record(name, False, time.monotonic() - start, error=str(err))
        except ChildError as err:
            self.record(name, False, time.monotonic() - start, error=str(err), detail=err.detail)
        except Exception as err:  # noqa: BLE001 - a bug of this script or of hpcrl: the step fails, with the trace
            self.record(name, False, time.monotonic() - start, error=f"{type(err).__name__}: {err}",
                        detail=traceback.format_exc()[-3000:])
        else:
            self.record(name, True, time.monotonic() - start, figures)


class Run:
    """The steps after preflight (tools/gpu/gpu_check.py's docstring), driving 2 trainer ranks and 1 vLLM replica."""

    def __init__(self, args: argparse.Namespace, mode: Mode, check: Check, work: Path, blocks: dict[str, str],
                 gpu_name: str) -> None:
        from hpcrl.rendezvous.meet import serve_store

        self.args, self.mode, self.check, self.work, self.gpu_name = args, mode, check, work, gpu_name
        self.checkpoint = work / "trained-checkpoint"
        self.stores: dict[str, Any] = {}  # a rendezvous store per transport, alive while its group is
        self.connected: set[str] = set()  # transports whose group formed
        self.delivered: set[str] = set()  # transports whose last update arrived in full
        self.reference: dict | None = None
        self.planned: list[str] = []
        self.parameters = 0  # set when the trainer ranks are up
        self.trained = False
        self.vllm_down = "vLLM did not start"  # why vLLM cannot be used; "" while it can
        self.blocks = blocks
        self.serve_store = serve_store
        self.fsdp_store = serve_store()
        self.children: dict[str, Child] = {}
        self.names = [f"trainer{r}" for r in range(TRAINER_RANKS)] + ["vllm"]
        self.logs = {name: str(work / f"{name}.log") for name in self.names}

    def spawn(self) -> None:
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        for name in self.names:
            env = {**os.environ, "PYTHONPATH": path}
            if name in self.blocks:
                env["CUDA_VISIBLE_DEVICES"] = self.blocks[name]
            if name == "vllm":
                # collective_rpc with a function (worker_pointers, worker_fill_nan) is cloudpickled on its way
                # to the engine's workers, which vLLM allows only with this set (vllm/v1/serial_utils.py).
                env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
            self.children[name] = Child(name, "vllm" if name == "vllm" else "trainer", env, Path(self.logs[name]))
        self.trainers = [self.children[f"trainer{r}"] for r in range(TRAINER_RANKS)]
        self.vllm = self.children["vllm"]

    # -- talking to the processes -------------------------------------------------------------------
    def ask(self, commands: dict[Child, tuple[str, dict]], deadline: float) -> dict[str, Any]:
        """Send every command at once (collectives need all ranks), then gather the results by process name."""
        sent = {child: (cmd, child.send(cmd, args)) for child, (cmd, args) in commands.items()}
        return self.gather(sent, deadline)

    def gather(self, sent: dict[Child, tuple[str, int]], deadline: float) -> dict[str, Any]:
        """Every process's reply, polled in turn, so that one's error shortens the wait for the others."""
        results: dict[str, Any] = {}
        errors: list[tuple[str, str]] = []
        pending = dict(sent)
        while pending:
            for child, (cmd, request) in list(pending.items()):
                reply = child.poll(request, cmd, timeout=0.2)
                if reply is None:
                    if time.monotonic() > deadline:
                        raise Stuck(f"{child.name} did not finish {cmd!r} in time"
                                    + (f" after {errors[0][0]}" if errors else "") + f"; its log: {child.log_path}")
                    continue
                del pending[child]
                if reply["ok"]:
                    results[child.name] = reply["result"]
                else:
                    errors.append((f"{child.name}: {reply['error']}", reply.get("traceback", "")))
                    deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)  # the others may wait on it
                    if child is self.children.get("vllm"):
                        # vLLM 0.32's MultiprocExecutor.collective_rpc raises at the first failed worker and
                        # leaves the later workers' replies queued: every later call would read stale ones.
                        self.vllm_down = f"vLLM failed {cmd!r} (its later collective_rpc replies would be stale)"
        if errors:
            raise ChildError("; ".join(e for e, _ in errors), errors[0][1])
        return results

    def timeout_s(self, deadline: float) -> float:
        return max(10.0, deadline - time.monotonic())

    # -- the steps ----------------------------------------------------------------------------------
    def run(self) -> None:
        a, m, c = self.args, self.mode, self.check
        self.spawn()
        spawned = time.monotonic()
        start_s = min(LIMITS_S["start"], c.deadline - spawned)
        starting = {t: ("start", dict(rank=r, store_port=self.fsdp_store.port, model_dir=a.model_dir, device=m.device,
                                      dtype=m.dtype, max_seq_len=max(a.seq_len, a.max_model_len) + 1,
                                      micro_batch_size=a.micro_batch_size, timeout_s=a.budget_s))
                    for r, t in enumerate(self.trainers)}
        starting[self.vllm] = ("start", dict(model_dir=a.model_dir, device=m.device, dtype=m.dtype,
                                             max_model_len=a.max_model_len, max_tokens=a.gen_tokens,
                                             gpu_memory_utilization=a.gpu_memory_utilization))
        sent = {child: (cmd, child.send(cmd, args)) for child, (cmd, args) in starting.items()}
        c.step("trainer_start", lambda d: self.trainer_started(sent, d), start_s, since=spawned)
        c.step("vllm_start", lambda d: self.vllm_started(sent, d), start_s, since=spawned)
        c.step("grpo_steps", self.train, LIMITS_S["grpo_steps"])
        c.step("trainer_checkpoint", self.save, LIMITS_S["trainer_checkpoint"])
        c.step("vllm_reference", self.take_reference, LIMITS_S["vllm_reference"])
        c.step("logprob_mismatch", self.compare_logprobs, LIMITS_S["logprob_mismatch"])
        c.step("pack_unpack_bandwidth", self.bandwidth, LIMITS_S["pack_unpack_bandwidth"])
        for i, transport in enumerate(m.transports):
            c.step(f"{transport}_transfer", functools.partial(self.transfer, transport), LIMITS_S["transfer"])
            c.step(f"{transport}_oracle", functools.partial(self.oracle, transport), LIMITS_S["oracle"])
            if i == 0:
                c.step("negative_control", functools.partial(self.negative_control, transport),
                       LIMITS_S["negative_control"])

    def trainer_started(self, sent: dict[Child, tuple[str, int]], deadline: float) -> dict:
        started = self.gather({t: sent[t] for t in self.trainers}, deadline)
        self.parameters = started["trainer0"]["parameters"]
        return {"parameters": self.parameters, "load_s": [r["load_s"] for r in started.values()],
                "memory_gib": [r["memory_gib"] for r in started.values()], "gpu": self.gpu_name,
                "dtype": self.mode.dtype, "cuda_visible_devices": [self.blocks.get(t.name) for t in self.trainers]}

    def vllm_started(self, sent: dict[Child, tuple[str, int]], deadline: float) -> dict:
        started = self.gather({self.vllm: sent[self.vllm]}, deadline)["vllm"]
        self.vllm_down = ""
        return started | {"tensor_parallel": TENSOR_PARALLEL, "cuda_visible_devices": self.blocks.get("vllm")}

    def train(self, deadline: float) -> dict:
        a = self.args
        if not self.parameters:
            raise Skipped("the trainer ranks did not start")
        results = self.ask({t: ("train", dict(steps=2, rows=a.rows, seq_len=a.seq_len, seed=0)) for t in self.trainers},
                           deadline)
        metrics = results["trainer0"]["metrics"]  # every rank reports the step's totals
        steps = [{k: s[k] for k in ("step", "loss", "kl", "grad_norm", "entropy", "step_time_s")}
                 | {"tokens": round(s["tokens_per_s"] * s["step_time_s"])} for s in metrics]
        memory = [r["peak_memory_gib"] for r in results.values()]
        peak = a.peak_tflops * 1e12 if a.peak_tflops else peak_bf16_flops(self.gpu_name)
        last = steps[-1]
        figures = {"steps": steps, "rows": a.rows, "seq_len": a.seq_len, "parameters": self.parameters,
                   "peak_memory_gib": max(memory) if None not in memory else None, "gpu": self.gpu_name,
                   "peak_tflops_per_gpu": peak / 1e12 if peak else None,
                   "mfu_formula": "6 * parameters * tokens / step_time_s / (peak_flops * 2 GPUs), second step",
                   "mfu": round(mfu(parameters=self.parameters, tokens=last["tokens"], step_s=last["step_time_s"],
                                    peak_flops=peak, gpus=TRAINER_RANKS), 4) if peak else None}
        bad = [f"step {s['step']} {k} = {s[k]}" for s in steps for k in ("loss", "kl", "grad_norm")
               if not math.isfinite(s[k])]
        if bad:
            raise StepFailed(", ".join(bad), figures)
        self.trained = True
        return figures

    def save(self, deadline: float) -> dict:
        if not self.trained:
            raise Skipped("no trained weights")
        results = self.ask({t: ("checkpoint", dict(directory=str(self.checkpoint), model_dir=self.args.model_dir))
                            for t in self.trainers}, deadline)
        return results["trainer0"]

    def observe(self, deadline: float, **what: bool) -> dict:
        return self.ask({self.vllm: ("observe", dict(prompts=list(PROMPTS), **what))}, deadline)["vllm"]

    def take_reference(self, deadline: float) -> dict:
        if self.vllm_down or not (self.checkpoint / "model.safetensors").is_file():
            raise Skipped(self.vllm_down or "no trained checkpoint")
        started = self.observe(deadline, digests=False, generation=False)["pointers"]  # after vLLM's start-up load
        self.ask({self.vllm: ("reload", dict(path=str(self.checkpoint)))}, deadline)
        self.reference = self.observe(deadline)
        moved = moved_pointers(started, self.reference["pointers"])
        return {"tp_ranks": len(self.reference["digests"]),
                "parameters_per_rank": [len(d) for d in self.reference["digests"]],
                "moved_by_reload": moved, "generation": [g["text"] for g in self.reference["generation"]]}

    def compare_logprobs(self, deadline: float) -> dict:
        if self.reference is None or not self.parameters:
            raise Skipped("no vLLM reference generation")
        generation = self.reference["generation"]
        sequences = [g["prompt_token_ids"] + g["token_ids"] for g in generation]
        trainer = self.ask({t: ("logprobs", dict(sequences=sequences)) for t in self.trainers}, deadline)["trainer0"]
        figures = logprob_mismatch(trainer, [g["logprobs"] for g in generation])
        if figures["tokens"] == 0 or not math.isfinite(figures["max_abs"]):
            raise StepFailed(f"no finite logprob difference over {figures['tokens']} tokens", figures)
        return figures

    def bandwidth(self, deadline: float) -> dict:
        if not self.parameters:
            raise Skipped("the trainer ranks did not start")
        return self.ask({self.trainers[0]: ("bench", dict(repeats=5))}, deadline)["trainer0"]

    def transfer(self, transport: str, deadline: float) -> dict:
        """Form the group over `transport`, set vLLM's planned weights to NaN, send, receive."""
        if self.vllm_down or self.reference is None or not self.parameters:
            raise Skipped(self.vllm_down or "needs the trainer ranks and vLLM's reference")
        store = self.serve_store()
        self.stores[transport] = store
        timeout_s = self.timeout_s(deadline)
        joined = time.monotonic()
        joins = {t: ("connect", dict(transport=transport, port=store.port, timeout_s=timeout_s)) for t in self.trainers}
        joins[self.vllm] = ("init", dict(transport=transport, port=store.port, timeout_s=timeout_s))
        self.ask(joins, deadline)
        self.connected.add(transport)
        connect_s = time.monotonic() - joined
        self.planned = self.ask({self.vllm: ("fill_nan", {})}, deadline)["vllm"]["planned"]
        figures = self.send(deadline, corrupt=False) | {"transport": transport, "connect_s": round(connect_s, 2)}
        self.delivered.add(transport)
        return figures

    def send(self, deadline: float, *, corrupt: bool) -> dict:
        commands = {t: ("send", dict(corrupt=corrupt)) for t in self.trainers}
        commands[self.vllm] = ("receive", {})
        results = self.ask(commands, deadline)
        sent = [results[t.name]["bytes"] for t in self.trainers]
        ranks = results["vllm"]["ranks"]
        received = [r.get("bytes", 0) for r in ranks]
        seconds = results["vllm"]["seconds"]
        figures = {"bytes_sent": sent, "bytes_received": received, "seconds": round(seconds, 3),
                   "gb_per_s": gb_per_s(sum(received), seconds),
                   "trainer_send_s": [round(results[t.name]["seconds"], 3) for t in self.trainers],
                   "receive_s": [round(r.get("receive_s", 0.0), 3) for r in ranks],
                   "corrupted": results["trainer0"]["corrupted"]}
        if sum(sent) != sum(received):
            raise StepFailed(f"trainer ranks sent {sum(sent)} bytes, vLLM's ranks received {sum(received)}", figures)
        return figures

    def oracle(self, transport: str, deadline: float) -> dict:
        """vLLM after the transfer against vLLM's own loading of the same checkpoint."""
        if self.vllm_down or self.reference is None or transport not in self.delivered:
            raise Skipped(self.vllm_down or f"no complete {transport} transfer to check")
        ref, now = self.reference, self.observe(deadline)
        mismatch = digest_mismatch(now["digests"], ref["digests"])
        moved = moved_pointers(ref["pointers"], now["pointers"])
        outside = unplanned(now["digests"], self.planned)
        same_tokens = [g["token_ids"] for g in now["generation"]] == [g["token_ids"] for g in ref["generation"]]
        figures = {"mismatch": mismatch, "moved": moved, "unplanned": outside, "generation_equal": same_tokens,
                   "parameters_per_rank": [len(d) for d in now["digests"]]}
        problems = []
        if any(mismatch):
            names = sorted({n for rank in mismatch for n in rank})
            problems.append(f"{len(names)} parameter(s) differ from vLLM's own loading, e.g. {', '.join(names[:3])}")
        if outside:
            problems.append(f"{len(outside)} vLLM parameter(s) are outside the plan, e.g. {', '.join(outside[:3])}")
        if any(moved) and self.mode.device == "cuda":  # vLLM on CPU replaces its repacked weights by design
            problems.append(f"parameters moved (data_ptr changed), e.g. {sorted({n for r in moved for n in r})[:3]}")
        if not same_tokens:
            problems.append("greedy generation differs from the reference's")
        if problems:
            raise StepFailed("; ".join(problems), figures)
        return figures

    def negative_control(self, transport: str, deadline: float) -> dict:
        """One changed element in one trainer shard: the oracle must flag exactly that parameter."""
        if self.vllm_down or self.reference is None or transport not in self.connected:
            raise Skipped(self.vllm_down or f"no {transport} transfer group")
        figures = self.send(deadline, corrupt=True)
        digests = self.observe(deadline, pointers=False, generation=False)["digests"]
        mismatch = digest_mismatch(digests, self.reference["digests"])
        caught, what = negative_control(mismatch, figures["corrupted"])
        figures |= {"mismatch": mismatch, "oracle": what}
        if not caught:
            raise StepFailed(what, figures)
        return figures

    def teardown(self) -> None:
        """Ask every process to exit (vLLM shuts its engine down), then end what is left of each session
        and remove the shared memory its processes held (vLLM on CPU leaves some even when it exits)."""
        from hpcrl.roles.reaper import session_pids, shared_memory_of

        sids = [child.proc.pid for child in self.children.values()]
        shm = shared_memory_of([pid for sid in sids for pid in session_pids(sid)])
        try:
            self.ask({child: ("exit", {}) for child in self.children.values()
                      if child.proc.poll() is None}, time.monotonic() + TEARDOWN_S / 2)
        except (Stuck, ChildError) as err:
            print(f"gpu_check: teardown: {err}", file=sys.stderr, flush=True)
        end_sessions(sids, grace_s=10.0)
        for path in shm:
            Path(path).unlink(missing_ok=True)
        for child in self.children.values():
            try:
                child.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if not self.args.keep_checkpoint:
            shutil.rmtree(self.checkpoint, ignore_errors=True)
