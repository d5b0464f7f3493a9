#!/usr/bin/env bash
# The README's second command: set up .venv, start the local Slurm cluster, run the tests.
#
#   tools/test.sh                 # everything
#   tools/test.sh tests/config    # any pytest arguments
#
# Fails on a lint or type error (tools/lint.sh, run first), when a test fails or when no test ran
# (pytest's exit code 5). Under CI (CI=true) a Slurm cluster that cannot start is an error, not a skip.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
tools/setup_env.sh
# Lint and type-check first: an error fails the run like a failing test (tools/lint.sh says which).
tools/lint.sh

if [[ ${CI:-} == true ]]; then
    export HPCRL_REQUIRE_SLURM=1
fi
if slurm_env=$(tools/local_slurm.sh up); then
    eval "$slurm_env"
else
    echo "test.sh: the local Slurm cluster did not start; tests marked slurm will be skipped" >&2
fi

exec .venv/bin/python -m pytest "$@"
