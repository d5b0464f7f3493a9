"""The head's one control port refuses what a stranger sends: forged registrations and exit codes
(BYE) sealed without the run's secret, garbage, and a genuine-looking frame from another run's
secret. Each is dropped and counted, and the run goes on as if nothing had been sent.

This is the attack that broke the old report channel (plain JSON on TCP): a "hello" claiming to be
trainer rank 1 on node n9, then a "bye" with code 75, made the head requeue a finished run.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from hpcrl.bus import PeerInfo
from hpcrl.bus.router import routing_id
from hpcrl.bus.secret import Secret, load_secret
from hpcrl.bus.wire import Kind, Sealer
from hpcrl.bus.zap import as_client
from hpcrl.rundir import EXIT_FILE, log_path, read_json

REPO = Path(__file__).resolve().parents[2]


def wait_for_line(path: Path, pattern: str, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while True:
        found = re.search(pattern, path.read_text() if path.exists() else "")
        if found:
            return found
        assert time.monotonic() < deadline, f"no line matching {pattern!r} in {path} within {timeout} s"
        time.sleep(0.05)


def forged_frames(run_name: str) -> list[list[bytes]]:
    """What an attacker without the secret can send: every kind the head takes, sealed with keys of
    its own, claiming to be trainer rank 1 of this run on node n9 (pid 4242)."""
    fake = PeerInfo(run_id=run_name, group="trainer", replica=0, rank=1, replica_ranks=2, task=1, host="n9", pid=4242)
    frames = []
    for _ in range(5):
        sealer = Sealer(Secret(secrets.token_bytes(32)), secrets.token_bytes(16))
        frames.append(sealer.seal(Kind.REGISTER, {"peer": fake.to_wire(), "endpoints": {}, "t": time.time(),
                                                  "ready": True}))
        frames.append(sealer.seal(Kind.BYE, {"reason": "the task exited with code 75", "code": 75,
                                             "by": "supervisor"}, to=secrets.token_bytes(16)))
        frames.append(sealer.seal(Kind.READY, {"endpoints": {"train_step": False}}, to=secrets.token_bytes(16)))
    frames += [[b"hello trainer 1 n9 4242\n"], [b"\x92\x01\x02" * 40], [b""]]
    return [[bytes(f) for f in message] for message in frames]


@pytest.mark.timeout(90)
def test_forged_registrations_and_exit_codes_are_refused_and_counted_and_the_check_run_is_unaffected(tmp_path):
    env = {**os.environ, "PATH": "/nonexistent", "PYTHONPATH": str(REPO)}
    env.pop("SLURM_CONF", None)
    run = subprocess.Popen([sys.executable, "-m", "hpcrl", "submit", "configs/tiny_grpo.toml", "--set",
                            f"run.run_dir={tmp_path}", "--set", "trainer.nodes=2", "--check", "--hold", "4",
                            "--wait"], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    head_log = log_path(tmp_path, "head", 0)
    try:
        address = wait_for_line(head_log, r"bus at (tcp://\S+)", 30)[1]
        wait_for_line(head_log, r"all \d+ tasks registered", 30)
        messages = forged_frames(run_name=read_json(tmp_path / "launch.json")["run_name"])
        ctx = zmq.Context.instance()
        stranger = ctx.socket(zmq.DEALER)
        stranger.setsockopt(zmq.LINGER, 2000)
        # Also on a connection whose routing id is a registered peer's own (the incarnation is no secret).
        stranger.setsockopt(zmq.ROUTING_ID, routing_id(secrets.token_bytes(16)))
        # A sniffer's connection: it learned the PLAIN token (sent in clear), not the secret.
        as_client(stranger, load_secret(tmp_path))
        stranger.connect(address)
        for message in messages:
            stranger.send_multipart(message)
        stranger.close()
        out, _ = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 0, out
    record = read_json(tmp_path / EXIT_FILE)
    assert record["state"] == "COMPLETED" and record["failures"] == []
    assert record["refused_messages"] >= len(messages) - 1  # the empty frame may not reach the head as one
    assert sorted((r["group"], r["rank"], r["node"]) for r in record["tasks"]) == sorted(
        (r["group"], r["rank"], r["node"]) for r in record["tasks"] if r["node"] != "n9")
    assert "n9" not in head_log.read_text() and "4242" not in head_log.read_text()
    assert re.search(r"the bus refused \d+ message\(s\): \{.*'bad_mac': \d+", head_log.read_text())
    # hpcrl status names the refusals by reason (issue 28).
    from hpcrl.launch.follow import status
    assert re.search(r"bus refused \d+ message\(s\): .*bad_mac \d+", status(tmp_path).render())


@pytest.mark.timeout(30)
def test_the_heads_report_names_new_refusals_by_reason_once_and_feeds_hpcrl_status(tmp_path, caplog):
    import asyncio
    import logging

    from hpcrl.bus import Router, create_secret
    from hpcrl.bus.config import REFUSED_FILE
    from hpcrl.launch.head import _report_refusals

    async def scenario() -> list[dict]:
        head = Router(run_id="r", secret=create_secret(tmp_path), address="tcp://127.0.0.1:0")
        address = await head.start()
        stranger = zmq.Context.instance().socket(zmq.DEALER)
        stranger.setsockopt(zmq.LINGER, 0)
        as_client(stranger, load_secret(tmp_path))  # a sniffer's: the PLAIN token, not the secret
        stranger.connect(address)
        for message in forged_frames(run_name="r")[:3] + [[b"x" * (1 << 17)]]:
            stranger.send_multipart(message)
        while sum(head.refused().values()) < 4:
            await asyncio.sleep(0.01)
        seen = [_report_refusals(head, tmp_path, {}, 10.0)]
        seen.append(_report_refusals(head, tmp_path, seen[0], 10.0))  # nothing new: no second line
        stranger.close()
        await head.close()
        return seen

    with caplog.at_level(logging.WARNING, logger="hpcrl.launch.head"):
        first, second = asyncio.run(scenario())
    assert first == second == {"bad_mac": 3, "too_large": 1}
    reports = [r.getMessage() for r in caplog.records if "bus: refused" in r.getMessage()]
    assert len(reports) == 1 and "'bad_mac': 3" in reports[0] and "'too_large': 1" in reports[0]
    assert read_json(tmp_path / REFUSED_FILE)["refused"] == first
