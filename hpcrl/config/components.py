"""What each component of the job is made of and what each of its tasks gets on its node (pure).

A component is one Slurm het group: head, trainer, inference, reward (reward only when
reward.tasks > 0). `make_components` derives, from a config merged over its cluster profile:

  nodes x tasks per node   trainer: trainer.nodes x one rank per GPU (one per CPU node);
                           inference: replicas packed gpus_per_node // tensor_parallel to a node
                           (one per CPU node); reward: reward.tasks over groups.reward.nodes (1)
  GPUs per task            trainer 1; inference tensor_parallel; reward groups.reward.gpus_per_node
                           split evenly among the node's reward tasks; head 0
  CPUs per task            groups.<name>.cpus_per_task when set; else a GPU task gets
                           cluster.cpus_per_gpu per GPU (default: the node's CPUs shared by GPU),
                           a CPU task of a worker group the node's CPUs shared among its tasks,
                           the head 2; 0 (Slurm's default of 1) when the profile has no CPU count
  memory per node          groups.<name>.mem when set; else GPU tasks get cluster.mem_per_gpu_gib per
                           GPU (default: the node's memory shared by GPU); on a CPU-only cluster
                           CPU tasks get the node's memory in proportion to their CPUs; else ""

Slurm gives these to the job (#SBATCH, hpcrl.slurm.spec) and to every step (srun,
hpcrl.launch.steps); each task then narrows the GPUs of its step to its own block
(hpcrl.plan.placement). A layout that asks a node for more GPUs, CPUs or memory than the
cluster profile says a node has is a ConfigError here, at load, naming the key and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcrl.config.groups import GROUP_NAMES, HEAD, INFERENCE, REWARD, TRAINER
from hpcrl.config.schema import Config
from hpcrl.errors import ConfigError

#: CPUs of the head's task: the bus router and the RL loop, plus the srun clients it starts.
HEAD_CPUS = 2


@dataclass(frozen=True, kw_only=True)
class Component:
    """One component of the heterogeneous job (one Slurm het group)."""

    name: str
    index: int
    """Het-group index (hetjob: srun --het-group, SLURM_*_HET_GROUP_<index>); in a split job its place
    among the groups. Head 0, then trainer, inference, reward."""
    nodes: int
    tasks_per_node: int
    gpus_per_node: int
    """GPUs asked of each node (--gpus-per-node): its tasks' GPUs, or groups.<name>.gpus_per_node."""
    gpus_per_task: int
    cpus_per_task: int
    """0 = not written (Slurm's default, one CPU)."""
    mem: str
    """--mem of each node ("200G", "1536M"); "" = not written (Slurm's default)."""
    role: str
    """What runs in each task, in words."""

    @property
    def tasks(self) -> int:
        return self.nodes * self.tasks_per_node


def _fail(key: str, problem: str, fix: str) -> None:
    raise ConfigError(key=key, problem=problem, fix=fix)


def _mem_text(gib: float) -> str:
    """Slurm --mem text for `gib` GiB, rounded down to whole MiB ("96G", "1536M")."""
    mib = int(gib * 1024)
    return f"{mib // 1024}G" if mib % 1024 == 0 else f"{mib}M"


def mem_gib(text: str) -> float:
    """GiB of a Slurm --mem text ("200G", "1536M", "1T", "4096"); 0 for "0" (all of the node)."""
    units = {"K": 1 / 1024**2, "M": 1 / 1024, "G": 1.0, "T": 1024.0}
    if text[-1:] in units:
        return int(text[:-1]) * units[text[-1]]
    return int(text) / 1024  # Slurm's default unit is MiB


def cpus_per_gpu(config: Config) -> int:
    """CPUs given with each GPU: cluster.cpus_per_gpu, or the node's CPUs shared by GPU (0: unknown)."""
    c = config.cluster
    if c.cpus_per_gpu:
        return c.cpus_per_gpu
    return c.cpus_per_node // c.gpus_per_node if c.cpus_per_node and c.gpus_per_node > 0 else 0


def mem_per_gpu_gib(config: Config) -> float:
    """Host memory given with each GPU: cluster.mem_per_gpu_gib, or the node's shared by GPU (0: unknown)."""
    c = config.cluster
    if c.mem_per_gpu_gib:
        return c.mem_per_gpu_gib
    return c.mem_per_node_gib / c.gpus_per_node if c.mem_per_node_gib and c.gpus_per_node > 0 else 0.0


