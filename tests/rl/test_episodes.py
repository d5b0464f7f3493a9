"""Multi-turn episodes ([env], hpcrl.rl.episodes) through the real controller and run_loop, over in-memory groups
(fake_ports.py: the fake policy over the tiny tokenizer's digits, the "feedback" environment in memory) and the
real chat template of the tiny model; and the loss's indifference to environment tokens.

    pytest tests/rl/test_episodes.py --durations=0
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch
from fake_config import fake_config
from fake_ports import FakeEnvironment, FakePorts, FakeReward
from test_controller import memory_dir, outcome

from hpcrl.config.schema import Config, DataConfig, EnvConfig, ModelConfig
from hpcrl.env.types import EnvReply, EnvRequest
from hpcrl.rl.loop import run_loop
from hpcrl.rl.metrics import read_metrics

STEPS = 6
PROMPTS_PER_STEP = 3
GROUP_SIZE = 4
#: The tiny tokenizer's <|user|>, <|assistant|> and <|end|> (tools/make_tiny_model.py).
USER, ASSISTANT, END = 100, 101, 102


@pytest.fixture
def runs(tmp_path):
    with memory_dir(tmp_path) as path:
        yield path


def env_config(run_dir: Path, model: Path, *, lag: int = 1, steps: int = STEPS, max_turns: int = 2,
               max_tokens: int = 64, inference_tokens: int = 1, interval: int = 0) -> Config:
    """builtin:guess in the chat format with the feedback environment: tiny-llama's template, the fake policy."""
    config = fake_config(run_dir, run_name="fake-episodes", seed=5, steps=steps, prompts_per_step=PROMPTS_PER_STEP,
                         group_size=GROUP_SIZE, interval=interval, max_policy_lag=lag)
    return dataclasses.replace(
        config, model=ModelConfig(preset="tiny-llama", path=str(model), dtype="float32"),
        data=DataConfig(source="builtin:guess", format="chat", max_prompt_tokens=16),
        inference=dataclasses.replace(config.inference, max_tokens=inference_tokens),
        env=EnvConfig(environment="feedback", max_turns=max_turns, max_tokens=max_tokens))


def untimed(run_dir: Path) -> list[dict]:
    """test_controller's outcome() without env_wait_share, a share of wall times too."""
    return [{k: v for k, v in row.items() if k != "env_wait_share"} for row in outcome(run_dir)]


def loop_once(config: Config, ports, **kwargs) -> None:
    asyncio.run(asyncio.wait_for(run_loop(config, ports, **kwargs), 30))


def trained_rows(ports: FakePorts):
    """(tokens, mask, logprobs, prompt id) of every sequence the trainer trained on."""
    for batch in ports.trainer.batches.values():
        yield from zip(batch["input_ids"], batch["policy_mask"], batch["logprobs"], batch["prompt_ids"])


@pytest.mark.timeout(60)
def test_the_ids_trained_on_are_the_ids_vllm_generated_each_turn_from_and_produced(runs, tiny_model):
    """Turn by turn: every model turn's prompt is a prefix of the trained sequence, its tokens follow it with mask 1
    and their sampling logprobs; every other token (the first messages, the turn endings, the environment's
    feedback) has mask 0 and logprob 0."""
    ports = FakePorts(env=FakeEnvironment())
    loop_once(env_config(runs, tiny_model, inference_tokens=2), ports)
    turns = ports.inference.turns
    rows = list(trained_rows(ports))
    assert rows and max(row[0].count(ASSISTANT) for row in rows) == 2  # some episodes took a second turn
    for tokens, mask, logprobs, prompt_id in rows:
        mine = [(ctx, out, lps) for ctx, out, lps in turns
                if tokens[:len(ctx)] == ctx and tokens[len(ctx):len(ctx) + len(out)] == out]
        # (the same ids recur in other batches, sampled under other weights: any of their logprobs may be this one's)
        generated: dict[int, set[float]] = {}
        for ctx, _, lps in mine:
            for j, lp in enumerate(lps):
                generated.setdefault(len(ctx) + j, set()).add(lp)
        assert 1 <= len({len(ctx) for ctx, _, _ in mine}) == tokens.count(ASSISTANT), prompt_id
        assert [j for j, flag in enumerate(mask) if flag] == sorted(generated)
        assert all(logprobs[j] in generated.get(j, {0.0}) for j in range(len(tokens)))
        assert tokens[:2] == [1, USER]  # <bos><|user|>guess:<|end|><|assistant|> ...
    feedback = next(t for t, _, _, _ in rows if t.count(ASSISTANT) == 2)
    second_user = [j for j, t in enumerate(feedback) if t == USER][1]
    assert feedback[second_user - 1] == END  # the policy's turn ended (by its own <|end|> here), then the feedback
    rows_metrics = read_metrics(runs)
    assert all(1.0 <= r["turns_mean"] <= 2.0 and r["env_errors"] == 0 for r in rows_metrics)
    assert {"time_env_s", "env_wait_share", "time_turn_s", "episodes_truncated"} <= set(rows_metrics[0])
    # The probe (lag 1) compares trainer and sampler on every policy token of every turn: the largest difference.
    assert [r["logprob_mismatch_max"] for r in rows_metrics] == [0.0] * STEPS


