"""reward.functions: several reward functions summed with weights, each one's score kept as a part."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcrl.config import load_config
from hpcrl.config.dump import dump_toml
from hpcrl.data.prompts import Prompt
from hpcrl.errors import ConfigError
from hpcrl.reward.model import make_scorer
from hpcrl.reward.pool import RewardPool
from hpcrl.reward.types import Sample, WeightedFunction
from hpcrl.rl.episodes import Episode
from hpcrl.rl.rollouts import score_groups

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
COMBINED = ['reward.function=""', 'reward.functions=[{function = "hpcrl.reward.builtin:exact_match", weight = 2.0}, '
            '{function = "verifiers_for_tests:half", weight = 0.5, name = "half_credit"}]']


@pytest.fixture(autouse=True)
def _verifiers_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))


def sample(i: int, completion: str, prompt: str = "") -> Sample:
    return Sample(id=f"p{i}/0", prompt_id=f"p{i}", prompt=prompt, completion=completion, answer="4")


@pytest.mark.timeout(60)
def test_weighted_rewards_add_up_and_each_part_is_kept():
    functions = [WeightedFunction(name="exact", function="hpcrl.reward.builtin:exact_match", weight=2.0),
                 WeightedFunction(name="half", function="verifiers_for_tests:half", weight=-0.5),
                 WeightedFunction(name="code", function="verifiers_for_tests:code_tests_quick", weight=1.0)]
    with RewardPool(functions, workers=1, timeout_s=20) as pool:
        right, wrong, broken = pool.score([sample(0, "4"), sample(1, "5"), sample(2, "4", prompt="raise")])
    # exact_match x 2 + half x -0.5 + code_tests x 1 (the code "4" then the tests "4" run clean: 1)
    assert right.parts == {"exact": 1.0, "half": 0.5, "code": 1.0} and right.reward == pytest.approx(2.0 - 0.25 + 1.0)
    assert wrong.parts == {"exact": 0.0, "half": 0.5, "code": 1.0} and wrong.reward == pytest.approx(-0.25 + 1.0)
    assert right.error is None and wrong.error is None
    # One failing part fails the sample (an error naming the function), never a partial sum.
    assert broken.reward is None and broken.parts is None and broken.error.startswith("half: ValueError: half failed")


@pytest.mark.timeout(60)
def test_a_reason_from_one_part_names_that_part():
    functions = [WeightedFunction(name="code", function="verifiers_for_tests:code_tests_quick", weight=1.0),
                 WeightedFunction(name="half", function="verifiers_for_tests:half", weight=1.0)]
    with RewardPool(functions, workers=1, timeout_s=20) as pool:
        (result,) = pool.score([Sample(id="a/0", prompt_id="a", prompt="", completion="x = 1", answer="assert x == 2")])
    assert (result.reward, result.reason, result.parts) == (0.5, "code: AssertionError", {"code": 0.0, "half": 0.5})


@pytest.mark.timeout(60)
def test_a_config_with_functions_scores_their_weighted_sum_and_survives_its_dump(tmp_path):
    config = load_config(REPO / "configs" / "tiny_grpo.toml", overrides=COMBINED)
    assert [(f.label, f.weight) for f in config.reward.functions] == [("exact_match", 2.0), ("half_credit", 0.5)]
    (tmp_path / "dumped.toml").write_text(dump_toml(config))
    assert load_config(tmp_path / "dumped.toml").reward == config.reward
    with make_scorer(config.reward) as pool:
        (result,) = pool.score([sample(0, "4")])
    assert result.reward == 2.25 and result.parts == {"exact_match": 1.0, "half_credit": 0.5}


def test_function_and_functions_together_are_refused_naming_both():
    with pytest.raises(ConfigError, match="both reward.function and reward.functions are set"):
        load_config(REPO / "configs" / "tiny_grpo.toml", overrides=COMBINED[1:])


def test_two_functions_reporting_under_one_name_are_refused():
    twice = ['reward.function=""', 'reward.functions=[{function = "hpcrl.reward.builtin:exact_match"}, '
             '{function = "hpcrl.reward.builtin:exact_match", weight = 0.1}]']
    with pytest.raises(ConfigError, match="two reward functions report as 'exact_match'"):
        load_config(REPO / "configs" / "tiny_grpo.toml", overrides=twice)


def test_an_unknown_builtin_in_functions_is_named_with_its_index():
    typo = ['reward.function=""', 'reward.functions=[{function = "hpcrl.reward.builtin:exact_match"}, '
            '{function = "hpcrl.reward.builtin:math_verfy"}]']
    with pytest.raises(ConfigError, match=r"reward.functions\[1\].function.*did you mean 'math_verify'"):
        load_config(REPO / "configs" / "tiny_grpo.toml", overrides=typo)



@pytest.mark.timeout(60)
def test_a_weighted_sum_that_is_not_finite_is_an_error_held_out_and_counted_as_a_nan_part_is():
    """Two parts of 1e308, each finite, sum to inf: the sample has no score, like one whose part is NaN."""
    functions = [WeightedFunction(name="large", function="verifiers_for_tests:numbers_of_other_types", weight=1.0),
                 WeightedFunction(name="again", function="verifiers_for_tests:numbers_of_other_types", weight=1.0)]
    samples = [Sample(id=f"{p}/0", prompt_id=p, prompt=p, completion="", answer="") for p in ("large", "nan")]
    with RewardPool(functions, workers=1, timeout_s=5) as pool:
        results = pool.score(samples)
    assert [r.reward for r in results] == [None, None]
    assert results[0].error == ("the weighted sum 1 x large + 1 x again is inf, not a finite number "
                                "(parts {'large': 1e+308, 'again': 1e+308})")
    assert results[1].error == "large: returned nan, not a finite number (or a (number, reason) pair)"
    groups = [[Episode(prompt=Prompt(id=p, text=p, answer=""), index=0)] for p in ("large", "nan")]
    scored, stats = score_groups(groups, results, weight_version=0)
    assert scored == [] and stats.groups_with_errors == 2 and len(stats.errors) == 2
