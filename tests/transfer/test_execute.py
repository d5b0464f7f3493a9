"""Executing plans over a real transfer group between spawned processes (no vLLM), over gloo and
over UCX: element-exact, digest mismatches and dead peers become errors naming ranks and
parameters, never hangs."""

from __future__ import annotations

import multiprocessing as mp
import queue

import procs
import pytest
import torch

from hpcrl.errors import TransferError
from hpcrl.transfer import execute
from hpcrl.transfer.rendezvous import host_store


def run(spec: dict, *, deadline: float = 90.0) -> list[tuple]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = host_store(timeout_s=deadline)
    t, inf = spec["trainer"], spec["inference"]
    world = t.get("dp_replicate", 1) * t["dp_shard"]
    children = [ctx.Process(target=procs.trainer, args=(spec, r, store.port, results)) for r in range(world)]
    children += [ctx.Process(target=procs.receiver, args=(spec, j, r, store.port, results))
                 for j in range(inf.get("replicas", 1)) for r in range(inf["tensor_parallel"])]
    for c in children:
        c.start()
    out = []
    try:
        expected = len(children) - (1 if "die_before_send" in spec else 0)
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


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["gloo", "ucx"])
@pytest.mark.parametrize("round_bytes", [1 << 28, 20000], ids=["one-round", "many-rounds"])
def test_three_fsdp_ranks_feed_two_replicas_at_tp2_element_exact(transport, round_bytes):
    spec = {"preset": "tiny-qwen2", "trainer": {"dp_shard": 3}, "inference": {"replicas": 2, "tensor_parallel": 2},
            "bucket": 8192, "transport": needs(transport), "round_bytes": round_bytes}
    out = run(spec)
    assert len(out) == 7, out
    assert all(status == "ok" for _, _, status, _ in out), out
    sent = sum(n for role, _, _, n in out if role == "trainer")
    received = sum(n for role, _, _, n in out if role == "receiver")
    assert sent == received > 0


@pytest.mark.timeout(180)
def test_hsdp_torchtitan_fused_qkv_trainer_feeds_tp2_element_exact():
    spec = {"preset": "tiny-llama", "trainer": {"dp_replicate": 2, "dp_shard": 2, "naming": "torchtitan"},
            "inference": {"replicas": 1, "tensor_parallel": 2}}
    out = run(spec)
    assert len(out) == 6 and all(status == "ok" for _, _, status, _ in out), out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["gloo", "ucx"])
def test_different_plans_fail_the_handshake_on_every_rank_naming_the_ranks(transport):
    spec = {"preset": "tiny-llama", "trainer": {"dp_shard": 2}, "inference": {"replicas": 1, "tensor_parallel": 1},
            "receiver_override": {"bucket": 4096}, "transport": needs(transport)}
    out = run(spec)
    assert len(out) == 3
    for _, _, status, message in out:
        assert status == "TransferError" and "transfer plans differ" in message
    assert any("replica 0 TP rank 0 has" in m or "trainer rank 0 has" in m for *_, m in out)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["gloo", "ucx"])
def test_a_trainer_dying_mid_transfer_is_a_timeout_error_naming_parameter_and_ranks(transport):
    spec = {"preset": "tiny-llama", "trainer": {"dp_shard": 2}, "inference": {"replicas": 1, "tensor_parallel": 1},
            "die_before_send": 1, "timeout": 10, "transport": needs(transport)}
    out = run(spec, deadline=60)
    receivers = [r for r in out if r[0] == "receiver"]
    assert receivers and receivers[0][2] == "TransferError", out
    assert "from trainer rank 1 to replica 0 TP rank 0" in receivers[0][3]
    assert "model." in receivers[0][3]


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
