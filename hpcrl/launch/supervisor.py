"""The head's process supervisor: starts every group's step, keeps the table of tasks from the
bus's peer events, starts a lost task of a revivable group again, and names what failed.

    sup = Supervisor(launch, run_dir, router)          # router: the head's hpcrl.bus.Router
    sup.start({"HPCRL_STORE_ADDR": ...})                 # one step per group (srun, or local processes)
    while not await sup.poll(): await asyncio.sleep(0.2)   # raises GroupFailed naming ranks
    sup.release()                                        # every task: a BYE with its exit code
    await sup.wait_ended()

A task is known by (group, task rank). It tells the head about itself on the bus, as every peer
does: REGISTER (it started: group, replica, rank, node, pid), READY (it serves), and at its end a
BYE with its exit code, which the task's supervisor process sends even after a kill -9
(hpcrl.bus.farewell). A task that vanishes without a word (its node lost power) is declared dead
by the bus's heartbeat timeout. The steps' own exit codes (srun returns the largest of its
tasks') complete the picture: a step that ended before all its tasks registered, or with a
non-zero code, fails the run naming group, rank and node.

Spare nodes (cluster.spare_nodes, layout split): the allocation's last nodes, idle. A revivable task
whose node is presumed lost (silent past the heartbeat timeout, or its step ended without its exit
code) starts again on the next spare instead of its own node; one that exited with a code (its node
lives) starts again in place. Each such recovery is appended to RUN_DIR/recoveries.json (what was
lost, where it started again, when it registered), which `hpcrl status` lists.

The trainer group (`trainer_restartable`, set by the head in a split job): a lost trainer
rank breaks its group's torch.distributed group, so poll() raises TrainerLost naming the lost ranks,
and the head, once its RL loop is stopped, calls restart_trainer(): the surviving ranks are stopped
(SIGTERM through their srun, SIGKILL if they do not go), and the whole group starts again in a new srun
step of the same job (hpcrl.launch.recovery decides where: in place, or a lost node swapped for a
spare), which resumes from the newest checkpoint. Also one entry of RUN_DIR/recoveries.json.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from hpcrl.bus.router import PeerEvent, Router
from hpcrl.config.groups import HEAD, TRAINER
from hpcrl.errors import HpcrlError
from hpcrl.launch.recovery import LostRank, NoRestart, TrainerRestart, describe_restart, plan_trainer_restart
from hpcrl.launch.steps import Step, local_gpu_blocks, start_local_step, start_replacement, start_slurm_step
from hpcrl.roles.trainer import TRAINER_START_ENV
from hpcrl.rundir import RECOVERIES_FILE, log_path, read_json, write_json
from hpcrl.slurm.identity import layout_env
from hpcrl.slurm.nodelist import expand_nodelist
from hpcrl.slurm.record import LaunchRecord
from hpcrl.slurm.spec import GroupSlot, spare_nodes_of

#: Times one lost inference replica is started again before the run gives up.
MAX_RELAUNCHES = 3
#: Most seconds a failed step's tasks get for their exit codes to arrive on the bus (their supervisors
#: send them as they end, but the step's own end can be seen first); they are waited for, not slept on.
EXIT_CODES_WAIT_S = 3.0
#: Times the trainer group is started again inside the job before a loss requeues it instead.
MAX_TRAINER_RESTARTS = 3
#: Most seconds the head waits for the surviving trainer ranks to end once their step was told to stop (srun
#: cancels it: SIGTERM, SIGKILL after Slurm's KillWait); they are then counted as gone (see _stop_group). The
#: group started again needs ~10 s of imports before it touches a GPU or a port: what is left is gone by then.
STOP_WAIT_S = 2.0

log = logging.getLogger(__name__)


class GroupFailed(HpcrlError):
    """A group's step ended with a non-zero exit code, or its tasks never registered."""


