"""Checkpoint directories that are complete or invisible.

    run_dir/checkpoints/step_40.tmp/   written by everyone (trainer ranks through DCP, the head's run state)
    run_dir/checkpoints/step_40/       after commit(): manifest written last, fsynced, renamed into place
    run_dir/checkpoints/step_40/MANIFEST.json   every file's size and sha256
    run_dir/checkpoints/corrupt/step_30/        a checkpoint that failed verification, set aside
    run_dir/checkpoints/corrupt/step_30/REASON.txt   which files were wrong, and when it was set aside

    store = CheckpointStore(run_dir / "checkpoints", keep_last=2)
    staging = store.staging(40)                 # fresh step_40.tmp
    ... write files under staging ...
    store.commit(40, meta={"weight_version": 40})
    found = store.latest()                      # newest checkpoint whose manifest checks out
    found.step, found.path, store.skipped       # skipped: [(path, why)] of corrupt or partial ones
    store.set_aside(store.skipped)              # move them to corrupt/ (the head does, on start)

A checkpoint without a manifest, or whose files do not match their manifest (truncated, missing,
altered), is reported by file name and skipped in favour of the next newest. Hashing can be shared
out: each writer may pass the entries of the files it wrote (`file_entries`), so a 70B checkpoint
is not hashed by one process.

Pruning (after each commit) keeps the newest `keep_last` checkpoints that verify and deletes only
checkpoints older than all of them; it never deletes one as new as the newest that verifies, nor
a verified one while keeping an unverified one. A checkpoint it finds unverifiable is moved to
corrupt/ with its reason rather than counted (a corrupt newer one used to push every new valid
checkpoint out as soon as it was written). Each checkpoint is hashed at most once per process:
the ones this store wrote or verified are remembered.

Replacing a step_N that exists (a run resumed from an earlier checkpoint reaches N again) is a
swap with no moment without a whole copy: the new one is complete in step_N.tmp, the old one is
renamed to step_N.old, the new one to step_N, then step_N.old is deleted. `latest` falls back to
step_N.old where step_N is missing or broken, and the next commit settles what a crash left.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from hpcrl.errors import HpcrlError
from hpcrl.fsio import fsync_path, write_atomic

MANIFEST = "MANIFEST.json"
FORMAT = 1
#: Where unverifiable checkpoints are moved (under the store's root), each with REASON_FILE.
CORRUPT_DIR = "corrupt"
REASON_FILE = "REASON.txt"
_STEP_RE = re.compile(r"^step_(\d+)$")
_OLD_RE = re.compile(r"^step_(\d+)\.old$")
_CHUNK = 8 << 20

log = logging.getLogger(__name__)


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


def verify_directory(path: Path, *, checksums: bool = True) -> list[str]:
    """Problems of the checkpoint directory `path`, each naming the file; [] when it is whole."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return [f"{manifest_path} is missing: the checkpoint was not finished"]
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        items = list(files.items())
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as err:
        return [f"{manifest_path} is unreadable ({err})"]
    problems = []
    for name, entry in items:
        file = path / name
        if not file.is_file():
            problems.append(f"{file} is missing")
        elif file.stat().st_size != entry["size"]:
            problems.append(f"{file} is truncated or altered: {file.stat().st_size} bytes, "
                            f"manifest says {entry['size']}")
        elif checksums and sha256_of(file) != entry["sha256"]:
            problems.append(f"{file} does not match its sha256 in the manifest")
    return problems


