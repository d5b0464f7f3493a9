"""Checkpoints: complete-or-invisible directories with a manifest written last."""

from hpcrl.ckpt.store import (
    CORRUPT_DIR,
    REASON_FILE,
    CheckpointError,
    CheckpointStore,
    FoundCheckpoint,
    file_entries,
    write_atomic,
)

__all__ = ["CORRUPT_DIR", "REASON_FILE", "CheckpointError", "CheckpointStore", "FoundCheckpoint", "file_entries",
           "write_atomic"]
