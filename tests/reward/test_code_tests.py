"""The code_tests reward: the completion's code runs against the row's tests in a sandbox process of the
reward pool's worker, under CPU, memory, process and wall limits, with no network."""

from __future__ import annotations

import ast
import os
import socket
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from hpcrl.reward.pool import RewardPool
from hpcrl.reward.types import Sample
from hpcrl.workers.sandbox import Limits, Outcome, extract_code, run_code, run_tests

HERE = Path(__file__).resolve().parent
ADD_TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0"
FORK_BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"


def _sandboxes_alive() -> list[int]:
    """Host pids of sandbox processes (forks of the boot script) still alive."""
    alive = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"_sandbox_boot.py" in (entry / "cmdline").read_bytes():
                alive.append(int(entry.name))
        except OSError:
            continue
    return alive


def _score(completions: dict[str, str], tests: str = ADD_TESTS) -> dict[str, object]:
    samples = [Sample(id=name, prompt_id=name, prompt="", completion=code, answer=tests)
               for name, code in completions.items()]
    with RewardPool("verifiers_for_tests:code_tests_quick", workers=2, timeout_s=20) as pool:
        return {r.id: r for r in pool.score(samples)}


@pytest.fixture(autouse=True)
def _verifiers_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))


@pytest.mark.timeout(120)
def test_code_that_passes_its_tests_scores_1_and_failing_code_0_with_the_failure():
    results = _score({"right": "```python\ndef add(a, b):\n    return a + b\n```", "wrong": "def add(a, b): return a - b",
                      "exits": "import sys\nsys.exit(0)", "quits": "import os\nos._exit(0)"})
    assert (results["right"].reward, results["right"].reason) == (1.0, None)
    assert results["wrong"].reward == 0.0 and results["wrong"].reason == "AssertionError"
    assert results["exits"].reward == 0.0 and "exited (sys.exit(0)) before the tests finished" in results["exits"].reason
    assert results["quits"].reward == 0.0 and "before the tests finished" in results["quits"].reason  # no early pass
    assert all(r.error is None for r in results.values())  # a failing test is a score, not an error


@pytest.mark.timeout(120)
def test_an_infinite_loop_a_fork_bomb_and_a_10_gb_allocation_are_killed_within_the_limits_and_scored_0():
    started = time.monotonic()
    results = _score({"loop": "while True:\n    pass", "sleep": "import time\ntime.sleep(600)", "bomb": FORK_BOMB,
                      "memory": "block = bytearray(10 * 1024**3)"})
    assert time.monotonic() - started < 15  # 2 s of wall time each, two workers, plus the pool's start
    assert {r.reward for r in results.values()} == {0.0} and all(r.error is None for r in results.values())
    assert results["loop"].reason in ("killed at the CPU-time limit (1 s)", "killed at the wall-time limit (2 s)")
    assert results["sleep"].reason == "killed at the wall-time limit (2 s)"
    assert results["bomb"].reason in ("killed at the CPU-time limit (1 s)", "killed at the wall-time limit (2 s)")
    assert results["memory"].reason == "MemoryError (memory limit 256 MiB)"
    deadline = time.monotonic() + 5  # the namespace's processes die with its first one
    while _sandboxes_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _sandboxes_alive() == []


@pytest.mark.timeout(60)
def test_a_sandbox_dies_with_the_worker_that_the_pool_kills_at_its_timeout():
    sample = Sample(id="s", prompt_id="s", prompt="", completion="import time\ntime.sleep(600)", answer="pass")
    with RewardPool("verifiers_for_tests:code_tests_quick", workers=1, timeout_s=0.8) as pool:  # under the 2 s wall
        (result,) = pool.score([sample])
        assert result.reward is None and "timed out after 0.8 s" in result.error
        deadline = time.monotonic() + 5
        while _sandboxes_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _sandboxes_alive() == []  # before the sandbox's own 2 s wall limit would have fired


@pytest.mark.timeout(60)
def test_the_code_cannot_connect_even_to_a_socket_listening_on_localhost():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\ndef add(a, b): return a + b"
        result = _score({"net": code})["net"]
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
    assert result.reward == 0.0 and "Connection refused" in result.reason  # the sandbox's own loopback: nobody


@pytest.mark.timeout(60)
def test_the_code_runs_in_a_private_tmp_of_its_own_and_its_host_directory_is_removed_afterwards():
    code = "import os\nprint(os.getcwd(), os.environ['HOME'])\nopen('left.txt', 'w').write('x')\nprint(os.listdir('.'))"
    ours = f"hpcrl-code-{os.getpid()}-*"  # this process's sandboxes' (another test process may run its own)
    before = {p.name for p in Path(tempfile.gettempdir()).glob(ours)}
    outcome, output = run_code(code, Limits(cpu_s=1, wall_s=4))
    # Beside its own file, only the (empty) mount points of an interpreter whose venv lies under the host's /tmp
    # (a clone there: its venv is bound read-only on the private /tmp).
    mounts = {Path(p).parts[2] for p in {sys.prefix, sys.base_prefix, os.path.realpath(sys.prefix)}
              if p.startswith("/tmp/")}
    where, listed = output.splitlines()
    assert outcome.passed and where == "/tmp /tmp" and sorted(ast.literal_eval(listed)) == sorted({"left.txt", *mounts})
    assert {p.name for p in Path(tempfile.gettempdir()).glob(ours)} <= before