class CheckpointStore:
    def __init__(self, root: str | Path, *, keep_last: int) -> None:
        if keep_last < 1:
            raise CheckpointError(f"keep_last = {keep_last}: keep at least 1 checkpoint")
        self.root = Path(root)
        self.keep_last = keep_last
        self.skipped: list[tuple[Path, str]] = []
        # step_N directories known whole in this process (committed here, or checksummed by latest()),
        # so pruning hashes each checkpoint at most once.
        self._verified: set[int] = set()

    def path(self, step: int) -> Path:
        return self.root / f"step_{step}"

    def _old(self, step: int) -> Path:
        return self.root / f"step_{step}.old"

    def staging(self, step: int) -> Path:
        """An empty step_N.tmp directory (a leftover from a killed writer is removed)."""
        tmp = self.root / f"step_{step}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        return tmp

    def commit(self, step: int, *, meta: dict, entries: dict[str, dict] | None = None) -> Path:
        """Seal step_N.tmp: manifest last, fsync, rename into place as step_N, prune old ones.

        `entries` are file entries already computed by the writers; files they do not cover are
        hashed here. An existing step_N is swapped out (see the module docstring), never removed
        before the new one is in place.
        """
        tmp = self.root / f"step_{step}.tmp"
        if not tmp.is_dir():
            raise CheckpointError(f"{tmp} does not exist: call staging({step}) and write into it first")
        entries = dict(entries or {})
        missing = [p for p in sorted(tmp.rglob("*")) if p.is_file() and str(p.relative_to(tmp)) not in entries]
        entries.update(file_entries(tmp, missing))
        manifest = {"format": FORMAT, "step": step, "created": time.time(), "meta": meta, "files": entries}
        write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
        for directory in sorted({p.parent for p in tmp.rglob("*")} | {tmp}, key=lambda p: -len(p.parts)):
            fsync_path(directory)
        self._settle()
        final, old = self.path(step), self._old(step)
        if final.exists():  # a whole older copy of the same step: swap, never a moment without one
            os.replace(final, old)
            fsync_path(self.root)
        os.replace(tmp, final)
        fsync_path(self.root)
        self._verified.add(step)
        if old.exists():
            shutil.rmtree(old)
        self._prune(step)
        return final

    def _steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.root.iterdir() if (m := _STEP_RE.match(p.name)))

    def _old_steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.root.iterdir() if (m := _OLD_RE.match(p.name)))

    def verify(self, step: int, *, checksums: bool = True) -> list[str]:
        """Problems of checkpoint `step`, each naming the file; [] when it is whole."""
        return verify_directory(self.path(step), checksums=checksums)

    def latest(self, *, checksums: bool = True) -> FoundCheckpoint | None:
        """The newest checkpoint that verifies; corrupt or partial ones go to `self.skipped`.

        Reads only: a step_N.old left by a crash mid-swap stands in for its step_N where that is
        missing or broken."""
        self.skipped = []
        for step in sorted(set(self._steps()) | set(self._old_steps()), reverse=True):
            for path in (self.path(step), self._old(step)):
                if not path.is_dir():
                    continue
                problems = verify_directory(path, checksums=checksums)
                if problems:
                    self.skipped.append((path, "; ".join(problems)))
                    continue
                if checksums and path == self.path(step):
                    self._verified.add(step)
                manifest = json.loads((path / MANIFEST).read_text())
                return FoundCheckpoint(step=step, path=path, meta=manifest["meta"])
        return None

    def set_aside(self, unusable: Iterable[tuple[Path, str]]) -> list[Path]:
        """Move each (checkpoint directory, why) to corrupt/<name>, with the why in REASON.txt: it can
        never be resumed from, and left in place it would be looked at (and hashed) on every start.
        Kept, not deleted: it may be the only copy of a long run's progress, for a person to inspect
        or repair. Returns where each went."""
        moved = []
        for path, why in unusable:
            path = Path(path)
            if not path.is_dir():
                continue
            corrupt = self.root / CORRUPT_DIR
            corrupt.mkdir(exist_ok=True)
            name = path.name.removesuffix(".old")
            target, copy = corrupt / name, 1
            while target.exists():  # the same step set aside before
                copy += 1
                target = corrupt / f"{name}.{copy}"
            os.replace(path, target)
            write_atomic(target / REASON_FILE, f"set aside {time.strftime('%Y-%m-%d %H:%M:%S %Z')} from "
                                               f"{path}: it did not verify.\n{why}\n")
            fsync_path(corrupt)
            fsync_path(self.root)
            if _STEP_RE.match(path.name):
                self._verified.discard(int(path.name[5:]))
            log.warning(f"checkpoint {path} moved to {target}: {why}")
            moved.append(target)
        return moved

    def _settle(self) -> None:
        """Finish what a crash during a swap left: step_N.old goes back to step_N where that is
        missing or broken, and is deleted where step_N is whole."""
        for step in self._old_steps():
            final, old = self.path(step), self._old(step)
            if final.is_dir():
                problems = [] if step in self._verified else self.verify(step)
                if not problems:
                    self._verified.add(step)
                    shutil.rmtree(old)
                    continue
                self.set_aside([(final, "; ".join(problems))])
            os.replace(old, final)
            fsync_path(self.root)

    def _prune(self, committed: int) -> None:
        """Keep the newest keep_last verified checkpoints and everything at least as new as `committed`
        that verifies; set aside the unverifiable ones seen on the way; delete the rest (older)."""
        newest_verified = max(self._verified & set(self._steps()), default=committed)
        kept = 0
        for step in reversed(self._steps()):
            if kept >= self.keep_last and step < newest_verified:
                shutil.rmtree(self.path(step))  # older than keep_last verified ones
                continue
            problems = [] if step in self._verified else self.verify(step)
            if problems:
                self.set_aside([(self.path(step), "; ".join(problems))])
                continue
            self._verified.add(step)
            kept += 1
        for leftover in self.root.glob("step_*.tmp"):
            # Staging directories of steps older than the newest verified one are dead.
            number = int(leftover.name[5:-4])
            if number < newest_verified:
                shutil.rmtree(leftover)
