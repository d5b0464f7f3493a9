"""tools/bench/bench_bus.py and tools/bench/bench_bus_heartbeats.py run with tiny counts and print their figures."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


def _run(repo, tool: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(repo / "tools" / "bench" / tool), *args],
                          capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


@pytest.mark.timeout(60)
def test_bus_benchmark_prints_route_and_fanout_figures_with_the_reply_spin_on_and_off(repo):
    out = _run(repo, "bench_bus.py", "--calls", "40", "--warmup", "10", "--rounds", "2", "--seconds", "0.2",
               "--fanouts", "10", "--replicas", "2", "--fanout-workers", "3", "--reply-spin", "300e-6")
    for what in ("hpcrl route(), 1 replica(s), one process each", "hpcrl route(), 2 replica(s), one process each",
                 "hpcrl fanout() to 3 workers in 3 processes"):
        for spin in ("300", "0"):
            assert re.search(rf"^\| {re.escape(what)} \| {spin} \| \d+ \| \d+ \|", out, re.M), (what, spin, out)
    assert re.search(r"^fanout to 3 workers \(3 processes, one Worker each\) p50 = [\d.]+ ms", out, re.M), out
    assert re.search(r"^reply_spin 300 us vs off, hpcrl route\(\), 1 replica\(s\).*: p50 \d+ -> \d+ us", out, re.M), out
    assert "worker processes: 6 (1 + 2 + 3, one Worker each)" in out


@pytest.mark.timeout(60)
def test_heartbeat_benchmark_prints_the_heads_cpu_and_notices_every_stopped_peer(repo):
    out = _run(repo, "bench_bus_heartbeats.py", "--peers", "6", "--per-process", "3", "--seconds", "1",
               "--settle", "0.2", "--interval", "0.25", "--timeout", "0.75")
    assert "6 peers registered" in out and "(2 processes, up to 3 Workers each" in out
    assert re.search(r"^head CPU, 6 peers heartbeating every 0.25 s: [\d.]+ % of one core", out, re.M), out
    assert re.search(r"^silent peers noticed: 3 of 3 .*detection delay - timeout = [-+][\d.]+ /", out, re.M), out
    assert "false deaths among the other 3 peers: 0" in out
    assert "head counters: dropped 0" in out
