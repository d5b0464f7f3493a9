"""The head: runs in component 0 (the batch step), starts every group, and propagates exits.

    python -m hpcrl.launch.head RUN_DIR      (the sbatch/ templates; submitit calls Head(run_dir))

  1. reads RUN_DIR/launch.json (written by hpcrl submit) and listens for reports (report.py)
  2. starts one step per group: `srun --het-group=i` (hetjob), srun on the group's node range
     (split), or local process trees (local executor); each task gets HPCRL_RUN_DIR,
     HPCRL_HEAD_ADDR and HPCRL_LAYOUT in its environment
  3. program "rl" (training): serves the control bus (HPCRL_BUS_ADDR, the run's secret) and a
     rendezvous store (HPCRL_STORE_ADDR: trainer process group, weight-transfer group), waits for
     every group's role to register, forms the weight-transfer group and runs the GRPO loop
     (hpcrl.rl.loop over hpcrl.rl.ports.BusPorts) while it watches every step; then tells each
     task to exit with 0.
     program "check": waits until every task has said hello (group, replica, rank, node), holds
     them for launch.json's hold_s, then tells each task its exit code (0, or launch.json's
     exit_codes, "group/rank" -> code, used to test failure handling)
  4. when every step has ended with 0, writes exit.json (COMPLETED) and returns the reports;
     when any step fails, names the group and ranks in its log and exit.json, stops the other
     steps and raises GroupFailed, so the job ends FAILED; SIGTERM (scancel, hpcrl cancel) stops
     every step and records CANCELLED.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hpcrl.errors import HpcrlError
from hpcrl.launch.report import ReportServer
from hpcrl.launch.rundir import CONFIG_FILE, EXIT_FILE, LAUNCH_FILE, log_path, read_json, write_json
from hpcrl.launch.steps import Step, start_local_step, start_replacement, start_slurm_step
from hpcrl.slurm.nodelist import expand_nodelist
from hpcrl.slurm.spec import GroupSlot

#: Seconds every task has to report after its step started.
DEFAULT_START_TIMEOUT_S = 600.0
#: Times one lost inference replica is started again before the run gives up.
MAX_RELAUNCHES = 3


class GroupFailed(HpcrlError):
    """A group's step ended with a non-zero exit code, or its tasks never reported."""


class RunCancelled(HpcrlError):
    """The head was told to stop (SIGTERM or SIGINT), e.g. by scancel or hpcrl cancel."""


@dataclass
class _Task:
    identity: dict
    conn: int
    bye: int | None = None
    closed: bool = False


