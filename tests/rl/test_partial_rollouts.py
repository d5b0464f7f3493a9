"""Partial rollouts' bookkeeping (hpcrl/rl/partial.py): which tokens carry which version, the lag bound, and the
per-token importance ratio every algorithm takes from it. Pure: completions are written here as vLLM answers."""

from __future__ import annotations

import math

import pytest
import torch

from hpcrl.algorithms import ALGORITHMS, load_algorithm
from hpcrl.algorithms.base import Selection
from hpcrl.algorithms.terms import Normaliser
from hpcrl.data.types import Prompt
from hpcrl.errors import ConfigError
from hpcrl.inference.types import Completion
from hpcrl.reward.types import RewardResult
from hpcrl.rl.buffer import ReplayBuffer
from hpcrl.rl.partial import PartialError, PartialState, idle_share
from hpcrl.rl.rollouts import batch_from_groups, score_groups

BOS = 1


def answer(request, tokens: list[int], *, version: int, stop: bool, logprob0: float = -1.0) -> Completion:
    """vLLM's answer to one request: `tokens` (each logprob logprob0 - 0.01 k), "stop" or cut at its limit."""
    prompt_ids = request.prompt.prefix if request.prompt.prefix is not None else [BOS, 7, 8]
    return Completion(prompt_id=request.prompt.id, index=0, prompt_token_ids=list(prompt_ids), token_ids=tokens,
                      logprobs=[logprob0 - 0.01 * k for k in range(len(tokens))], text="x" * len(tokens),
                      finish_reason="stop" if stop else "length", weight_version=version)


def test_a_sequence_cut_at_the_window_goes_on_from_its_tokens_and_each_token_keeps_the_version_that_sampled_it():
    state = PartialState()
    first = state.plan_window([Prompt(id="p", text="x 9:", answer="x" * 9)], group_size=2, segment=4, budget=10)
    assert [(r.member, r.max_tokens, r.prompt.prefix) for r in first] == [(0, 4, None), (1, 4, None)]
    # member 0 stops after 2 tokens; member 1 is cut at the window's 4
    lengths = state.apply_window(first, [answer(first[0], [20, 2], version=0, stop=True),
                                         answer(first[1], [20, 20, 20, 20], version=0, stop=False)])
    assert lengths == [2, 4] and idle_share(lengths) == pytest.approx(0.25)
    assert state.take_finished() == [] and state.carried() == 1
    second = state.plan_window([], group_size=2, segment=4, budget=10)
    # carried: its prompt's ids as vLLM read them, then its tokens; what is left of its budget, at most 4
    assert [(r.member, r.max_tokens, r.prompt.prefix) for r in second] == [(1, 4, [BOS, 7, 8, 20, 20, 20, 20])]
    state.apply_window(second, [answer(second[0], [20, 20, 20, 20], version=1, stop=False, logprob0=-2.0)])
    third = state.plan_window([], group_size=2, segment=4, budget=10)
    assert third[0].max_tokens == 2  # 8 of its 10 tokens made
    state.apply_window(third, [answer(third[0], [20, 2], version=3, stop=False, logprob0=-3.0)])
    (group,) = state.take_finished()  # its budget reached: finished ("length"), and its group with it
    member = group.members[1]
    assert member.finish_reason == "length" and len(member.tokens) == 10
    assert member.versions == [0] * 4 + [1] * 4 + [3] * 2
    assert member.logprobs == pytest.approx([-1.0, -1.01, -1.02, -1.03, -2.0, -2.01, -2.02, -2.03, -3.0, -3.01])
    assert group.oldest == 0 and len(state) == 0
    episode = group.episodes()[1]
    rollout = episode.rollout(1.0)
    assert rollout.tokens == [BOS, 7, 8] + member.tokens and rollout.policy_mask == [0] * 3 + [1] * 10
    assert rollout.versions == [-1] * 3 + member.versions and rollout.logprobs[3:] == member.logprobs


def test_a_window_answer_from_other_tokens_than_the_sequence_had_is_refused():
    state = PartialState()
    first = state.plan_window([Prompt(id="p", text="x 9:", answer="")], group_size=2, segment=2, budget=10)
    state.apply_window(first, [answer(r, [20, 20], version=0, stop=False) for r in first])
    second = state.plan_window([], group_size=2, segment=2, budget=10)
    wrong = Completion(prompt_id="p", index=0, prompt_token_ids=[BOS, 7, 8, 20], token_ids=[20], logprobs=[-1.0],
                       text="x", finish_reason="length", weight_version=1)
    with pytest.raises(PartialError, match="other tokens"):
        state.apply_window(second, [wrong, answer(second[1], [20], version=1, stop=True)])
    with pytest.raises(PartialError, match="completions for a window of 2"):
        state.apply_window(second, [wrong])


