"""The RL program of a run's head: the RL loop over the group tasks on the bus.

    preempted = await run_program(config, router, store=address, steps=None,
                                  stop_requested=event.is_set, connect_timeout=600)

The head's job entry (hpcrl.launch.head) starts the groups and watches their steps; this is the
part that trains: wait for every group's tasks to be ready on the bus, form the weight-transfer
group (hpcrl.rl.ports.BusPorts over the rendezvous store), and run the loop (hpcrl.rl.loop) until
the last step, or until `stop_requested()` after a step (Slurm's pre-timeout signal: the loop
checkpoints and stops). Returns True when it stopped early that way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from hpcrl.bus.router import Router
from hpcrl.config.schema import Config
from hpcrl.rl.loop import Preempted, run_loop
from hpcrl.rl.ports import BusPorts

log = logging.getLogger(__name__)


async def run_program(config: Config, router: Router, *, store: str,
                      steps: int | None, stop_requested: Callable[[], bool],
                      connect_timeout: float, generation: int = -1,
                      on_ports: Callable[[BusPorts], None] | None = None,
                      on_resumed: Callable[[int], None] | None = None) -> bool:
    """`generation`: the weight-transfer group formed last on this store (-1: none yet), when the loop runs
    again in the same job (the trainer group started again); `on_ports` gets the ports (the head reads
    their generation afterwards); `on_resumed(step)` is called once the loop resumed from checkpoint `step`."""
    ports = BusPorts(config, router, store=store, generation=generation)
    if on_ports is not None:
        on_ports(ports)
    try:
        await ports.connect(timeout=max(1.0, connect_timeout))
        try:
            await run_loop(config, ports, steps=steps, stop_requested=stop_requested, on_resumed=on_resumed)
        except Preempted as stopped:
            log.info(f"preempted: {stopped}")
            return True
        return False
    finally:
        ports.close()
