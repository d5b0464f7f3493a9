"""Prompt sources: JSONL and Parquet files, `datasets` directories (sources.py), small generated
tasks ("builtin:NAME", builtin.py), the run's seeded prompt stream with its held-out evaluation
prompts (prompts.py), prompt lengths in the model's tokens (tokens.py), and the chat format: prompts
rendered with the model's chat template into the token ids vLLM and the trainer see (chat.py)."""

from hpcrl.data.builtin import BUILTIN_TASKS, builtin_task

__all__ = ["BUILTIN_TASKS", "builtin_task"]
