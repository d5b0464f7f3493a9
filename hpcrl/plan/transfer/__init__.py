"""The weight-transfer plan: layouts (layout.py, names.py), the planner (planner.py) and its plan
(plan.py), the checker (check.py), the round schedule (rounds.py), predicted sync times (speed.py)
and the vLLM engines modelled for comparison (baselines.py). Pure; no I/O."""
