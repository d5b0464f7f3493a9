"""Episodes to scored groups and batches: one-turn episodes, policy masks, advantages, held-out groups, sharding."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from fake_config import fake_config
from fake_ports import FakePorts

from hpcrl.algorithms import load_algorithm
from hpcrl.algorithms.grpo import GrpoOptions
from hpcrl.config.schema import DataColumns
from hpcrl.data.prompts import Prompt
from hpcrl.data.sources import read_prompts
from hpcrl.inference.types import Completion
from hpcrl.reward.pool import RewardPool
from hpcrl.reward.types import RewardResult
from hpcrl.rl.buffer import ScoredGroup
from hpcrl.rl.episodes import Episode, EpisodeRunner
from hpcrl.rl.rollouts import batch_from_groups, samples_for, score_groups


def build_batch(groups: list[ScoredGroup], *, norm, drop_zero_variance: bool):
    """GRPO's batch of `groups`, and how many zero-variance groups it dropped."""
    selection = load_algorithm("grpo").select([g.rollouts for g in groups], GrpoOptions(
        advantage_norm=norm, filter_zero_variance=drop_zero_variance), wanted=len(groups))
    return batch_from_groups(groups, selection), selection.dropped_zero_variance


PROMPTS = [Prompt(id="a", text="say 1:", answer="1"), Prompt(id="b", text="say 2:", answer="2")]


def completions(prompt: Prompt, texts: list[str]) -> list[Completion]:
    return [Completion(prompt_id=prompt.id, index=k, prompt_token_ids=[1, 5], token_ids=[10 + k],
                       logprobs=[-0.5 - k], text=t, finish_reason="length", weight_version=2)
            for k, t in enumerate(texts)]


class _Generated:
    """The inference group's side of one-turn episodes: generate answers the completions it was given."""

    def __init__(self, completions: list[list[Completion]]) -> None:
        self.completions = completions

    async def generate(self, prompts, *, n, seed, temperature=None):
        return self.completions


def one_turn(prompts: list[Prompt], completions: list[list[Completion]]) -> list[list[Episode]]:
    """The episodes EpisodeRunner makes of `completions` without an environment."""
    config = fake_config(Path("/nonexistent"), run_name="rollouts", seed=0, steps=1, prompts_per_step=1,
                         group_size=2)  # the runner reads [inference] and [env] only
    groups, _ = asyncio.run(EpisodeRunner(config, _Generated(completions)).run(prompts, n=len(completions[0]), seed=0))
    return groups


def test_without_an_environment_an_episode_is_one_generate_call_with_the_batchs_seed_prompt_then_completion():
    ports = FakePorts()
    config = fake_config(Path("/nonexistent"), run_name="rollouts", seed=0, steps=1, prompts_per_step=2, group_size=3)
    groups, stats = asyncio.run(EpisodeRunner(config, ports).run(PROMPTS, n=3, seed=17, temperature=0.5))
    assert ports.events == [("generate", 17, 0.5)]  # no generate_turn, no environment, the seed as given
    made = ports.inference.generate(PROMPTS, n=3, seed=17, temperature=0.5)  # the same call, made again
    for group, completions_of in zip(groups, made, strict=True):
        for episode, completion in zip(group, completions_of, strict=True):
            prompt = completion.prompt_token_ids
            assert episode.tokens == prompt + completion.token_ids
            assert episode.mask == [0] * len(prompt) + [1] * len(completion.token_ids)
            assert episode.logprobs == [0.0] * len(prompt) + completion.logprobs
            assert (episode.turns, episode.text, episode.finish_reason) == (1, completion.text, "length")
            assert episode.reward is None and episode.error is None  # the run's [reward] scores it
    assert stats.turns == [1] * 6 and stats.generate_tokens == 6 and stats.versions == {0}


def test_a_turn_with_other_than_one_logprob_per_token_is_refused_naming_the_episode():
    from hpcrl.rl.episodes import EpisodeError

    bad = [[Completion(prompt_id="a", index=0, prompt_token_ids=[1], token_ids=[10, 11], logprobs=[-0.5], text="1",
                       finish_reason="length", weight_version=0)]]
    with pytest.raises(EpisodeError, match="1 logprobs for a turn of 2 tokens in episode a/0"):
        one_turn(PROMPTS[:1], bad)


def test_a_group_with_a_failed_reward_is_held_out_not_scored_zero():
    comps = one_turn(PROMPTS, [completions(PROMPTS[0], ["1", "3"]), completions(PROMPTS[1], ["2", "2"])])
    samples = samples_for(comps)
    assert [s.id for s in samples] == ["a/0", "a/1", "b/0", "b/1"]
    results = [RewardResult(id="a/0", prompt_id="a", reward=1.0), RewardResult(id="a/1", prompt_id="a", reward=0.0),
               RewardResult(id="b/0", prompt_id="b", reward=1.0),
               RewardResult(id="b/1", prompt_id="b", reward=None, error="timed out after 5 s")]
    groups, stats = score_groups(comps, results, weight_version=2)
    assert [g.prompt_id for g in groups] == ["a"]
    assert stats.groups_with_errors == 1 and stats.errors == ["b/1: timed out after 5 s"]
    assert groups[0].rewards == [1.0, 0.0]
    assert [r.tokens for r in groups[0].rollouts] == [[1, 5, 10], [1, 5, 11]]
    assert [r.policy_mask for r in groups[0].rollouts] == [[0, 0, 1], [0, 0, 1]]
    assert [r.logprobs for r in groups[0].rollouts] == [[0.0, 0.0, -0.5], [0.0, 0.0, -1.5]]
    assert [r.finish_reason for r in groups[0].rollouts] == ["length", "length"] and groups[0].weight_version == 2


