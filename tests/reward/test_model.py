"""A reward model (transformers sequence classification, one label) as the scorer."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from hpcrl.config import load_config
from hpcrl.reward.model import RewardModelScorer, make_scorer
from hpcrl.reward.pool import RewardPool
from hpcrl.reward.types import RewardError, Sample

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def reward_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny Llama with a one-label score head: a reward model, random but fixed."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path_factory.mktemp("rm") / "tiny-rm"
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1)
    model.config.pad_token_id = AutoTokenizer.from_pretrained(tiny_model).pad_token_id
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(out)
    return out


def samples(n: int) -> list[Sample]:
    return [Sample(id=f"p{i}/0", prompt_id=f"p{i}", prompt=f"say {i % 10}:", completion=str(i % 7), answer="")
            for i in range(n)]


@pytest.mark.timeout(120)
def test_a_reward_model_scores_every_sample_in_order_the_same_whatever_the_batching(reward_model):
    batch = samples(7)
    whole = RewardModelScorer(str(reward_model), batch_size=16).score(batch)
    split = RewardModelScorer(str(reward_model), batch_size=3).score(batch)
    assert [r.id for r in whole] == [s.id for s in batch]
    assert all(r.error is None and math.isfinite(r.reward) for r in whole)
    assert len({round(r.reward, 6) for r in whole}) > 1  # it reads the text: different texts, different scores
    for a, b in zip(whole, split):  # padding does not change a sample's score
        assert a.reward == pytest.approx(b.reward, abs=1e-5)


@pytest.mark.timeout(120)
def test_a_directory_without_a_reward_model_is_a_clear_error(tmp_path):
    with pytest.raises(RewardError, match="does not hold a sequence-classification model"):
        RewardModelScorer(str(tmp_path))


@pytest.mark.timeout(120)
def test_the_config_picks_the_scorer(reward_model):
    model = load_config(REPO / "configs" / "tiny_grpo.toml",
                        overrides=['reward.kind="model"', f'reward.model_path="{reward_model}"'])
    scorer = make_scorer(model.reward)
    assert isinstance(scorer, RewardModelScorer)
    function = load_config(REPO / "configs" / "tiny_grpo.toml")
    pool = make_scorer(function.reward)
    try:
        assert isinstance(pool, RewardPool)
    finally:
        pool.close()
