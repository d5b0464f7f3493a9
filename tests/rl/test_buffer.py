"""The replay buffer keeps groups within max_policy_lag of the trainer and drops the rest."""

from hpcrl.algorithms.base import Rollout
from hpcrl.rl.buffer import ReplayBuffer, ScoredGroup


def group(pid: str, version: int) -> ScoredGroup:
    return ScoredGroup(prompt_id=pid, rollouts=[Rollout.single_turn([1], [2], [-0.1], reward=1.0),
                                                Rollout.single_turn([1], [3], [-0.2], reward=0.0)],
                       weight_version=version)


def test_groups_older_than_the_lag_are_dropped_and_counted():
    buffer = ReplayBuffer(max_policy_lag=1)
    for pid, version in [("a", 0), ("b", 1), ("c", 2)]:
        buffer.put(group(pid, version))
    taken = buffer.take(5, trainer_version=2)
    assert [g.prompt_id for g in taken] == ["b", "c"]
    assert buffer.dropped_stale == 1


def test_fully_on_policy_keeps_only_the_current_version():
    buffer = ReplayBuffer(max_policy_lag=0)
    buffer.put(group("a", 3))
    buffer.put(group("b", 4))
    assert not buffer.ready(2, trainer_version=4)
    assert [g.prompt_id for g in buffer.take(1, trainer_version=4)] == ["b"]


def test_buffer_state_round_trips():
    buffer = ReplayBuffer(max_policy_lag=2)
    buffer.put(group("a", 1))
    other = ReplayBuffer(max_policy_lag=2)
    other.load_state_dict(buffer.state_dict())
    assert other.take(1, trainer_version=1) == [group("a", 1)]


def test_a_checkpointed_group_from_before_policy_masks_resumes_as_single_turn_rollouts():
    old = {"prompt_id": "a", "prompt_token_ids": [1], "completions": [[2], [3]], "logprobs": [[-0.1], [-0.2]],
           "rewards": [1.0, 0.0], "weight_version": 4, "batch": 3, "finish_reasons": ["stop", "length"]}
    restored = ScoredGroup.from_dict(old)
    assert restored.to_dict() == {"prompt_id": "a", "weight_version": 4, "batch": 3, "rollouts": [
        {"tokens": [1, 2], "policy_mask": [0, 1], "logprobs": [0.0, -0.1], "reward": 1.0, "finish_reason": "stop"},
        {"tokens": [1, 3], "policy_mask": [0, 1], "logprobs": [0.0, -0.2], "reward": 0.0, "finish_reason": "length"}]}