@pytest.mark.timeout(60)
def test_the_policy_learns_to_use_the_feedback_on_its_second_try(runs, tiny_model):
    ports = FakePorts(env=FakeEnvironment())
    loop_once(env_config(runs, tiny_model, steps=12), ports)
    rewards = [r["reward_mean"] for r in read_metrics(runs)]
    assert rewards[0] < 0.5 < rewards[-1]  # a random second guess is right 1 time in 10; the digit it is told, always
    assert ports.trainer.weights[0] > 1.0  # the weight of "say the digit of the context"


@pytest.mark.timeout(60)
def test_an_environment_error_holds_its_group_out_of_training_and_counts_it(runs, tiny_model):
    broken = {"guess-train-4/1", "guess-train-7/0"}  # a step of one episode, the reset of one prompt (by its first)
    ports = FakePorts(env=FakeEnvironment(broken.__contains__))
    loop_once(env_config(runs, tiny_model), ports)
    trained = {p for _, _, _, p in trained_rows(ports)}
    assert not {"guess-train-4", "guess-train-7"} & trained and {"guess-train-3", "guess-train-5"} <= trained
    rows = read_metrics(runs)
    assert [r["groups_held_out_total"] for r in rows] == [1, 2, 2, 2, 2, 2]  # batch 1 while step 0 trains (lag 1)
    assert [r["env_errors"] for r in rows] == [0, 1, 1, 0, 0, 0]
    assert rows[1]["env_error_example"] == "guess-train-4/1 (turn 1): timed out after 10 s"
    assert rows[2]["env_error_example"] == "guess-train-7/0 (reset): worker died"
    assert [r["groups"] for r in rows] == [3, 2, 2, 3, 3, 3]
    assert all(r["reward_errors"] == 0 for r in rows)
    # The failed episode's group stops at once: no second turn of guess-train-4 is generated.
    assert not [p for _, p, _ in ports.inference.generated if p.startswith("guess-train-4/")]


class AnswersOutsideTheTemplate(FakeEnvironment):
    """FakeEnvironment whose reset of guess-train-7 ends with the assistant's message and whose steps of
    guess-train-4/1 answer in a "tool" message: what the pool lets through but the tiny template cannot render."""

    def reset(self, requests: list[EnvRequest]) -> list[EnvReply]:
        return [EnvReply(episode=r.episode, messages=[*reply.messages, {"role": "assistant", "content": "7"}])
                if r.episode == "guess-train-7/0" else reply for r, reply in zip(requests, super().reset(requests))]

    def _step(self, request: EnvRequest) -> EnvReply:
        if request.episode == "guess-train-4/1":
            return EnvReply(episode=request.episode, messages=[{"role": "tool", "content": "no"}])
        return super()._step(request)


@pytest.mark.timeout(60)
def test_messages_the_chat_template_cannot_render_hold_their_group_out_and_count_it(runs, tiny_model):
    """As an environment error (the test above, on the same episodes): the run goes on."""
    ports = FakePorts(env=AnswersOutsideTheTemplate())
    loop_once(env_config(runs, tiny_model), ports)
    trained = {p for _, _, _, p in trained_rows(ports)}
    assert not {"guess-train-4", "guess-train-7"} & trained and {"guess-train-3", "guess-train-5"} <= trained
    rows = read_metrics(runs)
    assert [r["groups_held_out_total"] for r in rows] == [1, 2, 2, 2, 2, 2]
    assert [r["env_errors"] for r in rows] == [0, 1, 1, 0, 0, 0]
    assert rows[1]["env_error_example"].startswith("guess-train-4/1 (turn 1): the chat template of ")
    assert "failed on an environment's messages (roles ['tool'])" in rows[1]["env_error_example"]
    assert rows[2]["env_error_example"].startswith("guess-train-7/0 (reset): prompt 'guess-train-7': its messages end "
                                                   "with an assistant message")


