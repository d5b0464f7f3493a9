"""Benchmark: the head under a flood from a client without the secret, against the same head unflooded.

The flooder presents the run's PLAIN token (hpcrl.bus.zap), as a sniffer of the network could:
without it the head's handshake refuses its connection and nothing reaches the head at all.

The head (this process: a Router with the limits a run's head gets, hpcrl.bus.config.message_limit_for
for a batch of 64 sequences x 768 tokens: 16 MiB) drives step-like calls on worker processes
(tests/bus/worker_proc.py, whose echo endpoint sends its argument back):
  generate    one call to each of 2 replicas at once, each with half a batch (32 completions of 768
              token ids, logprobs and text: about 0.6 MB of msgpack each way), answered in kind;
  train_step  one call with the whole batch (64 sequences of ids, mask, logprobs: about 1 MB);
  score       8 small calls;
and, between steps, 200 small calls one at a time (the quickest round trip the head makes).
Blocks alternate: quiet, flooded at a fixed rate (tests/bus/flood_proc.py: a burst of 100 x 12 MiB
junk frames, then 20 rounds a second of one 12 MiB frame and 25 small junk messages: 250 MB/s), and
flooded as fast as the head reads (--rate 0: on a small VM this times the sharing of its CPUs with
the flooder, which a flooder on another node would not take). Per kind: step p50, small-call p50
and the head's RSS growth (peak over the block, from before it). The flooder shares this machine.

    PYTHONPATH=. .venv/bin/python tools/bench/bench_flood.py [--steps 30] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUN_ID = "test-run"  # worker_proc.py's default
SEQUENCES, TOKENS = 64, 768


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    """Start VmHWM again from the current RSS (Linux >= 4.0: write 5 to clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def _completions(count: int) -> list[dict]:
    return [{"prompt_id": f"p{i // 8}", "index": i % 8, "prompt_token_ids": list(range(1000, 1256)),
             "token_ids": list(range(2000, 2000 + TOKENS - 256)), "logprobs": [-0.125] * (TOKENS - 256),
             "text": "word " * (TOKENS - 256), "finish_reason": "length", "weight_version": 3}
            for i in range(count)]


def _batch() -> dict:
    return {"input_ids": [list(range(TOKENS))] * SEQUENCES, "policy_mask": [[0] * 256 + [1] * (TOKENS - 256)] * SEQUENCES,
            "logprobs": [[-0.125] * TOKENS] * SEQUENCES, "advantages": [0.5] * SEQUENCES, "rewards": [1.0] * SEQUENCES}


async def _block(head, names: list[str], steps: int) -> dict:
    half, batch = _completions(SEQUENCES // 2), _batch()
    step_s, call_s = [], []
    for _ in range(steps):
        started = time.perf_counter()
        await asyncio.gather(*(head.request(n, "echo", half, timeout=30) for n in names))
        await head.request(names[0], "echo", batch, timeout=30)
        await asyncio.gather(*(head.request(names[i % 2], "echo", {"score": i}, timeout=30) for i in range(8)))
        step_s.append(time.perf_counter() - started)
        for i in range(200):
            t = time.perf_counter()
            await head.request(names[i % 2], "echo", i, timeout=30)
            call_s.append(time.perf_counter() - t)
    return {"step": statistics.median(step_s), "call": statistics.median(call_s)}


async def _flooder(address: str, rate: float, run_dir: str) -> subprocess.Popen:
    """Start the flooder; returns once its burst was sent (the head, on this loop, reads it meanwhile).
    It presents the run's PLAIN token, as a sniffer could: without it, nothing would reach the head."""
    proc = subprocess.Popen([sys.executable, str(REPO / "tests/bus/flood_proc.py"), address, "--big-mib", "12",
                             "--burst", "100", "--rate", str(rate), "--max-gib", "1000", "--token-of", run_dir],
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = await asyncio.get_running_loop().run_in_executor(None, proc.stdout.readline)
    assert line.strip() == "flooding", line
    return proc


async def main(opts: argparse.Namespace) -> None:
    from hpcrl.bus import BusConfig, Router, create_secret, load_secret
    from hpcrl.bus.config import message_limit_for

    run_dir = tempfile.mkdtemp(prefix="bench-flood-")
    create_secret(run_dir)
    limit = message_limit_for(sequences=SEQUENCES, tokens_per_sequence=TOKENS)
    head = Router(run_id=RUN_ID, secret=load_secret(run_dir), address="tcp://127.0.0.1:0",
                  config=BusConfig(heartbeat_interval=1.0, heartbeat_timeout=30.0, max_message_bytes=limit))
    address = await head.start()
    workers = [subprocess.Popen([sys.executable, str(REPO / "tests/bus/worker_proc.py"), address, run_dir,
                                 "--replica", str(r), "--heartbeat", "1", "--timeout", "30"],
                                env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL)
               for r in range(2)]
    try:
        await head.wait_for_peers("inf", 2, timeout=60)
        names = [p.name for p in head.peers("inf")]
        await _block(head, names, 3)  # warm up
        kinds = {"quiet": None, f"flood {opts.rate:g} rounds/s": opts.rate, "flood, no rate": 0.0}
        results: dict[str, list[dict]] = {k: [] for k in kinds}
        for _ in range(opts.rounds):
            for kind, rate in kinds.items():
                before = _kib("VmRSS")
                _reset_peak()
                flooder = await _flooder(address, rate, run_dir) if rate is not None else None
                try:
                    figures = await _block(head, names, opts.steps)
                finally:
                    if flooder is not None:
                        flooder.kill()
                        flooder.wait()
                figures["rss_growth_mb"] = (_kib("VmHWM") - before) / 1024
                results[kind].append(figures)
                await asyncio.sleep(0.5)  # the flooder's last frames are read and dropped
        print(f"head limit {limit >> 20} MiB, receive_queue {head.config.receive_queue}; {opts.steps} steps x "
              f"{opts.rounds} rounds per kind; refused: {head.refused()}")
        print("| | " + " | ".join(kinds) + " |")
        print("|---" * (len(kinds) + 1) + "|")
        rows = [("step p50 (ms)", "step", 1e3, ".1f"), ("small call p50 (us)", "call", 1e6, ".0f"),
                ("head RSS growth, peak (MB)", "rss_growth_mb", 1, ".0f")]
        for label, key, scale, fmt in rows:
            pick = max if key == "rss_growth_mb" else statistics.median
            print(f"| {label} | " + " | ".join(format(pick([r[key] for r in results[k]]) * scale, fmt) for k in kinds) + " |")
        print(f"head RSS at the end: {_kib('VmRSS') / 1024:.0f} MB")
    finally:
        await head.close()
        for w in workers:
            w.wait(timeout=10)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rate", type=float, default=20.0, help="rounds a second of the rated flood")
    asyncio.run(main(ap.parse_args()))
