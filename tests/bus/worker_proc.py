"""A real group process for the bus tests: one Worker with a few endpoints, in its own process.

    python tests/bus/worker_proc.py ADDRESS RUN_DIR --group inf --replica 0 [--rank 0 --ranks 1]

Endpoints: echo (idempotent), slow (idempotent; sleeps args["s"]), once (not idempotent;
sleeps args["s"]), fail (raises ValueError). Each answers with its peer name and pid. Prints
the WorkerExit name on the last line and exits 0 when the bus tells it to go.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("address")
    ap.add_argument("run_dir")
    ap.add_argument("--run-id", default="test-run")
    ap.add_argument("--group", default="inf")
    ap.add_argument("--replica", type=int, default=0)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--heartbeat", type=float, default=0.2)
    ap.add_argument("--timeout", type=float, default=1.0)
    opts = ap.parse_args()

    from hpcrl.bus import BusConfig, PeerInfo, Worker, load_secret

    info = PeerInfo(run_id=opts.run_id, group=opts.group, replica=opts.replica, rank=opts.rank,
                    replica_ranks=opts.ranks, host=os.uname().nodename, pid=os.getpid())
    worker = Worker(info=info, secret=load_secret(opts.run_dir), address=opts.address,
                    config=BusConfig(heartbeat_interval=opts.heartbeat, heartbeat_timeout=opts.timeout,
                                     register_timeout=30))

    def answer(call):
        return {"peer": info.name, "pid": os.getpid(), "args": call.args}

    @worker.endpoint(idempotent=True)
    async def echo(call):
        return answer(call)

    @worker.endpoint(idempotent=True)
    async def slow(call):
        await asyncio.sleep(call.args["s"])
        return answer(call)

    @worker.endpoint()
    async def once(call):
        await asyncio.sleep(call.args["s"])
        return answer(call)

    @worker.endpoint()
    async def fail(call):
        raise ValueError(f"boom from {info.name}")

    async def serve():
        serving = asyncio.create_task(worker.serve())
        welcomed = asyncio.create_task(worker.welcomed())
        await asyncio.wait({serving, welcomed}, return_when=asyncio.FIRST_COMPLETED)
        if welcomed.done():
            print("welcomed", flush=True)
        return await serving

    how = asyncio.run(serve())
    print(how.name, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
