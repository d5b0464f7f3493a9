"""From a validated Config to what the job asks of Slurm: a JobSpec (pure, no I/O).

Two layouts (cluster.layout):

  hetjob  one #SBATCH block per component, separated by `#SBATCH hetjob`, in the order of
          hpcrl.plan.make_components (head, trainer, inference, reward; reward only when
          reward.tasks > 0). Each block takes its partition, account and QOS from
          [groups.<name>], falling back to [cluster]. Components never share nodes.
  split   one homogeneous job for clusters that forbid heterogeneous jobs: the non-head groups
          get consecutive node ranges of one allocation (trainer first), and the head runs in
          the batch step on the allocation's first node. Every Slurm setting must then agree
          across groups; where two groups differ, the spec is refused with the key to change.
          With cluster.spare_nodes = N the allocation ends with N more nodes, idle, and the job is
          submitted with --no-kill: a lost node does not end it, and the head starts the lost task
          again on a spare (docs/FACTS.md: only a homogeneous job outlives a node in Slurm 22.05).

The JobSpec also carries the launch layout the head needs (which group is which component,
how many tasks, how ranks form replicas) so the same data drives rendering and launching.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hpcrl.config.components import Component, make_components, mem_gib
from hpcrl.config.groups import HEAD, TASK_GROUPS, TRAINER
from hpcrl.config.schema import Config, GroupConfig
from hpcrl.errors import ConfigError

#: The `python -m` module every group task runs, with the group's name as its argument; the head
#: runs in the batch step itself.
GROUP_MODULES = dict.fromkeys(TASK_GROUPS, "hpcrl.roles")


@dataclass(frozen=True, kw_only=True)
class GroupSlot:
    """One group of the run as the launcher sees it: its component (what each node and each task
    gets: hpcrl.config.components.Component) and what the launcher adds to start and place it."""

    component: Component
    ranks_per_replica: int
    """Consecutive ranks forming one replica (trainer: an HSDP replica; others: 1)."""
    module: str
    """`python -m` module run by each task (`python -m MODULE NAME`); empty for the head."""
    first_node: int = 0
    """Split layout: index of the group's first node in the allocation."""

    @property
    def name(self) -> str:
        return self.component.name


@dataclass(frozen=True, kw_only=True)
class SbatchBlock:
    """The #SBATCH options of one component (hetjob) or of the whole job (split)."""

    title: str
    options: tuple[tuple[str, str], ...]
    """(option, value) in order; value "" for a bare flag; options given verbatim keep their '='."""


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """Everything the batch script says, except paths and the command (see render.py)."""

    job_name: str
    layout: str
    cluster: str
    groups: tuple[GroupSlot, ...]
    blocks: tuple[SbatchBlock, ...]
    modules: tuple[str, ...] = ()
    setup: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    signal_delay_s: int = 90
    spare_nodes: int = 0
    """Split layout: idle nodes at the end of the allocation, where a lost task starts again."""
    time_limit: str = ""
    """Longest --time of the job ("" = partition default); used by the local executor too."""
    notes: tuple[str, ...] = field(default=())

    def group(self, name: str) -> GroupSlot:
        return slot_named(self.groups, name)


def slot_named(slots: tuple[GroupSlot, ...], name: str) -> GroupSlot:
    """The slot of group `name` (a JobSpec's or a launch record's); KeyError naming the groups there are."""
    for slot in slots:
        if slot.name == name:
            return slot
    raise KeyError(f"no group {name!r} in this run (its groups: {', '.join(s.name for s in slots)})")


def spare_nodes_of(slots: tuple[GroupSlot, ...], allocation: list[str], count: int) -> list[str]:
    """Split layout: the `count` spare nodes of `allocation` (the job's nodes, in order), after every group's range."""
    used = max((s.first_node + s.component.nodes for s in slots if s.module), default=0)
    return allocation[used:used + count]


def _ranks_per_replica(config: Config, name: str, tasks: int) -> int:
    if name != TRAINER:
        return 1
    t = config.trainer
    shard = t.dp_shard if t.dp_shard != -1 else tasks // t.dp_replicate
    return max(1, shard)


def _slots(config: Config, components: list[Component]) -> list[GroupSlot]:
    return [GroupSlot(component=c, ranks_per_replica=_ranks_per_replica(config, c.name, c.tasks),
                      module=GROUP_MODULES.get(c.name, ""))
            for c in components]


def _check_slots(config: Config, slots: list[GroupSlot]) -> None:
    cpu_only = config.cluster.gpus_per_node == 0
    for c in (slot.component for slot in slots):
        if c.nodes < 1 or c.tasks_per_node < 1:
            raise ConfigError(key=f"groups.{c.name}.nodes",
                              problem=f"component {c.name!r} would get {c.nodes} nodes x {c.tasks_per_node} tasks",
                              fix=f"give [groups.{c.name}] at least 1 node (or remove nodes to derive it)")
        if cpu_only and c.gpus_per_node > 0:
            raise ConfigError(key=f"groups.{c.name}.gpus_per_node",
                              problem=f"component {c.name!r} asks for {c.gpus_per_node} GPUs per node, "
                                      f"but cluster profile {config.cluster.name!r} has no GPUs",
                              fix="set the role's gpus_per_node = 0, or use a cluster profile with GPUs")


def _setting(config: Config, group: GroupConfig, key: str) -> str:
    value = getattr(group, key)
    return value or (getattr(config.cluster, key) if key in ("partition", "account", "qos") else "")


