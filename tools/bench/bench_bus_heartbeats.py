"""Benchmark: the head's CPU while 1,024 peers heartbeat, and how soon it notices a silent host.

Each peer is a Worker with a DEALER of its own (its own connection to the head's ROUTER), as
every group task of a run has; they are hosted --per-process to a process, on one event loop
(on a 2-core machine 1,024 processes would measure the scheduler, not the head). Only the head
(this process, one Router, heartbeats both ways every --interval) is measured:

  head CPU      once every peer has registered and --settle seconds have passed: the head
                process's CPU time (user + system, all threads: the event loop and libzmq's I/O
                thread; getrusage) over --seconds, as % of one core; and the loop's thread alone.
  silent peers  SIGSTOP one hosting process (--per-process peers), then time, from the stop,
                the Router's "dead" PeerEvent of each of its peers; reported minus --timeout
                (BusConfig.heartbeat_timeout). By design within (-interval, +interval]: a peer's
                last heartbeat came up to one interval before the stop, and the head checks its
                peers once an interval. Any other peer declared dead is a false death, counted.

Run (45 s on a 2-core VM; any Python with hpcrl's dependencies, uvloop if installed):
    .venv/bin/python tools/bench/bench_bus_heartbeats.py [--loop asyncio] [--peers 1024 --per-process 128]
The hosting processes are tools/bench/bench_bus.py's (`--serve`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_bus  # noqa: E402  (tools/ is not a package)

sys.path.insert(0, str(bench_bus.REPO))  # this checkout's hpcrl, whichever Python runs the script


async def bench(opts: argparse.Namespace, run_dir: str) -> list[str]:
    from hpcrl.bus import BusConfig, Router, load_secret

    router = Router(run_id=bench_bus.RUN_ID, secret=load_secret(run_dir),
                    config=BusConfig(heartbeat_interval=opts.interval, heartbeat_timeout=opts.timeout))
    loop = asyncio.get_running_loop()
    deaths: dict[str, tuple[float, str]] = {}  # peer name -> (loop time of its "dead" event, reason)

    def on_event(event) -> None:
        if event.kind == "dead":
            deaths.setdefault(event.info.name, (loop.time(), event.reason))

    router.watch(on_event)
    address = await router.start()
    hosts = bench_bus.spawn(address, run_dir, "hb", opts.peers, opts.per_process, opts.loop)
    out = []
    try:
        start = time.perf_counter()
        await router.wait_for_peers("hb", opts.peers, timeout=120)
        out.append(f"{opts.peers} peers registered in {time.perf_counter() - start:.1f} s "
                   f"({len(hosts)} processes, up to {opts.per_process} Workers each, one socket per Worker)")
        await asyncio.sleep(opts.settle)

        accepted0, hosts0 = router.counters()["accepted"], sum(bench_bus.process_cpu(p.pid) for p in hosts)
        cpu0, thread0, wall0 = bench_bus.own_cpu(), time.thread_time(), time.perf_counter()
        await asyncio.sleep(opts.seconds)
        wall = time.perf_counter() - wall0
        head = (bench_bus.own_cpu() - cpu0) / wall * 100
        thread = (time.thread_time() - thread0) / wall * 100
        hosted = (sum(bench_bus.process_cpu(p.pid) for p in hosts) - hosts0) / wall * 100
        rate = (router.counters()["accepted"] - accepted0) / wall
        out.append(f"head CPU, {opts.peers} peers heartbeating every {opts.interval:g} s: {head:.2f} % of one core "
                   f"over {wall:.0f} s (event-loop thread {thread:.2f} %) (target < 5 %)")
        out.append(f"head accepted {rate:.0f} messages/s; hosting processes together: {hosted:.1f} % of one core")
        if deaths:
            out.append(f"FALSE DEATHS before any peer was stopped: {len(deaths)}, e.g. {next(iter(deaths.values()))[1]}")

        victim = hosts[0]
        silenced = {p.name for p in router.peers("hb") if p.pid == victim.pid}
        os.kill(victim.pid, signal.SIGSTOP)
        stopped = loop.time()
        give_up = stopped + opts.timeout + 2 * opts.interval + 10
        while not silenced <= deaths.keys() and loop.time() < give_up:
            await asyncio.sleep(0.02)
        late = sorted(deaths[n][0] - stopped - opts.timeout for n in silenced if n in deaths)
        if late:
            out.append(f"silent peers noticed: {len(late)} of {len(silenced)} (one SIGSTOPped process), "
                       f"heartbeat_timeout {opts.timeout:g} s: detection delay - timeout = "
                       f"{late[0]:+.2f} / {statistics.median(late):+.2f} / {late[-1]:+.2f} s (min / median / max; "
                       f"by design within (-{opts.interval:g}, +{opts.interval:g}] s)")
        else:
            out.append(f"silent peers noticed: 0 of {len(silenced)} within {give_up - stopped:.0f} s")
        others = [n for n in deaths if n not in silenced]
        out.append(f"false deaths among the other {opts.peers - len(silenced)} peers: {len(others)}")
        out.append(f"head counters: dropped {router.counters()['dropped']}")
    finally:
        await router.close()
        hosts[0].kill()  # stopped (or not): SIGKILL ends it either way
        bench_bus.reap(hosts)
    return out


def main() -> int:
    from hpcrl.bus import create_secret
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default, text in (("--peers", 1024, "registered peers (Workers, one socket each)"),
                                ("--per-process", 128, "Workers hosted per process, on one event loop"),
                                ("--seconds", 30.0, "duration of the head CPU figure"),
                                ("--settle", 3.0, "pause after the last registration"),
                                ("--interval", 1.0, "BusConfig.heartbeat_interval (s)"),
                                ("--timeout", 5.0, "BusConfig.heartbeat_timeout (s)")):
        ap.add_argument(flag, type=type(default), default=default, help=text)
    ap.add_argument("--loop", choices=["auto", "asyncio", "uvloop"], default="auto",
                    help="event loop of the head and hosts; auto = uvloop when installed")
    opts = ap.parse_args()
    if opts.peers < 2 * opts.per_process:
        ap.error("--peers must be at least 2 x --per-process: one process is stopped, the others stay")
    logging.getLogger("hpcrl.bus").setLevel(logging.ERROR)  # not one warning per silenced peer
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hpcrl-bench-hb-") as run_dir:
        create_secret(run_dir)
        opts.loop = bench_bus.new_loop_policy(opts.loop)
        lines = asyncio.run(bench(opts, run_dir))
    print("\n".join(lines))
    print(f"event loop: {opts.loop}; total {time.perf_counter() - start:.0f} s; "
          f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
