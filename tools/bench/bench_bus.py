"""Benchmark: the hpcrl control bus against Ray actor calls, on loopback, in one run.

(About 480 lines: the worker processes, the Ray driver and the alternating measurement blocks
have to live in one file so that one command reproduces every figure of BENCHMARKS.md's table.)

The production topology: every worker process holds exactly one Worker (one DEALER), and the
head (this process) holds the Router. What it measures (the same work on both sides: an
endpoint / actor method that returns its small argument, a dict of about 64 bytes):
  route()   1 replica and 8 replicas (one process each): sequential round trip p50/p99, and
            throughput with batches of concurrent calls;
  fanout()  to the 8 replicas, and to 64 workers in 64 processes: p50/p99 of one call
            answered by every worker;
  Ray       an actor method call (`ray.get(actor.echo.remote(x))`) in the same shapes.
Every hpcrl figure is taken with the head's reply spin on (--reply-spin, BusConfig.reply_spin)
and off, in alternating blocks. Ray runs in a driver process of its own, started before any
figure is taken, so every figure is taken beside Ray's daemons; route() to 1 replica (spin on,
spin off) and Ray's call to 1 actor are taken in alternating blocks (--rounds), so that a
change in the machine's load hits all three alike.

Set up Ray's environment once (Ray stays out of hpcrl's dependencies):
    python3 -m venv .venv-bench && .venv-bench/bin/pip install ray uvloop -e .
Run (1-2 minutes on a 2-core VM; prints a Markdown table, the target figures, the spin's effect):
    .venv-bench/bin/python tools/bench/bench_bus.py
Any Python with hpcrl's dependencies runs the hpcrl part; without Ray it says that Ray was skipped.
Options: --fanout-workers N (default 64, one process each); --replicas N for route();
--transport ipc instead of tcp; --loop asyncio|uvloop (default: uvloop when installed);
--reply-spin S the spin of the "on" blocks (0: every block without it).
The first row is the floor: a blocking pyzmq echo with no asyncio, auth or msgpack. The CPU
columns are CPU time per sequential call, of the head and of the called workers' processes
together (all threads, libzmq's I/O thread included).
The head's CPU under 1,024 heartbeating peers is tools/bench/bench_bus_heartbeats.py.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ARG = {"prompt_id": 12345, "tokens": list(range(12)), "note": "sixty-four bytes"}
RUN_ID = "bench"


# ---------------------------------------------------------------- worker processes

def new_loop_policy(name: str) -> str:
    """Use uvloop when asked (or, with "auto", when it is installed); returns the loop's name."""
    if name in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if name == "uvloop":
                raise
        else:
            asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
            return "uvloop"
    return "asyncio"


def serve(address: str, run_dir: str, loop: str, group: str, first: int, count: int) -> None:
    """Host Workers `group` replicas first..first+count-1 in this process, each with its own
    socket, on one event loop (count is 1 in the production topology)."""
    sys.path.insert(0, str(REPO))
    from hpcrl.bus import PeerInfo, Worker, load_secret

    secret = load_secret(run_dir)

    def echo(call):  # a plain function, like Ray's actor method: answered without a task
        return call.args

    async def main() -> None:
        workers = []
        for replica in range(first, first + count):
            worker = Worker(info=PeerInfo(run_id=RUN_ID, group=group, replica=replica, pid=os.getpid()),
                            secret=secret, address=address)  # heartbeat settings: the head's WELCOME
            worker.add_endpoint("echo", echo, idempotent=True)
            workers.append(worker.serve())
        await asyncio.gather(*workers)

    new_loop_policy(loop)
    asyncio.run(main())


def spawn(address: str, run_dir: str, group: str, peers: int, per_process: int, loop: str) -> list[subprocess.Popen]:
    """Start processes hosting `peers` Workers of `group`, `per_process` in each."""
    return [subprocess.Popen([sys.executable, __file__, "--serve", address, run_dir, loop, group,
                              str(first), str(min(per_process, peers - first))])
            for first in range(0, peers, per_process)]


