"""The reward group: reward functions run in a worker pool, or a reward model."""
