"""The trainer role's engine: torchtitan model + FSDP2 + GRPO loss (see engine.py).

torchtitan is imported only by hpcrl.trainer.titan, lazily; importing this package is cheap.
The process entry point (`python -m hpcrl.trainer`) comes with the bus and the launcher.
"""

from hpcrl.trainer.batch import RolloutBatch, pad_rows
from hpcrl.trainer.engine import EngineOptions, StepMetrics, TrainerEngine
from hpcrl.trainer.weights import LocalShard

__all__ = ["EngineOptions", "LocalShard", "RolloutBatch", "StepMetrics", "TrainerEngine", "pad_rows"]