class TrainerLost(GroupFailed):
    """A trainer rank was lost while the group may start again inside the job (Supervisor.trainer_restartable).
    Uncaught, it is the GroupFailed it derives from: the head requeues the job."""

    def __init__(self, lost: list[LostRank]) -> None:
        super().__init__("; ".join(f"trainer rank {one.rank}{f' on node {one.node}' if one.node else ''} lost: "
                                   f"{one.why}" for one in lost))
        self.lost = lost


@dataclass
class Task:
    """A task as the head knows it from the bus."""

    identity: dict
    """group, rank (within the group), replica, node, pid: what exit.json lists."""
    peer: str
    """Its name on the bus (group/replica/rank)."""
    code: int | None = None
    """Its exit code, once a BYE carried it."""
    lost: str = ""
    """Why the bus declared it dead without an exit code ("" while not)."""


class Supervisor:
    """The head's state: steps, tasks that registered, and what went wrong."""

    def __init__(self, launch: LaunchRecord, run_dir: Path, router: Router) -> None:
        self.launch = launch
        self.run_dir = run_dir
        self.router = router
        self.expected = {(g.name, r) for g in launch.groups if g.module for r in range(g.component.tasks)}
        self.tasks: dict[tuple[str, int], Task] = {}
        self.steps: list[Step] = []
        self.problems: list[str] = []
        self.revivable: set[str] = set()
        """Groups whose lost tasks are started again instead of failing the run (program rl: inference)."""
        self.relaunches: dict[tuple[str, int], int] = {}
        self.live_step: dict[tuple[str, int], Step] = {}
        self.retired: set[int] = set()
        self.env: dict[str, str] = {}
        self.bus_address = ""
        """The bus as tasks reach it (tcp://<the head's host>:<port>), set once the router is bound."""
        self.released = False
        self.all_registered = False
        self._events: list[PeerEvent] = []
        self.local_gpus: dict[tuple[str, int], str] = {}
        """(group, rank) -> its GPUs, under the local executor (every group on this machine)."""
        self.spares: list[str] = []
        """Spare nodes of the allocation not used yet (split layout with cluster.spare_nodes)."""
        self._recovering: dict[tuple[str, int], dict] = {}
        """(group, rank) -> its entry of RECOVERIES_FILE, until the task started again is ready."""
        self.trainer_restartable = False
        """Whether a lost trainer rank raises TrainerLost (the head starts the group again inside the job)."""
        self.trainer_lost: dict[int, LostRank] = {}
        self.trainer_restarts = 0
        self.group_nodes: dict[str, list[str]] = {}
        """Split layout: a group's nodes once it was started again elsewhere (else its range of the allocation)."""
        self._group_recovery: dict | None = None
        """The trainer group's entry of RECOVERIES_FILE, until it is running again."""
        self._deadline = time.monotonic() + launch.start_timeout_s
        router.watch(self._events.append)
        node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        self.head_identity = {"group": HEAD, "rank": 0, "replica": 0, "node": node, "pid": os.getpid()}

    # ---------------------------------------------------------------- starting

    def start(self, extra_env: dict[str, str] | None = None) -> None:
        """Start one step per group; every task gets the bus address and the layout in its environment."""
        # cluster.env is exported by the batch script too; the local executor has only this.
        self.env = {**os.environ, **self.launch.env, "HPCRL_RUN_DIR": str(self.run_dir),
                    "HPCRL_BUS_ADDR": self.bus_address or self.router.address,
                    "HPCRL_LAYOUT": layout_env(self.launch.groups), **(extra_env or {})}
        self._deadline = time.monotonic() + self.launch.start_timeout_s
        self.local_gpus = local_gpu_blocks(self.launch.groups, os.environ) if self.launch.executor == "local" else {}
        self.spares = self.spare_nodes()
        if self.spares:
            log.info(f"spare nodes, idle until a node is lost: {','.join(self.spares)}")
        for slot in self.launch.groups:
            if not slot.module:
                continue
            if self.launch.executor == "local":
                step = start_local_step(slot, run_dir=self.run_dir, python=self.launch.python, env=self.env,
                                        gpus=self.local_gpus)
            else:
                nodes = (self.nodes_of(slot) or None) if self.launch.layout == "split" else None
                step = start_slurm_step(slot, layout=self.launch.layout, run_dir=self.run_dir,
                                        python=self.launch.python, env=self.env, nodelist=nodes,
                                        no_kill=bool(self.launch.spare_nodes))
            self.steps.append(step)
            for rank in step.ranks:
                self.live_step[(slot.name, rank)] = step
            log.info(f"started group {slot.name}: {slot.component.nodes} node(s) x {slot.component.tasks_per_node} "
                     "task(s)")

    def revive(self, group: str, rank: int, why: str, *, node_lost: bool = False) -> None:
        """Start a lost task of a revivable group again (it registers anew): on a spare node when its own
        is presumed lost and a spare is left, else on the same node."""
        key = (group, rank)
        count = self.relaunches.get(key, 0) + 1
        if count > MAX_RELAUNCHES:
            raise GroupFailed(f"group {group} rank {rank} was lost {count} times (last: {why}); not starting it again")
        self.relaunches[key] = count
        old = self.tasks.pop(key, None)
        lost_on = old.identity.get("node") if old else self.node_of(group, rank)
        node = self.spares.pop(0) if node_lost and self.spares else lost_on
        where = f"on spare node {node}" if node != lost_on else "on its node"
        log.warning(f"group {group} rank {rank} lost ({why}); starting it again {where} (time {count} of "
                    f"{MAX_RELAUNCHES})")
        if node != lost_on:
            self._recovering[key] = {"group": group, "rank": rank, "lost_on": lost_on, "why": why,
                                     "restarted_on": node, "at": time.time(), "registered_after_s": None,
                                     "ready_after_s": None}
            self._record_recovery(self._recovering[key])
        slot = self.launch.group(group)
        step = start_replacement(slot, rank, executor=self.launch.executor, layout=self.launch.layout,
                                 run_dir=self.run_dir, python=self.launch.python, env=self.env,
                                 node=node, gpus=self.local_gpus)
        self.steps.append(step)
        self.live_step[key] = step

    def spare_nodes(self) -> list[str]:
        """The allocation's spare nodes (split layout): the launch record's spare_nodes after every group's
        range; [] without them or without Slurm."""
        if self.launch.layout != "split" or not self.launch.spare_nodes or self.launch.executor != "slurm":
            return []
        return spare_nodes_of(self.launch.groups, expand_nodelist(os.environ.get("SLURM_JOB_NODELIST", "")),
                              self.launch.spare_nodes)

    def _record_recovery(self, entry: dict) -> None:
        """Add `entry` to RECOVERIES_FILE, or update it there (same group, rank and time)."""
        path = self.run_dir / RECOVERIES_FILE
        known = read_json(path).get("recoveries", []) if path.is_file() else []
        known = [e for e in known if (e["group"], e["rank"], e["at"]) != (entry["group"], entry["rank"], entry["at"])]
        write_json(path, {"recoveries": [*known, entry]})

    def identities(self) -> list[dict]:
        """Every task's identity as exit.json lists them: the head's, then each registered task's by group and rank."""
        return [self.head_identity] + [task.identity for _, task in sorted(self.tasks.items())]

    def nodes_of(self, slot: GroupSlot) -> list[str]:
        """The nodes of group `slot` in the job: its component's (hetjob), or its range of the allocation
        (split); [] without Slurm."""
        if self.launch.layout == "hetjob":
            return expand_nodelist(os.environ.get(f"SLURM_JOB_NODELIST_HET_GROUP_{slot.component.index}", ""))
        if slot.name in self.group_nodes:
            return list(self.group_nodes[slot.name])
        return expand_nodelist(os.environ.get("SLURM_JOB_NODELIST", ""))[
            slot.first_node:slot.first_node + slot.component.nodes]

    def node_of(self, group: str, rank: int) -> str | None:
        """The node rank `rank` of `group` was started on (srun lays ranks out node by node); None without Slurm."""
        slot = self.launch.group(group)
        nodes, index = self.nodes_of(slot), rank // slot.component.tasks_per_node
        return nodes[index] if index < len(nodes) else None

    # ---------------------------------------------------------------- the bus's word

    def handle_events(self) -> None:
        """Take in what the bus saw since the last call: registrations, exit codes, deaths."""
        events, self._events[:] = list(self._events), []
        for event in events:
            info = event.info
            key = (info.group, info.task)
            if event.kind == "registered":
                if key not in self.expected:
                    self.problems.append(f"unexpected task {info.group} rank {info.task} registered from "
                                         f"{info.host} (pid {info.pid})")
                    continue
                self.tasks[key] = Task(identity={"group": info.group, "rank": info.task, "replica": info.replica,
                                                 "node": info.host, "pid": info.pid, "gpus": info.gpu,
                                                 "cpus": info.cpus, "threads": info.threads}, peer=info.name)
                gpus = f", GPUs {info.gpu}" if info.gpu else ""
                if (entry := self._recovering.get(key)) is not None:
                    entry["registered_after_s"] = round(time.time() - entry["at"], 1)
                    self._record_recovery(entry)
                group_entry = self._group_recovery
                if (group_entry is not None and info.group == group_entry["group"]
                        and group_entry["registered_after_s"] is None
                        and all((info.group, r) in self.tasks for r in range(self.launch.group(info.group).component.tasks))):
                    group_entry["registered_after_s"] = round(time.time() - group_entry["at"], 1)
                    self._record_recovery(group_entry)
                log.info(f"registered: {info.group} rank {info.task} replica {info.replica} "
                         f"on node {info.host} (pid {info.pid}, {info.cpus} CPUs{gpus})")
                if self.released:  # started again just before the end
                    self.router.dismiss(info.name, 0, "the run is over")
                continue
            task = self.tasks.get(key)
            if task is None or task.peer != info.name or task.identity["pid"] != info.pid:
                continue  # an earlier incarnation of a task started again since
            if event.kind == "ready" and (entry := self._recovering.pop(key, None)) is not None:
                entry["ready_after_s"] = round(time.time() - entry["at"], 1)  # serving: its engine is up
                self._record_recovery(entry)
            elif event.kind == "exited":
                task.code = event.code
                if info.group in self.revivable and event.code != 0:
                    self.revive(*key, why=f"it exited with code {event.code}: {event.reason}")
                elif self._restarts_trainer(info.group) and event.code != 0:
                    self._trainer_rank_lost(task, f"it exited with code {event.code}: {event.reason}", False)
            elif event.kind == "dead":
                task.lost = event.reason
                if info.group in self.revivable:  # silent: its node is presumed lost
                    self.revive(*key, why=event.reason, node_lost=True)
                elif self._restarts_trainer(info.group):
                    self._trainer_rank_lost(task, event.reason, True)

    # ---------------------------------------------------------------- the trainer group, started again

    def _restarts_trainer(self, group: str) -> bool:
        return group == TRAINER and self.trainer_restartable and not self.released

    def _trainer_rank_lost(self, task: Task, why: str, node_lost: bool) -> None:
        rank = int(task.identity["rank"])
        if rank not in self.trainer_lost:
            log.warning(f"trainer rank {rank} lost on node {task.identity['node']} ({why})")
            self.trainer_lost[rank] = LostRank(rank, task.identity.get("node"), node_lost, why)

    async def settle_trainer_loss(self) -> list[LostRank]:
        """After the RL loop failed: the trainer ranks lost, once their exit codes had EXIT_CODES_WAIT_S to
        arrive (a rank's collective can fail before the head hears that its peer died); [] when none was."""
        if not self.trainer_restartable:
            return []
        deadline = time.monotonic() + EXIT_CODES_WAIT_S
        self.handle_events()
        while not self.trainer_lost and time.monotonic() < deadline:  # the first lost rank is enough: all restart
            await asyncio.sleep(0.02)
            self.handle_events()
        return sorted(self.trainer_lost.values(), key=lambda one: one.rank)

    async def restart_trainer(self, lost: list[LostRank]) -> TrainerRestart:
        """Stop what is left of the trainer group and start it again inside the job (see the module docstring).
        GroupFailed when it cannot (no spare left for a lost node, or restarted MAX_TRAINER_RESTARTS times):
        the head then requeues the job."""
        slot = self.launch.group(TRAINER)
        why = "; ".join(f"rank {one.rank}: {one.why}" for one in lost)
        if self.trainer_restarts >= MAX_TRAINER_RESTARTS:
            raise GroupFailed(f"the trainer group was started again {self.trainer_restarts} times inside the job "
                              f"and lost a rank again ({why})")
        try:
            plan = plan_trainer_restart(nodes=self.nodes_of(slot), lost=lost, spares=self.spares)
        except NoRestart as err:
            raise GroupFailed(f"{err} ({why})") from None
        at = time.time()
        await self._stop_group(TRAINER)
        self.trainer_restarts += 1
        self.trainer_lost.clear()
        for rank in range(slot.component.tasks):
            self.tasks.pop((TRAINER, rank), None)
        self.spares = plan.spares
        self.group_nodes[TRAINER] = plan.nodes
        log.warning(f"starting the trainer group again {describe_restart(plan)} (time {self.trainer_restarts} of "
                    f"{MAX_TRAINER_RESTARTS}), same job: it resumes from the newest checkpoint")
        self.env[TRAINER_START_ENV] = str(self.trainer_restarts)
        step = start_slurm_step(slot, layout=self.launch.layout, run_dir=self.run_dir, python=self.launch.python,
                                env=self.env, nodelist=plan.nodes, no_kill=True, again=True)
        self.steps.append(step)
        for rank in step.ranks:
            self.live_step[(TRAINER, rank)] = step
        lost_on = sorted({one.node for one in lost if one.node}) or ["?"]
        self._group_recovery = {
            "group": TRAINER, "rank": lost[0].rank, "ranks": [one.rank for one in lost], "lost_on": ",".join(lost_on),
            "why": why, "restarted_on": ",".join(plan.nodes), "spares_used": sorted(plan.replaced.values()),
            "at": at, "stopped_after_s": round(time.time() - at, 1), "registered_after_s": None,
            "resumed_from_step": None, "running_again_after_s": None}
        self._record_recovery(self._group_recovery)
        return plan

    def trainer_running_again(self, step: int) -> None:
        """The RL loop resumed from checkpoint `step` after the trainer group started again: the recovery's end."""
        entry, self._group_recovery = self._group_recovery, None
        if entry is None:
            return
        entry["resumed_from_step"] = step
        entry["running_again_after_s"] = round(time.time() - entry["at"], 1)
        self._record_recovery(entry)
        log.info(f"trainer group running again {entry['running_again_after_s']} s after it was lost, from step "
                 f"{step}")

    async def _stop_group(self, group: str) -> None:
        """End every running step of `group` (SIGTERM to srun, which cancels the step: Slurm sends its tasks
        SIGTERM, then SIGKILL after KillWait), and wait until each registered task told its exit code or was
        declared lost, or every step's srun ended, at most STOP_WAIT_S. A task still unaccounted for then is
        counted as gone (the bus is told: its name is free for the rank started again). The steps are retired:
        their codes (and those of a lost node's tasks, which come when Slurm marks the node down) fail nothing.

        Why not wait for every exit code: a task of a cancelled step often sends none (measured: srun's SIGTERM,
        KillWait 3 s, the trainer rank went silent without one), and srun itself stays until Slurm marks a lost
        node down (~30 s) when the step had a task there."""
        steps = [s for s in self.steps if s.slot.name == group and id(s) not in self.retired]
        for step in steps:
            self.retired.add(id(step))
            if step.poll() is None:
                step.terminate()
        deadline = time.monotonic() + STOP_WAIT_S
        while True:
            self.handle_events()
            left = [(key, task) for key, task in self.tasks.items()
                    if key[0] == group and task.code is None and not task.lost]
            if not left or all(step.poll() is not None for step in steps) or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.05)
        for _, task in left:
            task.lost = "stopped by the head: its group starts again"
            self.router.mark_dead(task.peer, task.lost)
        if left and any(step.poll() is None for step in steps):
            log.info(f"{group} ranks {[rank for (_, rank), _ in left]} told no exit code within {STOP_WAIT_S:g} s of "
                     "their step's cancel: counted as gone")

    def release(self) -> None:
        """Tell every task to exit: 0, or launch.json's exit_codes (program check, to test failures)."""
        self.released = True
        for (group, rank), task in sorted(self.tasks.items()):
            self.router.dismiss(task.peer, int(self.launch.exit_codes.get(f"{group}/{rank}", 0)), "the run is over")

    # ---------------------------------------------------------------- steps

    def failures_of(self, step: Step, code: int) -> list[dict]:
        """Name the ranks of a failed step: non-zero exit code, lost without one, or never registered."""
        found = []
        for rank in step.ranks:
            task = self.tasks.get((step.slot.name, rank))
            if task is None:
                last = last_line(log_path(self.run_dir, step.slot.name, rank))
                found.append({"group": step.slot.name, "rank": rank, "node": None, "code": None,
                              "why": "never registered with the head" + (f" (its log ends: {last!r})" if last else "")})
            elif task.code not in (None, 0):
                found.append({"group": step.slot.name, "rank": rank, "node": task.identity["node"],
                              "code": task.code, "why": f"exited with code {task.code}"})
            elif task.code is None:
                found.append({"group": step.slot.name, "rank": rank, "node": task.identity["node"], "code": None,
                              "why": f"ended without telling the head its exit code{f' ({task.lost})' if task.lost else ''}"})
        return found or [{"group": step.slot.name, "rank": None, "node": None, "code": code,
                          "why": f"its step exited with code {code}"}]

    async def poll(self) -> bool:
        """One look at the bus's events and the steps: raise GroupFailed naming what failed; True once
        every step ended with 0 (before release(), a step that ends at all is a failure)."""
        released = self.released
        self.handle_events()
        if self.problems:
            raise GroupFailed("; ".join(self.problems))
        codes = [(step, step.poll()) for step in self.steps if id(step) not in self.retired]
        for step, code in codes:
            if (self._restarts_trainer(step.slot.name) and code is not None
                    and all((step.slot.name, rank) in self.tasks for rank in step.ranks)):
                # Every rank had registered: those without an exit code went with their node. (A step that
                # ended before its ranks registered fails below: the job is requeued onto healthy nodes.)
                await self._exit_codes_of([step])
                for rank in step.ranks:
                    ended = self.tasks[(step.slot.name, rank)]
                    if ended.code is None:
                        self._trainer_rank_lost(ended, f"its step ended with code {code} without its exit code", True)
        if self.trainer_lost:
            raise TrainerLost(sorted(self.trainer_lost.values(), key=lambda one: one.rank))
        for step, code in codes:
            if step.slot.name in self.revivable and code is not None and (code != 0 or not released):
                here = [rank for rank in step.ranks if self.live_step.get((step.slot.name, rank)) is step]
                if any((step.slot.name, rank) not in self.tasks for rank in here):
                    # A task that never registered - at its first start, or started again (its node is
                    # likely lost: an srun into a dead node ends without the task running) - would fail
                    # the same way again: a failure now, so the job is requeued onto healthy nodes.
                    continue
                self.retired.add(id(step))
                if step.local:
                    step.kill()  # the lost task's children (vLLM's engine processes) go with it
                for rank in step.ranks:  # unless its exit code on the bus already had it started again
                    if self.live_step.get((step.slot.name, rank)) is step:
                        task = self.tasks.get((step.slot.name, rank))  # no exit code of its own: node lost
                        self.revive(step.slot.name, rank, why=f"its step ended with code {code}",
                                    node_lost=task is None or task.code is None)
        codes = [(step, code) for step, code in codes if id(step) not in self.retired]
        failed = [(step, code) for step, code in codes if code not in (None, 0)]
        if failed:
            await self._exit_codes_of([step for step, _ in failed])
            for step, code in [(step, code) for step, code in failed if self._replaced(step)]:
                self.retired.add(id(step))  # its non-zero code is a task already started again elsewhere
                failed.remove((step, code))
                codes.remove((step, code))
        if failed:
            failures = [f for step, code in failed for f in self.failures_of(step, code)]
            raise GroupFailed("; ".join(describe(f) for f in failures), failures)
        for step, code in codes:
            if code == 0 and not released:
                missing = [r for r in step.ranks if (step.slot.name, r) not in self.tasks]
                if missing:
                    raise GroupFailed(f"group {step.slot.name} ended before ranks {missing} registered with the head")
                raise GroupFailed(f"group {step.slot.name} ended before the head told it to")
        if self.expected <= self.tasks.keys():
            self.all_registered = True  # from now on a task started again has the bus's timeouts instead
        if not released and not self.all_registered and time.monotonic() > self._deadline:
            unregistered = sorted(self.expected - self.tasks.keys())
            raise GroupFailed("tasks never registered within start_timeout_s: "
                              + ", ".join(f"{g} rank {r}" for g, r in unregistered))
        return all(code == 0 for _, code in codes)

    async def _exit_codes_of(self, steps: list[Step], timeout_s: float = EXIT_CODES_WAIT_S) -> None:
        """Take in the bus's events until every registered task of `steps` has its exit code or was
        declared lost (a task whose node lost power sends none), at most `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.handle_events()
            tasks = [self.tasks.get((step.slot.name, rank)) for step in steps for rank in step.ranks]
            if all(t is None or t.code is not None or t.lost for t in tasks) or time.monotonic() >= deadline:
                return
            await asyncio.sleep(0.02)

    def _replaced(self, step: Step) -> bool:
        """True when the ranks of `step` that failed all run in another step now (started again), and the
        rest told the head they exited 0: e.g. a step of two replicas on one node, one of them killed and
        started again alone, the other released at the end of the run."""
        name = step.slot.name
        moved = [rank for rank in step.ranks if self.live_step.get((name, rank)) not in (None, step)]
        stayed = [self.tasks.get((name, rank)) for rank in step.ranks if rank not in moved]
        return bool(moved) and all(task is not None and task.code == 0 for task in stayed)

    async def wait_ended(self) -> None:
        """After release(): wait until every step has ended with 0 (GroupFailed otherwise)."""
        while not await self.poll():
            await asyncio.sleep(0.2)

    def stop_steps(self) -> None:
        """End every step still running: SIGTERM, then SIGKILL after 10 s."""
        for step in self.steps:
            if step.local and step.poll() is not None:
                step.kill()  # what a dead task left in its POSIX process group (e.g. vLLM's engine processes)
        running = [s for s in self.steps if s.poll() is None]
        for step in running:
            step.terminate()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(s.poll() is None for s in running):
            time.sleep(0.1)
        for step in running:
            step.kill()
        for step in running:
            for proc in step.procs:
                proc.wait()


def last_line(path: Path, *, limit: int = 300) -> str:
    """The last non-empty line of a task's log (e.g. srun's "execve(): ...: No such file or directory" when the
    run's interpreter is missing on that node); "" when there is none."""
    try:
        with open(path, "rb") as log:
            log.seek(max(0, log.seek(0, 2) - 4096))
            lines = [line.strip() for line in log.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][-limit:] if lines else ""


def describe(failure: dict) -> str:
    rank = f" rank {failure['rank']}" if failure["rank"] is not None else ""
    node = f" on node {failure['node']}" if failure["node"] else ""
    return f"group {failure['group']}{rank}{node} {failure['why']}"
