"""The bus's contract: every endpoint declared once, each message checked field by field (no sockets here)."""

from __future__ import annotations

import pytest

from hpcrl.config.groups import INFERENCE, REWARD, TASK_GROUPS, TRAINER
from hpcrl.contract.endpoints import (
    ENDPOINTS,
    BadReply,
    BadRequest,
    GenerateCall,
    InferenceEndpoints,
    RewardEndpoints,
    TrainerEndpoints,
    TrainStepCall,
    UnknownEndpoint,
    endpoint,
)
from hpcrl.data.types import Prompt
from hpcrl.inference.types import Completion
from hpcrl.trainer.types import TrainBatch

GENERATE = InferenceEndpoints.generate


def prompt() -> Prompt:
    """A fresh prompt (an encoded request shares its lists: a test that spoils them spoils only its own)."""
    return Prompt(id="p0", text="1+2=", answer="3", token_ids=[5, 6])


def test_every_group_that_serves_the_head_declares_its_endpoints_and_no_name_twice_in_a_group():
    assert set(ENDPOINTS) == set(TASK_GROUPS)
    assert {name for table in ENDPOINTS.values() for name in table} == {
        "connect_transfer", "train_step", "send_weights", "logprobs", "save", "load", "generate",
        "receive_weights", "status", "score", "env_reset", "env_step"}
    assert all(e.group == group and e.name == name for group, table in ENDPOINTS.items() for name, e in table.items())
    # the same name on two groups is two endpoints: the trainer's logprobs answer None on ranks > 0
    assert endpoint(TRAINER, "logprobs") is TrainerEndpoints.logprobs is not InferenceEndpoints.logprobs
    assert not TrainerEndpoints.logprobs.idempotent and InferenceEndpoints.logprobs.idempotent


def test_a_request_crosses_as_a_map_and_comes_back_as_the_same_typed_request():
    call = GenerateCall(prompts=[prompt()], n=2, seed=7, offset=4, temperature=0.0, max_tokens=[16])
    args = GENERATE.encode_request(call)
    assert args["prompts"] == [{"id": "p0", "text": "1+2=", "answer": "3", "messages": None, "extra": {},
                                "token_ids": [5, 6], "prefix": None}]
    assert GENERATE.decode_request(args) == call
    batch = TrainBatch(prompt_ids=["p"], input_ids=[[1, 2]], policy_mask=[[0, 1]], logprobs=[[0.0, -0.5]],
                       advantages=[1.0], rewards=[1.0])
    train = TrainerEndpoints.train_step
    assert train.decode_request(train.encode_request(TrainStepCall(batch=batch, step=3))) == TrainStepCall(
        batch=batch, step=3)


@pytest.mark.parametrize(("change", "field", "problem"), [
    (lambda a: a.pop("seed"), "seed", "is missing"),
    (lambda a: a.update(n="2"), "n", "must be an int, got str '2'"),
    (lambda a: a.update(n=True), "n", "must be an int, got bool True"),
    (lambda a: a.update(colour="red"), "colour", "is not a field of GenerateCall"),
    (lambda a: a["prompts"][0].pop("text"), "prompts[0].text", "is missing"),
    (lambda a: a["prompts"][0]["token_ids"].append("7"), "prompts[0].token_ids[2]", "must be an int, got str '7'"),
    (lambda a: a.update(prompts={"p0": 1}), "prompts", "must be a list, got dict"),
], ids=["missing", "wrong-type", "bool-for-int", "extra", "nested-missing", "nested-element", "not-a-list"])
def test_a_malformed_request_is_refused_naming_the_endpoint_and_the_field(change, field, problem):
    args = GENERATE.encode_request(GenerateCall(prompts=[prompt()], n=2, seed=7))
    change(args)
    with pytest.raises(BadRequest, match=r"^inference\.generate request: field ") as refused:
        GENERATE.decode_request(args)
    assert refused.value.field == field and problem in str(refused.value)


def test_a_request_that_is_not_a_map_is_refused():
    with pytest.raises(BadRequest, match=r"inference\.generate request: must be a map of GenerateCall's fields, "
                                         r"got list \[1\]"):
        GENERATE.decode_request([1])


def test_a_malformed_reply_is_refused_naming_the_peer_the_endpoint_and_the_field():
    good = Completion(prompt_id="p0", index=0, prompt_token_ids=[1], token_ids=[2], logprobs=[-0.1], text="x",
                      finish_reason="stop", weight_version=3)
    reply = GENERATE.encode_reply([[good]])
    assert GENERATE.decode_reply(reply, peer="inference/0/0") == [[good]]
    reply[0][0]["logprobs"] = [-0.1, None]
    with pytest.raises(BadReply, match=r"peer inference/1/0: inference\.generate reply: field '\[0\]\[0\]\.logprobs"
                                       r"\[1\]' must be a float, got NoneType None") as refused:
        GENERATE.decode_reply(reply, peer="inference/1/0")
    assert refused.value.peer == "inference/1/0" and refused.value.field == "[0][0].logprobs[1]"


def test_an_int_is_a_float_on_the_wire_and_rank_replies_may_be_none_where_declared():
    assert TrainerEndpoints.train_step.decode_reply({"loss": 1, "lr": 0.5}, peer="trainer/0/0") == {"loss": 1, "lr": 0.5}
    assert TrainerEndpoints.train_step.decode_reply(None, peer="trainer/0/1") is None
    with pytest.raises(BadReply, match="must be a list, got NoneType None"):
        InferenceEndpoints.logprobs.decode_reply(None, peer="inference/0/0")


def test_an_unknown_endpoint_or_group_is_refused_with_what_there_is():
    with pytest.raises(UnknownEndpoint, match=r"group reward has no endpoint 'scor' \(its endpoints: score, "
                                              r"env_reset, env_step\)"):
        endpoint(REWARD, "scor")
    with pytest.raises(UnknownEndpoint, match=r"group 'head' has no endpoints on the bus \(groups that serve: "
                                              r"trainer, inference, reward\)"):
        endpoint("head", "generate")
    assert endpoint(INFERENCE, "generate") is GENERATE and endpoint(REWARD, "score") is RewardEndpoints.score
