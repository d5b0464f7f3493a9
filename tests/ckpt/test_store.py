"""Checkpoints are complete or invisible; corrupt ones are named and skipped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl.ckpt import CheckpointStore


def save(store: CheckpointStore, step: int, payload: bytes = b"x" * 100) -> Path:
    staging = store.staging(step)
    (staging / "trainer").mkdir()
    (staging / "trainer" / "__0_0.distcp").write_bytes(payload)
    (staging / "run_state.json").write_text(json.dumps({"step": step}))
    return store.commit(step, meta={"weight_version": step})


def test_the_newest_complete_checkpoint_is_found_with_its_meta(tmp_path: Path):
    store = CheckpointStore(tmp_path, keep_last=3)
    save(store, 10)
    save(store, 20)
    found = store.latest()
    assert (found.step, found.meta) == (20, {"weight_version": 20})
    manifest = json.loads((found.path / "MANIFEST.json").read_text())
    assert set(manifest["files"]) == {"trainer/__0_0.distcp", "run_state.json"}


def test_only_keep_last_checkpoints_stay_on_disk(tmp_path: Path):
    store = CheckpointStore(tmp_path, keep_last=2)
    for step in (1, 2, 3, 4):
        save(store, step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3", "step_4"]


def test_a_staging_directory_left_by_a_killed_writer_is_invisible(tmp_path: Path):
    store = CheckpointStore(tmp_path, keep_last=2)
    save(store, 10)
    (store.staging(20) / "run_state.json").write_text("{}")
    assert store.latest().step == 10


def test_a_checkpoint_renamed_but_without_manifest_is_skipped_and_reported(tmp_path: Path):
    store = CheckpointStore(tmp_path, keep_last=2)
    save(store, 10)
    save(store, 20)
    (tmp_path / "step_20" / "MANIFEST.json").unlink()
    assert store.latest().step == 10
    assert "not finished" in store.skipped[0][1]


def test_a_truncated_file_is_reported_by_name_and_the_previous_checkpoint_is_used(tmp_path: Path):
    store = CheckpointStore(tmp_path, keep_last=2)
    save(store, 10)
    save(store, 20)
    shard = tmp_path / "step_20" / "trainer" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:50])
    assert store.latest().step == 10
    (path, why), = store.skipped
    assert path == tmp_path / "step_20"
    assert str(shard) in why and "truncated" in why


def test_an_altered_file_fails_its_checksum(tmp_path: Path):
    store = CheckpointStore(tmp_path, keep_last=2)
    save(store, 10)
    (tmp_path / "step_10" / "trainer" / "__0_0.distcp").write_bytes(b"y" * 100)
    assert store.latest() is None
    assert "sha256" in store.skipped[0][1]


WRITER = """
import sys, time
from pathlib import Path
from hpcrl.ckpt import CheckpointStore
store = CheckpointStore(Path(sys.argv[1]), keep_last=2)
staging = store.staging(2)
with open(staging / "big.bin", "wb") as f:
    print("writing", flush=True)
    while True:
        f.write(b"z" * (1 << 20)); f.flush(); time.sleep(0.01)
"""


@pytest.mark.timeout(60)
def test_killing_the_writer_mid_checkpoint_leaves_the_previous_one_in_use(tmp_path: Path):
    store = CheckpointStore(tmp_path, keep_last=2)
    save(store, 1)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert writer.stdout.readline().strip() == b"writing"
    big = tmp_path / "step_2.tmp" / "big.bin"
    deadline = time.monotonic() + 30
    while big.stat().st_size < 4 << 20:  # killed mid-write: some megabytes in, more to come
        assert time.monotonic() < deadline, f"the writer wrote {big.stat().st_size} bytes in 30 s"
        time.sleep(0.01)
    writer.send_signal(signal.SIGKILL)
    writer.wait(10)
    assert big.stat().st_size >= 4 << 20
    found = store.latest()
    assert found.step == 1
    save(store, 3)  # the next successful save clears the dead staging directory
    assert not (tmp_path / "step_2.tmp").exists()
