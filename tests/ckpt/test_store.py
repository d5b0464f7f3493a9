"""Checkpoints are complete or invisible; corrupt ones are named and skipped."""

from __future__ import annotations

import json
import os
import shutil
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


# -- unverifiable checkpoints and pruning ----------------------------------------------------------
def corrupt(path: Path) -> None:
    """Damage a checkpoint the way a bad disk or a copy cut short would: its shard loses bytes."""
    shard = path / "trainer" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:10])


def test_a_new_checkpoint_survives_pruning_when_every_newer_one_is_corrupt(tmp_path: Path):
    """The issue's repro: commit 10 and 20, corrupt both, reopen, commit 5. Counting every checkpoint
    with a manifest as complete deleted step_5 as soon as it was written, and a requeued run looped."""
    store = CheckpointStore(tmp_path, keep_last=2)
    save(store, 10)
    save(store, 20)
    corrupt(tmp_path / "step_10")
    corrupt(tmp_path / "step_20")
    reopened = CheckpointStore(tmp_path, keep_last=2)
    save(reopened, 5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corrupt", "step_5"]
    assert sorted(p.name for p in (tmp_path / "corrupt").iterdir()) == ["step_10", "step_20"]
    reason = (tmp_path / "corrupt" / "step_20" / "REASON.txt").read_text()
    assert str(tmp_path / "step_20" / "trainer" / "__0_0.distcp") in reason and "truncated" in reason
    assert CheckpointStore(tmp_path, keep_last=2).latest().step == 5


def test_pruning_keeps_keep_last_verified_checkpoints_rather_than_a_corrupt_newer_one(tmp_path: Path):
    store = CheckpointStore(tmp_path, keep_last=3)
    for step in (10, 20, 30):
        save(store, step)
    corrupt(tmp_path / "step_30")
    reopened = CheckpointStore(tmp_path, keep_last=3)
    assert reopened.latest().step == 20  # the run resumes from 20 and writes 21
    save(reopened, 21)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_10", "step_20", "step_21"]
    assert (tmp_path / "corrupt" / "step_30" / "REASON.txt").is_file()


def test_set_aside_moves_skipped_checkpoints_to_corrupt_with_the_reason_and_never_overwrites(tmp_path: Path):
    store = CheckpointStore(tmp_path, keep_last=2)
    for _ in range(2):  # the same step corrupt twice (a run that started over, then broke again)
        save(store, 10)
        corrupt(tmp_path / "step_10")
        assert store.latest() is None
        store.set_aside(store.skipped)
    assert sorted(p.name for p in (tmp_path / "corrupt").iterdir()) == ["step_10", "step_10.2"]
    assert "truncated" in (tmp_path / "corrupt" / "step_10.2" / "REASON.txt").read_text()
    assert store.latest() is None and store.skipped == []


class SimulatedCrash(Exception):
    """The process died here."""


def crash_at(monkeypatch, when: int | str) -> list[str]:
    """Make a rename or tree removal raise SimulatedCrash before it runs: the `when`-th such call
    (1-based), or the first one named `when` ("rmtree(step_20.old)"). These are the steps of a commit
    that change what is on disk under a name. Returns the calls made, named so."""
    seen: list[str] = []
    real_replace, real_rmtree = os.replace, shutil.rmtree

    def wrap(name, real):
        def fake(*args, **kwargs):
            seen.append(f"{name}({', '.join(Path(a).name for a in args[:2])})")
            if when in (len(seen), seen[-1]):
                raise SimulatedCrash(seen[-1])
            return real(*args, **kwargs)
        return fake
    monkeypatch.setattr(os, "replace", wrap("replace", real_replace))
    monkeypatch.setattr(shutil, "rmtree", wrap("rmtree", real_rmtree))
    return seen


def test_replacing_a_step_leaves_one_whole_copy_whatever_call_the_writer_dies_at(tmp_path: Path, monkeypatch):
    """A run resumed from step 10 reaches step 20 again and replaces it. Removing the old step_20 before
    renaming the new one left a moment with neither: a crash there lost both."""
    crash_points = 0
    while True:
        crash_points += 1
        root = tmp_path / f"crash{crash_points}"
        store = CheckpointStore(root, keep_last=2)
        save(store, 10)
        save(store, 20, payload=b"old" * 30)
        seen = crash_at(monkeypatch, crash_points)
        try:
            save(store, 20, payload=b"new" * 30)
            crashed = False
        except SimulatedCrash:
            crashed = True
        finally:
            monkeypatch.undo()
        reopened = CheckpointStore(root, keep_last=2)
        found = reopened.latest()
        assert found is not None and found.step == 20, f"a crash at {seen[-1]} left no whole step_20: {seen}"
        assert (found.path / "trainer" / "__0_0.distcp").read_bytes() in (b"old" * 30, b"new" * 30)
        save(reopened, 21)  # the next commit settles what the crash left
        assert sorted(p.name for p in root.iterdir()) == ["step_20", "step_21"]
        assert reopened.verify(20) == []
        if not crashed:
            break
    # the manifest's rename, step_20 -> .old, .tmp -> step_20, the old copy's removal: each a crash point
    assert [c for c in seen if "step_20" in c] == ["replace(step_20, step_20.old)", "replace(step_20.tmp, step_20)",
                                                    "rmtree(step_20.old)"], seen
    assert crash_points == len(seen) + 1 >= 4, seen


def test_a_broken_step_after_a_swap_cut_short_falls_back_to_the_old_copy(tmp_path: Path, monkeypatch):
    store = CheckpointStore(tmp_path, keep_last=2)
    save(store, 20, payload=b"old" * 30)
    crash_at(monkeypatch, "rmtree(step_20.old)")  # dies before removing the old copy: both on disk
    with pytest.raises(SimulatedCrash):
        save(store, 20, payload=b"new" * 30)
    monkeypatch.undo()
    corrupt(tmp_path / "step_20")
    reopened = CheckpointStore(tmp_path, keep_last=2)
    found = reopened.latest()
    assert found.path == tmp_path / "step_20.old"
    assert (found.path / "trainer" / "__0_0.distcp").read_bytes() == b"old" * 30
    save(reopened, 21)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_20", "step_21"]
    assert (tmp_path / "step_20" / "trainer" / "__0_0.distcp").read_bytes() == b"old" * 30
    assert (tmp_path / "corrupt" / "step_20" / "REASON.txt").is_file()
