"""The head controller: the RL loop, GRPO maths, advantages, replay buffer, staleness bound, metrics."""