def process_cpu(pid: int) -> float:
    """CPU seconds used so far by process `pid`, all its threads (libzmq's I/O thread too), to the
    nanosecond (/proc/PID/task/*/schedstat; Linux)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return total / 1e9


def own_cpu() -> float:
    """CPU seconds (user + system) used so far by this process, all its threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def reap(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def serve_raw(address: str) -> None:
    """The floor: a plain blocking DEALER that echoes (no asyncio, no auth, no msgpack)."""
    import zmq
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(address)
    sock.send(b"hello")
    while (msg := sock.recv_multipart()) != [b"quit"]:
        sock.send_multipart(msg)
    sock.close(linger=0)


def bench_raw_zmq(opts: argparse.Namespace, address: str) -> dict:
    import msgpack
    import zmq
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(address)
    proc = subprocess.Popen([sys.executable, __file__, "--serve-raw", sock.getsockopt_string(zmq.LAST_ENDPOINT)])
    ident, _ = sock.recv_multipart()
    payload = msgpack.packb(ARG)
    lat = []
    for _ in range(opts.warmup + opts.calls):
        t = time.perf_counter()
        sock.send_multipart([ident, payload])
        sock.recv_multipart()
        lat.append(time.perf_counter() - t)
    sock.send_multipart([ident, b"quit"])
    proc.wait(timeout=10)
    sock.close(linger=0)
    return row("floor: blocking pyzmq DEALER/ROUTER echo, no auth (not a bus)", None, lat[opts.warmup:])


# ---------------------------------------------------------------- measurement helpers

def bind_address(opts: argparse.Namespace, run_dir: str, name: str) -> str:
    return "tcp://127.0.0.1:0" if opts.transport == "tcp" else f"ipc://{run_dir}/{name}.sock"


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def row(what: str, spin: float | None, lat: list[float] | None = None, rate: float | None = None,
        cpu: tuple[float, float] | None = None) -> dict:
    """A table row; `cpu`: CPU seconds per call in the head, and in the workers' processes together."""
    return {"what": what, "spin_us": None if spin is None else spin * 1e6,
            "p50_us": pct(lat, 0.5) * 1e6 if lat else None, "p99_us": pct(lat, 0.99) * 1e6 if lat else None,
            "calls_s": rate, "head_cpu_us": cpu[0] * 1e6 if cpu else None,
            "workers_cpu_us": cpu[1] * 1e6 if cpu else None}


async def timed(call, n: int) -> list[float]:
    lat = []
    for _ in range(n):
        t = time.perf_counter()
        await call()
        lat.append(time.perf_counter() - t)
    return lat


async def alternating(router, spins: list[float], opts: argparse.Namespace, what: str, call, *,
                      calls: int, procs: list[subprocess.Popen], batch: int = 0, between=None) -> list[dict]:
    """One figure per reply spin, taken in alternating blocks (the order swaps every round), with
    `between()` (Ray's blocks) run after the first block of each round; then, if `batch`, the
    throughput with `batch` concurrent calls, in alternating blocks too. One row per spin, with
    the CPU time per sequential call of the head and of the worker processes `procs`."""
    lat: dict[float, list[float]] = {s: [] for s in spins}
    cpu = {s: [0.0, 0.0] for s in spins}
    per_block = max(1, calls // opts.rounds)
    for r in range(opts.rounds):
        for i, spin in enumerate(spins if r % 2 == 0 else spins[::-1]):
            # The spin is read at every request: switching the config switches it at once.
            router.config = dataclasses.replace(router.config, reply_spin=spin)
            head, workers = own_cpu(), sum(process_cpu(p.pid) for p in procs)
            lat[spin] += await timed(call, per_block)
            cpu[spin][0] += own_cpu() - head
            cpu[spin][1] += sum(process_cpu(p.pid) for p in procs) - workers
            if between is not None and i == 0:
                between()
    done = {s: [0, 0.0] for s in spins}
    for r in range(2 if batch else 0):
        for spin in spins if r % 2 == 0 else spins[::-1]:
            router.config = dataclasses.replace(router.config, reply_spin=spin)
            t = time.perf_counter()
            while time.perf_counter() - t < opts.seconds / 2:
                await asyncio.gather(*(call() for _ in range(batch)))
                done[spin][0] += batch
            done[spin][1] += time.perf_counter() - t
    router.config = dataclasses.replace(router.config, reply_spin=spins[0])
    return [row(what, s, lat[s], done[s][0] / done[s][1] if batch else None,
                (cpu[s][0] / len(lat[s]), cpu[s][1] / len(lat[s]))) for s in spins]


# ---------------------------------------------------------------- hpcrl

async def bench_hpcrl(opts: argparse.Namespace, run_dir: str, ray_side: RaySide | None) -> list[dict]:
    from hpcrl.bus import BusConfig, Router, Service, load_secret

    router = Router(run_id=RUN_ID, secret=load_secret(run_dir), address=bind_address(opts, run_dir, "bus"),
                    config=BusConfig(heartbeat_interval=1.0, heartbeat_timeout=5.0))
    address = await router.start()
    spins = [opts.reply_spin, 0.0] if opts.reply_spin > 0 else [0.0]
    rows, procs = [], {}
    try:
        # Every worker process is started first (each holds one Worker), then the figures are
        # taken beside all of them, as the head of a run sees its peers.
        for group, n in (("route1", 1), ("routeN", opts.replicas), ("fan", opts.fanout_workers)):
            procs[group] = spawn(address, run_dir, group, n, 1, opts.loop)
        for group, n in (("route1", 1), ("routeN", opts.replicas), ("fan", opts.fanout_workers)):
            await router.wait_for_peers(group, n, timeout=120)
        one, many, fan = (Service(router, group) for group in procs)
        ray_lat: list[float] = []

        def ray_block() -> None:  # Ray's 1 actor between the two spins' blocks; blocks the loop meanwhile
            ray_lat.extend(ray_side.sequential(1, max(1, opts.calls // opts.rounds)))

        for svc, n in ((one, 1), (many, opts.replicas)):
            for _ in range(opts.warmup):
                await svc.route("echo", ARG)
            with_ray = n == 1 and ray_side is not None
            rows += await alternating(router, spins, opts, f"hpcrl route(), {n} replica(s), one process each",
                                      lambda svc=svc: svc.route("echo", ARG), calls=opts.calls, batch=32 * n,
                                      procs=procs[svc.group], between=ray_block if with_ray else None)
            if with_ray:
                rows.append(row("Ray actor call, 1 actor", None, ray_lat, ray_side.throughput(1)))
        rows += await alternating(router, spins, opts, f"hpcrl fanout() to {opts.replicas} replicas, one process each",
                                  lambda: many.fanout("echo", ARG), calls=opts.fanouts, procs=procs["routeN"])
        for _ in range(max(1, opts.warmup // 4)):
            assert len(await fan.fanout("echo", ARG)) == opts.fanout_workers
        rows += await alternating(router, spins, opts,
                                  f"hpcrl fanout() to {opts.fanout_workers} workers in {opts.fanout_workers} processes",
                                  lambda: fan.fanout("echo", ARG), calls=opts.fanouts, procs=procs["fan"])
        assert router.counters()["dropped"] == 0, router.counters()
    finally:
        await router.close()
        reap([p for group in procs.values() for p in group])
    return rows


# ---------------------------------------------------------------- Ray

class RayBench:
    """Ray's figures, in a process of their own (a Ray driver's threads would otherwise share
    the hpcrl head's process and its GIL, slowing the figure they are compared with)."""

    def __init__(self, opts: argparse.Namespace) -> None:
        import ray

        self.ray, self.opts = ray, opts
        ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)

        @ray.remote(num_cpus=0)
        class Echo:
            def echo(self, x):
                return x

        self.Echo = Echo
        self.actors: dict[int, list] = {}

    def _actors(self, n: int) -> list:
        if n not in self.actors:
            self.actors[n] = actors = [self.Echo.remote() for _ in range(n)]
            self.ray.get([a.echo.remote(ARG) for a in actors])
            for i in range(self.opts.warmup):
                self.ray.get(actors[i % n].echo.remote(ARG))
        return self.actors[n]

    def sequential(self, n: int, calls: int) -> list[float]:
        ray, actors, lat = self.ray, self._actors(n), []
        for i in range(calls):
            t = time.perf_counter()
            ray.get(actors[i % n].echo.remote(ARG))
            lat.append(time.perf_counter() - t)
        return lat

    def throughput(self, n: int) -> float:
        ray, actors, batch = self.ray, self._actors(n), 32 * n
        done, t = 0, time.perf_counter()
        while time.perf_counter() - t < self.opts.seconds:
            ray.get([actors[i % n].echo.remote(ARG) for i in range(batch)])
            done += batch
        return done / (time.perf_counter() - t)

    def rest(self) -> list[dict]:
        """The figures not interleaved with hpcrl's: N actors, and a call to a list of actors."""
        opts, ray, n = self.opts, self.ray, self.opts.replicas
        rows = [row(f"Ray actor call, {n} actors (round robin)", None, self.sequential(n, opts.calls),
                    self.throughput(n))]
        actors = [self.Echo.remote() for _ in range(opts.ray_fanout)]
        ray.get([a.echo.remote(ARG) for a in actors])
        lat = []
        for _ in range(opts.fanouts):
            t = time.perf_counter()
            ray.get([a.echo.remote(ARG) for a in actors])
            lat.append(time.perf_counter() - t)
        rows.append(row(f"Ray call to {opts.ray_fanout} actors (ray.get of a list), like fanout()", None, lat))
        return rows

    def close(self) -> None:
        self.ray.shutdown()


def serve_ray(argv: list[str]) -> None:
    """The Ray driver process: one JSON command per stdin line, one JSON answer per stdout line."""
    import json
    opts = argparse.Namespace(**json.loads(argv[0]))
    out = sys.stdout
    sys.stdout = sys.stderr  # Ray's own messages must not mix with the answers
    bench = RayBench(opts)
    print(json.dumps("ready"), file=out, flush=True)
    for line in sys.stdin:
        cmd, *args = json.loads(line)
        if cmd == "quit":
            break
        print(json.dumps(getattr(bench, cmd)(*args)), file=out, flush=True)
    bench.close()


class RaySide:
    """Drives RayBench in its own process: started before any figure is taken, so every figure
    is taken beside Ray's daemons, and idle while hpcrl's figures are taken."""

    def __init__(self, opts: argparse.Namespace) -> None:
        import importlib.util
        import json
        if importlib.util.find_spec("ray") is None:
            raise ImportError("ray")
        self._json = json
        self._proc = subprocess.Popen([sys.executable, __file__, "--serve-ray", json.dumps(vars(opts))],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._read()

    def _read(self):
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError("the Ray driver process died (its error is above)")
        return self._json.loads(line)

    def _ask(self, *cmd):
        self._proc.stdin.write(self._json.dumps(cmd) + "\n")
        self._proc.stdin.flush()
        return self._read()

    def sequential(self, n: int, calls: int) -> list[float]:
        return self._ask("sequential", n, calls)

    def throughput(self, n: int) -> float:
        return self._ask("throughput", n)

    def rest(self) -> list[dict]:
        return self._ask("rest")

    def close(self) -> None:
        try:
            self._proc.stdin.write(self._json.dumps(["quit"]) + "\n")
            self._proc.stdin.close()
            self._proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self._proc.kill()


# ---------------------------------------------------------------- main

def summary(rows: list[dict], opts: argparse.Namespace) -> list[str]:
    """The target figures, and the reply spin's effect on each, as lines to print."""

    def fmt(v: float | None, f: str) -> str:
        return f.format(v) if v is not None else "-"

    lines = ["\n| what | reply spin (us) | p50 (us) | p99 (us) | calls/s | head CPU/call (us) | workers' CPU/call (us) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['what']} | {fmt(r['spin_us'], '{:.0f}')} | {fmt(r['p50_us'], '{:.0f}')} | "
              f"{fmt(r['p99_us'], '{:.0f}')} | {fmt(r['calls_s'], '{:.0f}')} | {fmt(r['head_cpu_us'], '{:.0f}')} | "
              f"{fmt(r['workers_cpu_us'], '{:.0f}')} |" for r in rows]
    by = {(r["what"], r["spin_us"]): r for r in rows}
    on, off = opts.reply_spin * 1e6, 0.0
    route1 = "hpcrl route(), 1 replica(s), one process each"
    ray = by.get(("Ray actor call, 1 actor", None))
    lines.append("")
    if ray:
        ratios = [f"{by[(route1, s)]['p50_us'] / ray['p50_us']:.3f} with reply_spin {s:.0f} us"
                  for s in ((on, off) if on else (off,))]
        lines.append(f"route() p50 / Ray p50 = {', '.join(ratios)} (target <= 0.2)")
    n = opts.fanout_workers
    fan = by[(f"hpcrl fanout() to {n} workers in {n} processes", on)]
    lines.append(f"fanout to {n} workers ({n} processes, one Worker each) p50 = {fan['p50_us'] / 1000:.2f} ms "
                 f"with reply_spin {on:.0f} us (target < 2 ms)")
    cpu = (fan["head_cpu_us"] + fan["workers_cpu_us"]) / 1000
    lines.append(f"CPU time of one fanout to {n} workers: {fan['workers_cpu_us'] / 1000:.2f} ms in the workers "
                 f"together ({fan['workers_cpu_us'] / n:.0f} us each) + {fan['head_cpu_us'] / 1000:.2f} ms in the head: "
                 f"at least {cpu / (os.cpu_count() or 1):.2f} ms a fanout on {os.cpu_count()} CPUs")
    if on:
        for what in dict.fromkeys(r["what"] for r in rows if r["spin_us"] == on):
            a, b = by[(what, on)], by[(what, off)]
            rate = f"; calls/s {b['calls_s']:.0f} -> {a['calls_s']:.0f}" if a["calls_s"] else ""
            lines.append(f"reply_spin {on:.0f} us vs off, {what}: p50 {b['p50_us']:.0f} -> {a['p50_us']:.0f} us "
                         f"({(a['p50_us'] - b['p50_us']) / b['p50_us'] * 100:+.0f} %){rate}; head CPU/call "
                         f"{b['head_cpu_us']:.0f} -> {a['head_cpu_us']:.0f} us")
    return lines


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-raw":
        serve_raw(sys.argv[2])
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-ray":
        serve_ray(sys.argv[2:])
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(*sys.argv[2:6], int(sys.argv[6]), int(sys.argv[7]))
        return 0
    sys.path.insert(0, str(REPO))  # this checkout's hpcrl, whichever Python runs the script
    from hpcrl.bus import BusConfig, create_secret
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000, help="sequential calls per latency figure (and spin)")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=10,
                    help="alternating blocks (spin on / Ray / spin off) per latency figure")
    ap.add_argument("--seconds", type=float, default=2.0, help="duration of each throughput figure (per spin)")
    ap.add_argument("--fanouts", type=int, default=300, help="fanout calls measured (per spin)")
    ap.add_argument("--replicas", type=int, default=8, help="replicas (processes) of the second route() figure")
    ap.add_argument("--fanout-workers", type=int, default=64, help="workers of the big fanout, one process each")
    ap.add_argument("--loop", choices=["auto", "asyncio", "uvloop"], default="auto",
                    help="event loop of hpcrl's side; auto = uvloop when installed")
    ap.add_argument("--transport", choices=["tcp", "ipc"], default="tcp", help="tcp on 127.0.0.1, or ipc")
    ap.add_argument("--reply-spin", type=float, default=BusConfig().reply_spin,
                    help="the head's BusConfig.reply_spin in the 'on' blocks, in seconds (0: no block spins)")
    ap.add_argument("--ray-fanout", type=int, default=8, help="actors in Ray's fanout figure")
    opts = ap.parse_args()
    BusConfig(reply_spin=opts.reply_spin)  # checks its range

    start = time.perf_counter()
    try:
        ray_side = RaySide(opts)
    except ImportError:
        ray_side = None
        print("Ray was skipped: it is not installed in this Python (see the set-up at the top of "
              "tools/bench/bench_bus.py)", file=sys.stderr)
    try:
        with tempfile.TemporaryDirectory(prefix="hpcrl-bench-") as run_dir:
            create_secret(run_dir)
            opts.loop = new_loop_policy(opts.loop)
            rows = [bench_raw_zmq(opts, bind_address(opts, run_dir, "raw"))]
            rows += asyncio.run(bench_hpcrl(opts, run_dir, ray_side))
        if ray_side is not None:
            rows += ray_side.rest()
    finally:
        if ray_side is not None:
            ray_side.close()

    print("\n".join(summary(rows, opts)))
    procs = 1 + opts.replicas + opts.fanout_workers
    print(f"worker processes: {procs} (1 + {opts.replicas} + {opts.fanout_workers}, one Worker each); "
          f"hpcrl event loop: {opts.loop}; transport {opts.transport}; total {time.perf_counter() - start:.0f} s; "
          f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
