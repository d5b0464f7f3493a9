"""Benchmark: the hpcrl control bus against Ray actor calls, on loopback, in one run.

What it measures (the same work on both sides: an endpoint / actor method that returns its
small argument, a dict of about 64 bytes):
  route()   1 replica and 8 replicas (one process each): sequential round trip p50/p99, and
            throughput with batches of concurrent calls;
  fanout()  to 64 workers: p50/p99 of one call answered by every worker;
  Ray       an actor method call (`ray.get(actor.echo.remote(x))`) in the same shapes.
Ray runs in a driver process of its own, started before any figure is taken, so every figure
is taken beside Ray's daemons; the two figures of the target (route() to 1 replica, Ray's call
to 1 actor) are taken in alternating blocks (--rounds), so that a change in the machine's load
hits both alike.

Set up Ray's environment once (Ray stays out of hpcrl's dependencies):
    python3 -m venv .venv-bench && .venv-bench/bin/pip install ray pyzmq msgpack uvloop
Run (20-60 s; prints a Markdown table for BENCHMARKS.md):
    PYTHONPATH=. .venv-bench/bin/python tools/bench_bus.py
Any Python with pyzmq and msgpack runs the hpcrl part; without Ray it says that Ray was skipped.
Options: --fanout-procs N hosts the 64 fanout workers in N processes (default 8, one per 8 workers);
--transport ipc instead of tcp; --loop asyncio|uvloop (default: uvloop when installed);
--reply-spin S the head's busy-poll after a request (BusConfig.reply_spin; 0 turns it off).
The first row is the floor: a blocking pyzmq echo with no asyncio, auth or msgpack.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
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


def serve(address: str, run_dir: str, loop: str, names: list[str]) -> None:
    """Host one Worker per "group:replica" in this process, all on one event loop."""
    sys.path.insert(0, str(REPO))
    from hpcrl.bus import BusConfig, PeerInfo, Worker, load_secret

    secret = load_secret(run_dir)
    config = BusConfig(heartbeat_interval=1.0, heartbeat_timeout=5.0)

    def echo(call):  # a plain function, like Ray's actor method: answered without a task
        return call.args

    async def main() -> None:
        workers = []
        for name in names:
            group, replica = name.split(":")
            worker = Worker(info=PeerInfo(run_id=RUN_ID, group=group, replica=int(replica), pid=os.getpid()),
                            secret=secret, address=address, config=config)
            worker.add_endpoint("echo", echo, idempotent=True)
            workers.append(worker.serve())
        await asyncio.gather(*workers)

    new_loop_policy(loop)
    asyncio.run(main())


def spawn(address: str, run_dir: str, group: str, replicas: int, procs: int, loop: str) -> list[subprocess.Popen]:
    per = -(-replicas // procs)
    out = []
    for start in range(0, replicas, per):
        names = [f"{group}:{r}" for r in range(start, min(replicas, start + per))]
        out.append(subprocess.Popen([sys.executable, __file__, "--serve", address, run_dir, loop, *names]))
    return out


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
    for i in range(opts.warmup + opts.calls):
        t = time.perf_counter()
        sock.send_multipart([ident, payload])
        sock.recv_multipart()
        lat.append(time.perf_counter() - t)
    sock.send_multipart([ident, b"quit"])
    proc.wait(timeout=10)
    sock.close(linger=0)
    return row("floor: blocking pyzmq DEALER/ROUTER echo, no auth (not a bus)", lat[opts.warmup:])


# ---------------------------------------------------------------- measurement helpers

def bind_address(opts: argparse.Namespace, run_dir: str, name: str) -> str:
    return "tcp://127.0.0.1:0" if opts.transport == "tcp" else f"ipc://{run_dir}/{name}.sock"


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def row(what: str, lat: list[float] | None = None, rate: float | None = None) -> dict:
    return {"what": what, "p50_us": pct(lat, 0.5) * 1e6 if lat else None,
            "p99_us": pct(lat, 0.99) * 1e6 if lat else None, "calls_s": rate}


# ---------------------------------------------------------------- hpcrl

async def bench_hpcrl(opts: argparse.Namespace, run_dir: str, ray_side: "RaySide | None") -> list[dict]:
    from hpcrl.bus import BusConfig, Head, load_secret
    from hpcrl.services import Service

    head = Head(run_id=RUN_ID, secret=load_secret(run_dir), address=bind_address(opts, run_dir, "bus"),
                config=BusConfig(heartbeat_interval=1.0, heartbeat_timeout=5.0, reply_spin=opts.reply_spin))
    address = await head.start()
    rows, procs = [], []
    try:
        for replicas in (1, 8):
            group = f"route{replicas}"
            procs += spawn(address, run_dir, group, replicas, replicas, opts.loop)
            await head.wait_for_peers(group, replicas, timeout=60)
            svc = Service(head, group)
            for _ in range(opts.warmup):
                await svc.route("echo", ARG)
            lat, ray_lat = [], []
            rounds = opts.rounds if replicas == 1 and ray_side is not None else 1
            for _ in range(rounds):  # 1 replica vs Ray's 1 actor: alternating blocks, same conditions
                for _ in range(opts.calls // rounds):
                    t = time.perf_counter()
                    await svc.route("echo", ARG)
                    lat.append(time.perf_counter() - t)
                if rounds > 1:
                    ray_lat += ray_side.sequential(1, opts.calls // rounds)  # blocks the loop: nothing else runs
            batch = 32 * replicas
            done, t = 0, time.perf_counter()
            while time.perf_counter() - t < opts.seconds:
                await asyncio.gather(*(svc.route("echo", ARG) for _ in range(batch)))
                done += batch
            rows.append(row(f"hpcrl route(), {replicas} replica(s)", lat, done / (time.perf_counter() - t)))
            if ray_lat:
                rows.append(row("Ray actor call, 1 actor(s) (round robin)", ray_lat, ray_side.throughput(1)))
        lat = []
        for _ in range(opts.fanouts):  # the shape of Ray's fanout row below
            t = time.perf_counter()
            await svc.fanout("echo", ARG)
            lat.append(time.perf_counter() - t)
        rows.append(row("hpcrl fanout() to 8 replicas (one process each)", lat))
        procs += spawn(address, run_dir, "fan", 64, opts.fanout_procs, opts.loop)
        await head.wait_for_peers("fan", 64, timeout=90)
        svc = Service(head, "fan")
        for _ in range(opts.warmup // 4):
            await svc.fanout("echo", ARG)
        lat = []
        for _ in range(opts.fanouts):
            t = time.perf_counter()
            out = await svc.fanout("echo", ARG)
            lat.append(time.perf_counter() - t)
            assert len(out) == 64
        rows.append(row(f"hpcrl fanout() to 64 workers in {len(procs) - 9} process(es)", lat))
        assert head.counters()["dropped"] == 0, head.counters()
    finally:
        await head.close()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
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
        """The figures not interleaved with hpcrl's: 8 actors, and a call to a list of actors."""
        opts, ray = self.opts, self.ray
        rows = [row("Ray actor call, 8 actor(s) (round robin)", self.sequential(8, opts.calls), self.throughput(8))]
        actors = [self.Echo.remote() for _ in range(opts.ray_fanout)]
        ray.get([a.echo.remote(ARG) for a in actors])
        lat = []
        for _ in range(opts.fanouts):
            t = time.perf_counter()
            ray.get([a.echo.remote(ARG) for a in actors])
            lat.append(time.perf_counter() - t)
        rows.append(row(f"Ray call to {opts.ray_fanout} actors (ray.get of a list), like fanout()", lat))
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

