"""Executing plans over a real transfer group between worker processes (tests/forked.py; no vLLM), over gloo, over
UCX and over the NCCL transport driven by a strict fake PyNccl (fake_pynccl.py, gloo underneath):
element-exact, digest mismatches and dead or stalled peers become errors naming ranks and
parameters, never hangs."""

from __future__ import annotations

import queue

import forked
import procs
import pytest
import torch

from hpcrl.errors import TransferError
from hpcrl.rendezvous.meet import client_store, serve_store
from hpcrl.transfer import execute


def run(spec: dict, *, deadline: float = 90.0) -> list[tuple]:
    results = forked.context().Queue()
    store = serve_store()
    t, inf = spec["trainer"], spec["inference"]
    world = t.get("dp_replicate", 1) * t["dp_shard"]
    children = [forked.process(procs.trainer, spec, r, store.address, results) for r in range(world)]
    children += [forked.process(procs.receiver, spec, j, r, store.address, results)
                 for j in range(inf.get("replicas", 1)) for r in range(inf["tensor_parallel"])]
    for c in children:
        c.start()
    out = []
    try:
        expected = len(children) - (1 if "die_before_send" in spec else 0)
        if "stall" in spec:  # every process forms the group twice; the stalled rank reports the second only
            expected = 2 * len(children) - 1
        while len(out) < expected:
            out.append(results.get(timeout=deadline))
    except queue.Empty:
        pass
    finally:
        for c in children:
            c.join(timeout=5)
            if c.is_alive():
                c.kill()
                c.join()
    return out


def needs(transport: str) -> str:
    if transport == "ucx":
        pytest.importorskip("ucxx")  # the optional UCX transport: tools/setup_env.sh installs it
    return transport


TRANSPORTS = ["gloo", "ucx", "nccl-fake"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("round_bytes", [1 << 28, 20000], ids=["one-round", "many-rounds"])
def test_three_fsdp_ranks_feed_two_replicas_at_tp2_element_exact(transport, round_bytes):
    spec = {"preset": "tiny-qwen2", "trainer": {"dp_shard": 3}, "inference": {"replicas": 2, "tensor_parallel": 2},
            "bucket": 8192, "transport": needs(transport), "round_bytes": round_bytes}
    out = run(spec)
    assert len(out) == 7, out
    assert all(r[2] == "ok" for r in out), out
    sent = sum(r[3] for r in out if r[0] == "trainer")
    received = sum(r[3] for r in out if r[0] == "receiver")
    assert sent == received > 0


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("transport", "path"), [("gloo", "gather"), ("ucx", "gather"), ("nccl-fake", "gather"),
                                                 ("gloo", "triton")])
def test_each_packing_path_feeds_two_replicas_at_tp2_element_exact_over_many_rounds(transport, path, monkeypatch):
    """The round-at-once packing paths (hpcrl.transfer.packing) through the transports, the next
    round packed while one is on the wire. "triton" runs in Triton's interpreter on CPU tensors
    (float32 wire: the interpreter truncates float32 -> bf16 where a GPU rounds)."""
    if path == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("HPCRL_PACKING", path)  # inherited by the ranks (tests/forked.py sends the environment)
    spec = {"preset": "tiny-qwen2", "trainer": {"dp_shard": 3}, "inference": {"replicas": 2, "tensor_parallel": 2},
            "bucket": 8192, "transport": needs(transport), "round_bytes": 20000}
    out = run(spec)
    assert len(out) == 7 and all(r[2] == "ok" for r in out), out
    assert sum(r[3] for r in out if r[0] == "trainer") == sum(r[3] for r in out if r[0] == "receiver") > 0


@pytest.mark.timeout(180)
def test_an_hsdp_trainer_feeds_tp2_element_exact():
    spec = {"preset": "tiny-llama", "trainer": {"dp_replicate": 2, "dp_shard": 2},
            "inference": {"replicas": 1, "tensor_parallel": 2}}
    out = run(spec)
    assert len(out) == 6 and all(r[2] == "ok" for r in out), out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("inference", [{"tensor_parallel": 2}, {"tensor_parallel": 2, "expert_parallel": True},
                                       {"tensor_parallel": 3, "expert_parallel": True,  # 6 / 3 heads, vocab 150: TP 3
                                        "expert_placement": "round_robin"}], ids=["tp2", "ep2", "ep3-round-robin"])
