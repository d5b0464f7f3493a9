"""A group task's supervisor: what the task leaves running is ended when it dies, and its status is kept.

Real processes: a supervised task (a python script) starts helpers in sessions of their own, as
vLLM's engine processes would outlive their parent, and the tests kill, signal or end the task.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hpcrl.roles.reaper import descendants, live, session_pids, shared_memory_of

REPO = Path(__file__).resolve().parents[2]

TASK = textwrap.dedent("""
    import os, subprocess, sys, time
    import hpcrl.roles.reaper as reaper
    reaper.GRACE_S = 1.0
    reaper.supervise("hpcrl.test")
    # the task: a helper that ignores SIGTERM and has a helper of its own, in a session of its own
    helper = subprocess.Popen([sys.executable, "-c",
        "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); time.sleep(300)"],
        start_new_session=True)
    print(os.getpid(), helper.pid, flush=True)
    code = sys.stdin.readline().strip()
    if code:
        os._exit(int(code))
    time.sleep(300)
""")


def until(check, what: str, timeout: float = 20.0) -> None:
    """Poll `check` every 10 ms until it holds; fail saying `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def ignores(pid: int, sig: signal.Signals) -> bool:
    """Whether process `pid` ignores `sig` (its SigIgn mask in /proc/PID/status)."""
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("SigIgn:"))
    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)


def start_task() -> tuple[subprocess.Popen, int, int]:
    """The supervisor process, the task's pid and its helper's pid (once the helper's own helper runs)."""
    sup = subprocess.Popen([sys.executable, "-c", TASK], env={**os.environ, "PYTHONPATH": str(REPO)},
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    task, helper = map(int, sup.stdout.readline().split())
    until(lambda: descendants(helper), "the helper did not start its own helper")
    return sup, task, helper


@pytest.mark.timeout(60)
def test_killing_the_task_ends_every_process_it_started_and_the_supervisor_dies_of_the_same_signal():
    sup, task, helper = start_task()
    left = [helper, *descendants(helper)]
    assert set(descendants(sup.pid)) >= {task, *left}
    os.kill(task, signal.SIGKILL)
    assert sup.wait(timeout=30) == -signal.SIGKILL
    assert live(left) == []
    err = sup.stderr.read()
    assert f"the task (pid {task}) killed by SIGKILL; ended what it left running" in err
    assert f"(pid {helper})" in err


@pytest.mark.timeout(60)
def test_a_task_that_exits_keeps_its_exit_code_and_leaves_nothing_behind():
    sup, task, helper = start_task()
    left = [helper, *descendants(helper)]
    sup.stdin.write("3\n")
    sup.stdin.flush()
    assert sup.wait(timeout=30) == 3
    assert live(left) == []


@pytest.mark.timeout(60)
def test_sigterm_to_the_supervisor_reaches_the_task_and_sigint_alone_does_not_end_the_supervisor():
    sup, task, helper = start_task()
    # The supervisor ignores SIGINT from right after its fork (the task may have printed before that).
    until(lambda: ignores(sup.pid, signal.SIGINT), "the supervisor does not ignore SIGINT")
    os.kill(sup.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the task itself; the supervisor waits on
    assert sup.poll() is None and live([task]) == [task]  # an ignored signal is dropped when sent: no wait
    os.kill(sup.pid, signal.SIGTERM)
    assert sup.wait(timeout=30) == -signal.SIGTERM
    assert live([task, helper]) == []


def test_descendants_lists_children_and_their_children_but_not_the_process_itself():
    outer = subprocess.Popen([sys.executable, "-c",
                              "import subprocess, sys; subprocess.run([sys.executable, '-c', "
                              "'import time; time.sleep(30)'])"])
    try:
        until(lambda: descendants(outer.pid), "the outer process did not start its child")
        below = descendants(os.getpid())
        assert outer.pid in below and os.getpid() not in below
        assert set(descendants(outer.pid)) < set(below)
    finally:
        for pid in descendants(outer.pid):
            os.kill(pid, signal.SIGKILL)
        outer.kill()
        outer.wait()


@pytest.mark.timeout(60)
def test_the_supervisor_hands_on_exit_the_status_of_a_task_killed_with_9_and_of_one_that_exits():
    script = textwrap.dedent("""
        import os, sys, time
        import hpcrl.roles.reaper as reaper
        reaper.supervise("hpcrl.test", on_exit=lambda code, how: print(f"on_exit {code} {how}", flush=True))
        print(os.getpid(), flush=True)
        code = sys.stdin.readline().strip()
        os._exit(int(code)) if code else time.sleep(300)
    """)
    for how, expected in (("kill", "on_exit 137 killed by SIGKILL"), ("7", "on_exit 7 exited with code 7")):
        sup = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": str(REPO)},
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        task = int(sup.stdout.readline())
        if how == "kill":
            os.kill(task, signal.SIGKILL)
            out, _ = sup.communicate(timeout=30)
        else:
            out, _ = sup.communicate(f"{how}\n", timeout=30)
        assert out.strip() == expected


@pytest.mark.timeout(30)
def test_a_sessions_processes_and_the_shared_memory_they_hold_are_found():
    name = f"/dev/shm/hpcrl-test-{os.getpid()}"
    code = textwrap.dedent(f"""
        import subprocess, sys, time
        held = open({name!r}, "w")
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        print(child.pid, flush=True)
        time.sleep(30)
    """)
    leader = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        child = int(leader.stdout.readline())
        assert set(session_pids(leader.pid)) == {leader.pid, child}
        assert shared_memory_of(session_pids(leader.pid)) == {name}
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()
        Path(name).unlink(missing_ok=True)
