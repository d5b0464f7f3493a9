"""inference.weight_transport: "auto" resolved in one place (Config.weight_transport), NCCL refused on CPU groups."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from hpcrl.config import load_config
from hpcrl.config.dump import dump_toml
from hpcrl.config.schema import Config, DataConfig, InferenceConfig, ModelConfig, RunConfig, TrainerConfig
from hpcrl.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]

CONFIG = """\
[run]
name = "w"

[model]
preset = "qwen2.5-7b"

[trainer]
nodes = 1
gpus_per_node = 8
global_batch_size = 64

[inference]
replicas = 4
tensor_parallel = 2
gpus_per_node = 8

[data]
source = "builtin:arithmetic"
"""


def config_with(trainer_gpus: int, inference_gpus: int, written: str | None) -> Config:
    inference = {"gpus_per_node": inference_gpus} | ({"weight_transport": written} if written else {})
    return Config(run=RunConfig(name="w"), model=ModelConfig(preset="qwen2.5-7b"),
                  data=DataConfig(source="builtin:arithmetic"), trainer=TrainerConfig(gpus_per_node=trainer_gpus),
                  inference=InferenceConfig(**inference))


def load(tmp_path: Path, *overrides: str) -> Config:
    path = tmp_path / "w.toml"
    path.write_text(CONFIG)
    return load_config(path, overrides=list(overrides))


# (trainer GPUs per node, inference GPUs per node, inference.weight_transport as written (None: unset), resolved)
RESOLUTIONS = [
    (8, 8, None, "nccl"),
    (8, 8, "auto", "nccl"),
    (8, 0, None, "gloo"),
    (0, 8, None, "gloo"),
    (0, 0, None, "gloo"),
    (8, 8, "gloo", "gloo"),
    (8, 8, "ucx", "ucx"),
    (0, 0, "ucx", "ucx"),
    (8, 8, "nccl", "nccl"),
]


@pytest.mark.parametrize("trainer_gpus, inference_gpus, written, resolved", RESOLUTIONS)
def test_auto_is_nccl_when_trainer_and_inference_have_gpus_else_gloo_and_a_written_choice_is_kept(
        trainer_gpus, inference_gpus, written, resolved):
    assert config_with(trainer_gpus, inference_gpus, written).weight_transport == resolved


def test_the_default_is_auto_and_a_loaded_gpu_config_resolves_it_to_nccl(tmp_path: Path):
    config = load(tmp_path)
    assert config.inference.weight_transport == "auto"
    assert config.weight_transport == "nccl"
    assert load(tmp_path, "trainer.gpus_per_node=0", "trainer.ranks_per_node=1", "trainer.global_batch_size=8",
                "inference.gpus_per_node=0").weight_transport == "gloo"


def test_the_run_directory_copy_keeps_auto_so_the_job_resolves_it_the_same_way(tmp_path: Path):
    config = load(tmp_path)
    copy = tmp_path / "config.toml"
    copy.write_text(dump_toml(config))
    again = load_config(copy)
    assert again == config and again.inference.weight_transport == "auto" and again.weight_transport == "nccl"


def test_explicit_gloo_on_gpu_groups_is_allowed(tmp_path: Path):
    config = load(tmp_path, 'inference.weight_transport="gloo"')
    assert config.inference.weight_transport == "gloo" and config.weight_transport == "gloo"


@pytest.mark.parametrize("overrides, cpu_keys", [
    (["inference.gpus_per_node=0", "inference.tensor_parallel=1"], ["inference.gpus_per_node = 0"]),
    (["trainer.gpus_per_node=0", "trainer.ranks_per_node=1", "trainer.global_batch_size=8"],
     ["trainer.gpus_per_node = 0"]),
])
def test_nccl_with_a_cpu_group_is_a_config_error_naming_the_key_and_the_fix(tmp_path: Path, overrides, cpu_keys):
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, 'inference.weight_transport="nccl"', *overrides)
    err = caught.value
    assert err.key == "inference.weight_transport", str(err)
    assert '"nccl" sends from GPU to GPU' in err.problem
    for key in cpu_keys:
        assert key in err.problem
    assert 'weight_transport = "gloo"' in err.fix and '"auto"' in err.fix


def _reads_of_the_written_transport(path: Path) -> list[int]:
    """Lines of `path` that read `<x>.inference.weight_transport` (the value as written, "auto" unresolved)."""
    return [node.lineno for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and node.attr == "weight_transport"
            and isinstance(node.value, ast.Attribute) and node.value.attr == "inference"]


def test_only_the_config_package_reads_the_unresolved_weight_transport():
    readers = {str(p.relative_to(REPO)): lines for p in sorted((REPO / "hpcrl").rglob("*.py"))
               if (lines := _reads_of_the_written_transport(p))}
    assert set(readers) == {"hpcrl/config/schema.py", "hpcrl/config/checks.py"}, readers


@pytest.mark.parametrize("written, used", [("auto", "gloo"), ("gloo", "gloo"), ("ucx", "ucx")])
def test_hpcrl_run_on_one_gpu_uses_gloo_for_auto_and_keeps_a_written_host_transport(written, used):
    assert config_with(8, 8, written).one_process_weight_transport() == used


def test_hpcrl_run_refuses_a_written_nccl_because_its_two_ranks_would_share_one_gpu():
    with pytest.raises(ConfigError, match="NCCL cannot join two ranks on one GPU"):
        config_with(8, 8, "nccl").one_process_weight_transport()
