"""The vLLM adapter on CPU: n completions per prompt, seeded per chunk, with one logprob per sampled token."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from hpcrl.config import load_config
from hpcrl.data.prompts import Prompt

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def engine(tiny_model):
    from hpcrl.inference.engine import VllmEngine
    config = load_config(REPO / "configs" / "tiny_grpo.toml", overrides=[f"model.path={tiny_model}"])
    eng = VllmEngine.from_config(config)
    yield eng
    eng.close()


PROMPTS = [Prompt(id="a", text="1+2=", answer="3"), Prompt(id="b", text="rev abc:", answer="cba")]


@pytest.mark.timeout(300)
def test_every_prompt_gets_n_completions_with_a_logprob_per_token(engine):
    groups = engine.generate(PROMPTS, n=4, seed=7)
    assert [len(g) for g in groups] == [4, 4]
    for prompt, group in zip(PROMPTS, groups):
        for k, completion in enumerate(group):
            assert completion.prompt_id == prompt.id and completion.index == k
            assert 1 <= len(completion.token_ids) <= 8
            assert len(completion.logprobs) == len(completion.token_ids)
            assert all(lp <= 0 and math.isfinite(lp) for lp in completion.logprobs)
            assert completion.finish_reason in ("length", "stop")
            assert completion.weight_version == 0
        assert group[0].prompt_token_ids[0] == 1  # <bos>, then one token per character
        assert len(group[0].prompt_token_ids) == len(prompt.text) + 1


@pytest.mark.timeout(300)
def test_the_same_seed_draws_the_same_tokens_and_another_seed_others(engine):
    first = engine.generate(PROMPTS, n=4, seed=7)
    again = engine.generate(PROMPTS, n=4, seed=7)
    other = engine.generate(PROMPTS, n=4, seed=8)
    tokens = lambda groups: [[c.token_ids for c in g] for g in groups]  # noqa: E731
    assert tokens(first) == tokens(again)
    assert tokens(first) != tokens(other)


@pytest.mark.timeout(300)
def test_a_chunk_generated_again_draws_the_same_tokens_and_another_chunk_seed_others(engine):
    tokens = lambda groups: [[c.token_ids for c in g] for g in groups]  # noqa: E731
    first = engine.generate(PROMPTS, n=8, seed=7, offset=2)
    between = engine.generate(PROMPTS[::-1], n=3, seed=9, offset=0)  # other requests, other cache contents
    again = engine.generate(PROMPTS, n=8, seed=7, offset=2)
    other_chunk = engine.generate(PROMPTS, n=8, seed=7, offset=4)
    other_step = engine.generate(PROMPTS, n=8, seed=8, offset=2)
    assert tokens(first) == tokens(again)
    assert [[c.logprobs for c in g] for g in first] == [[c.logprobs for c in g] for g in again]
    assert tokens(first) != tokens(other_chunk) and tokens(first) != tokens(other_step)
    assert tokens(between) and all(len(g) == 3 for g in between)


@pytest.mark.timeout(300)
def test_a_chunk_draws_the_same_tokens_on_a_fresh_engine_as_on_one_that_served_others_before(engine, tiny_model):
    """What a resumed run and a chunk failed over to another replica rely on."""
    from hpcrl.inference.engine import VllmEngine

    engine.generate(PROMPTS[::-1], n=6, seed=11, offset=3)
    engine.token_logprobs([[1, 5, 6, 7]])
    served = engine.generate(PROMPTS, n=8, seed=7, offset=2)
    config = load_config(REPO / "configs" / "tiny_grpo.toml", overrides=[f"model.path={tiny_model}"])
    fresh = VllmEngine.from_config(config)
    try:
        again = fresh.generate(PROMPTS, n=8, seed=7, offset=2)
    finally:
        fresh.close()
    assert [[(c.token_ids, c.logprobs) for c in g] for g in served] == \
        [[(c.token_ids, c.logprobs) for c in g] for g in again]


@pytest.mark.timeout(300)
def test_generate_sends_one_unseeded_request_per_prompt_with_n_the_group_size(engine, monkeypatch):
    sent = []
    enqueue = engine.llm.enqueue

    def spy(prompts, params, **kwargs):
        sent.append((list(prompts), params))
        return enqueue(prompts, params, **kwargs)

    monkeypatch.setattr(engine.llm, "enqueue", spy)
    groups = engine.generate(PROMPTS, n=5, seed=1)
    assert len(sent) == 1  # one batch: the scheduler sees the whole chunk at its first step
    prompts, params = sent[0]
    assert prompts == [p.text for p in PROMPTS]
    assert params.n == 5 and params.seed is None  # vLLM's batched sampler, not one generator per request
    assert [[c.index for c in g] for g in groups] == [list(range(5))] * 2


@pytest.mark.timeout(300)
def test_a_chat_prompt_with_a_system_prompt_reaches_vllm_and_the_trainer_as_the_same_ids(engine, tiny_model,
                                                                                         monkeypatch):
    """The head renders once; vLLM generates from those ids (told to stop at the template's <|end|>) and
    the trainer trains on them, as one-turn episodes: its logprobs of the sampled tokens equal vLLM's (CPU, fp32)."""
    import asyncio

    from hpcrl.algorithms.base import Selection
    from hpcrl.data.chat import ChatTemplate
    from hpcrl.reward.types import RewardResult
    from hpcrl.rl.episodes import EpisodeRunner
    from hpcrl.rl.rollouts import batch_from_groups, score_groups
    from hpcrl.trainer import TrainerEngine

    chat = ChatTemplate(str(tiny_model), system_prompt="one")  # 15 tokens: the engine takes 16 (tiny_grpo.toml)
    prompts = chat.with_ids([Prompt(id="c", text="say 7:", answer="7"), Prompt(
        id="m", text="", answer="3", messages=[{"role": "user", "content": "say 3:"}])])
    sent = []
    enqueue = engine.llm.enqueue

    def spy(inputs, params, **kwargs):
        sent.append((list(inputs), params))
        return enqueue(inputs, params, **kwargs)

    monkeypatch.setattr(engine.llm, "enqueue", spy)
    config = load_config(REPO / "configs" / "tiny_grpo.toml", overrides=[f"model.path={tiny_model}"])
    episodes, _ = asyncio.run(EpisodeRunner(config, _OneTurnPorts(engine)).run(prompts, n=4, seed=5))
    (inputs, params), = sent
    assert [i["prompt_token_ids"] for i in inputs] == [p.token_ids for p in prompts]  # not tokenized again
    assert params.stop_token_ids == [102]  # <|end|>: not the eos token, nor in generation_config.json
    assert all(e.tokens[:len(p.token_ids or [])] == p.token_ids and e.turns == 1 for p, g in zip(prompts, episodes)
               for e in g)
    results = [RewardResult(id=e.id, prompt_id=e.prompt.id, reward=float(e.index)) for g in episodes for e in g]
    scored, _ = score_groups(episodes, results, weight_version=0)
    batch = batch_from_groups(scored, Selection(kept=[0, 1], advantages=[[1.0] * 4] * 2))
    assert [ids[:len(p.token_ids or [])] for ids, p in zip(batch.input_ids[::4], prompts)] == \
        [p.token_ids for p in prompts]
    rows = batch.rows()
    trainer = TrainerEngine.from_config(config, max_seq_len=64).logprobs(rows)
    assert (trainer - rows.old_logprobs)[rows.completion_mask].abs().max().item() < 1e-6


class _OneTurnPorts:
    """The episodes' ports without an environment: generate over the module's engine."""

    def __init__(self, engine) -> None:
        self.engine = engine

    async def generate(self, prompts, *, n, seed, temperature=None):
        return self.engine.generate(prompts, n=n, seed=seed, temperature=temperature)


class _TwoTurnPorts:
    """The episodes' ports over the module's engine and a two-try environment in this process (the environment
    workers are hpcrl.env's): reset says "g"; a first turn gets "x" back; a second ends the episode, unrewarded."""

    def __init__(self, engine) -> None:
        self.engine, self.calls = engine, []

    async def generate_turn(self, prompts, *, n, seed, max_tokens, temperature=None):
        self.calls.append(([list(p.token_ids) for p in prompts], list(max_tokens)))
        return self.engine.generate(prompts, n=n, seed=seed, max_tokens=max_tokens, temperature=temperature)

    async def env_reset(self, requests):
        from hpcrl.env.types import EnvReply
        return [EnvReply(episode=r.episode, messages=[{"role": "user", "content": "g"}]) for r in requests]

    async def env_step(self, requests):
        from hpcrl.env.types import EnvReply
        return [EnvReply(episode=r.episode, messages=[], done=True) if len(r.messages) > 3 else
                EnvReply(episode=r.episode, messages=[{"role": "user", "content": "x"}]) for r in requests]


@pytest.mark.timeout(300)
def test_an_episode_grows_from_the_ids_vllm_returned_and_the_trainer_scores_its_turns_as_vllm_sampled(engine,
                                                                                                       tiny_model):
    """[env] over real vLLM: each turn is generated from the episode's ids so far, which vLLM echoes unchanged;
    a turn's max_tokens is what the budget leaves; the trainer's logprobs of every policy token, over both turns,
    equal the sampling ones (fp32 on CPU: < 1e-6)."""
    import asyncio

    from hpcrl.algorithms.base import Selection
    from hpcrl.data.chat import ChatTemplate
    from hpcrl.reward.types import RewardResult
    from hpcrl.rl.episodes import EpisodeRunner
    from hpcrl.rl.rollouts import batch_from_groups, samples_for, score_groups
    from hpcrl.trainer import TrainerEngine

    config = load_config(REPO / "configs" / "tiny_grpo.toml", overrides=[
        f"model.path={tiny_model}", "data.format=chat", "env.environment=feedback", "env.max_tokens=17",
        "inference.max_tokens=4", "algorithm.filter_zero_variance=false"])
    ports = _TwoTurnPorts(engine)
    runner = EpisodeRunner(config, ports, ChatTemplate(str(tiny_model)))
    prompts = [Prompt(id="e", text="g", answer="1")]
    groups, stats = asyncio.run(runner.run(prompts, n=3, seed=4))
    episodes = groups[0]
    assert ports.calls[0] == ([[1, 100, 74, 102, 101]], [4])  # <bos><|user|>g<|end|><|assistant|>: one request, n=3
    for ids, limits in ports.calls[1:]:  # the second turn: from each episode's own ids, within the budget
        assert limits == [min(4, 17 - len(i)) for i in ids]
        assert all(any(e.tokens[:len(i)] == i for e in episodes) for i in ids)
    assert max(e.turns for e in episodes) == 2 and stats.env_errors == []
    assert all(len(e.tokens) <= 17 and e.finish_reason in ("done", "budget") for e in episodes)
    results = [RewardResult(id=s.id, prompt_id=s.prompt_id, reward=float(k)) for k, s in
               enumerate(samples_for(groups))]
    scored, _ = score_groups(groups, results, weight_version=0)
    rows = batch_from_groups(scored, Selection(kept=[0], advantages=[[1.0] * 3])).rows()
    trainer = TrainerEngine.from_config(config, max_seq_len=64).logprobs(rows)
    assert rows.completion_mask.sum().item() == sum(sum(e.mask) for e in episodes)
    assert (trainer - rows.old_logprobs)[rows.completion_mask].abs().max().item() < 1e-6


@pytest.mark.timeout(300)
def test_hpcrl_runs_ports_take_two_chunks_turns_at_once_to_vllm_one_after_the_other(engine):
    """Episodes' chunks call generate_turn concurrently; two calls into one LLM from two threads abort the process
    in ZeroMQ (docs/FACTS.md), so InProcessPorts makes them one at a time: both answer, as they would alone."""
    import asyncio
    import threading

    from hpcrl.launch.inprocess import InProcessPorts

    ports = object.__new__(InProcessPorts)  # its engines without starting a trainer: the module's vLLM engine
    ports.inference = engine
    ports._inference_turn = threading.Lock()
    asked = [Prompt(id=f"t{k}", text="", answer="", token_ids=[1, 100, 20 + k, 102, 101]) for k in range(2)]

    async def both():
        return await asyncio.gather(*(ports.generate_turn([p], n=2, seed=k, max_tokens=[2]) for k, p in enumerate(asked)))

    together = asyncio.run(both())
    alone = [engine.generate([p], n=2, seed=k, max_tokens=[2]) for k, p in enumerate(asked)]
    assert [[c.token_ids for c in g[0]] for g in together] == [[c.token_ids for c in g[0]] for g in alone]


@pytest.mark.timeout(300)
def test_token_logprobs_of_a_sampled_completion_equal_its_sampling_logprobs(engine):
    group = engine.generate(PROMPTS[:1], n=2, seed=3)[0]
    sequences = [c.prompt_token_ids + c.token_ids for c in group]
    scored = engine.token_logprobs(sequences)
    for completion, logprobs in zip(group, scored):
        assert len(logprobs) == len(completion.prompt_token_ids) + len(completion.token_ids) - 1
        tail = logprobs[-len(completion.token_ids):]
        assert max(abs(a - b) for a, b in zip(tail, completion.logprobs)) < 1e-4


@pytest.mark.timeout(60)
def test_a_one_rank_engine_on_cpu_runs_its_worker_inside_the_engine_core_bound_to_its_cpus(engine):
    """No worker process of its own: that third interpreter importing torch and vLLM was 7-8 s of the start."""
    from hpcrl.roles.reaper import descendants

    vllm = {pid: name for pid, name in descendants(os.getpid()).items() if name.startswith("VLLM::")}
    assert len(vllm) == 1, vllm  # before: VLLM::EngineCore and VLLM::Worker_TP0
    (core, name), = vllm.items()
    assert name.startswith("VLLM::EngineCor"), vllm  # the kernel keeps 15 characters of a title
    assert os.sched_getaffinity(core) == os.sched_getaffinity(0)


def test_the_openmp_environment_of_a_worker_binds_one_thread_to_each_cpu_of_its_binding():
    from hpcrl.inference.vllm_llm import InferenceError, omp_environment

    assert omp_environment("1") == {"OMP_NUM_THREADS": "1", "OMP_PLACES": "{1}", "OMP_PROC_BIND": "true"}
    assert omp_environment("0-2,5")["OMP_PLACES"] == "{0,1,2,5}"
    assert omp_environment("0-2,5")["OMP_NUM_THREADS"] == "4"
    assert omp_environment("auto")["OMP_NUM_THREADS"] == str(len(os.sched_getaffinity(0)))
    assert omp_environment("nobind") == {}
    with pytest.raises(InferenceError, match=r"'0\|1' is not a CPU list of one tensor-parallel rank"):
        omp_environment("0|1")


@pytest.mark.timeout(300)
def test_a_carried_sequence_goes_on_from_its_prefix_as_read_and_its_logprobs_are_the_whole_sequences(engine):
    """A partial rollout's next window (hpcrl.rl.partial): vLLM reads prompt ids + tokens so far as they are (no
    second <bos>) and samples on from them, each new token's logprob the one of the whole sequence's forward."""
    (first,) = engine.generate([PROMPTS[0]], n=1, seed=7, max_tokens=[3])
    prefix = first[0].prompt_token_ids + first[0].token_ids
    carried = Prompt(id="a", text=PROMPTS[0].text, answer="3", prefix=prefix)
    (group,) = engine.generate([carried, PROMPTS[1]], n=1, seed=8, max_tokens=[4, 4])[:1]
    (more,) = group
    assert more.prompt_token_ids == prefix and 1 <= len(more.token_ids) <= 4
    (scored,) = engine.token_logprobs([prefix + more.token_ids])
    assert max(abs(a - b) for a, b in zip(scored[len(prefix) - 1:], more.logprobs, strict=True)) < 1e-6


@pytest.mark.timeout(120)
def test_close_ends_vllms_client_thread_and_zmq_context_before_returning(engine):
    """Runs last: it closes the module's engine. vLLM's own shutdown leaves both to whichever thread
    drops them last, which can be the interpreter's teardown (docs/FACTS.md, "Teardown")."""
    client = engine.llm.llm_engine.engine_core
    thread, ctx = client.output_queue_thread, client.ctx
    assert thread.is_alive() and not ctx.closed
    engine.close()
    assert not thread.is_alive() and ctx.closed
    engine.close()  # a second close does nothing
