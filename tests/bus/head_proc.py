"""A real head process for the bus tests: binds, prints its address, reports registrations.

    python tests/bus/head_proc.py RUN_DIR --replicas N [--heartbeat 0.2 --timeout 1.0]

Prints "address <addr>", then "ready" once N replicas of group "inf" registered, then serves
until killed (the tests kill it with SIGKILL to check that its workers leave on their own).
"""

from __future__ import annotations

import argparse
import asyncio
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--run-id", default="test-run")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--heartbeat", type=float, default=0.2)
    ap.add_argument("--timeout", type=float, default=1.0)
    opts = ap.parse_args()

    from hpcrl.bus import BusConfig, Router, load_secret

    async def serve() -> None:
        head = Router(run_id=opts.run_id, secret=load_secret(opts.run_dir), address="tcp://127.0.0.1:0",
                    config=BusConfig(heartbeat_interval=opts.heartbeat, heartbeat_timeout=opts.timeout))
        print("address", await head.start(), flush=True)
        await head.wait_for_peers("inf", opts.replicas, timeout=60)
        print("ready", flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