def test_grouped_expert_shards_of_two_fsdp_ranks_fill_fused_experts_element_exact(inference):
    """A MoE of 7 experts (uneven over 2 FSDP ranks, EP 2 and EP 3) whose trainer holds torchtitan's
    3-D expert stacks: each rank's FSDP shard [experts here, I, H] goes as is, and each vLLM rank's
    w13/w2 (smaller under uneven EP: fewer real rows) equals the reference gather
    (plan.transfer.check.vllm_expected: vLLM's weight_loader re-derived expert by expert)."""
    heads = {"num_heads": 6, "num_kv_heads": 3, "vocab_size": 150} if inference["tensor_parallel"] == 3 else {}
    spec = {"preset": "tiny-qwen3-moe", "shape": {"num_experts": 7, **heads}, "trainer": {"dp_shard": 2, "grouped_experts": True},
            "inference": {"replicas": 1, **inference}, "bucket": 4096, "round_bytes": 20000}
    out = run(spec)
    assert len(out) == 2 + inference["tensor_parallel"], out
    assert all(r[2] == "ok" for r in out), out
    assert sum(r[3] for r in out if r[0] == "trainer") == sum(r[3] for r in out if r[0] == "receiver") > 0


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_different_plans_fail_the_handshake_on_every_rank_naming_the_ranks(transport):
    spec = {"preset": "tiny-llama", "trainer": {"dp_shard": 2}, "inference": {"replicas": 1, "tensor_parallel": 1},
            "receiver_override": {"bucket": 4096}, "transport": needs(transport)}
    out = run(spec)
    assert len(out) == 3
    for r in out:
        assert r[2] == "TransferError" and "transfer plans differ" in r[3]
    assert any("replica 0 TP rank 0 has" in r[3] or "trainer rank 0 has" in r[3] for r in out)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_trainer_dying_mid_transfer_is_a_timeout_error_naming_parameter_and_ranks(transport):
    spec = {"preset": "tiny-llama", "trainer": {"dp_shard": 2}, "inference": {"replicas": 1, "tensor_parallel": 1},
            "die_before_send": 1, "timeout": 10, "transport": needs(transport)}
    out = run(spec, deadline=60)
    receivers = [r for r in out if r[0] == "receiver"]
    assert receivers and receivers[0][2] == "TransferError", out
    # gloo and UCX name the message that failed; NCCL fails a round as one and names its peers
    assert "to replica 0 TP rank 0" in receivers[0][3] and "trainer rank 1" in receivers[0][3], receivers
    assert "model." in receivers[0][3]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["nccl-fake"])  # gloo's and UCX's re-formation: tests/rl, tests/faults
def test_a_stalled_trainer_is_a_transfer_error_within_the_deadline_and_the_group_then_forms_again(transport):
    """Trainer rank 1 joins but sends nothing (a hung rank): its receivers fail within the
    deadline naming the ranks, every rank forms the group again (generation 1, as ports.py does
    after a failure) and that transfer is element-exact."""
    timeout = 8
    spec = {"preset": "tiny-qwen2", "trainer": {"dp_shard": 3}, "inference": {"replicas": 2, "tensor_parallel": 2},
            "bucket": 8192, "round_bytes": 20000, "stall": 1, "timeout": timeout, "transport": needs(transport)}
    out = run(spec, deadline=120)
    first = [r for r in out if r[0] == "receiver" and r[4] == 0]
    assert len(first) == 4 and all(r[2] == "TransferError" for r in first), out
    assert all("trainer rank 1" in r[3] for r in first), first
    assert all(r[5] < timeout + 5 for r in first), [r[5] for r in first]
    second = [r for r in out if r[4] == 1]
    assert len(second) == 7 and all(r[2] == "ok" for r in second), out


