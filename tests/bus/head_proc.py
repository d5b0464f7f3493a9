"""A real head process for the bus tests: binds, prints its address, reports registrations.

    python tests/bus/head_proc.py RUN_DIR --replicas N [--heartbeat 0.2 --timeout 1.0]
                                  [--max-message-mib M] [--serve-calls]

Prints "address <addr>", then "ready" once N replicas of group "inf" registered, then serves
until killed (the tests kill it with SIGKILL to check that its workers leave on their own).
With --serve-calls it also reads commands from stdin: "measure K" makes K echo calls, one at a
time, over the ready replicas in turn, and prints one line "measured <json>": the median and
90th percentile of their round trips (s), the head's refused-message counters, its accepted
count and its ready peers; "counters" prints one line "counters <json>": the head's counters.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--run-id", default="test-run")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--heartbeat", type=float, default=0.2)
    ap.add_argument("--timeout", type=float, default=1.0)
    ap.add_argument("--max-message-mib", type=float, default=0.0)
    ap.add_argument("--serve-calls", action="store_true")
    opts = ap.parse_args()

    from hpcrl.bus import BusConfig, Router, load_secret

    limits = {"max_message_bytes": int(opts.max_message_mib * (1 << 20))} if opts.max_message_mib else {}

    async def measure(head: Router, calls: int) -> dict:
        names = [p.name for p in head.peers("inf")]
        took = []
        for i in range(calls):
            started = time.perf_counter()
            await head.request(names[i % len(names)], "echo", i, timeout=10)
            took.append(time.perf_counter() - started)
        took.sort()
        counters = head.counters()
        refused = {k: v for k, v in counters.items()
                   if v and k not in ("accepted", "dropped", "late_reply", "send_failed")}  # head.refused(), also before it
        return {"median_s": statistics.median(took), "p90_s": took[int(0.9 * len(took))],
                "refused": refused, "accepted": counters["accepted"], "peers": sorted(names)}

    async def serve() -> None:
        head = Router(run_id=opts.run_id, secret=load_secret(opts.run_dir), address="tcp://127.0.0.1:0",
                      config=BusConfig(heartbeat_interval=opts.heartbeat, heartbeat_timeout=opts.timeout, **limits))
        print("address", await head.start(), flush=True)
        await head.wait_for_peers("inf", opts.replicas, timeout=60)
        print("ready", flush=True)
        if not opts.serve_calls:
            await asyncio.Event().wait()
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            command, _, count = line.partition(" ")
            if command == "measure":
                print("measured", json.dumps(await measure(head, int(count))), flush=True)
            elif command.strip() == "counters":
                print("counters", json.dumps(head.counters()), flush=True)

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
