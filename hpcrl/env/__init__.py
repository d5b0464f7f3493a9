"""Multi-turn environments: what a rollout talks to between the policy's turns (issue 32).

The head drives episodes (hpcrl.rl.episodes) and never imports an environment; the environments run
in worker processes of the reward group's tasks (hpcrl.env.pool), reached over the bus.
"""
