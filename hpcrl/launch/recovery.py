"""What to start again, and where, when the trainer group loses a rank inside the job (pure).

    plan = plan_trainer_restart(nodes=["n1", "n2"], lost=[LostRank(1, "n2", node_lost=True, why="silent")],
                                spares=["n6"])
    plan.nodes    # ["n1", "n6"]: the group's step starts again there, every rank, from the last checkpoint
    plan.spares   # []: the spares left

A trainer rank cannot be started again alone: its torch.distributed group is broken the moment one rank
is gone, so the whole group starts again (a new srun step, same job) and resumes from the newest
checkpoint, as a requeued job does. A lost rank whose node lives (it exited with a code: kill -9, a
crash) starts again on the same node; a node presumed lost (the rank fell silent, or its step ended
without its exit code) is swapped for the next spare, in its place in the group's node list. When a
lost node finds no spare, there is no plan (NoRestart): the head requeues the job, the last resort.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcrl.errors import HpcrlError


class NoRestart(HpcrlError):
    """The group cannot start again inside the job (no spare left for a lost node): requeue instead."""


@dataclass(frozen=True)
class LostRank:
    rank: int
    node: str | None
    """The node it ran on (None when unknown: it never said)."""
    node_lost: bool
    """Its node is presumed lost (silent, or its step ended without its exit code); False: it exited with a code."""
    why: str


@dataclass(frozen=True)
class TrainerRestart:
    nodes: list[str]
    """The group's nodes for its new step: the old list, each lost node replaced by a spare in its place."""
    replaced: dict[str, str]
    """lost node -> the spare that takes its place (empty: every rank starts again where it ran)."""
    spares: list[str]
    """The spares left after this restart."""

    @property
    def in_place(self) -> bool:
        return not self.replaced


def plan_trainer_restart(*, nodes: list[str], lost: list[LostRank], spares: list[str]) -> TrainerRestart:
    """Where the trainer group starts again after losing `lost` (see the module docstring)."""
    if not lost:
        raise ValueError("a restart needs a lost rank")
    if not nodes:
        raise NoRestart("the trainer group's nodes are unknown (no Slurm allocation): it cannot start again in place")
    dead = []
    for one in lost:
        if one.node_lost and one.node is not None and one.node in nodes and one.node not in dead:
            dead.append(one.node)
        elif one.node_lost and one.node is None:
            raise NoRestart(f"trainer rank {one.rank} was lost ({one.why}) on a node it never named: "
                            "which node to replace is unknown")
    if len(dead) > len(spares):
        raise NoRestart(f"trainer node(s) {', '.join(dead)} lost, {len(spares)} spare node(s) left: "
                        "the group cannot start again inside the job")
    replaced = dict(zip(dead, spares, strict=False))
    return TrainerRestart(nodes=[replaced.get(node, node) for node in nodes], replaced=replaced,
                          spares=list(spares[len(dead):]))


def describe_restart(plan: TrainerRestart) -> str:
    if plan.in_place:
        return f"in place on {','.join(plan.nodes)}"
    swaps = ", ".join(f"{lost} -> spare {spare}" for lost, spare in plan.replaced.items())
    return f"on {','.join(plan.nodes)} ({swaps})"
