"""Prompt sources: JSONL files, and small generated tasks ("builtin:NAME") for tests and demos."""

from hpcrl.data.builtin import BUILTIN_TASKS, builtin_task

__all__ = ["BUILTIN_TASKS", "builtin_task"]
