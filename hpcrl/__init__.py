"""hpcrl: Slurm-native RL post-training of large language models.

One TOML file describes a run; `hpcrl submit CONFIG` turns it into one Slurm heterogeneous
job (head, trainer, inference and reward components). See README.md and docs/ARCHITECTURE.md.

Importing this package is cheap on purpose: vendor libraries (torch, vllm, torchtitan, zmq)
are imported lazily by the one adapter module that needs each.
"""

__version__ = "0.1.0"