def test_a_missing_or_misshaped_local_shard_is_named_before_anything_is_sent():
    p, shape = procs._plan({"preset": "tiny-llama", "trainer": {"dp_shard": 3}, "inference": {"tensor_parallel": 2}})
    shards = procs.id_shards(p, shape, 2)
    del shards["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(TransferError, match=r"trainer rank 2 has no tensor 'model.layers.1.mlp.up_proj.weight'"):
        execute.check_sources(p, 2, shards)
    shards = procs.id_shards(p, shape, 2)
    shards["model.norm.weight"] = torch.zeros(43)
    with pytest.raises(TransferError, match=r"local shard of model.norm.weight is \(43,\), the plan expects \(42, 1\)"):
        execute.check_sources(p, 2, shards)


def test_a_destination_of_the_wrong_dtype_is_named_with_its_ranks():
    p, _ = procs._plan({"preset": "tiny-llama", "trainer": {"dp_shard": 1}, "inference": {"tensor_parallel": 2}})
    dests = {d.name: torch.zeros(d.local_shape) for d in p.dests}
    dests["model.layers.0.self_attn.qkv_proj.weight"] = torch.zeros(128, 128, dtype=torch.bfloat16)
    with pytest.raises(TransferError, match="replica 0 TP rank 1: model.layers.0.self_attn.qkv_proj.weight is torch.bfloat16"):
        execute.check_dests(p, 0, 1, dests)


def test_a_disabled_pynccl_is_refused_before_anything_is_sent():
    """PyNccl without a loadable libnccl (this machine) makes every send a silent no-op: opening
    the NCCL transport over it is an error naming the cause, and so is the real communicator here."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    from hpcrl.transfer.nccl import check_communicator

    store = client_store(serve_store().address, timeout_s=10)
    group = StatelessProcessGroup(rank=0, world_size=2, store=torch.distributed.PrefixStore("t", store))
    real = PyNcclCommunicator(group, device=0)
    assert real.disabled  # no CUDA NCCL here: the condition the guard exists for
    with pytest.raises(TransferError, match="reports itself unavailable or disabled"):
        check_communicator(real, rank=0)
    out = run({"preset": "tiny-llama", "trainer": {"dp_shard": 1}, "inference": {"replicas": 1, "tensor_parallel": 1},
               "transport": "nccl-disabled", "timeout": 10}, deadline=60)
    assert len(out) == 2 and all(r[2] == "TransferError" and "unavailable or disabled" in r[3] for r in out), out


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device: the premise is none")
def test_the_nccl_transport_refuses_to_open_without_a_cuda_device():
    from hpcrl.transfer.registry import open_group

    store = serve_store()
    with pytest.raises(TransferError, match="needs a CUDA device"):
        open_group("nccl", store=store.address, rank=0, world_size=2, timeout_s=5)


def test_a_round_that_cannot_be_issued_names_every_peer_of_the_round():
    """gloo fails a post on any pair once one peer of the context closed its connection (a trainer rank
    died): the rank to blame need not be the first message's, so the error names all of the round's."""
    from hpcrl.config.model_shapes import preset
    from hpcrl.plan.transfer.layout import InferenceLayout, TrainerLayout
    from hpcrl.plan.transfer.planner import plan as plan_transfer

    plan = plan_transfer(TrainerLayout(dp_shard=2), InferenceLayout(replicas=1, tensor_parallel=1),
                         preset("tiny-llama"), wire_dtype="float32", bucket_bytes=4096)
    batch = next(b for b in execute.schedule(plan) if {m.src_rank for m in b} == {0, 1})
    first = batch[0].src_rank
    with pytest.raises(TransferError, match=rf"from trainer rank {first} to replica 0 TP rank 0 and \d+ more in its "
                                            rf"round \(its round also with trainer rank {1 - first}\) could not be "
                                            "issued: Connection closed by peer"):
        with execute._issuing(plan, batch, "dest"):
            raise RuntimeError("Connection closed by peer")
