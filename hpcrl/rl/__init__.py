"""The head controller: the RL loop, rollouts and their scoring, replay buffer, staleness bound, metrics
(the advantages and losses are the algorithm's: hpcrl.algorithms)."""