@pytest.mark.timeout(60)
def test_the_rows_extra_columns_reach_a_reward_function_that_asks_for_them(tmp_path, monkeypatch):
    """data.columns.extra, read from the file, travels with the prompt to its samples and to a function with an
    `extra` parameter (one without it is called as before)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "reward"))
    rows = [{"id": "a", "question": "2+2=", "accepted": ["4", "four"]}, {"id": "b", "question": "1+1=", "accepted": ["2"]}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    prompts = read_prompts(tmp_path / "rows.jsonl", split="train",
                           columns=DataColumns(prompt="question", answer="", extra=["accepted"]))
    samples = samples_for(one_turn(prompts, [completions(prompts[0], ["four", "5"]), completions(prompts[1], ["2", "3"])]))
    assert [s.extra for s in samples] == [{"accepted": ["4", "four"]}] * 2 + [{"accepted": ["2"]}] * 2
    with RewardPool("verifiers_for_tests:given_extra", workers=1, timeout_s=5) as pool:
        assert [r.reward for r in pool.score(samples)] == [1.0, 0.0, 1.0, 0.0]


def test_batches_concatenate_prompt_and_completion_and_drop_zero_variance_groups_on_request():
    comps = one_turn(PROMPTS, [completions(PROMPTS[0], ["1", "3"]), completions(PROMPTS[1], ["2", "2"])])
    results = [RewardResult(id=f"{p}/{k}", prompt_id=p, reward=r)
               for p, k, r in [("a", 0, 1.0), ("a", 1, 0.0), ("b", 0, 1.0), ("b", 1, 1.0)]]
    groups, _ = score_groups(comps, results, weight_version=2)
    batch, dropped = build_batch(groups, norm="mean", drop_zero_variance=True)
    assert dropped == 1 and batch.prompt_ids == ["a", "a"]
    assert batch.input_ids == [[1, 5, 10], [1, 5, 11]] and batch.policy_mask == [[0, 0, 1], [0, 0, 1]]
    assert batch.advantages == [0.5, -0.5] and batch.logprobs == [[0.0, 0.0, -0.5], [0.0, 0.0, -1.5]]
    full, dropped = build_batch(groups, norm="mean", drop_zero_variance=False)
    assert dropped == 0 and len(full) == 4 and full.advantages[2:] == [0.0, 0.0]


def test_shards_split_like_torch_chunk_and_cover_the_batch_once():
    comps = one_turn(PROMPTS[:1], [completions(PROMPTS[0], ["1", "3", "1"])])
    results = [RewardResult(id=f"a/{k}", prompt_id="a", reward=float(k == 1)) for k in range(3)]
    groups, _ = score_groups(comps, results, weight_version=0)
    batch, _ = build_batch(groups, norm="mean", drop_zero_variance=False)
    shards = [batch.shard(r, 2) for r in range(2)]
    assert [len(s) for s in shards] == [2, 1]
    assert shards[0].input_ids + shards[1].input_ids == batch.input_ids
    assert [len(batch.shard(r, 4)) for r in range(4)] == [1, 1, 1, 0]


def test_a_batch_pads_a_multi_turn_rollout_training_only_the_policy_tokens_with_per_token_advantages():
    from hpcrl.algorithms.base import Rollout, Selection

    # prompt [1, 5], the policy's turn [10, 11], tool output [7, 8], the policy's turn [12].
    turns = Rollout(tokens=[1, 5, 10, 11, 7, 8, 12], policy_mask=[0, 0, 1, 1, 0, 0, 1],
                    logprobs=[0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.3], reward=1.0)
    single = Rollout.single_turn([1, 5], [13], [-0.4], reward=0.0)
    group = ScoredGroup(prompt_id="a", rollouts=[turns, single], weight_version=0)
    selection = Selection(kept=[0], advantages=[[[0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 2.0], [0.0, 0.0, -1.0]]])
    rows = batch_from_groups([group], selection).rows()
    assert rows.completion_mask.tolist() == [[False, False, True, True, False, False, True],
                                             [False, False, True, False, False, False, False]]
    assert rows.old_logprobs[0, 6].item() == -0.30000001192092896 and rows.old_logprobs[1, 2].item() == -0.4000000059604645
    assert rows.advantages.tolist() == [[0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 2.0], [0.0, 0.0, -1.0, 0.0, 0.0, 0.0, 0.0]]