@pytest.mark.timeout(60)
def test_an_episode_over_the_token_budget_is_truncated_marked_and_scored_by_the_runs_reward(runs, tiny_model):
    """10 ids of first messages, 1 of a guess, 15 of turn ending and feedback: a budget of 20 ends a wrong first
    guess there ("budget"); the run's [reward] scores it (exact match: 0), and a right first guess is done."""
    ports = FakePorts(env=FakeEnvironment(), reward=FakeReward())
    loop_once(env_config(runs, tiny_model, max_tokens=20, inference_tokens=4), ports)
    assert {(len(t), sum(m)) for t, m, _, _ in trained_rows(ports)} == {(12, 2)}  # a digit and <|end|>, no more
    assert {len(ctx) for ctx, _, _ in ports.inference.turns} == {10}  # no second turn fits
    rows = read_metrics(runs)
    assert sum(r["episodes_truncated"] for r in rows) > 0 and all(r["turns_mean"] == 1.0 for r in rows)
    assert all(r["episodes_cut_max_turns"] == 0 for r in rows)
    # One id left for a turn: max_tokens is what the budget leaves (1), not inference.max_tokens (4).
    tight = FakePorts(env=FakeEnvironment())
    loop_once(env_config(runs / "tight", tiny_model, max_tokens=11, inference_tokens=4, steps=1), tight)
    assert {len(out) for _, out, _ in tight.inference.turns} == {1}


@pytest.mark.timeout(60)
def test_an_episode_out_of_turns_is_cut_and_scored_by_the_runs_reward(runs, tiny_model):
    ports = FakePorts(env=FakeEnvironment(unrewarded=True))
    loop_once(env_config(runs, tiny_model, max_turns=1, steps=2), ports)
    rows = read_metrics(runs)
    assert all(r["turns_mean"] == 1.0 for r in rows)
    assert sum(r["episodes_cut_max_turns"] for r in rows) > 0 and all(r["episodes_truncated"] == 0 for r in rows)
    # The environment rewards none: exact match scores the cut (wrong) guesses 0 and the right ones, done, 1.
    assert all(r["reward_mean"] == pytest.approx(1 - r["episodes_cut_max_turns"] / r["episodes"]) for r in rows)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("lag", [0, 1])
def test_a_resumed_run_with_episodes_equals_an_uninterrupted_one(runs, tiny_model, lag):
    whole = FakePorts(env=FakeEnvironment({"guess-train-4/1"}.__contains__))
    loop_once(env_config(runs / "whole", tiny_model, lag=lag), whole)
    config = env_config(runs / "split", tiny_model, lag=lag, interval=3)
    loop_once(config, FakePorts(env=FakeEnvironment({"guess-train-4/1"}.__contains__)), steps=3)
    second = FakePorts(env=FakeEnvironment({"guess-train-4/1"}.__contains__))
    loop_once(config, second)
    assert untimed(runs / "split") == untimed(runs / "whole")
    assert second.trainer.weights == whole.trainer.weights
    assert [b["input_ids"] for s, b in sorted(second.trainer.batches.items())] == \
        [b["input_ids"] for s, b in sorted(whole.trainer.batches.items()) if s >= 3]


@pytest.mark.timeout(60)
def test_the_evaluation_runs_the_held_out_prompts_as_greedy_episodes(runs, tiny_model):
    from hpcrl.config.schema import EvalConfig

    ports = FakePorts(env=FakeEnvironment())
    config = env_config(runs, tiny_model, steps=12)
    config = dataclasses.replace(config, eval=EvalConfig(interval=6, at_start=True),
                                 data=dataclasses.replace(config.data, eval_source="builtin:guess", eval_size=8))
    loop_once(config, ports)
    evaluated = [(r["step"], r["eval/pass@1"]) for r in read_metrics(runs) if "eval/pass@1" in r]
    assert [s for s, _ in evaluated] == [0, 6, 12]
    assert evaluated[-1][1] == 1.0 > evaluated[0][1]  # greedy: "0" then "0" at first; the told digit at the end
    assert any(len(e) == 3 and e[0] == "turn" and e[2] == 0.0 for e in ports.events)


