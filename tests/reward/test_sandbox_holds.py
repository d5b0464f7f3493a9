"""Hostile code against the sandbox of code_tests and python_tool (hpcrl.workers.sandbox): what it may not
write, read, reach or hold. Run as root in CI, as a normal user where a developer runs them."""

from __future__ import annotations

import os
import socket
import sysconfig
import textwrap
from pathlib import Path

import pytest

from hpcrl.workers.sandbox import Limits, SandboxError, run_code, run_tests

QUICK = Limits(cpu_s=2, wall_s=5, memory_mib=512, processes=16)


def _run(code: str, limits: Limits = QUICK) -> str:
    outcome, output = run_code(textwrap.dedent(code), limits, output_chars=8000)
    assert outcome.passed, (outcome.reason, output)
    return output


@pytest.mark.timeout(60)
def test_code_cannot_write_into_the_venv_the_host_tmp_the_home_or_the_workers_cwd(tmp_path):
    """A .pth file in the venv would run in every later Python of it, outside the sandbox (the one written
    here holds a comment only, and is removed should the sandbox fail)."""
    targets = [Path(sysconfig.get_paths()["purelib"]) / f"hpcrl-sandbox-escape-{os.getpid()}.pth",
               Path(f"/tmp/hpcrl-sandbox-escape-{os.getpid()}"), Path.home() / f"hpcrl-sandbox-escape-{os.getpid()}",
               Path.cwd() / f"hpcrl-sandbox-escape-{os.getpid()}", tmp_path / "hpcrl-sandbox-escape"]
    try:
        output = _run(f"""
            for path in {[str(t) for t in targets]!r}:
                try:
                    with open(path, "w") as f:
                        f.write("# written from inside the sandbox\\n")
                    print("wrote", path)
                except OSError as err:
                    print("refused", path, err.strerror)
            open("mine.txt", "w").write("the tmpfs is writable")
            """)
        assert [t for t in targets if t.exists()] == [], output
        assert "refused " + str(targets[0]) in output  # the venv is there, read-only
    finally:
        for target in targets:
            target.unlink(missing_ok=True)


@pytest.mark.timeout(60)
def test_code_cannot_read_a_runs_bus_secret_nor_find_one(tmp_path):
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    (run_dir / "bus.secret").write_text("s3cr3t-of-the-bus")
    outcome, output = run_code(textwrap.dedent(f"""
        import os, sys
        try:
            print(open({str(run_dir / "bus.secret")!r}).read(), flush=True)
        except OSError as err:
            print("refused", err.strerror)
        interpreter = ("/proc", "/usr", *{{os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)}})
        found = []
        for d, subdirs, files in os.walk("/"):
            subdirs[:] = [s for s in subdirs if not os.path.join(d, s).startswith(interpreter)]
            found += [os.path.join(d, f) for f in files if f == "bus.secret"]
        print("found", found)
        """), QUICK, output_chars=8000)
    assert "s3cr3t-of-the-bus" not in output and "refused" in output, output
    assert outcome.passed and "found []" in output, (outcome, output)


@pytest.mark.timeout(60)
def test_code_cannot_connect_to_a_unix_socket_an_abstract_one_or_localhost(tmp_path):
    listeners = []
    path_socket = socket.socket(socket.AF_UNIX)
    path_socket.bind(str(tmp_path / "listener.sock"))
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind(f"\0hpcrl-sandbox-test-{os.getpid()}")
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    listeners = [path_socket, abstract, tcp]
    for listener in listeners:
        listener.listen()
        listener.setblocking(False)
    try:
        output = _run(f"""
            import socket
            for family, address in ((socket.AF_UNIX, {str(tmp_path / "listener.sock")!r}),
                                    (socket.AF_UNIX, {abstract.getsockname()!r}),
                                    (socket.AF_INET, ("127.0.0.1", {tcp.getsockname()[1]}))):
                try:
                    socket.socket(family).connect(address)
                    print("connected", address)
                except OSError as err:
                    print("refused", address, err.strerror)
            """)
        for listener in listeners:
            with pytest.raises(BlockingIOError):
                listener.accept()  # nobody connected
    finally:
        for listener in listeners:
            listener.close()
    assert [line.split()[0] for line in output.splitlines()] == ["refused"] * 3, output


@pytest.mark.timeout(60)
def test_a_sandbox_cannot_hold_more_processes_than_its_bound_whatever_its_user():
    """Root included: the sandbox's cgroup bounds it (root is exempt from RLIMIT_NPROC)."""
    code = """
        import os, time
        started = 0
        try:
            while started < 1000:
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                started += 1
        except OSError:
            pass
        """
    outcome = run_tests(textwrap.dedent(code), f"assert started < {QUICK.processes}, started", QUICK)
    assert outcome == outcome.__class__(True, "")


@pytest.mark.timeout(60)
def test_memory_held_across_children_is_bounded_for_the_whole_sandbox():
    """Four children of 300 MiB each, each under the per-process bound (512 MiB), hold at most one at a time:
    the sandbox's 512 MiB is for all its processes together."""
    code = """
        import os, select
        r, w = os.pipe()
        for _ in range(4):
            if os.fork() == 0:
                block = b"1" * (300 << 20)
                os.write(w, b"x")
                select.select([], [], [], 30)
                os._exit(0)
        os.close(w)
        held = 0
        while select.select([r], [], [], 3)[0] and os.read(r, 1):
            held += 1
            print("held", held, flush=True)
        """
    _, output = run_code(textwrap.dedent(code), Limits(cpu_s=4, wall_s=10, memory_mib=512, processes=16))
    held = max([int(line.split()[1]) for line in output.splitlines() if line.startswith("held ")], default=0)
    assert held * 300 <= 512, output


@pytest.mark.timeout(30)
def test_without_bubblewrap_the_sandbox_refuses_naming_the_package_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxError, match="install it .*apt-get install bubblewrap"):
        run_tests("def add(a, b): return a + b", "assert add(1, 2) == 3")


def test_a_python_whose_venv_lies_under_the_hosts_tmp_runs_in_the_sandbox(tmp_path):
    """A clean clone under /tmp (CI's) has its venv there: the sandbox's private /tmp must not hide it."""
    import subprocess
    import sys

    assert str(tmp_path).startswith("/tmp/")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    code = "from hpcrl.workers.sandbox import run_code; print(run_code('print(6 * 7)'))"
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(repo)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "(Outcome(passed=True, reason=''), '42\\n')"
