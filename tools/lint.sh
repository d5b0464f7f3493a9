#!/usr/bin/env bash
# Lint and type-check, as CI does (tools/test.sh runs ruff before pytest, mypy beside it). Rules: pyproject.toml.
#
#   tools/lint.sh                          # ruff over hpcrl, tests, tools; mypy over hpcrl
#   tools/lint.sh ruff                     # one of the two (tools/test.sh runs ruff, then mypy beside pytest)
#   .venv/bin/ruff check --fix PATH...     # fix what ruff can by itself (import order, upgrades)
#
# Runs both checks whatever the first finds; exits 1 if either reported an error. Uses the tools
# in .venv (tools/setup_env.sh installs them with the `test` extra). mypy's first run takes about
# a minute (it reads torch and vLLM); later runs reuse .mypy_cache and take seconds.
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"

tools=("$@")
((${#tools[@]})) || tools=(ruff mypy)
for tool in "${tools[@]}"; do
    [[ $tool == ruff || $tool == mypy ]] || { echo "lint: unknown check '$tool': ruff or mypy" >&2; exit 2; }
    [[ -x .venv/bin/$tool ]] || { echo "lint: .venv/bin/$tool is missing: run tools/setup_env.sh" >&2; exit 1; }
done
failed=0
for tool in "${tools[@]}"; do
    case $tool in
        ruff) .venv/bin/ruff check hpcrl tests tools || failed=1 ;;
        mypy) .venv/bin/mypy hpcrl || failed=1 ;;
    esac
done
if ((failed)); then
    echo "lint: errors above (rules in pyproject.toml; a deliberate exception takes '# noqa: CODE - why')" >&2
fi
exit "$failed"