def test_a_group_joins_the_batch_of_the_window_its_last_member_finishes_in_and_groups_keep_their_start_order():
    state = PartialState()
    w0 = state.plan_window([Prompt(id="a", text="", answer=""), Prompt(id="b", text="", answer="")],
                           group_size=2, segment=3, budget=9)
    # a: one member cut; b: both stop
    state.apply_window(w0, [answer(w0[0], [5, 5, 5], version=0, stop=False), answer(w0[1], [2], version=0, stop=True),
                            answer(w0[2], [2], version=0, stop=True), answer(w0[3], [5, 2], version=0, stop=True)])
    assert [g.prompt.id for g in state.take_finished()] == ["b"]
    w1 = state.plan_window([Prompt(id="c", text="", answer="")], group_size=2, segment=3, budget=9)
    assert [(w1[k].prompt.id, w1[k].prompt.prefix is not None) for k in range(3)] == [
        ("a", True), ("c", False), ("c", False)]  # carried first, then the new group's members
    state.apply_window(w1, [answer(w1[0], [2], version=1, stop=True), answer(w1[1], [2], version=1, stop=True),
                            answer(w1[2], [2], version=1, stop=True)])
    assert [g.prompt.id for g in state.take_finished()] == ["a", "c"]


def test_max_policy_lag_bounds_the_oldest_token_a_step_trains_on():
    state = PartialState()
    w0 = state.plan_window([Prompt(id="old", text="", answer="")], group_size=2, segment=2, budget=9)
    state.apply_window(w0, [answer(r, [5, 5], version=0, stop=False) for r in w0])
    w1 = state.plan_window([Prompt(id="new", text="", answer="")], group_size=2, segment=2, budget=9)
    state.apply_window(w1, [answer(r, [5, 5], version=1, stop=False) for r in w1])
    # step 3 with max_policy_lag 2: "old" (oldest token version 0, 3 behind) may never train; "new" (2 behind) may
    assert [g.prompt.id for g in state.drop_stale(step=3, max_policy_lag=2)] == ["old"]
    assert [g.prompt.id for g in state.groups] == ["new"]
    assert state.drop_stale(step=3, max_policy_lag=2) == []
    # once finished and scored, the group's weight_version is its oldest token's: the buffer holds it to the bound
    w2 = state.plan_window([], group_size=2, segment=2, budget=9)
    state.apply_window(w2, [answer(r, [2], version=3, stop=True) for r in w2])
    (group,) = state.take_finished()
    episodes = group.episodes()
    scored, _ = score_groups([episodes], [RewardResult(id=e.id, prompt_id="new", reward=float(e.index)) for e in episodes],
                             weight_version=3, batch=3)
    assert scored[0].weight_version == 1
    for trainer_version, kept in ((3, True), (4, False)):
        buffer = ReplayBuffer(max_policy_lag=2)
        buffer.put(scored[0])
        assert len(buffer.take_batch(3, trainer_version=trainer_version)) == int(kept)
        assert buffer.dropped_stale == int(not kept)