def _shape(config: Config, name: str) -> tuple[int, int, int, str]:
    """(nodes, tasks per node, GPUs per task, role) of component `name`, before its Slurm settings."""
    t, inf, reward = config.trainer, config.inference, config.reward
    group = config.group(name)
    if name == HEAD:
        return 1, 1, 0, "controller: the RL loop, the bus, launches the other groups"
    if name == TRAINER:
        return t.nodes, t.ranks_on_each_node, 1 if t.gpus_per_node else 0, "one FSDP2 rank per task (torchtitan)"
    if name == INFERENCE:
        tp = inf.tensor_parallel
        per_node = max(1, inf.gpus_per_node // tp) if inf.gpus_per_node else 1  # a CPU replica gets a node
        nodes = group.nodes or -(-inf.replicas // per_node)
        tasks_per_node = -(-inf.replicas // nodes)
        if nodes * tasks_per_node != inf.replicas:
            _fail("inference.replicas",
                  f"{inf.replicas} replicas do not fill {nodes} inference nodes evenly "
                  f"({tasks_per_node} per node would start {nodes * tasks_per_node})",
                  f"use a multiple of {tasks_per_node} replicas"
                  + (f" ({per_node} of TP {tp} fit a node of {inf.gpus_per_node} GPUs)" if inf.gpus_per_node else "")
                  + ", or set groups.inference.nodes so that it divides replicas")
        return nodes, tasks_per_node, tp if inf.gpus_per_node else 0, f"one vLLM engine per task, TP={tp}"
    nodes = group.nodes or 1
    tasks_per_node = -(-reward.tasks // nodes)
    gpus_per_task = 0
    if group.gpus_per_node > 0:
        if reward.kind != "model":
            _fail("groups.reward.gpus_per_node",
                  f'reward.kind = "{reward.kind}" scores with a Python function, which uses no GPU',
                  'remove groups.reward.gpus_per_node, or set reward.kind = "model" to run a reward model on GPUs')
        if group.gpus_per_node % tasks_per_node:
            _fail("groups.reward.gpus_per_node",
                  f"{group.gpus_per_node} GPUs per node cannot be split evenly among {tasks_per_node} reward tasks "
                  "per node",
                  f"use a multiple of {tasks_per_node} GPUs, or change reward.tasks")
        gpus_per_task = group.gpus_per_node // tasks_per_node
    where = f" on {gpus_per_task} GPU(s)" if gpus_per_task else ""
    what = f"reward model{where}" if reward.kind == "model" else f"reward worker pool ({reward.workers} workers)"
    return nodes, tasks_per_node, gpus_per_task, what


def _cpus(config: Config, name: str, tasks_per_node: int, gpus_per_task: int) -> tuple[int, str]:
    """(CPUs per task, the key a user changes to change it)."""
    group = config.group(name)
    if group.cpus_per_task:
        return group.cpus_per_task, f"groups.{name}.cpus_per_task"
    if gpus_per_task:
        return gpus_per_task * cpus_per_gpu(config), "cluster.cpus_per_gpu"
    node = config.cluster.cpus_per_node
    if name == HEAD:
        return (min(HEAD_CPUS, node) if node else 0), f"groups.{name}.cpus_per_task"
    return node // tasks_per_node if node else 0, f"groups.{name}.cpus_per_task"


def _mem(config: Config, name: str, tasks_per_node: int, gpus_per_task: int, cpus: int) -> tuple[str, str]:
    """(--mem of each node, the key a user changes to change it)."""
    group, c = config.group(name), config.cluster
    if group.mem:
        return group.mem, f"groups.{name}.mem"
    if gpus_per_task:
        per_gpu = mem_per_gpu_gib(config)
        return (_mem_text(per_gpu * gpus_per_task * tasks_per_node) if per_gpu else ""), "cluster.mem_per_gpu_gib"
    # A GPU cluster's profile describes its GPU nodes; the CPU components often run elsewhere (a "cpu"
    # partition): their memory is derived only on CPU-only clusters, where every node is the profile's.
    if c.gpus_per_node == 0 and c.mem_per_node_gib and c.cpus_per_node and cpus:
        return _mem_text(c.mem_per_node_gib * min(1.0, cpus * tasks_per_node / c.cpus_per_node)), f"groups.{name}.mem"
    return "", f"groups.{name}.mem"


def _check_node(config: Config, comp: Component, cpus_key: str, mem_key: str) -> None:
    c = config.cluster
    if c.gpus_per_node >= 0 and comp.gpus_per_node > c.gpus_per_node:
        key = {TRAINER: "trainer.gpus_per_node", INFERENCE: "inference.tensor_parallel"}.get(
            comp.name, f"groups.{comp.name}.gpus_per_node")
        _fail(key, f"component {comp.name!r} asks each node for {comp.gpus_per_node} GPUs "
                   f"({comp.tasks_per_node} task(s) x {comp.gpus_per_task}), but {c.name!r} nodes have {c.gpus_per_node}",
              f"lower {key}, or use a cluster profile with bigger nodes (--cluster)")
    if c.cpus_per_node and comp.cpus_per_task * comp.tasks_per_node > c.cpus_per_node:
        _fail(cpus_key, f"component {comp.name!r} asks each node for {comp.tasks_per_node} task(s) x "
                        f"{comp.cpus_per_task} CPUs = {comp.tasks_per_node * comp.cpus_per_task}, but {c.name!r} "
                        f"nodes have {c.cpus_per_node}",
              f"lower {cpus_key} to at most {c.cpus_per_node // comp.tasks_per_node}"
              + (" per GPU" if cpus_key == "cluster.cpus_per_gpu" else ""))
    if c.mem_per_node_gib and comp.mem and comp.mem != "0" and mem_gib(comp.mem) > c.mem_per_node_gib + 1e-9:
        _fail(mem_key, f"component {comp.name!r} asks each node for {comp.mem} of memory, but {c.name!r} nodes "
                       f"have {c.mem_per_node_gib:g} GiB (cluster.mem_per_node_gib)",
              f"lower {mem_key} (or set it to \"0\" for all of the node's memory)"
              if mem_key.endswith(".mem") else f"lower {mem_key} to at most "
              f"{c.mem_per_node_gib / max(1, comp.gpus_per_node):g} GiB")


def _check_profile(config: Config) -> None:
    c = config.cluster
    if c.gpus_per_node > 0 and c.cpus_per_node and c.cpus_per_gpu * c.gpus_per_node > c.cpus_per_node:
        _fail("cluster.cpus_per_gpu", f"cpus_per_gpu = {c.cpus_per_gpu} x {c.gpus_per_node} GPUs is more than the "
                                      f"node's {c.cpus_per_node} CPUs",
              f"set cpus_per_gpu to at most {c.cpus_per_node // c.gpus_per_node}, or 0 to share the node's CPUs by GPU")
    if c.gpus_per_node > 0 and c.mem_per_node_gib and c.mem_per_gpu_gib * c.gpus_per_node > c.mem_per_node_gib:
        _fail("cluster.mem_per_gpu_gib", f"mem_per_gpu_gib = {c.mem_per_gpu_gib:g} x {c.gpus_per_node} GPUs is more "
                                         f"than the node's {c.mem_per_node_gib:g} GiB",
              f"set mem_per_gpu_gib to at most {c.mem_per_node_gib / c.gpus_per_node:g}, or 0 to share the "
              "node's memory by GPU")


def make_components(config: Config) -> list[Component]:
    """The job's components in het-group order, each with what its tasks get (see the module docstring);
    raises ConfigError when one asks a node for more than the cluster profile says it has."""
    _check_profile(config)
    components: list[Component] = []
    for name in GROUP_NAMES:
        if name == REWARD and config.reward.tasks == 0:
            continue
        nodes, tasks_per_node, gpus_per_task, role = _shape(config, name)
        group = config.group(name)
        gpus_per_node = tasks_per_node * gpus_per_task
        if name in (INFERENCE, REWARD) and group.gpus_per_node > gpus_per_node:
            gpus_per_node = group.gpus_per_node  # asked for more than the tasks use: the job holds them
        elif name == INFERENCE and 0 <= group.gpus_per_node < gpus_per_node:
            _fail("groups.inference.gpus_per_node",
                  f"groups.inference.gpus_per_node = {group.gpus_per_node} is fewer than the {tasks_per_node} "
                  f"replica(s) x TP {gpus_per_task} = {gpus_per_node} GPUs each inference node runs",
                  "remove groups.inference.gpus_per_node (it is derived), or lower replicas or tensor_parallel")
        cpus, cpus_key = _cpus(config, name, tasks_per_node, gpus_per_task)
        mem, mem_key = _mem(config, name, tasks_per_node, gpus_per_task, cpus)
        comp = Component(name=name, index=len(components), nodes=group.nodes or nodes, tasks_per_node=tasks_per_node,
                         gpus_per_node=gpus_per_node, gpus_per_task=gpus_per_task, cpus_per_task=cpus, mem=mem,
                         role=role)
        _check_node(config, comp, cpus_key, mem_key)
        components.append(comp)
    return components
