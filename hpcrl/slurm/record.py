"""launch.json: what the head needs to start and watch a run's groups, as a typed record.

`hpcrl submit` writes it into the run directory before submitting (hpcrl.launch.submit); the head
and every group task read it back (`read_launch`). A file that does not parse as this record is a
SlurmError naming the file and the field, never a KeyError deep inside the head. Each group is
stored as its GroupSlot is built: {"component": {...the Component...}, "ranks_per_replica", "module",
"first_node"}. Version 1 stored the component's fields flat beside the slot's, its het index under
"component": it is still read (a job requeued by Slurm after hpcrl was upgraded in its venv resumes
by itself), and written back as version 2 by the next `hpcrl resume` or `hpcrl submit`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcrl.config.components import Component
from hpcrl.errors import SlurmError
from hpcrl.rundir import LAUNCH_FILE, read_json, write_json
from hpcrl.slurm.spec import GroupSlot, slot_named

VERSION = 2
#: What the head runs: "rl" trains; "check" starts every task, has each register, and ends them.
PROGRAMS = ("rl", "check")
#: Seconds every task has to register after its step started (the default of start_timeout_s).
DEFAULT_START_TIMEOUT_S = 600.0


@dataclass(frozen=True, kw_only=True)
class LaunchRecord:
    run_name: str
    run_dir: str
    executor: str
    """"slurm" or "local"."""
    layout: str
    """"hetjob" or "split" (hpcrl.slurm.spec)."""
    cluster: str
    python: str
    """The interpreter the head and every task run: cluster.python, or the one that ran hpcrl submit."""
    groups: tuple[GroupSlot, ...]
    program: str = "rl"
    stop_after: int | None = None
    """Program rl: stop (checkpointed) after this step instead of trainer.steps."""
    hold_s: float = 0.0
    """Program check: keep every task this long after all registered."""
    exit_codes: dict[str, int] = field(default_factory=dict)
    """Program check: "group/rank" -> the exit code the head tells that task (tests failure handling)."""
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S
    slurm_conf: str = ""
    env: dict[str, str] = field(default_factory=dict)
    """cluster.env: exported to every task."""
    max_requeues: int = 0
    spare_nodes: int = 0
    """Split layout: idle nodes at the end of the allocation (cluster.spare_nodes), where a lost task starts again."""
    verbose: bool = False
    """hpcrl submit --verbose: every task logs hpcrl's DEBUG lines, and every library's INFO lines on its terminal."""
    version: int = VERSION

    def __post_init__(self) -> None:
        if self.program not in PROGRAMS:
            raise SlurmError(f"{LAUNCH_FILE}: program {self.program!r} is not one of {PROGRAMS}")

    def group(self, name: str) -> GroupSlot:
        return slot_named(self.groups, name)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any, where: str = LAUNCH_FILE) -> LaunchRecord:
        version = data.get("version") if isinstance(data, dict) else None
        if version == 1 and isinstance(data.get("groups"), list):
            data = {**data, "version": VERSION, "groups": [_slot_v1(g) for g in data["groups"]]}
        elif version != VERSION:
            raise SlurmError(f"{where} is not a launch record of version {VERSION} (it says {version!r}; another "
                             "hpcrl wrote it): write it again with `hpcrl resume RUN_DIR` (a stopped run) or "
                             "hpcrl submit")
        try:
            groups = tuple(GroupSlot(**{**g, "component": Component(**g["component"])}) for g in data["groups"])
            return cls(**{**data, "groups": groups})
        except (KeyError, TypeError) as err:
            raise SlurmError(f"{where} does not hold what the head needs ({err}): write it again with "
                             "hpcrl submit") from None


#: Version 1's flat group entries: these keys were the Component's; "component" held its index.
_V1_COMPONENT_KEYS = ("name", "nodes", "tasks_per_node", "gpus_per_node", "gpus_per_task", "cpus_per_task", "mem")


def _slot_v1(group: Any) -> Any:
    """A version 1 group entry as version 2 stores it (anything malformed is left for from_json to refuse)."""
    if not isinstance(group, dict) or not all(k in group for k in (*_V1_COMPONENT_KEYS, "component")):
        return group
    component = {k: group[k] for k in _V1_COMPONENT_KEYS} | {"index": group["component"], "role": ""}
    rest = {k: v for k, v in group.items() if k not in (*_V1_COMPONENT_KEYS, "component", "tasks")}
    return {**rest, "component": component}


def read_launch(run_dir: Path | str) -> LaunchRecord:
    path = Path(run_dir) / LAUNCH_FILE
    return LaunchRecord.from_json(read_json(path), where=str(path))


def write_launch(run_dir: Path | str, record: LaunchRecord) -> None:
    write_json(Path(run_dir) / LAUNCH_FILE, record.to_json())