def _logger(run_dir: Path) -> logging.Logger:
    log = logging.getLogger(f"hpcrl.head.{run_dir}")
    log.setLevel(logging.INFO)
    log.propagate = False
    fmt = logging.Formatter("%(asctime)s head: %(message)s")
    path = log_path(run_dir, "head", 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    for handler in (logging.FileHandler(path), logging.StreamHandler(sys.stderr)):
        handler.setFormatter(fmt)
        log.addHandler(handler)
    return log


def _raise_cancelled(signum: int, frame: object) -> None:
    raise RunCancelled(f"received {signal.Signals(signum).name}")


def _late_usr2(signum: int, frame: object) -> None:
    """SIGUSR2 once training is over (the groups are stopping): nothing is left to checkpoint."""
    print("head: SIGUSR2 after the last step: the run is finishing, nothing to checkpoint", file=sys.stderr,
          flush=True)


class _Supervisor:
    """The head's state: steps, tasks that reported, and what went wrong."""

    def __init__(self, launch: dict, run_dir: Path, log: logging.Logger) -> None:
        self.launch = launch
        self.run_dir = run_dir
        self.log = log
        self.groups = [GroupSlot(**{k: v for k, v in g.items() if k != "tasks"}) for g in launch["groups"]]
        self.expected = {(g.name, r) for g in self.groups if g.module for r in range(g.tasks)}
        self.tasks: dict[tuple[str, int], _Task] = {}
        self.by_conn: dict[int, tuple[str, int]] = {}
        self.steps: list[Step] = []
        self.problems: list[str] = []
        self.revivable: set[str] = set()
        """Groups whose lost tasks are started again instead of failing the run (program rl: inference)."""
        self.on_lost = None
        """Called with (group, rank, why) when a revivable task is lost (the head's bus marks it dead)."""
        self.relaunches: dict[tuple[str, int], int] = {}
        self.live_step: dict[tuple[str, int], Step] = {}
        self.retired: set[int] = set()
        self.env: dict[str, str] = {}
        self.server: ReportServer | None = None
        self.released = False
        self.all_reported = False
        node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        self.head_identity = {"group": "head", "component": 0, "rank": 0, "group_size": 1, "replica": 0,
                              "local_rank": 0, "node": node, "node_index": 0, "pid": os.getpid()}

    def start(self, server: ReportServer, extra_env: dict[str, str] | None = None) -> None:
        layout = {"groups": self.launch["groups"]}
        # cluster.env is exported by the batch script too; the local executor has only this.
        env = {**os.environ, **self.launch.get("env", {}), "HPCRL_RUN_DIR": str(self.run_dir),
               "HPCRL_HEAD_ADDR": server.address,
               "HPCRL_LAYOUT": _compact_json(layout), **(extra_env or {})}
        self.env, self.server = env, server
        python = self.launch["python"]
        job_nodes = expand_nodelist(os.environ.get("SLURM_JOB_NODELIST", "")) if self.launch["layout"] == "split" else []
        for slot in self.groups:
            if not slot.module:
                continue
            if self.launch["executor"] == "local":
                step = start_local_step(slot, run_dir=self.run_dir, python=python, env=env)
            else:
                nodes = job_nodes[slot.first_node:slot.first_node + slot.nodes] if job_nodes else None
                step = start_slurm_step(slot, layout=self.launch["layout"], run_dir=self.run_dir,
                                        python=python, env=env, nodelist=nodes)
            self.steps.append(step)
            for rank in step.ranks:
                self.live_step[(slot.name, rank)] = step
            self.log.info(f"started group {slot.name}: {slot.nodes} node(s) x {slot.tasks_per_node} task(s)")

    def revive(self, group: str, rank: int, why: str) -> None:
        """Start a lost task of a revivable group again (it reports and registers anew)."""
        key = (group, rank)
        count = self.relaunches.get(key, 0) + 1
        if count > MAX_RELAUNCHES:
            raise GroupFailed(f"group {group} rank {rank} was lost {count} times (last: {why}); not starting it again")
        self.relaunches[key] = count
        old = self.tasks.pop(key, None)
        if old is not None:
            self.by_conn.pop(old.conn, None)
        node = old.identity.get("node") if old else None
        self.log.warning(f"group {group} rank {rank} lost ({why}); starting it again (time {count} of "
                         f"{MAX_RELAUNCHES})")
        if self.on_lost is not None:
            self.on_lost(group, rank, why)
        slot = next(g for g in self.groups if g.name == group)
        step = start_replacement(slot, rank, executor=self.launch["executor"], layout=self.launch["layout"],
                                 run_dir=self.run_dir, python=self.launch["python"], env=self.env,
                                 node=node if self.launch["layout"] == "split" else None)
        self.steps.append(step)
        self.live_step[key] = step

    def handle(self, events: list) -> None:
        for event in events:
            key = self.by_conn.get(event.conn)
            if event.kind == "error":
                self.problems.append(f"protocol error from {key or event.peer}: {event.error}")
            elif event.kind == "closed":
                if key:
                    self.tasks[key].closed = True
                    if key[0] in self.revivable and self.tasks[key].bye is None:
                        self.revive(*key, why="its process ended without a word")
            elif event.message["type"] == "hello":
                identity = event.message["identity"]
                key = (identity["group"], int(identity["rank"]))
                if key not in self.expected:
                    self.problems.append(f"unexpected task {key[0]} rank {key[1]} reported from {event.peer}")
                    continue
                self.tasks[key] = _Task(identity={**identity, "pid": event.message.get("pid")}, conn=event.conn)
                self.by_conn[event.conn] = key
                self.log.info(f"report: {identity['group']} rank {identity['rank']} replica {identity['replica']} "
                              f"on node {identity['node']} (pid {event.message.get('pid')})")
                if self.released and self.server is not None:  # started again just before the end
                    self.server.send(event.conn, {"type": "exit", "code": 0})
            elif event.message["type"] == "bye" and key:
                self.tasks[key].bye = int(event.message["code"])
                if key[0] in self.revivable and self.tasks[key].bye != 0:
                    self.revive(*key, why=f"it exited with code {self.tasks[key].bye}")
            else:
                self.problems.append(f"unknown message {event.message['type']!r} from {key or event.peer}")

    def release(self, server: ReportServer) -> None:
        self.released = True
        codes = self.launch.get("exit_codes", {})
        for (group, rank), task in sorted(self.tasks.items()):
            server.send(task.conn, {"type": "exit", "code": int(codes.get(f"{group}/{rank}", 0))})

    def failures_of(self, step: Step, code: int) -> list[dict]:
        """Name the ranks of a failed step: non-zero bye, gone without bye, or never reported."""
        found = []
        for rank in step.ranks:
            task = self.tasks.get((step.slot.name, rank))
            if task is None:
                found.append({"group": step.slot.name, "rank": rank, "node": None, "code": None,
                              "why": "never reported to the head"})
            elif task.bye not in (None, 0):
                found.append({"group": step.slot.name, "rank": rank, "node": task.identity["node"],
                              "code": task.bye, "why": f"exited with code {task.bye}"})
            elif task.bye is None and task.closed:
                found.append({"group": step.slot.name, "rank": rank, "node": task.identity["node"],
                              "code": None, "why": "ended without telling the head its exit code"})
        return found or [{"group": step.slot.name, "rank": None, "node": None, "code": code,
                          "why": f"its step exited with code {code}"}]

    def stop_steps(self) -> None:
        for step in self.steps:
            if step.local and step.poll() is not None:
                step.kill()  # what a dead task left in its process group (e.g. vLLM's engine processes)
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


def _compact_json(data: object) -> str:
    return json.dumps(data, separators=(",", ":"))


def _describe(failure: dict) -> str:
    rank = f" rank {failure['rank']}" if failure["rank"] is not None else ""
    node = f" on node {failure['node']}" if failure["node"] else ""
    return f"group {failure['group']}{rank}{node} {failure['why']}"


def _check_steps(sup: _Supervisor, server: ReportServer, *, released: bool, deadline: float) -> bool:
    """One look at reports and steps: raise GroupFailed naming what failed; True once every step ended with 0."""
    sup.handle(server.poll(0.0))
    if sup.problems:
        raise GroupFailed("; ".join(sup.problems))
    codes = [(step, step.poll()) for step in sup.steps if id(step) not in sup.retired]
    for step, code in codes:
        if step.slot.name in sup.revivable and code is not None and (code != 0 or not released):
            sup.retired.add(id(step))
            if step.local:
                step.kill()  # the lost task's children (vLLM's engine processes) go with it
            for rank in step.ranks:
                if sup.live_step.get((step.slot.name, rank)) is step:
                    sup.revive(step.slot.name, rank, why=f"its step ended with code {code}")
    codes = [(step, code) for step, code in codes if id(step) not in sup.retired]
    failed = [(step, code) for step, code in codes if code not in (None, 0)]
    if failed:
        sup.handle(server.poll(0.3))  # collect byes still in flight
        failures = [f for step, code in failed for f in sup.failures_of(step, code)]
        raise GroupFailed("; ".join(_describe(f) for f in failures), failures)
    for step, code in codes:
        if code == 0 and not released:
            missing = [r for r in step.ranks if (step.slot.name, r) not in sup.tasks]
            if missing:
                raise GroupFailed(f"group {step.slot.name} ended before ranks {missing} reported to the head")
            raise GroupFailed(f"group {step.slot.name} ended before the head told it to")
    if sup.expected <= sup.tasks.keys():
        sup.all_reported = True  # from now on a task started again has the bus's rejoin timeout instead
    if not released and not sup.all_reported and time.monotonic() > deadline:
        missing = sorted(sup.expected - sup.tasks.keys())
        raise GroupFailed("tasks never reported within start_timeout_s: "
                          + ", ".join(f"{g} rank {r}" for g, r in missing))
    return all(code == 0 for _, code in codes)


def _start_deadline(launch: dict) -> float:
    return time.monotonic() + float(launch.get("start_timeout_s", DEFAULT_START_TIMEOUT_S))


def _supervise(sup: _Supervisor, server: ReportServer, *, released: bool = False) -> None:
    """Program "check" (and the end of "rl"): release every task once all reported, wait for the steps."""
    hold_s = float(sup.launch.get("hold_s", 0))
    deadline = _start_deadline(sup.launch)
    started, reported_at = time.monotonic(), None
    while True:
        if _check_steps(sup, server, released=released, deadline=deadline):
            return
        if reported_at is None and not released and sup.expected <= sup.tasks.keys():
            reported_at = time.monotonic()
            sup.log.info(f"all {len(sup.expected)} tasks reported in {reported_at - started:.1f} s")
        if reported_at is not None and not released and time.monotonic() - reported_at >= hold_s:
            sup.release(server)
            released = True
        time.sleep(0.2)


async def _train(sup: _Supervisor, server: ReportServer, advertise: str) -> bool:
    """Program "rl": bus + rendezvous store, start the groups, run the GRPO loop while watching the steps.

    Returns True when the run was preempted (SIGUSR2, Slurm's pre-timeout signal): it checkpointed
    after the step in progress and stopped; False when it trained to the end."""
    from hpcrl.bus import BusConfig, load_secret
    from hpcrl.bus import Head as BusHead
    from hpcrl.config.load import load_config
    from hpcrl.rl.loop import Preempted, run_loop
    from hpcrl.rl.ports import BusPorts
    from hpcrl.roles.serve import BUS_SETTINGS
    from hpcrl.transfer.group import host_store

    log, launch = sup.log, sup.launch
    config = load_config(sup.run_dir / CONFIG_FILE)
    bus = BusHead(run_id=launch["run_name"], secret=load_secret(sup.run_dir), address="tcp://0.0.0.0:0",
                  config=BusConfig(**BUS_SETTINGS))
    bound = await bus.start()
    bus_address = f"tcp://{advertise}:{bound.rpartition(':')[2]}"
    store = host_store(advertise, 0, timeout_s=float(launch.get("start_timeout_s", DEFAULT_START_TIMEOUT_S)))
    log.info(f"bus at {bus_address}, rendezvous store at {advertise}:{store.port}")
    sup.revivable = {"inference"}

    def lost(group: str, rank: int, why: str) -> None:
        bus.mark_dead(f"{group}/{rank}/0", why)  # one inference task per replica: replica = rank
    sup.on_lost = lost
    sup.start(server, {"HPCRL_BUS_ADDR": bus_address, "HPCRL_STORE_ADDR": f"{advertise}:{store.port}"})
    ports = BusPorts(config, bus, store_host=advertise, store_port=store.port, log=log.info)
    deadline = _start_deadline(launch)
    preempt = asyncio.Event()

    def on_usr2() -> None:
        log.info("SIGUSR2 (the time limit is near): checkpointing after this step, then requeueing")
        preempt.set()
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR2, on_usr2)

    async def work() -> bool:
        await ports.connect(timeout=max(1.0, deadline - time.monotonic()))
        try:
            await run_loop(config, ports, log=log.info, steps=launch.get("stop_after"),
                           stop_requested=preempt.is_set)
        except Preempted as stopped:
            log.info(f"preempted: {stopped}")
            return True
        return False

    async def watch() -> None:
        while not _check_steps(sup, server, released=False, deadline=deadline):
            await asyncio.sleep(0.2)

    loop_task, watch_task = asyncio.create_task(work()), asyncio.create_task(watch())
    try:
        done, _ = await asyncio.wait({loop_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        if watch_task in done:
            watch_task.result()  # raises GroupFailed naming the group and ranks
        try:
            preempted = loop_task.result()
        except GroupFailed:
            raise
        except Exception as err:  # noqa: BLE001 - the loop's error ends the run FAILED, with its message
            log.exception("the GRPO loop failed")
            raise GroupFailed(f"the GRPO loop failed: {type(err).__name__}: {err}") from None
        sup.revivable = set()
        sup.release(server)  # every task: exit 0
        return preempted
    finally:
        asyncio.get_running_loop().remove_signal_handler(signal.SIGUSR2)  # leaves SIG_DFL, which would kill us
        signal.signal(signal.SIGUSR2, _late_usr2)
        for task in (loop_task, watch_task):
            task.cancel()
        await asyncio.gather(loop_task, watch_task, return_exceptions=True)
        ports.close()
        await bus.close("the run is over")
        del store


def run_head(run_dir: Path | str) -> dict:
    """Start, watch and stop every group of the run in `run_dir`; return the reports."""
    run_dir = Path(run_dir).absolute()
    launch = read_json(run_dir / LAUNCH_FILE)
    log = _logger(run_dir)
    sup = _Supervisor(launch, run_dir, log)
    advertise = os.environ.get("HPCRL_HEAD_HOST") or socket.gethostname()
    server = ReportServer(advertise)
    log.info(f"run {launch['run_name']} ({launch['executor']}, layout {launch['layout']}): "
             f"head on {sup.head_identity['node']}, reports at {server.address}")
    previous = {sig: signal.signal(sig, _raise_cancelled) for sig in (signal.SIGTERM, signal.SIGINT)}
    started = time.time()
    state, failures, error = "FAILED", [], ""
    try:
        if launch.get("program", "check") == "rl":
            preempted = asyncio.run(_train(sup, server, advertise))
            _supervise(sup, server, released=True)
        else:
            sup.start(server)
            _supervise(sup, server)
            preempted = False
        state = ("REQUEUED" if launch["executor"] == "slurm" else "PREEMPTED") if preempted else "COMPLETED"
    except GroupFailed as err:
        failures = err.args[1] if len(err.args) > 1 else []
        error = err.args[0]
        restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
        if (launch.get("program") == "rl" and launch["executor"] == "slurm"
                and restarts < int(launch.get("max_requeues", 0))):
            # A node died or a task was killed: come back from the last checkpoint (a new allocation
            # avoids a dead node once Slurm has marked it down) instead of ending the run.
            state = "REQUEUED"
            log.error(f"run lost a task: {error}; requeueing to resume from the last checkpoint "
                      f"(restart {restarts + 1} of at most {launch['max_requeues']})")
        else:
            log.error(f"run FAILED: {error}")
            raise GroupFailed(error) from None
    except RunCancelled as err:
        state, error = "CANCELLED", str(err)
        log.info(f"run CANCELLED ({err}); stopping every group")
        raise
    except Exception as err:  # a bug or an unreadable run directory: still FAILED, saying why
        error = f"the head failed: {type(err).__name__}: {err}"
        log.exception(error)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sup.stop_steps()
        server.close()
        reports = [sup.head_identity] + [t.identity for _, t in sorted(sup.tasks.items())]
        write_json(run_dir / EXIT_FILE, {"state": state, "error": error, "failures": failures,
                                         "reports": reports, "elapsed_s": round(time.time() - started, 3),
                                         "step_codes": {s.slot.name: s.poll() for s in sup.steps}})
        if state == "COMPLETED":
            log.info(f"run COMPLETED in {time.time() - started:.1f} s")
        if state in ("REQUEUED", "PREEMPTED"):
            log.info("requeueing the job (scontrol requeue); it resumes from its newest checkpoint when it starts "
                     "again" if state == "REQUEUED" else
                     "run stopped at a checkpoint: submit the same run directory again to resume")
        for handler in list(log.handlers):
            handler.close()
            log.removeHandler(handler)
    if state == "REQUEUED":
        _requeue_this_job()
    return {"state": state, "reports": reports, "run_dir": str(run_dir)}


def _requeue_this_job() -> None:
    """Put this job back in the queue (it keeps its id; Slurm restarts the head, which resumes),
    then leave without a result, as submitit does after its own requeue."""
    import subprocess

    job_id = os.environ.get("SLURM_JOB_ID", "")
    done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise GroupFailed(f"scontrol requeue {job_id} failed ({done.stderr.strip()}): the run stopped at its "
                          "checkpoint; submit the same run directory again to resume")
    raise SystemExit(-1)


class Head:
    """What submitit runs in the batch step: picklable, it carries only the run directory."""

    def __init__(self, run_dir: Path | str) -> None:
        self.run_dir = str(run_dir)

    def __call__(self) -> dict:
        return run_head(self.run_dir)

    def __repr__(self) -> str:
        return f"Head({self.run_dir!r})"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m hpcrl.launch.head RUN_DIR", file=sys.stderr)
        return 2
    try:
        run_head(args[0])
    except GroupFailed:
        return 1
    except RunCancelled:
        return 143
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