def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-raw":
        serve_raw(sys.argv[2])
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-ray":
        serve_ray(sys.argv[2:])
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:])
        return 0
    sys.path.insert(0, str(REPO))  # this checkout's hpcrl, whichever Python runs the script
    from hpcrl.bus import BusConfig, create_secret
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000, help="sequential calls per latency figure")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=10,
                    help="alternating blocks of hpcrl route() and Ray calls for the 1-replica latency figures")
    ap.add_argument("--seconds", type=float, default=2.0, help="duration of each throughput figure")
    ap.add_argument("--fanouts", type=int, default=300, help="fanout calls measured")
    ap.add_argument("--fanout-procs", type=int, default=8, help="processes hosting the 64 fanout workers")
    ap.add_argument("--loop", choices=["auto", "asyncio", "uvloop"], default="auto",
                    help="event loop of hpcrl's side; auto = uvloop when installed")
    ap.add_argument("--transport", choices=["tcp", "ipc"], default="tcp", help="tcp on 127.0.0.1, or ipc")
    ap.add_argument("--reply-spin", type=float, default=BusConfig().reply_spin,
                    help="the head's BusConfig.reply_spin in seconds (0: sleep at once while awaiting replies)")
    ap.add_argument("--ray-fanout", type=int, default=8, help="actors in Ray's fanout figure")
    opts = ap.parse_args()

    start = time.perf_counter()
    try:
        ray_side = RaySide(opts)
    except ImportError:
        ray_side = None
        print("Ray was skipped: it is not installed in this Python (see the set-up at the top of "
              "tools/bench_bus.py)", file=sys.stderr)
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

    print("\n| what | p50 (us) | p99 (us) | calls/s |\n| --- | --- | --- | --- |")
    for r in rows:
        fmt = lambda v, f: f.format(v) if v is not None else "-"
        print(f"| {r['what']} | {fmt(r['p50_us'], '{:.0f}')} | {fmt(r['p99_us'], '{:.0f}')} | {fmt(r['calls_s'], '{:.0f}')} |")
    by = {r["what"]: r for r in rows}
    ours, theirs = by.get("hpcrl route(), 1 replica(s)"), by.get("Ray actor call, 1 actor(s) (round robin)")
    if ours and theirs:
        print(f"\nroute() p50 / Ray p50 = {ours['p50_us'] / theirs['p50_us']:.3f} (target <= 0.2)")
    fan = [r for r in rows if r["what"].startswith("hpcrl fanout() to 64")][0]
    print(f"fanout to 64 workers p50 = {fan['p50_us'] / 1000:.2f} ms (target < 2 ms)")
    print(f"hpcrl event loop: {opts.loop}; transport {opts.transport}; reply_spin {opts.reply_spin * 1e6:.0f} us; total {time.perf_counter() - start:.0f} s; python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
