"""The contract over real bus sockets: a head's GroupClient and a task's typed handlers (serve_endpoints).

A malformed request is answered with BadRequest naming the endpoint and the field, and the task serves
on; a malformed reply raises BadReply naming the peer; an endpoint outside the contract, or one the
peer does not serve, is refused before anything is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

import pytest

from hpcrl.bus import BusConfig, PeerInfo, Router, Worker, create_secret, load_secret
from hpcrl.bus.errors import RemoteError, UnknownEndpointError
from hpcrl.config.groups import REWARD
from hpcrl.contract.calls import GroupClient, serve_endpoints
from hpcrl.contract.endpoints import (
    BadReply,
    CheckpointCall,
    EnvCall,
    RewardEndpoints,
    ScoreCall,
    TrainerEndpoints,
    UnknownEndpoint,
)
from hpcrl.reward.types import RewardResult, Sample

BUS = BusConfig(heartbeat_interval=0.1, heartbeat_timeout=2.0, register_timeout=10)
SAMPLE = Sample(id="s/0", prompt_id="s", prompt="1+2=", completion="3", answer="3")


async def exact_match(call: ScoreCall) -> list[RewardResult]:
    """The reward group's score, as a test's: 1.0 where the completion is the answer."""
    return [RewardResult(id=s.id, prompt_id=s.prompt_id, reward=float(s.completion == s.answer)) for s in call.samples]


@contextlib.asynccontextmanager
async def reward_task(tmp_path, add_endpoints):
    """A head and one reward task on real sockets; `add_endpoints(worker)` gives the task its endpoints."""
    create_secret(tmp_path)
    secret = load_secret(tmp_path)
    async with Router(run_id="r", secret=secret, address="tcp://127.0.0.1:0", config=BUS) as head:
        worker = Worker(info=PeerInfo(run_id="r", group=REWARD, replica=0, pid=os.getpid()), secret=secret,
                        address=head.address, config=BUS)
        add_endpoints(worker)
        serving = asyncio.create_task(worker.serve())
        try:
            await head.wait_for_peers(REWARD, 1, timeout=10)
            yield head
        finally:
            worker.stop("test over")
            await asyncio.wait_for(serving, 5)


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))


@pytest.mark.timeout(60)
def test_a_malformed_request_is_answered_with_an_error_naming_the_endpoint_and_field_and_the_task_serves_on(tmp_path):
    async def go() -> None:
        async with reward_task(tmp_path, lambda w: serve_endpoints(w, REWARD, {RewardEndpoints.score: exact_match})) as head:
            good = {"id": "s/0", "prompt_id": "s", "prompt": "1+2=", "completion": "3", "answer": "3"}
            refusals = [({"samples": [{"id": "s/0"}]}, "field 'samples[0].answer' is missing"),
                        ({"samples": [good], "colour": 1}, "field 'colour' is not a field of ScoreCall"),
                        ({"samples": [{**good, "answer": 3}]}, "field 'samples[0].answer' must be a str, got int 3"),
                        (None, "must be a map of ScoreCall's fields, got NoneType None")]
            for args, problem in refusals:
                with pytest.raises(RemoteError) as refused:
                    await head.request("reward/0/0", "score", args, timeout=10)
                assert refused.value.peer == "reward/0/0" and refused.value.error_type == "BadRequest"
                assert refused.value.remote_message.startswith("reward.score request: ") \
                    and problem in refused.value.remote_message
            reward = GroupClient(head, REWARD)  # the task still serves, and a typed call gets typed results
            assert await reward.route(RewardEndpoints.score, ScoreCall(samples=[SAMPLE]), timeout=10) == [
                RewardResult(id="s/0", prompt_id="s", reward=1.0)]
    run(go())


@pytest.mark.timeout(60)
def test_a_malformed_reply_raises_on_the_calling_side_naming_the_peer_endpoint_and_field(tmp_path):
    def out_of_contract(worker: Worker) -> None:  # a task whose score answers what the contract does not declare
        worker.add_endpoint("score", lambda call: [{"id": "s/0", "prompt_id": "s", "reward": "high"}], idempotent=True)

    async def go() -> None:
        async with reward_task(tmp_path, out_of_contract) as head:
            reward = GroupClient(head, REWARD)
            for call in (reward.route(RewardEndpoints.score, ScoreCall(samples=[SAMPLE]), timeout=10),
                         reward.fanout(RewardEndpoints.score, ScoreCall(samples=[SAMPLE]), timeout=10),
                         reward.request("reward/0/0", RewardEndpoints.score, ScoreCall(samples=[SAMPLE]), timeout=10)):
                with pytest.raises(BadReply, match=r"^peer reward/0/0: reward\.score reply: field '\[0\]\.reward' "
                                                   r"must be a float, got str 'high'") as refused:
                    await call
                assert refused.value.endpoint is RewardEndpoints.score
    run(go())


@pytest.mark.timeout(60)
def test_an_endpoint_outside_the_contract_or_not_served_by_the_peer_is_refused_before_it_is_sent(tmp_path):
    async def go() -> None:
        async with reward_task(tmp_path, lambda w: serve_endpoints(w, REWARD, {RewardEndpoints.score: exact_match})) as head:
            reward = GroupClient(head, REWARD)
            with pytest.raises(UnknownEndpoint, match=r"trainer\.save is not an endpoint of group reward \(its "
                                                      r"endpoints: score, env_reset, env_step\)"):
                await reward.route(TrainerEndpoints.save, CheckpointCall(directory="/tmp/x"), timeout=10)
            # declared, but this task has no environment: the head refuses, naming the peer and what it serves
            with pytest.raises(UnknownEndpointError, match=r"peer reward/0/0: has no endpoint 'env_step' "
                                                           r"\(it exposes: score\)"):
                await reward.route(RewardEndpoints.env_step, EnvCall(requests=[]), timeout=10)
    run(go())


def test_a_task_refuses_to_serve_an_endpoint_of_another_group(tmp_path):
    create_secret(tmp_path)
    worker = Worker(info=PeerInfo(run_id="r", group=REWARD, replica=0), secret=load_secret(tmp_path),
                    address="tcp://127.0.0.1:1", config=BUS)

    async def save(call: CheckpointCall) -> None:
        raise AssertionError("never served")

    with pytest.raises(UnknownEndpoint, match=r"a task of group reward cannot serve trainer\.save: its endpoints are "
                                              r"score, env_reset, env_step"):
        serve_endpoints(worker, REWARD, {TrainerEndpoints.save: save})
