"""The trainer role's engine: torchtitan model + FSDP2 + GRPO loss (see engine.py).

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

torchtitan is imported only by hpcrl.trainer.titan, lazily. The process entry point
(`python -m hpcrl.trainer`) comes with the bus and the launcher.
"""

from hpcrl.trainer.batch import RolloutBatch, pad_rows
from hpcrl.trainer.engine import EngineOptions, StepMetrics, TrainerEngine
from hpcrl.trainer.weights import LocalShard

__all__ = ["EngineOptions", "LocalShard", "RolloutBatch", "StepMetrics", "TrainerEngine", "pad_rows"]
