"""Processes for the transfer tests: trainer ranks and receivers that are not vLLM (spawned)."""

from __future__ import annotations

import traceback

import numpy as np


def _plan(spec: dict):
    from hpcrl.config.model_shapes import PRESETS
    from hpcrl.plan.transfer.layout import InferenceLayout, TrainerLayout
    from hpcrl.plan.transfer.planner import plan
    shape = PRESETS[spec["preset"]]
    if "shape" in spec:  # a variant of the preset (e.g. a MoE with an odd number of experts)
        import dataclasses
        shape = dataclasses.replace(shape, **spec["shape"])
    p = plan(TrainerLayout(**spec["trainer"]), InferenceLayout(**spec["inference"]), shape,
             wire_dtype=spec.get("wire_dtype", "float32"), bucket_bytes=spec.get("bucket", 1 << 16))
    if "round_bytes" in spec:
        import dataclasses
        p = dataclasses.replace(p, round_bytes=spec["round_bytes"])
    return p, shape


def id_shards(p, shape, rank: int) -> dict:
    """This trainer rank's local shards of tensors filled with element ids (as float32); a grouped
    expert stack's shard as FSDP2 holds torchtitan's, 3-D [experts here, rows, columns]."""
    import torch

    from hpcrl.plan.transfer.check import _hf_ids, _trainer_tensors
    from hpcrl.plan.transfer.layout import chunk_source_rows
    tensors = _trainer_tensors(p, shape, _hf_ids(shape))
    out = {}
    for s in p.sources:
        a, e = chunk_source_rows(s.shape[0], p.trainer.dp_shard, s.shard_rows)[rank % p.trainer.dp_shard]
        local = torch.from_numpy(tensors[s.name][a:e].astype(np.float32))
        out[s.name] = local.reshape(-1, s.shard_rows, s.shape[1]) if s.shard_rows > 1 else local
    return out


def transport(spec: dict) -> str:
    """The transport to open; "nccl-fake" is NCCL's transport over the strict fake (fake_pynccl.py)."""
    name = spec.get("transport", "gloo")
    if name.startswith("nccl-"):
        import fake_pynccl

        from hpcrl.transfer import nccl
        nccl.RUNTIME = {"nccl-fake": fake_pynccl.RUNTIME, "nccl-disabled": fake_pynccl.DISABLED_RUNTIME}[name]
        return "nccl"
    return name


def trainer(spec: dict, rank: int, store: str, results) -> None:
    import time

    from hpcrl.transfer.trainer import TrainerSender
    for generation in range(2 if "stall" in spec else 1):
        t0 = time.monotonic()
        try:
            p, shape = _plan(spec)
            sender = TrainerSender.connect(p, rank=rank, store=store, timeout_s=60,
                                           transport=transport(spec), generation=generation)
            sender.timeout_s = spec.get("timeout", 60)  # the transfer's deadline (forming may take longer)
            if spec.get("die_before_send") == rank:
                import os
                os._exit(3)
            if generation == 0 and spec.get("stall") == rank:  # alive, but not sending until the others gave up
                time.sleep(spec["timeout"] + 2)
                sender.close()
                continue
            sent = sender.send(id_shards(p, shape, rank))
            sender.close()
            results.put(("trainer", rank, "ok", sent, generation))
        except BaseException as err:  # noqa: BLE001 - reported to the test
            results.put(("trainer", rank, type(err).__name__, f"{err}\n{traceback.format_exc()[-600:]}", generation,
                         time.monotonic() - t0))


def receiver(spec: dict, replica: int, tp_rank: int, store: str, results) -> None:
    import time
    for generation in range(2 if "stall" in spec else 1):
        t0 = time.monotonic()
        try:
            import torch

            from hpcrl.plan.transfer.check import _hf_ids, vllm_expected
            from hpcrl.transfer import execute
            from hpcrl.transfer.registry import open_group
            spec_here = dict(spec, **spec.get("receiver_override", {}))
            p, shape = _plan(spec_here)
            rank = execute.inference_group_rank(p, replica, tp_rank)
            world = p.trainer.world_size + p.inference.replicas * p.inference.tensor_parallel
            group = open_group(transport(spec), store=store, rank=rank, world_size=world,
                               timeout_s=60, generation=generation)
            group.check_digests(rank=rank, digest=p.digest, describe=lambda r, p=p: execute.describe_group_rank(p, r))
            # As vLLM holds them: a rank with fewer experts (uneven expert parallel) has a smaller parameter.
            # (vocab padding rows stay: vLLM's embedding is padded on every rank).
            rows = {d.name: d.real_rows[tp_rank] if ".experts." in d.name else d.local_shape[0] for d in p.dests}
            dests = {d.name: torch.full((rows[d.name], d.local_shape[1]), -1.0) for d in p.dests}
            t0 = time.monotonic()
            try:
                got = execute.receive(group, p, replica, tp_rank, execute.check_dests(p, replica, tp_rank, dests),
                                      timeout_s=spec.get("timeout", 60))
            finally:
                group.close()
            expected = vllm_expected(p, shape, _hf_ids(shape), tp_rank)
            wrong = [d.name for d in p.dests if not np.array_equal(
                dests[d.name].numpy(), expected[d.name].astype(np.float32).reshape(d.local_shape)[:rows[d.name]])]
            results.put(("receiver", (replica, tp_rank), "ok" if not wrong else "wrong", wrong or got, generation))
        except BaseException as err:  # noqa: BLE001 - reported to the test
            results.put(("receiver", (replica, tp_rank), type(err).__name__, f"{err}", generation,
                         time.monotonic() - t0))


def fake_scenario(scenario: str, rank: int, store: str, results) -> None:
    """One rank of a two-rank exchange over the strict fake PyNccl (test_fake_pynccl.py)."""
    try:
        import time
        from datetime import timedelta

        import fake_pynccl
        import torch
        import torch.distributed as dist
        from vllm.distributed.utils import StatelessProcessGroup

        from hpcrl.rendezvous.meet import rendezvous_store
        client, prefix = rendezvous_store(store=store, rank=rank, world_size=2, timeout_s=60, generation=0)
        comm = fake_pynccl.StrictFakePyNccl(StatelessProcessGroup(rank=rank, world_size=2, store=prefix),
                                            torch.device("cpu"), op_timeout=timedelta(seconds=3))
        assert isinstance(prefix, dist.PrefixStore)
        sends = {"in-order": [torch.arange(3.0), torch.arange(5.0) + 10], "swapped": [torch.zeros(3), torch.zeros(5)],
                 "dtype": [torch.zeros(4, dtype=torch.bfloat16)]}[scenario]
        recvs = {"in-order": [torch.empty(3), torch.empty(5)], "swapped": [torch.empty(5), torch.empty(3)],
                 "dtype": [torch.empty(4)]}[scenario]
        comm.group_start()
        for t in sends if rank == 0 else recvs:
            (comm.send if rank == 0 else comm.recv)(t, 1 - rank)
        comm.group_end()
        done, end = comm.completion(), time.monotonic() + 20
        try:
            while not done():
                if time.monotonic() > end:
                    raise TimeoutError("the group did not finish within 20 s")
                time.sleep(0.001)
        finally:
            comm.destroy()
            comm.join()
        results.put((rank, "ok", [t.tolist() for t in recvs] if rank == 1 else None))
    except BaseException as err:  # noqa: BLE001 - reported to the test
        results.put((rank, type(err).__name__, str(err)))