@pytest.mark.timeout(120)
def test_a_solution_that_empties_or_patches_the_tests_exits_early_or_answers_always_equal_scores_0():
    """The tests run in a process of their own that the solution cannot reach; what comes back is plain data."""
    wrong = "\ndef add(a, b):\n    return 0\n"
    results = _score({
        "empties": "for p in ('tests.py', '/hpcrl/tests.py'):\n"
                   "    try:\n        open(p, 'w').close()\n    except OSError:\n        pass" + wrong,
        "compile": "import builtins\nreal = compile\nbuiltins.compile = lambda *a, **k: real('pass', 'x', 'exec')" + wrong,
        "open": "import builtins, io\nbuiltins.open = lambda *a, **k: io.StringIO('')" + wrong,
        "exit": wrong + "import sys\nsys.exit(0)",
        "os_exit": wrong + "import os\nos._exit(0)",
        "always_equal": "class Same:\n    def __eq__(self, other): return True\n    __hash__ = None\n"
                        "def add(a, b):\n    return Same()",
        "int_subclass": "class Same(int):\n    def __eq__(self, other): return True\n"
                        "def add(a, b):\n    return Same(0)",
        "exits_in_call": "def add(a, b):\n    raise SystemExit(0)",
    })
    assert {name: r.reward for name, r in results.items()} == dict.fromkeys(results, 0.0), results
    assert all(r.error is None for r in results.values())


@pytest.mark.timeout(60)
def test_honest_solutions_pass_through_the_proxies_whatever_they_return_or_raise():
    """HumanEval's check(candidate), classes and their methods, generators, exceptions of a builtin type,
    and plain data of every kind the protocol carries, each compared in the tests' own process."""
    code = textwrap.dedent("""
        import math
        LIMIT = 10
        def add(a, b):
            return a + b
        def kinds():
            return [None, True, 2**100, 0.5, math.inf, 1j, "é\\ud800", b"\\x00", (1, [2]), {3}, frozenset({4}),
                    {"k": (5,)}]
        def count(n):
            yield from range(n)
        def picky(x):
            if x < 0:
                raise ValueError("negative")
            return x
        class Stack:
            def __init__(self):
                self.items = []
            def push(self, x):
                self.items.append(x)
                return len(self.items)
        """)
    tests = textwrap.dedent("""
        import math
        def check(candidate):
            assert candidate(1, 2) == 3 and candidate("a", "b") == "ab"
        check(add)
        got = kinds()
        assert got[:4] == [None, True, 2**100, 0.5] and math.isinf(got[4]) and got[5] == 1j
        assert got[6:] == ["é\\ud800", b"\\x00", (1, [2]), {3}, frozenset({4}), {"k": (5,)}]
        assert list(count(3)) == [0, 1, 2] and sum(count(4)) == 6 and LIMIT == 10
        try:
            picky(-1)
            raise AssertionError("no error")
        except ValueError as err:
            assert str(err) == "negative"
        s = Stack()
        assert s.push(7) == 1 and s.push(8) == 2 and s.items == [7, 8] and len(s.items) == 2
        """)
    assert run_tests(code, tests, Limits(cpu_s=2, wall_s=10)) == Outcome(True, "")


@pytest.mark.timeout(60)
def test_each_call_removes_its_cgroup_even_with_a_child_of_the_code_left_running():
    own = [p for p in Path("/sys/fs/cgroup").glob(f"*/**/hpcrl-sandbox-{os.getpid()}-*")]
    assert own == []
    lingers = "import os, time\nif os.fork() == 0:\n    time.sleep(60)\n    os._exit(0)\ndef add(a, b): return a + b"
    assert run_tests(lingers, ADD_TESTS, Limits(wall_s=10)).passed  # its child still sleeping at the end
    assert [p for p in Path("/sys/fs/cgroup").glob(f"*/**/hpcrl-sandbox-{os.getpid()}-*")] == []


def test_the_last_python_block_is_the_code_else_the_whole_completion():
    assert extract_code("x\n```python\na = 1\n```\nthen\n```py\nb = 2\n```") == "b = 2\n"
    assert extract_code("def f(): return 1") == "def f(): return 1"


@pytest.mark.timeout(60)
def test_the_builtin_code_tests_scores_through_the_pool():
    samples = [Sample(id=k, prompt_id=k, prompt="", completion=c, answer=ADD_TESTS)
               for k, c in (("right", "def add(a, b): return a + b"), ("wrong", "def add(a, b): return 0"))]
    with RewardPool("hpcrl.reward.builtin:code_tests", workers=1, timeout_s=20) as pool:
        results = pool.score(samples)
    assert [(r.reward, r.reason) for r in results] == [(1.0, None), (0.0, "AssertionError")]
