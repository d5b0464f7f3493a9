"""Checkpoints: complete-or-invisible directories with a manifest written last."""

from hpcrl.ckpt.store import CheckpointError, CheckpointStore, FoundCheckpoint, file_entries, write_atomic

__all__ = ["CheckpointError", "CheckpointStore", "FoundCheckpoint", "file_entries", "write_atomic"]
