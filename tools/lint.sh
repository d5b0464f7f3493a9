#!/usr/bin/env bash
# Lint and type-check, as CI does (tools/test.sh runs this before pytest). Rules: pyproject.toml.
#
#   tools/lint.sh                          # ruff over hpcrl, tests, tools; mypy over hpcrl
#   .venv/bin/ruff check --fix PATH...     # fix what ruff can by itself (import order, upgrades)
#
# Runs both checks whatever the first finds; exits 1 if either reported an error. Uses the tools
# in .venv (tools/setup_env.sh installs them with the `test` extra). mypy's first run takes about
# a minute (it reads torch and vLLM); later runs reuse .mypy_cache and take seconds.
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"

for tool in ruff mypy; do
    [[ -x .venv/bin/$tool ]] || { echo "lint: .venv/bin/$tool is missing: run tools/setup_env.sh" >&2; exit 1; }
done
failed=0
.venv/bin/ruff check hpcrl tests tools || failed=1
.venv/bin/mypy hpcrl || failed=1
if ((failed)); then
    echo "lint: errors above (rules in pyproject.toml; a deliberate exception takes '# noqa: CODE - why')" >&2
fi
exit "$failed"
