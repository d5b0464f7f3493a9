"""hpcrl.trainer.titan supplies what torchtitan 0.3.0 imports from torch and an older torch (2.11) lacks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: Run in a fresh interpreter: torchtitan must not have been imported yet, and the attribute removed
#: from torch must stay removed for no other test.
WITHOUT_THE_NAME = textwrap.dedent("""
    import importlib
    import sys

    import torch.distributed.fsdp as fsdp

    if hasattr(fsdp, "DataParallelMeshDims"):  # torch >= 2.13, or a stand-in a sitecustomize set
        del fsdp.DataParallelMeshDims  # as in torch 2.11
    assert not [m for m in sys.modules if m.startswith("torchtitan")]
    try:
        importlib.import_module("torchtitan.models.deepseek_v3.mtp")
    except ImportError as err:
        print("without hpcrl:", err)
    else:
        raise SystemExit("torchtitan imported without DataParallelMeshDims: this test checks nothing")

    from hpcrl.config.model_shapes import preset
    from hpcrl.trainer import titan

    model = titan.build_model(preset("tiny-llama"), max_seq_len=16)
    names = titan.hf_to_titan_names(preset("tiny-llama"))
    importlib.import_module("torchtitan.models.deepseek_v3.mtp")
    from torch.distributed.fsdp import DataParallelMeshDims

    print("with hpcrl:", DataParallelMeshDims(shard="fsdp"), len(names), type(model).__name__)
""")


@pytest.mark.timeout(120)
def test_on_a_torch_without_data_parallel_mesh_dims_the_model_builds_and_torchtitan_imports():
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)  # torchtitan may be there
    done = subprocess.run([sys.executable, "-c", WITHOUT_THE_NAME], capture_output=True, text=True, timeout=110,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": path})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("without hpcrl: cannot import name 'DataParallelMeshDims'"), lines
    assert lines[1].startswith("with hpcrl: DataParallelMeshDims(shard='fsdp', replicate=None)"), lines


def test_where_torch_has_data_parallel_mesh_dims_its_own_class_stays():
    import torch.distributed.fsdp as fsdp

    from hpcrl.trainer import titan

    try:
        from torch.distributed.fsdp._fully_shard import DataParallelMeshDims
    except ImportError:
        pytest.skip("this torch has no DataParallelMeshDims of its own (torch 2.11)")

    titan.supply_missing_torch_names()
    assert fsdp.DataParallelMeshDims is DataParallelMeshDims
