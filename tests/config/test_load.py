"""Loading configs: every shipped file, merge order, overrides, paths, line lookup."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hpcrl.config import load_config
from hpcrl.config.load import find_line, parse_override
from hpcrl.config.model_shapes import PRESETS, from_hf_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.toml"))
EXAMPLES = sorted((REPO / "examples").glob("*/*.toml"))
PROFILES = sorted((REPO / "launch").glob("*.toml"))


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def test_the_shipped_configs_and_profiles_are_there():
    assert {p.name for p in CONFIGS} >= {"tiny_grpo.toml", "llama70b_grpo.toml", "llama8b_grpo.toml",
                                          "qwen2.5-7b_grpo.toml"}
    assert {p.name for p in PROFILES} >= {"local.toml", "generic.toml"}


@pytest.mark.parametrize("path", CONFIGS + EXAMPLES, ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path):
    config = load_config(path)
    assert config.run.name


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
def test_every_cluster_profile_loads_under_a_config_that_suits_it(profile: Path):
    # A CPU-only profile carries the CPU config, an 8-GPU one the 70B config, a smaller one the 8B config's
    # shape scaled to 4-GPU nodes (as tests/slurm/test_gpu_placement.py submits it).
    text = profile.read_text()
    if "gpus_per_node = 0" in text:
        experiment, overrides = "tiny_grpo.toml", []
    elif "gpus_per_node = 8" in text:
        experiment, overrides = "llama70b_grpo.toml", []
    else:
        experiment = "llama8b_grpo.toml"
        overrides = ["trainer.nodes=2", "trainer.gpus_per_node=4", "trainer.global_batch_size=64",
                     "inference.replicas=2", "inference.gpus_per_node=4"]
    config = load_config(REPO / "configs" / experiment, cluster=profile.stem, overrides=overrides)
    assert config.cluster.name == profile.stem


def test_the_experiment_wins_over_the_profile_and_set_wins_over_both(tmp_path: Path):
    profile = tmp_path / "prof.toml"
    profile.write_text('[cluster]\nname = "prof"\npartition = "p1"\n[trainer]\nlr = 0.5\nsteps = 7\n')
    config = load_config(REPO / "configs" / "tiny_grpo.toml", cluster=str(profile),
                         overrides=["trainer.steps=9", "run.name=renamed", "cluster.partition=p2"])
    assert config.trainer.lr == 1e-3            # the experiment's, not the profile's 0.5
    assert config.trainer.steps == 9            # --set over the experiment's 40
    assert config.run.name == "renamed"         # a bare word is taken as a string
    assert config.cluster.partition == "p2"
    assert config.cluster.name == "prof"        # only in the profile


def test_run_cluster_in_the_file_selects_the_profile(tmp_path: Path):
    text = (REPO / "configs" / "tiny_grpo.toml").read_text().replace('seed = 0', 'seed = 0\ncluster = "local"')
    path = tmp_path / "x.toml"
    path.write_text(text)
    assert load_config(path).cluster.name == "local"


def test_relative_paths_become_absolute_against_the_current_directory():
    config = load_config(REPO / "configs" / "tiny_grpo.toml", cluster="local")
    assert config.model.path == str(REPO / "models" / "tiny-llama")
    assert config.cluster.slurm_conf == str(REPO / ".local_slurm" / "slurm.conf")
    assert config.run_dir == "runs/tiny-grpo"


def test_configs_are_frozen():
    config = load_config(REPO / "configs" / "tiny_grpo.toml")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.trainer.lr = 1.0  # type: ignore[misc]


def test_find_line_finds_keys_in_tables_dotted_keys_and_falls_back_to_the_header():
    text = '[run]\nname = "x"\n\n[groups.trainer]\n# comment\ntime = "1:00"\n[cluster]\nenv.A = "1"\n'
    assert find_line(text, "run.name") == 2
    assert find_line(text, "groups.trainer.time") == 6
    assert find_line(text, "groups.trainer.mem") == 4
    assert find_line(text, "cluster.env.A") == 8
    assert find_line(text, "nowhere.at.all") is None


def test_overrides_parse_toml_values_and_fall_back_to_strings():
    assert parse_override("trainer.lr=1e-5") == (["trainer", "lr"], 1e-5)
    assert parse_override("trainer.betas=[0.9, 0.95]") == (["trainer", "betas"], [0.9, 0.95])
    assert parse_override("run.name=my-run") == (["run", "name"], "my-run")
    assert parse_override('run.name="7"') == (["run", "name"], "7")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip_through_a_hugging_face_config(name: str):
    shape = PRESETS[name]
    assert from_hf_config(shape.to_hf_config()) == shape