@pytest.mark.parametrize("name", ["grpo", "dapo", "gspo", "dr_grpo"])
def test_the_loss_and_its_gradient_do_not_change_when_environment_tokens_change(name):
    """Whatever the logprobs, old logprobs and reference logprobs at the environment's tokens (mask 0), every
    algorithm's loss and its gradient are the same: those tokens are neither trained on nor compared."""
    from hpcrl.algorithms import load_algorithm
    from hpcrl.algorithms.base import Options
    from hpcrl.algorithms.terms import Normaliser

    algorithm = load_algorithm(name)
    mask = torch.tensor([[0, 0, 1, 1, 0, 0, 0, 1], [0, 0, 1, 0, 0, 0, 1, 1]], dtype=torch.bool)
    generator = torch.Generator().manual_seed(0)
    base = -torch.rand(2, 8, generator=generator)
    old, ref = base + 0.1 * torch.randn(2, 8, generator=generator), base - 0.05
    settings = Options(name=name, kl_coef=0.1, max_tokens=8)
    norm = Normaliser(tokens=float(mask.sum()), sequences=2.0)

    def loss_and_grad(noise: float):
        env = (~mask).float() * noise
        logprobs = (base + env).requires_grad_(True)
        share = algorithm.loss(logprobs=logprobs, old_logprobs=old - 2 * env, advantages=torch.tensor([0.7, -0.4]),
                               mask=mask, settings=settings, norm=norm, ref_logprobs=ref + env)
        (grad,) = torch.autograd.grad(share.loss, logprobs)
        return share.loss.detach(), grad

    loss, grad = loss_and_grad(0.0)
    for noise in (-3.0, 5.0):
        other_loss, other_grad = loss_and_grad(noise)
        assert torch.equal(other_loss, loss) and torch.equal(other_grad, grad)
    assert grad[~mask].abs().max() == 0 and grad[mask].abs().max() > 0


@pytest.mark.timeout(60)
def test_over_bus_ports_episodes_spread_over_the_replicas_and_give_the_in_memory_figures(runs, tiny_model):
    """Two replicas, four chunks: each turn's generate goes to one replica and the environment calls to the reward
    group; where a chunk's turn runs changes nothing (its seed is the chunk's and the turn's)."""
    from fake_head import FakeHead, FakeJob

    from hpcrl.rl.ports import BusPorts

    def two_replicas(run_dir: Path) -> Config:
        config = env_config(run_dir, tiny_model, steps=4)
        return dataclasses.replace(config, inference=dataclasses.replace(config.inference, replicas=2))

    loop_once(two_replicas(runs / "memory"), FakePorts(env=FakeEnvironment({"guess-train-4/1"}.__contains__)))

    async def over_the_bus() -> FakeJob:
        config, head = two_replicas(runs / "bus"), FakeHead()
        job = FakeJob(config, head, env=FakeEnvironment({"guess-train-4/1"}.__contains__))
        ports = BusPorts(config, head, store="tcp://127.0.0.1:29500")
        await ports.connect(timeout=5)
        await run_loop(config, ports)
        return job
    job = asyncio.run(asyncio.wait_for(over_the_bus(), 30))
    assert untimed(runs / "bus") == untimed(runs / "memory")
    assert {p.replica for p in job.processes if p.engine.turns} == {0, 1}
    assert read_metrics(runs / "bus")[1]["env_errors"] == 1


