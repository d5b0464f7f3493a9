"""The reward role takes its device from the environment it is given, as the config asks."""

from __future__ import annotations

import pytest

from hpcrl.config import load_config
from hpcrl.reward.types import RewardError
from hpcrl.roles.reward import RewardRole
from hpcrl.slurm.identity import TaskIdentity


def test_a_reward_task_given_gpus_by_the_config_but_seeing_none_stops_with_the_reason(repo, tmp_path):
    (tmp_path / "config.json").write_text("{}")  # the check fails before any model is read
    config = load_config(repo / "configs" / "tiny_grpo.toml",
                         overrides=['reward.kind="model"', f"reward.model_path={tmp_path}", "groups.reward.gpus_per_node=1"])
    identity = TaskIdentity(group="reward", component=3, rank=0, group_size=1, replica=0, local_rank=0, node="n0",
                            node_index=0)
    with pytest.raises(RewardError, match=r"gpus_per_node = 1, but this reward task sees no GPU \(CUDA_VISIBLE_DEVICES=''\)"):
        RewardRole(config, identity, {"CUDA_VISIBLE_DEVICES": ""})


@pytest.mark.timeout(60)
def test_a_reward_task_with_an_environment_serves_env_calls_over_the_bus_and_a_hanging_one_never_delays_scoring(
        repo, tmp_path, monkeypatch):
    """env_step awaits the environment pool's own thread, not the engine thread that scores: a score call
    made while an environment hangs is answered at once, and the hang is an error reply at its timeout."""
    import asyncio
    import os
    import time

    from hpcrl.bus import BusConfig, PeerInfo, Router, Service, Worker, create_secret, load_secret
    from hpcrl.contract.calls import serve_endpoints

    monkeypatch.syspath_prepend(str(repo / "tests" / "env"))  # envs_for_tests: Misbehave
    config = load_config(repo / "configs" / "tiny_grpo.toml", overrides=[
        'env.environment="envs_for_tests:Misbehave"', "env.workers=2", "env.step_timeout_s=3", "reward.workers=1",
        "data.format=chat"])
    identity = TaskIdentity(group="reward", component=3, rank=0, group_size=1, replica=0, local_rank=0, node="n0",
                            node_index=0)
    role = RewardRole(config, identity, {})
    create_secret(tmp_path)
    secret = load_secret(tmp_path)
    row = {"id": "p", "prompt": "go", "answer": "7"}
    sample = {"id": "s/0", "prompt_id": "s", "prompt": "say 4:", "completion": "4", "answer": "4"}

    def step(episode: str, turn: str) -> dict:
        return {"episode": episode, "row": row, "messages": [{"role": "user", "content": "go"},
                                                             {"role": "assistant", "content": turn}]}

    async def hang_sent() -> None:
        """Until the hanging call is in its worker's hands."""
        while not any(job.request.episode == "p/0" for w in role.env._workers if w is not None for job in w.sent):
            await asyncio.sleep(0.01)

    async def serve() -> None:
        bus = BusConfig(heartbeat_interval=0.2, heartbeat_timeout=5.0, register_timeout=10)
        router = Router(run_id="r", secret=secret, address="tcp://127.0.0.1:0", config=bus)
        await router.start()
        worker = Worker(info=PeerInfo(run_id="r", group="reward", replica=0, pid=os.getpid()), secret=secret,
                        address=router.address, config=bus)
        serve_endpoints(worker, role.group, role.handlers())
        serving = asyncio.create_task(worker.serve())
        await router.wait_for_peers("reward", 1, timeout=10)
        reward = Service(router, "reward")
        first = await reward.route("env_reset", {"requests": [{"episode": "p/0", "row": row, "messages": []}]},
                                   timeout=20)
        assert first == [{"episode": "p/0", "messages": [{"role": "user", "content": "go"}], "reward": None,
                          "done": False, "error": None, "seconds": first[0]["seconds"]}]
        hanging = asyncio.create_task(reward.route("env_step", {"requests": [step("p/0", "hang"), step("p/1", "done")]},
                                                   timeout=20))
        await asyncio.wait_for(hang_sent(), 10)
        started = time.monotonic()
        scored = await reward.route("score", {"samples": [sample]}, timeout=20)
        assert scored[0]["reward"] == 1.0 and time.monotonic() - started < 2.0 and not hanging.done()
        replies = await hanging
        assert "episode p/0: timed out after 3 s" in replies[0]["error"] and replies[0]["messages"] is None
        assert (replies[1]["reward"], replies[1]["done"], replies[1]["error"]) == (1.0, True, None)
        router.dismiss("reward/0/0", 0, "done")
        await asyncio.wait_for(serving, 10)
        await router.close()

    try:
        assert {endpoint.name for endpoint in role.handlers()} == {"score", "env_reset", "env_step"}
        asyncio.run(serve())
        assert role.env is not None and role.env.restarts == 1
    finally:
        role.close()
