"""The head controller: the RL loop, advantages, replay buffer, staleness bound, metrics."""
