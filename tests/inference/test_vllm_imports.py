"""vLLM has one adapter: the inference package (engine, client glue, worker extension) and the weight
transfer's vLLM side (its engine, its LoRA slots, and the NCCL wrapper it borrows). Nothing else in hpcrl
imports it."""

from __future__ import annotations

import ast
from pathlib import Path

HPCRL = Path(__file__).resolve().parents[2] / "hpcrl"
ALLOWED = {"inference/engine.py", "inference/vllm_llm.py", "inference/vllm_worker.py",
           "transfer/vllm_engine.py", "transfer/vllm_lora.py", "transfer/nccl.py"}


def vllm_importers() -> set[str]:
    found = set()
    for path in HPCRL.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            if any(name == "vllm" or name.startswith("vllm.") for name in names):
                found.add(path.relative_to(HPCRL).as_posix())
    return found


def test_only_the_inference_package_and_the_transfers_vllm_side_import_vllm():
    assert vllm_importers() == ALLOWED