@pytest.mark.parametrize("override, key, fix", [
    ("data.format=text", "data.format", 'set data.format = "chat"'),
    ("reward.tasks=0", "reward.tasks", "set reward.tasks = 1 or more"),
    ("inference.max_model_len=32", "inference.max_model_len", "set max_model_len = 64 or 0"),
    ("algorithm.name=dapo", "algorithm.overlong_buffer_fraction", "= 0.0"),  # DAPO shapes overlong answers
    ("env.environment=feedbak", "env.environment", "did you mean 'feedback'?"),
    ("env.environment=no_such_module:Env", "env.environment", "add its directory to PYTHONPATH"),
])
def test_an_env_config_that_cannot_run_episodes_is_refused_at_load_naming_the_key_and_fix(override, key, fix):
    from hpcrl.config import load_config
    from hpcrl.errors import ConfigError

    repo = Path(__file__).resolve().parents[2]
    config = load_config(repo / "configs" / "tiny_env_grpo.toml")
    assert config.env.environment == "feedback" and config.max_model_len == 64
    with pytest.raises(ConfigError, match=key) as refused:
        load_config(repo / "configs" / "tiny_env_grpo.toml", overrides=[override])
    assert fix in str(refused.value)


def partial_config(run_dir: Path, model: Path, *, interval: int = 0) -> Config:
    """The feedback environment with partial rollouts of one token a window: every turn (a digit, then the
    template's <|end|>) spans two windows, an episode of two turns four, with the environment's step between."""
    config = env_config(run_dir, model, inference_tokens=2, lag=4, interval=interval)
    return dataclasses.replace(config, algorithm=dataclasses.replace(config.algorithm, partial_rollouts=True,
                                                                     partial_tokens=1))


@pytest.mark.timeout(60)
def test_with_partial_rollouts_a_turn_goes_on_across_windows_and_each_token_keeps_the_weights_that_sampled_it(
        runs, tiny_model):
    ports = FakePorts(env=FakeEnvironment())
    loop_once(partial_config(runs, tiny_model), ports)
    rows = read_metrics(runs)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # Window 0 cuts every first turn after its digit: no group can finish; from window 1 on, groups whose every
    # episode guessed right at once finish, the others take two more windows (feedback, second digit, <|end|>).
    assert rows[0]["partial_groups_finished"] == 0 and rows[0]["partial_carried"] == PROMPTS_PER_STEP * GROUP_SIZE
    assert sum(r["partial_groups_finished"] for r in rows) > 0
    assert max(r["token_lag_max"] or 0 for r in rows) >= 1  # a group's tokens of more than one version
    assert all(r["env_errors"] == 0 and r["partial_groups_dropped_stale"] == 0 for r in rows)
    trained = list(trained_rows(ports))
    assert trained and max(row[0].count(ASSISTANT) for row in trained) == 2
    for tokens, mask, logprobs, prompt_id in trained:
        # each policy token is one the engine produced from exactly the ids before it, with that call's logprob
        for j, flag in enumerate(mask):
            if flag:
                made = [(out, lps) for ctx, out, lps in ports.inference.turns
                        if len(ctx) == j and tokens[:j] == ctx and out[0] == tokens[j]]
                assert made and logprobs[j] in {lps[0] for _, lps in made}, (prompt_id, j)
        # a turn's digit and its <|end|> came from two calls: the digit's call stopped at the window ("length")
        digits = [j for j, flag in enumerate(mask) if flag and tokens[j] != END]
        assert all(tokens[j + 1] == END and mask[j + 1] == 1 for j in digits), prompt_id
    # the trainer's own forward agrees with the sampler on every policy token (each under the weights that made it
    # is checked in test_partial_rollouts_vllm.py with vLLM; here the probe's largest difference)
    assert [r["logprob_mismatch_max"] for r in rows if r.get("logprob_mismatch_max") is not None] \
        == [0.0] * sum(r.get("logprob_mismatch_max") is not None for r in rows)


@pytest.mark.timeout(60)
def test_with_partial_rollouts_a_run_resumed_while_episodes_are_half_made_equals_an_uninterrupted_one(
        runs, tiny_model):
    whole = FakePorts(env=FakeEnvironment())
    loop_once(partial_config(runs / "whole", tiny_model), whole)
    config = partial_config(runs / "resumed", tiny_model, interval=2)
    loop_once(config, FakePorts(env=FakeEnvironment()), steps=3)  # its checkpoint after step 2 holds live episodes
    assert read_metrics(runs / "resumed")[1]["partial_carried"] > 0
    second = FakePorts(env=FakeEnvironment())
    loop_once(config, second)
    assert untimed(runs / "resumed") == untimed(runs / "whole")
    assert (second.trainer.version, second.trainer.weights) == (whole.trainer.version, whole.trainer.weights)