def test_partial_rollouts_need_a_lag_to_carry_into_and_refuse_what_they_cannot_do():
    from hpcrl.algorithms.dapo import DapoOptions
    from hpcrl.algorithms.grpo import GrpoOptions

    with pytest.raises(ConfigError, match="max_policy_lag >= 1"):
        GrpoOptions(partial_rollouts=True, max_policy_lag=0)
    with pytest.raises(ConfigError, match="dynamic_sampling"):
        DapoOptions(partial_rollouts=True, filter_zero_variance=True, dynamic_sampling=True)
    GrpoOptions(partial_rollouts=True).check_episodes()  # multi-turn episodes take them too (test_episodes.py)
    assert GrpoOptions(partial_rollouts=True, max_policy_lag=1, partial_tokens=8).partial_tokens == 8


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_algorithm_takes_each_tokens_ratio_against_the_logprob_of_the_weights_that_sampled_it(name):
    """A sequence whose first tokens were sampled with version 0 and its last with version 1: the batch carries
    each token's own sampling logprob, and the loss's gradient at each token is its own ratio's (a per-token
    algorithm: proportional to exp(logp_t - sampled_t); GSPO: its sequence ratio exp(mean_t(logp_t - sampled_t)),
    the same for every token)."""
    algorithm = load_algorithm(name)
    state = PartialState()
    w0 = state.plan_window([Prompt(id="p", text="", answer="")], group_size=2, segment=3, budget=6)
    state.apply_window(w0, [answer(w0[0], [5, 5, 5], version=0, stop=False, logprob0=-1.0),
                            answer(w0[1], [6, 2], version=0, stop=True, logprob0=-1.5)])
    w1 = state.plan_window([], group_size=2, segment=3, budget=6)
    state.apply_window(w1, [answer(w1[0], [5, 2], version=1, stop=True, logprob0=-2.5)])
    (group,) = state.take_finished()
    episodes = group.episodes()
    scored, _ = score_groups([episodes], [RewardResult(id=e.id, prompt_id="p", reward=1.0 - e.index) for e in episodes],
                             weight_version=1, batch=1)
    batch = batch_from_groups(scored, Selection(kept=[0], advantages=[[1.0, -1.0]], dropped_zero_variance=0))
    sampled = batch.logprobs[0]
    assert scored[0].rollouts[0].versions == [-1, -1, -1, 0, 0, 0, 1, 1]
    assert sampled[3:] == pytest.approx([-1.0, -1.01, -1.02, -2.5, -2.51])
    width = max(map(len, batch.input_ids))
    pad = lambda rows, fill: torch.tensor([r + [fill] * (width - len(r)) for r in rows], dtype=torch.float64)  # noqa: E731
    old = pad(batch.logprobs, 0.0)
    mask = pad(batch.policy_mask, 0).bool()
    # the current policy: within the clip range of every token's own sampling logprob, by a different step each
    delta = torch.tensor([[0.0] * 3 + [0.03, -0.02, 0.05, -0.04, 0.01], [0.0] * 3 + [0.02, -0.03, 0.0, 0.0, 0.0]],
                         dtype=torch.float64)[:, :width]
    settings = algorithm.options(name=name, max_tokens=6)
    norm = Normaliser(tokens=float(mask.sum()), sequences=2.0)
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)

    def gradient(current):
        current = current.clone().requires_grad_(True)
        share = algorithm.loss(logprobs=current, old_logprobs=old, advantages=advantages, mask=mask,
                               settings=settings, norm=norm)
        return share.loss, torch.autograd.grad(share.loss, current)[0][0][mask[0]]

    loss, row = gradient(old + delta * mask)
    _, at_one = gradient(old)  # every ratio 1
    if name == "gspo":  # each token: the sequence's ratio times its gradient at ratio 1
        expected = torch.full_like(row, math.exp(float(delta[0][mask[0]].mean())))
    else:  # each token: its own ratio times its gradient at ratio 1
        expected = torch.exp(delta[0][mask[0]])
    torch.testing.assert_close(row / at_one, expected, rtol=1e-9, atol=0)
    # and a ratio against any other logprob than the token's own (version 0's for the version-1 tokens) moves it
    wrong = old.clone()
    wrong[0, 6:8] = wrong[0, 3:5]
    other = algorithm.loss(logprobs=old + delta * mask, old_logprobs=wrong, advantages=advantages, mask=mask,
                           settings=settings, norm=norm)
    assert abs(float(other.loss.detach()) - float(loss.detach())) > 1e-3


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_the_decoupled_loss_keeps_a_stale_tokens_gradient_weighted_by_its_truncated_behaviour_ratio(name):
    """algorithm.behavior_weight_cap: tokens far from the weights that sampled them (as a partial rollout's oldest
    are) keep a gradient, each its ratio's at ratio 1 times min(behaviour ratio, cap); the clip against the
    sampling logprobs gives the stale one none."""
    algorithm = load_algorithm(name)
    old = torch.full((2, 4), -3.0, dtype=torch.float64)
    mask = torch.ones(2, 4, dtype=torch.bool)
    delta = torch.tensor([[1.0, 0.1, -1.0, 0.0], [0.5, 0.0, 0.0, -0.2]], dtype=torch.float64)
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)
    norm = Normaliser(tokens=8.0, sequences=2.0)

    def gradient(current, cap):
        settings = algorithm.options(**{**algorithm.defaults, "name": name, "max_tokens": 4,
                                        "behavior_weight_cap": cap})  # GSPO's small clips among them
        current = current.clone().requires_grad_(True)
        share = algorithm.loss(logprobs=current, old_logprobs=old, advantages=advantages, mask=mask,
                               settings=settings, norm=norm)
        return torch.autograd.grad(share.loss, current)[0]

    at_one = gradient(old, 0.0)  # every ratio 1: nothing clipped
    clipped = gradient(old + delta, 0.0)
    decoupled = gradient(old + delta, 2.0)
    if name == "gspo":  # one behaviour ratio per sequence: the geometric mean of its tokens'
        weight = torch.exp(delta.mean(dim=1, keepdim=True)).clamp(max=2.0).expand_as(delta)
        assert float(clipped[0].abs().sum()) == 0.0  # A > 0, ratio 1.025: far outside GSPO's 4e-4 clip
    else:
        weight = torch.exp(delta).clamp(max=2.0)  # e = 2.72 -> 2.0: truncated
        assert float(clipped[0, 0]) == 0.0 and float(clipped[1, 0]) != 0.0  # A > 0, r = e > 1.28: clipped away
    torch.testing.assert_close(decoupled / at_one, weight, rtol=1e-9, atol=0)


def test_the_wall_time_idle_share_counts_slots_empty_while_the_call_waits_for_its_last_request():
    from hpcrl.rl.partial import time_idle_share

    # two requests over 0..10 s: one the whole call, one 0..2 s: half of 2 slots x 10 s minus 2 s = 40 % empty
    assert time_idle_share([(0.0, 10.0), (0.0, 2.0)]) == pytest.approx(0.4)
    # a queued request scheduled when the first frees its slot keeps one slot busy: nothing idle
    assert time_idle_share([(0.0, 4.0), (4.0, 10.0)]) == pytest.approx(0.0)
    assert time_idle_share([]) == 0.0 and time_idle_share([(1.0, 1.0)]) == 0.0
