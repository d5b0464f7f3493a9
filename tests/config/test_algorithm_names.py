"""algorithm.name is checked against the registry of hpcrl.algorithms, whose defaults fill the unset keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcrl.algorithms.base import Options
from hpcrl.config import load_config
from hpcrl.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny_grpo.toml"


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


@pytest.mark.parametrize("name", ["ppo", "GRPO", ""])
def test_an_unknown_algorithm_is_a_config_error_listing_the_known_ones(name: str):
    with pytest.raises(ConfigError) as caught:
        load_config(TINY, overrides=[f"algorithm.name={name}"])
    message = str(caught.value)
    assert caught.value.key == "algorithm.name" and "--set" in message
    assert "grpo, dapo, gspo, dr_grpo" in message


def test_a_misspelt_algorithm_gets_a_did_you_mean(tmp_path: Path):
    config = tmp_path / "run.toml"
    config.write_text(TINY.read_text().replace("[algorithm]\n", '[algorithm]\nname = "dr_gpro"\n'))
    with pytest.raises(ConfigError, match="did you mean 'dr_grpo'") as caught:
        load_config(config)
    assert caught.value.file == str(config) and caught.value.line is not None


def test_the_schema_checks_the_name_when_built_directly():
    with pytest.raises(ConfigError, match="unknown algorithm 'ppo'"):
        Options(name="ppo")


def test_an_algorithms_defaults_fill_only_the_keys_the_config_leaves_unset():
    dapo = load_config(TINY, overrides=["algorithm.name=dapo", "algorithm.max_sampling_rounds=2"]).algorithm
    assert dapo.dynamic_sampling and dapo.overlong_buffer_fraction == 0.2    # DAPO's defaults
    assert dapo.max_sampling_rounds == 2                                        # --set wins over DAPO's 4
    gspo = load_config(TINY, overrides=["algorithm.name=gspo"]).algorithm
    assert gspo.loss_aggregation == "seq_mean_token_mean"                       # GSPO's default
    assert (gspo.clip_eps_low, gspo.clip_eps_high) == (0.2, 0.28)              # tiny_grpo.toml sets both
    grpo = load_config(TINY).algorithm
    assert grpo.name == "grpo" and not hasattr(grpo, "dynamic_sampling") and grpo.advantage_norm == "mean_std"


def test_dynamic_sampling_without_filtering_is_a_config_error():
    with pytest.raises(ConfigError, match="filter_zero_variance = true"):
        load_config(TINY, overrides=["algorithm.name=dapo", "algorithm.filter_zero_variance=false"])


def test_a_key_of_another_algorithm_is_refused_naming_the_algorithm_that_declares_it():
    with pytest.raises(ConfigError) as caught:
        load_config(TINY, overrides=["algorithm.dynamic_sampling=true"])
    assert caught.value.key == "algorithm.dynamic_sampling"
    assert "unknown key 'dynamic_sampling' in [algorithm] (an option of dapo" in caught.value.problem
    assert 'set name = "dapo"' in caught.value.problem and "group_size" in caught.value.fix   # the valid keys


def test_an_option_out_of_its_declared_bounds_names_the_bounds_and_the_fix():
    with pytest.raises(ConfigError) as caught:
        load_config(TINY, overrides=["algorithm.name=dapo", "algorithm.overlong_buffer_fraction=1.5"])
    assert caught.value.key == "algorithm.overlong_buffer_fraction" and caught.value.file == "--set"
    assert caught.value.problem == "must be in [0, 1), got 1.5"
    assert caught.value.fix == "set overlong_buffer_fraction = 0.2"
    with pytest.raises(ConfigError, match="did you mean 'clip_eps_high'"):
        load_config(TINY, overrides=["algorithm.clip_eps_hi=0.3"])
