"""algorithm.name = "module:NAME": an algorithm from outside hpcrl, with options of its own, through the
config, the head's selection and the trainer's loss; and the errors of a name that loads nothing."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from hpcrl.algorithms import load_algorithm
from hpcrl.algorithms.base import Rollout, options_of
from hpcrl.algorithms.terms import Normaliser
from hpcrl.config import load_config
from hpcrl.config.dump import dump_toml
from hpcrl.errors import ConfigError
from hpcrl.rl.buffer import ScoredGroup
from hpcrl.rl.rollouts import batch_from_groups

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny_grpo.toml"
NAME = "external_algorithm:ALGORITHM"   # tests/algorithms is on sys.path (pytest's rootdir insertion)


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def test_an_external_algorithm_is_configured_selects_and_trains_through_its_own_options(tmp_path: Path):
    config = load_config(TINY, overrides=[f"algorithm.name={NAME}", "algorithm.baseline=0.25"])
    options = config.algorithm
    assert type(options).__name__ == "BaselineOptions" and options.baseline == 0.25
    assert options.clip_eps_high == 0.28             # tiny_grpo.toml's key wins over the algorithm's default 0.3
    assert load_config(TINY, overrides=[f"algorithm.name={NAME}"]).algorithm.baseline == 0.5   # its own default
    # The resolved config (the run directory's copy) loads back equal, the external options included.
    copy = tmp_path / "config.toml"
    copy.write_text(dump_toml(config))
    assert load_config(copy) == config

    algorithm = load_algorithm(options.name)
    settings = options_of(config)
    assert settings.max_tokens == config.inference.max_tokens
    rollouts = [Rollout.single_turn([1, 5], [7], [-0.5], reward=r) for r in (1.0, 0.0)]
    groups = [ScoredGroup(prompt_id="p", rollouts=rollouts, weight_version=0, batch=0)]
    selection = algorithm.select([g.rollouts for g in groups], settings, wanted=1)
    assert selection.advantages == [[0.75, -0.25]]
    batch = batch_from_groups(groups, selection)
    logp = torch.full((2, 3), -0.5, requires_grad=True)
    share = algorithm.loss(logprobs=logp, old_logprobs=torch.full((2, 3), -0.5), advantages=torch.tensor([0.75, -0.25]),
                           mask=torch.tensor([[0, 0, 1], [0, 0, 1]], dtype=torch.bool), settings=settings,
                           norm=Normaliser(tokens=2, sequences=2))
    assert len(batch) == 2 and share.loss.item() == pytest.approx(-(0.75 - 0.25) / 2)


def test_an_external_algorithms_own_key_is_unknown_to_the_others_and_bounded():
    with pytest.raises(ConfigError, match="unknown key 'baseline'"):
        load_config(TINY, overrides=["algorithm.baseline=0.25"])
    with pytest.raises(ConfigError, match="must be zero or more, got -1.0") as caught:
        load_config(TINY, overrides=[f"algorithm.name={NAME}", "algorithm.baseline=-1.0"])
    assert caught.value.key == "algorithm.baseline" and caught.value.file == "--set"


@pytest.mark.parametrize("name, problem, fix", [
    ("no_such_module_here:ALGORITHM", "cannot import module 'no_such_module_here'", "PYTHONPATH"),
    ("external_algorithm:MISSING", "has no 'MISSING'", "external_algorithm:ALGORITHM"),
    ("external_algorithm:NOT_AN_ALGORITHM", "is a str, not an Algorithm", "hpcrl.algorithms.base.Algorithm"),
])
def test_a_module_name_that_loads_no_algorithm_is_a_config_error_naming_the_key_and_the_fix(name, problem, fix):
    with pytest.raises(ConfigError) as caught:
        load_config(TINY, overrides=[f"algorithm.name={name}"])
    assert caught.value.key == "algorithm.name" and caught.value.file == "--set"
    assert problem in caught.value.problem and fix in caught.value.fix


def test_a_built_in_algorithm_loads_by_its_module_path_too():
    assert load_algorithm("hpcrl.algorithms.reinforce_pp:ALGORITHM") is load_algorithm("reinforce_pp")
    config = load_config(TINY, overrides=["algorithm.name=hpcrl.algorithms.reinforce_pp:ALGORITHM",
                                          "algorithm.gamma=0.9"])
    assert type(config.algorithm).__name__ == "ReinforcePPOptions" and config.algorithm.gamma == 0.9
    assert config.algorithm.kl_estimator == "k1"     # its defaults apply, whichever way it is named


def test_a_malformed_name_is_neither_registered_nor_module_colon_name():
    with pytest.raises(ConfigError, match="unknown algorithm 'external_algorithm:'"):
        load_algorithm("external_algorithm:")
    assert dataclasses.fields(load_algorithm(NAME).options)[-1].name == "baseline"
