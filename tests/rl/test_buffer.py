"""The replay buffer keeps groups within max_policy_lag of the trainer and drops the rest."""

from hpcrl.rl.buffer import ReplayBuffer, ScoredGroup


def group(pid: str, version: int) -> ScoredGroup:
    return ScoredGroup(prompt_id=pid, prompt_token_ids=[1], completions=[[2], [3]], logprobs=[[-0.1], [-0.2]],
                       rewards=[1.0, 0.0], weight_version=version)


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
