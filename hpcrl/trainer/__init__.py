"""The trainer role's engine: torchtitan model + FSDP2 + the configured algorithm's loss (see engine.py).

On every trainer rank, after torch.distributed is initialised (gloo on CPU, NCCL on GPUs):

    from hpcrl.config import load_config
    from hpcrl.trainer import TrainerEngine, pad_rows

    engine = TrainerEngine.from_config(load_config("configs/tiny_grpo.toml"))
    batch = pad_rows(sequences, prompt_lengths, vllm_logprobs, advantages)   # or RolloutBatch(...)
    mine = batch.shard(engine.rank, engine.world_size)                       # this rank's rows
    metrics = engine.train_step(mine)                                        # StepMetrics, same on all ranks
    logprobs = engine.logprobs(mine)                                         # [b, T]; compare with vLLM's
    for hf_name, (rows, global_shape, dim0_offset) in engine.local_shards().items():
        ...                                                                  # send to inference

    types.py    TrainBatch: what the head sends (plain lists; no torch)
    batch.py    RolloutBatch: the padded tensors a rank trains on; pack: its rows end to end (micro_batch_tokens)
    loss.py     token logprobs and entropy (the losses are in hpcrl.algorithms)
    engine.py   TrainerEngine; titan.py, parallel.py, weights.py, checkpoint.py, schedule.py beside it
    group.py    the trainer ranks' torch.distributed group (a group of one for a single rank)

torchtitan is imported only by hpcrl.trainer.titan, lazily. Names are re-exported lazily, so
that the head can import hpcrl.trainer.types without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EngineOptions": "hpcrl.trainer.engine", "StepMetrics": "hpcrl.trainer.engine",
    "TrainerEngine": "hpcrl.trainer.engine", "RolloutBatch": "hpcrl.trainer.batch",
    "pad_rows": "hpcrl.trainer.batch", "LocalShard": "hpcrl.trainer.weights", "TrainBatch": "hpcrl.trainer.types",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hpcrl.trainer' has no attribute {name!r}")
