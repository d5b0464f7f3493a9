"""Rollouts to scored groups and batches: policy masks, advantages, held-out groups, sharding."""

from __future__ import annotations

from hpcrl.algorithms import load_algorithm
from hpcrl.algorithms.grpo import GrpoOptions
from hpcrl.data.prompts import Prompt
from hpcrl.inference.types import Completion
from hpcrl.reward.types import RewardResult
from hpcrl.rl.buffer import ScoredGroup
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


def test_a_group_with_a_failed_reward_is_held_out_not_scored_zero():
    comps = [completions(PROMPTS[0], ["1", "3"]), completions(PROMPTS[1], ["2", "2"])]
    samples = samples_for(PROMPTS, comps)
    assert [s.id for s in samples] == ["a/0", "a/1", "b/0", "b/1"]
    results = [RewardResult(id="a/0", prompt_id="a", reward=1.0), RewardResult(id="a/1", prompt_id="a", reward=0.0),
               RewardResult(id="b/0", prompt_id="b", reward=1.0),
               RewardResult(id="b/1", prompt_id="b", reward=None, error="timed out after 5 s")]
    groups, stats = score_groups(PROMPTS, comps, results, weight_version=2)
    assert [g.prompt_id for g in groups] == ["a"]
    assert stats.groups_with_errors == 1 and stats.errors == ["b/1: timed out after 5 s"]
    assert groups[0].rewards == [1.0, 0.0]
    assert [r.tokens for r in groups[0].rollouts] == [[1, 5, 10], [1, 5, 11]]
    assert [r.policy_mask for r in groups[0].rollouts] == [[0, 0, 1], [0, 0, 1]]
    assert [r.logprobs for r in groups[0].rollouts] == [[0.0, 0.0, -0.5], [0.0, 0.0, -1.5]]


def test_batches_concatenate_prompt_and_completion_and_drop_zero_variance_groups_on_request():
    comps = [completions(PROMPTS[0], ["1", "3"]), completions(PROMPTS[1], ["2", "2"])]
    results = [RewardResult(id=f"{p}/{k}", prompt_id=p, reward=r)
               for p, k, r in [("a", 0, 1.0), ("a", 1, 0.0), ("b", 0, 1.0), ("b", 1, 1.0)]]
    groups, _ = score_groups(PROMPTS, comps, results, weight_version=2)
    batch, dropped = build_batch(groups, norm="mean", drop_zero_variance=True)
    assert dropped == 1 and batch.prompt_ids == ["a", "a"]
    assert batch.input_ids == [[1, 5, 10], [1, 5, 11]] and batch.policy_mask == [[0, 0, 1], [0, 0, 1]]
    assert batch.advantages == [0.5, -0.5] and batch.logprobs == [[0.0, 0.0, -0.5], [0.0, 0.0, -1.5]]
    full, dropped = build_batch(groups, norm="mean", drop_zero_variance=False)
    assert dropped == 0 and len(full) == 4 and full.advantages[2:] == [0.0, 0.0]


def test_shards_split_like_torch_chunk_and_cover_the_batch_once():
    comps = [completions(PROMPTS[0], ["1", "3", "1"])]
    results = [RewardResult(id=f"a/{k}", prompt_id="a", reward=float(k == 1)) for k in range(3)]
    groups, _ = score_groups(PROMPTS[:1], comps, results, weight_version=0)
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