def _resource_options(config: Config, group: GroupConfig, *, nodes: int, tasks_per_node: int,
                      cpus_per_task: int, gpus_per_node: int, mem: str) -> list[tuple[str, str]]:
    options = []
    for key in ("partition", "account", "qos"):
        if value := _setting(config, group, key):
            options.append((key, value))
    options += [("nodes", str(nodes)), ("ntasks-per-node", str(tasks_per_node))]
    if cpus_per_task:
        options.append(("cpus-per-task", str(cpus_per_task)))
    if gpus_per_node > 0:
        options.append(("gpus-per-node", str(gpus_per_node)))
    if mem:
        options.append(("mem", mem))
    for key in ("time", "constraint"):
        if value := getattr(group, key):
            options.append((key, value))
    for extra in group.sbatch_extra:
        flag, _, value = extra[2:].partition("=")
        options.append((flag, value))
    return options


def _hetjob_blocks(config: Config, components: list[Component]) -> list[SbatchBlock]:
    blocks = []
    for c in components:
        options = _resource_options(config, config.group(c.name), nodes=c.nodes, tasks_per_node=c.tasks_per_node,
                                    cpus_per_task=c.cpus_per_task, gpus_per_node=c.gpus_per_node, mem=c.mem)
        blocks.append(SbatchBlock(title=f"component {c.index}: {c.name}", options=tuple(options)))
    return blocks


_AGREE = ("partition", "account", "qos", "mem", "time", "constraint", "sbatch_extra")


def _split_layout(config: Config, slots: list[GroupSlot]) -> tuple[list[GroupSlot], SbatchBlock]:
    """Lay the non-head groups end to end in one allocation, then cluster.spare_nodes idle nodes; the head
    takes no node of its own."""
    workers = [s for s in slots if s.name != HEAD]
    if not workers:
        raise ConfigError(key="cluster.layout", problem='layout = "split" with no group besides the head',
                          fix='use layout = "hetjob", or give the run a trainer')
    for key in _AGREE:
        seen: dict[str, str] = {}
        for slot in workers:
            value = getattr(config.group(slot.name), key)
            value = " ".join(value) if isinstance(value, list) else value
            value = value or (_setting(config, config.group(slot.name), key) if key in ("partition", "account", "qos") else "")
            seen.setdefault(value, slot.name)
        if len(seen) > 1:
            (first_value, first), (other_value, other) = list(seen.items())[:2]
            raise ConfigError(
                key=f"groups.{other}.{key}",
                problem=f'layout = "split" puts every group in one job, but groups.{first}.{key} = '
                        f"{first_value!r} and groups.{other}.{key} = {other_value!r} differ",
                fix=f'give every group the same {key} (or none), or use layout = "hetjob"')
    placed, first_node = [], 0
    for slot in slots:
        if slot.name == HEAD:
            placed.append(slot)
            continue
        placed.append(replace(slot, first_node=first_node))
        first_node += slot.component.nodes
    parts = [s.component for s in workers]
    spares = config.cluster.spare_nodes
    options = _resource_options(
        config, config.group(parts[0].name), nodes=first_node + spares,
        tasks_per_node=max(c.tasks_per_node for c in parts),
        cpus_per_task=max(c.cpus_per_task for c in parts),
        gpus_per_node=max(c.gpus_per_node for c in parts),
        mem=max((c.mem for c in parts), key=lambda m: mem_gib(m) if m and m != "0" else (1e18 if m else 0)))
    if spares:
        options.append(("no-kill", ""))  # a lost node leaves the job running: the head decides
    return placed, SbatchBlock(title="one job for every group (layout split)", options=tuple(options))


def job_spec(config: Config) -> JobSpec:
    """The JobSpec of a validated config (see the module docstring for the two layouts)."""
    slots = _slots(config, make_components(config))
    _check_slots(config, slots)
    cluster = config.cluster
    notes = []
    if cluster.layout == "split":
        slots, block = _split_layout(config, slots)
        blocks = [block]
        if any(getattr(config.group(HEAD), k) for k in ("partition", "account", "qos", "mem", "constraint")):
            notes.append('layout = "split": the head runs in the batch step, so [groups.head] Slurm settings are unused')
        if cluster.spare_nodes:
            notes.append(f"spare nodes: the allocation's last {cluster.spare_nodes}, idle; a task whose node is lost "
                         "starts again on one (cluster.spare_nodes)")
    else:
        blocks = _hetjob_blocks(config, [slot.component for slot in slots])
    times = [config.group(s.name).time for s in slots if config.group(s.name).time]
    return JobSpec(
        job_name=config.run.name, layout=cluster.layout, cluster=cluster.name,
        groups=tuple(slots), blocks=tuple(blocks), modules=tuple(cluster.modules),
        setup=tuple(cluster.setup), env=tuple(sorted(cluster.env.items())),
        time_limit=max(times, key=_time_seconds) if times else "", notes=tuple(notes),
        signal_delay_s=cluster.signal_delay_s, spare_nodes=cluster.spare_nodes)


def _time_seconds(text: str) -> int:
    """Slurm --time text -> seconds (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS)."""
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        hours, minutes, seconds = (parts + [0, 0])[:3]
    elif len(parts) == 3:
        hours, minutes, seconds = parts
    else:
        hours, (minutes, seconds) = 0, (parts + [0])[:2]
    return ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds


def time_limit_seconds(spec: JobSpec) -> int:
    """The job's --time in seconds; 0 when unset."""
    return _time_seconds(spec.time_limit) if spec.time_limit else 0
