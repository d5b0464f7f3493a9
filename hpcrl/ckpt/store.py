"""Checkpoint directories that are complete or invisible.

    run_dir/checkpoints/step_40.tmp/   written by everyone (trainer ranks through DCP, the head's run state)
    run_dir/checkpoints/step_40/       after commit(): fsynced, renamed
    run_dir/checkpoints/step_40/MANIFEST.json   written last: every file's size and sha256

    store = CheckpointStore(run_dir / "checkpoints", keep_last=2)
    staging = store.staging(40)                 # fresh step_40.tmp
    ... write files under staging ...
    store.commit(40, meta={"weight_version": 40})
    found = store.latest()                      # newest checkpoint whose manifest checks out
    found.step, found.path, store.skipped       # skipped: [(path, why)] of corrupt or partial ones

A checkpoint without a manifest (killed mid-write, or mid-rename) is partial and never used; one
whose files do not match their manifest (truncated, missing, altered) is reported by file name and
skipped in favour of the next newest. Hashing can be shared out: each writer may pass the entries
of the files it wrote (`file_entries`), so a 70B checkpoint is not hashed by one process.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from hpcrl.errors import HpcrlError
from hpcrl.fsio import fsync_path, write_atomic

MANIFEST = "MANIFEST.json"
FORMAT = 1
_STEP_RE = re.compile(r"^step_(\d+)$")
_CHUNK = 8 << 20


class CheckpointError(HpcrlError):
    """A checkpoint cannot be written or used; the message names the file."""


@dataclass(frozen=True)
class FoundCheckpoint:
    step: int
    path: Path
    meta: dict


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def file_entries(root: Path, files: list[Path] | None = None) -> dict[str, dict]:
    """{relative path: {"size", "sha256"}} of `files` (default: every file) under `root`, each fsynced."""
    chosen = files if files is not None else [p for p in sorted(root.rglob("*")) if p.is_file()]
    entries = {}
    for path in chosen:
        fsync_path(path)
        entries[str(path.relative_to(root))] = {"size": path.stat().st_size, "sha256": sha256_of(path)}
    return entries


class CheckpointStore:
    def __init__(self, root: str | Path, *, keep_last: int) -> None:
        if keep_last < 1:
            raise CheckpointError(f"keep_last = {keep_last}: keep at least 1 checkpoint")
        self.root = Path(root)
        self.keep_last = keep_last
        self.skipped: list[tuple[Path, str]] = []

    def path(self, step: int) -> Path:
        return self.root / f"step_{step}"

    def staging(self, step: int) -> Path:
        """An empty step_N.tmp directory (a leftover from a killed writer is removed)."""
        tmp = self.root / f"step_{step}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        return tmp

    def commit(self, step: int, *, meta: dict, entries: dict[str, dict] | None = None) -> Path:
        """Seal step_N.tmp: fsync, rename to step_N, write the manifest last, prune old ones.

        `entries` are file entries already computed by the writers; files they do not cover are
        hashed here.
        """
        tmp = self.root / f"step_{step}.tmp"
        if not tmp.is_dir():
            raise CheckpointError(f"{tmp} does not exist: call staging({step}) and write into it first")
        entries = dict(entries or {})
        missing = [p for p in sorted(tmp.rglob("*")) if p.is_file() and str(p.relative_to(tmp)) not in entries]
        entries.update(file_entries(tmp, missing))
        for directory in sorted({p.parent for p in tmp.rglob("*")} | {tmp}, key=lambda p: -len(p.parts)):
            fsync_path(directory)
        final = self.path(step)
        if final.exists():  # a complete older copy of the same step: replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_path(self.root)
        manifest = {"format": FORMAT, "step": step, "created": time.time(), "meta": meta, "files": entries}
        write_atomic(final / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
        self._prune()
        return final

    def _steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.root.iterdir() if (m := _STEP_RE.match(p.name)))

    def verify(self, step: int, *, checksums: bool = True) -> list[str]:
        """Problems of checkpoint `step`, each naming the file; [] when it is whole."""
        path = self.path(step)
        manifest_path = path / MANIFEST
        if not manifest_path.is_file():
            return [f"{manifest_path} is missing: the checkpoint was not finished"]
        try:
            manifest = json.loads(manifest_path.read_text())
            files = manifest["files"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            return [f"{manifest_path} is unreadable ({err})"]
        problems = []
        for name, entry in files.items():
            file = path / name
            if not file.is_file():
                problems.append(f"{file} is missing")
            elif file.stat().st_size != entry["size"]:
                problems.append(f"{file} is truncated or altered: {file.stat().st_size} bytes, "
                                f"manifest says {entry['size']}")
            elif checksums and sha256_of(file) != entry["sha256"]:
                problems.append(f"{file} does not match its sha256 in the manifest")
        return problems

    def latest(self, *, checksums: bool = True) -> FoundCheckpoint | None:
        """The newest checkpoint that verifies; corrupt or partial ones go to `self.skipped`."""
        self.skipped = []
        for step in reversed(self._steps()):
            problems = self.verify(step, checksums=checksums)
            if problems:
                self.skipped.append((self.path(step), "; ".join(problems)))
                continue
            manifest = json.loads((self.path(step) / MANIFEST).read_text())
            return FoundCheckpoint(step=step, path=self.path(step), meta=manifest["meta"])
        return None

    def _prune(self) -> None:
        complete = [s for s in self._steps() if (self.path(s) / MANIFEST).is_file()]
        for step in complete[:-self.keep_last]:
            shutil.rmtree(self.path(step))
        for step in self._steps():
            # Unfinished (no manifest) and older than the newest complete one: never usable.
            if step not in complete and complete and step < complete[-1]:
                shutil.rmtree(self.path(step))
        for leftover in self.root.glob("step_*.tmp"):
            # Staging directories of steps older than the newest complete one are dead.
            number = int(leftover.name[5:-4])
            if complete and number < complete[-1]:
                shutil.rmtree(leftover)
