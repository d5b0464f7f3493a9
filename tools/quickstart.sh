#!/usr/bin/env bash
# The README's first command: set up .venv, make the tiny model, train the embedded default.
#
#   tools/quickstart.sh            # under a minute on a 2-core CPU once set up (setting up: a few minutes)
#
# Runs configs/tiny_grpo.toml with `hpcrl run` (every group in this one process: the trainer
# engine, a vLLM engine, the reward pool, real weight transfer), shows a progress line per step (on
# a terminal it rewrites itself, one kept every 20 steps) and the reward curve, and draws it to
# RUN_DIR/metrics.png. The terminal shows hpcrl's lines only; the full log (vLLM's, other libraries'
# warnings, what any process wrote to its stderr) is RUN_DIR/logs/run/rank0.log. Each call trains
# a fresh run directory. Under 60 lines on a terminal.
# The same run as a job: `hpcrl submit configs/tiny_grpo.toml --wait` (local processes without
# Slurm, or `--cluster local` on tools/local_slurm.sh).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
tools/setup_env.sh
.venv/bin/python tools/make_tiny_model.py
RUN_DIR=runs/tiny-grpo-$(date +%Y%m%d-%H%M%S)
.venv/bin/hpcrl run configs/tiny_grpo.toml --set run.run_dir="$RUN_DIR"
.venv/bin/python tools/plot_metrics.py "$RUN_DIR"
