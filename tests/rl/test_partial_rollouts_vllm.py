"""A generation continued across a weight sync on a real vLLM engine (CPU, the tiny model), through the same
ports `hpcrl run` drives: its tokens carry two weight versions, and the trainer's logprob of each token under the
weights that sampled it is vLLM's (docs/ARCHITECTURE.md, "Partial rollouts")."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from hpcrl.config import load_config
from hpcrl.data.types import Prompt
from hpcrl.rl.partial import PartialState
from hpcrl.trainer.types import TrainBatch

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow]

SEGMENT = 4


async def window(ports, state: PartialState, prompts: list[Prompt], *, seed: int) -> None:
    requests = state.plan_window(prompts, group_size=4, segment=SEGMENT, budget=12)
    made = await ports.generate_turn([r.prompt for r in requests], n=1, seed=seed,
                                     max_tokens=[r.max_tokens for r in requests])
    state.apply_window(requests, [group[0] for group in made])


def largest_gap(trainer: list[float], member, version: int) -> float:
    """|trainer - vLLM| over the member's tokens sampled with `version` (the trainer gives every token after the first)."""
    start = len(member.prompt_ids)
    return max(abs(trainer[start + k - 1] - lp)
               for k, (lp, v) in enumerate(zip(member.logprobs, member.versions)) if v == version)


@pytest.mark.extended  # 28-46 s on the 2-vCPU VM, most of it starting vLLM and the trainer (CI's budget is spent)
@pytest.mark.timeout(300)
def test_a_generation_continued_across_a_sync_carries_two_versions_each_matching_the_weights_that_sampled_it(
        tiny_model):
    from hpcrl.launch.inprocess import InProcessPorts

    config = load_config(REPO / "configs" / "tiny_long_grpo.toml", overrides=[
        f"model.path={tiny_model}", "algorithm.partial_rollouts=true", f"algorithm.partial_tokens={SEGMENT}",
        "inference.max_tokens=12", "reward.workers=1"])
    ports = InProcessPorts(config)

    async def scenario() -> None:
        await ports.sync_weights(0)
        state = PartialState()
        await window(ports, state, [Prompt(id="a", text="x 5:", answer="xxxxx"),
                                    Prompt(id="b", text="x 9:", answer="xxxxxxxxx")], seed=11)
        carried = [m for g in state.groups for m in g.members if not m.finished]
        assert carried, "every sequence stopped within the first window"
        before = await ports.trainer_logprobs([m.prompt_ids + m.tokens for m in carried])
        # a train step on the window's sequences moves the weights; version 1 goes to vLLM
        members = [m for g in state.groups for m in g.members]
        batch = TrainBatch(prompt_ids=["a"] * len(members), input_ids=[m.prompt_ids + m.tokens for m in members],
                           policy_mask=[[0] * len(m.prompt_ids) + [1] * len(m.tokens) for m in members],
                           logprobs=[[0.0] * len(m.prompt_ids) + m.logprobs for m in members],
                           advantages=[1.0 if k % 2 else -1.0 for k in range(len(members))],
                           rewards=[0.0] * len(members))
        await ports.train_step(batch, step=0)
        await ports.sync_weights(1)
        await window(ports, state, [], seed=12)  # the carried sequences go on from their tokens, on version 1
        after = await ports.trainer_logprobs([m.prompt_ids + m.tokens for m in carried])
        gaps = [(largest_gap(old, m, 0), largest_gap(new, m, 1), largest_gap(new, m, 0))
                for m, old, new in zip(carried, before, after)]
        print(f"{len(carried)} sequences continued across the sync; largest |trainer - vLLM|: version 0's tokens "
              f"{max(g[0] for g in gaps):.2e}, version 1's {max(g[1] for g in gaps):.2e}; version 0's tokens under "
              f"version 1's weights at least {min(g[2] for g in gaps):.2e}")
        for member, old, new in zip(carried, before, after):
            assert set(member.versions) == {0, 1}
            assert member.versions == sorted(member.versions) and member.versions.count(0) == SEGMENT
            assert largest_gap(old, member, 0) < 1e-6  # version 0's tokens against version 0's weights
            assert largest_gap(new, member, 1) < 1e-6  # version 1's tokens against version 1's weights
            assert largest_gap(new, member, 0) > 1e-5  # the weights moved: version 1 would not have matched them

    try:
        asyncio.run(scenario())
    finally:
        ports.close()
