#!/usr/bin/env bash
# The README's first command: set up .venv, make the tiny model, run the embedded default.
#
#   tools/quickstart.sh
#
# Until the GRPO loop lands (issue 6), the embedded default prints its resource plan.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
tools/setup_env.sh
.venv/bin/python tools/make_tiny_model.py
.venv/bin/hpcrl plan configs/tiny_grpo.toml
