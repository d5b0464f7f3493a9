"""`hpcrl export` of a LoRA run: a PEFT directory peft loads to the trainer's logits, a merged HF checkpoint
transformers loads to the adapter's, lora.init_from reading it back, and clear errors for bad input."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from trainer_workers import toy_batch

from hpcrl.cli.main import main
from hpcrl.config import load_config
from hpcrl.config.dump import dump_toml
from hpcrl.errors import ConfigError
from hpcrl.rundir import CONFIG_FILE
from hpcrl.trainer import TrainerEngine

REPO = Path(__file__).resolve().parents[2]
TOKENS = torch.tensor([[1, 40, 41, 42, 43, 44, 9, 17], [1, 60, 61, 62, 3, 5, 7, 11]])


def _config(run_dir: Path, *overrides: str):
    return load_config(REPO / "configs" / "tiny_lora_grpo.toml",
                       overrides=[f"run.run_dir={run_dir}", f"model.path={REPO / 'models' / 'tiny-llama'}", *overrides])


@pytest.fixture(scope="module")
def lora_run(tiny_model, tmp_path_factory):
    """A LoRA run directory whose step-2 checkpoint holds trained adapters; the trainer's logits of TOKENS."""
    from hpcrl.rl.checkpointing import TRAINER_DIR, store_for

    run_dir = tmp_path_factory.mktemp("lora-run")
    config = _config(run_dir)
    (run_dir / CONFIG_FILE).write_text(dump_toml(config))
    engine = TrainerEngine.from_config(config, device="cpu", max_seq_len=64)
    for _ in range(2):
        engine.train_step(toy_batch())
    store = store_for(config)
    engine.save_checkpoint(store.staging(2) / TRAINER_DIR)
    store.commit(2, meta={"step": 2})
    with torch.no_grad():
        logits = engine.model(TOKENS)
    return run_dir, logits, engine.adapter_state_dict()


def _transformers_logits(model_dir: Path, adapter: Path | None = None) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        return model.eval()(TOKENS).logits


@pytest.mark.timeout(120)
def test_the_exported_adapter_loads_in_peft_to_the_trainers_logits_and_merged_to_the_adapters(
        lora_run, tiny_model, tmp_path, capsys):
    run_dir, trainer_logits, _ = lora_run
    assert main(["export", str(run_dir)]) == 0
    adapter = run_dir / "export" / "step_2" / "adapter"
    assert str(adapter) in capsys.readouterr().out
    peft_logits = _transformers_logits(tiny_model, adapter)
    base_logits = _transformers_logits(tiny_model)
    assert (peft_logits - base_logits).abs().max() > 1e-3  # the adapter changes the model
    assert (peft_logits - trainer_logits).abs().max() < 1e-6

    assert main(["export", str(run_dir), "--step", "2", "--merged", "--out", str(tmp_path / "merged")]) == 0
    assert (tmp_path / "merged" / "config.json").is_file() and (tmp_path / "merged" / "tokenizer.json").is_file()
    assert (_transformers_logits(tmp_path / "merged") - peft_logits).abs().max() < 1e-5


@pytest.mark.timeout(120)
def test_init_from_reads_the_exported_adapter_and_refuses_one_of_another_rank_or_targets(lora_run, tmp_path):
    run_dir, _, trained = lora_run
    out = tmp_path / "adapter"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    config = _config(tmp_path / "run", f"lora.init_from={out}")
    engine = TrainerEngine.from_config(config, device="cpu", max_seq_len=64)
    assert all(torch.equal(tensor, trained[name]) for name, tensor in engine.adapter_state_dict().items())
    with pytest.raises(ConfigError, match="lora.rank.*r = 16"):
        _config(tmp_path / "run", f"lora.init_from={out}", "lora.rank=8")
    with pytest.raises(ConfigError, match="lora.targets.*q_proj"):
        _config(tmp_path / "run", f"lora.init_from={out}", "lora.targets=[\"q_proj\"]")
    with pytest.raises(ConfigError, match="lora.init_from.*adapter_config.json"):
        _config(tmp_path / "run", f"lora.init_from={tmp_path}")


@pytest.mark.timeout(60)
def test_export_of_a_missing_run_a_run_without_checkpoint_or_without_lora_says_what_is_wrong(
        lora_run, tmp_path, capsys):
    def error(*argv: str) -> str:
        assert main(["export", *argv]) == 2
        return capsys.readouterr().err

    assert "is not a run directory" in error(str(tmp_path / "nowhere"))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / CONFIG_FILE).write_text(dump_toml(_config(empty)))
    assert "has no complete checkpoint" in error(str(empty))
    assert "no complete checkpoint of step 7" in error(str(lora_run[0]), "--step", "7")
    full = tmp_path / "full"
    full.mkdir()
    (full / CONFIG_FILE).write_text(dump_toml(dataclasses.replace(_config(full), lora=None)))
    assert "run without LoRA" in error(str(full))
