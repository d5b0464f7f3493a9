"""Benchmark the resharding planner and the weight transfer; prints markdown for BENCHMARKS.md.

    PYTHONPATH=. python tools/bench_reshard.py                 # everything (a few minutes on 2 cores)
    PYTHONPATH=. python tools/bench_reshard.py --skip-update   # planner and bytes only (seconds)
    PYTHONPATH=. python tools/bench_reshard.py --transport ucx # (3) over UCX (pip install ucxx-cu12)

1. Planner time (best of --repeat) for Llama-3-70B (FSDP 64 -> 4 replicas x TP 8) and Llama-3-8B
   (FSDP 8 -> 4 x TP 2), and the checker's time.
2. Bytes per inference rank versus the minimum for every config in configs/, next to vLLM's NCCL
   engine (full tensors to every rank) and M2N engine (full tensors for fused / vocab-parallel
   parameters), from hpcrl.plan.transfer.baselines.
3. A real update in one run on this machine: a small Llama made here (random weights), vLLM on CPU
   at TP --tp, trainer FSDP2 over --fsdp gloo ranks. Ours: every trainer rank sends its local
   shards straight into the live vLLM parameters (LLM.start_weight_update / update_weights /
   finish_weight_update). Naive: full_tensor() of every parameter on the trainer, rank 0 writes a
   safetensors file to /dev/shm, then the worker's reload_weights via collective_rpc. Median of
   --rounds rounds each, wall time seen by the driver from "go" to "weights live".
"""

from __future__ import annotations

import argparse
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


def bench_planner(repeat: int) -> list[str]:
    from hpcrl.config.model_shapes import PRESETS
    from hpcrl.plan.transfer.check import check_plan
    from hpcrl.plan.transfer.layout import InferenceLayout, TrainerLayout
    from hpcrl.plan.transfer.planner import plan

    rows = [f"| model | trainer -> inference | blocks | messages | plan (best of {repeat}) | check | digest |",
            "|---|---|---:|---:|---:|---:|---:|"]
    for name, shard, replicas, tp in (("llama3-70b", 64, 4, 8), ("llama3-8b", 8, 4, 2)):
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            p = plan(TrainerLayout(dp_shard=shard), InferenceLayout(replicas=replicas, tensor_parallel=tp), PRESETS[name])
            best = min(best, time.perf_counter() - t0)
        t0 = time.perf_counter()
        check_plan(p)
        check = time.perf_counter() - t0
        t0 = time.perf_counter()
        _ = p.digest  # the property hashes the plan: this line is what is timed
        digest = time.perf_counter() - t0
        stats = p.stats()
        rows.append(f"| {name} | FSDP {shard} -> {replicas} x TP {tp} | {stats.blocks:,} | {stats.messages:,} | "
                    f"{best:.3f} s | {check:.3f} s | {digest:.3f} s |")
    return rows


def bench_bytes() -> list[str]:
    from hpcrl.cli.transfer_view import transfer_summary
    from hpcrl.config.load import load_config_and_shape

    rows = ["| config | trainer -> inference | bytes per inference rank | ours vs minimum | vLLM NCCL | vLLM M2N |"
            " sync at 400 Gbit/s (ours / NCCL) |",
            "|---|---|---:|---:|---:|---:|---:|"]
    for path in sorted((REPO / "configs").glob("*.toml")):
        config, shape = load_config_and_shape(path)
        s = transfer_summary(config, shape, link_gbps=400)
        t, inf = s["trainer"], s["inference"]
        rows.append(f"| {path.name} | {t['dp_replicate']} x {t['dp_shard']} -> {inf['replicas']} x TP "
                    f"{inf['tensor_parallel']} | {max(inf['received_bytes']) / 2**30:.3f} GiB | "
                    f"{s['ratio_to_minimum']:.2f}x | {s['baselines_ratio']['vllm-nccl']:.1f}x | "
                    f"{s['baselines_ratio']['vllm-m2n']:.1f}x | {s['predicted_sync_s']:.3f} s / "
                    f"{s['baselines_sync_s']['vllm-nccl']:.3f} s |")
    return rows


# ---- a real update: ours vs the naive path --------------------------------------------------

def make_checkpoint(shape, out: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    sys.path.insert(0, str(REPO / "tools"))
    from make_tiny_model import make_tokenizer

    tokenizer = make_tokenizer(shape.vocab_size)
    hf = shape.to_hf_config()
    model_type = hf.pop("model_type")
    hf.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
              pad_token_id=tokenizer.pad_token_id, initializer_range=0.02)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **hf), dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def trainer(ckpt: str, shape_json: str, rank: int, world: int, tp: int, fsdp_port: int, transfer_port: int,
            commands, replies, transport: str = "gloo") -> None:
    try:
        import torch
        import torch.distributed as dist
        from hf_module import checkpoint_module, local_shards
        from safetensors.torch import save_file
        from torch.distributed.fsdp import fully_shard

        from hpcrl.config.model_shapes import ModelShape
        from hpcrl.plan.transfer.layout import InferenceLayout, TrainerLayout
        from hpcrl.plan.transfer.planner import plan as plan_transfer
        from hpcrl.rendezvous.meet import client_store
        from hpcrl.transfer.trainer import TrainerSender

        store = client_store(f"tcp://127.0.0.1:{fsdp_port}", timeout_s=300)
        dist.init_process_group("gloo", store=dist.PrefixStore("fsdp", store), rank=rank, world_size=world)
        model = checkpoint_module(ckpt)
        mesh = dist.init_device_mesh("cpu", (world,))
        for layer in model.model.layers.children():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        p = plan_transfer(TrainerLayout(dp_shard=world), InferenceLayout(tensor_parallel=tp),
                          ModelShape(**json.loads(shape_json)), wire_dtype="float32")
        sender = TrainerSender.connect(p, rank=rank, store=f"tcp://127.0.0.1:{transfer_port}", timeout_s=300,
                                       transport=transport)
        replies.put((rank, "ready", 0.0))
        while True:
            command = commands.get(timeout=600)
            if command[0] == "stop":
                break
            t0 = time.perf_counter()
            with torch.no_grad():
                for prm in model.parameters():  # a stand-in optimizer step: new values every round
                    prm.data.to_local().add_(1e-3)
                if command[0] == "ours":
                    sender.send(local_shards(model))
                else:  # naive: gather every full tensor, rank 0 writes a checkpoint for reload_weights
                    full = {n: prm.data.full_tensor() for n, prm in model.named_parameters()}
                    if rank == 0:
                        save_file(full, command[1] + "/model.safetensors.tmp")
                        os.replace(command[1] + "/model.safetensors.tmp", command[1] + "/model.safetensors")
            replies.put((rank, command[0], time.perf_counter() - t0))
        sender.close()
        dist.destroy_process_group()
    except BaseException as err:  # noqa: BLE001 - reported to the driver
        replies.put((rank, "error", f"{err}\n{traceback.format_exc()[-1500:]}"))


def bench_update(*, tp: int, fsdp: int, rounds: int, transport: str = "gloo") -> list[str]:
    import dataclasses

    from hpcrl.config.model_shapes import PRESETS
    from hpcrl.plan.transfer.layout import InferenceLayout, TrainerLayout
    from hpcrl.plan.transfer.planner import plan as plan_transfer
    from hpcrl.rendezvous.meet import serve_store

    shape = dataclasses.replace(PRESETS["tiny-llama"], hidden_size=512, intermediate_size=1536, num_layers=8,
                                num_heads=8, num_kv_heads=4, head_dim=64, vocab_size=4096)
    work = Path(tempfile.mkdtemp(prefix="bench-reshard-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    ckpt = make_checkpoint(shape, work / "model")
    naive_dir = work / "naive"
    naive_dir.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (ckpt / name).exists():
            (naive_dir / name).write_bytes((ckpt / name).read_bytes())
    os.environ["PYTHONPATH"] = f"{REPO}:{os.environ.get('PYTHONPATH', '')}"
    if tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % os.cpu_count()) for i in range(tp)))
    from vllm import LLM

    kwargs = dict(model=str(ckpt), tensor_parallel_size=tp, dtype="float32", seed=0, max_model_len=128,
                  gpu_memory_utilization=0.15, enforce_eager=True, enable_prefix_caching=False,
                  worker_extension_cls="hpcrl.inference.vllm_worker.HpcrlWorkerExtension",
                  weight_transfer_config={"backend": "hpcrl"})
    if tp > 1:
        kwargs["distributed_executor_backend"] = "mp"
    _keeper = serve_store()  # before vLLM starts: its workers inherit the stores' secret (HPCRL_STORE_SECRET_DIR)
    llm = LLM(**kwargs)
    from hpcrl.transfer.vllm_engine import init_info

    plan = plan_transfer(TrainerLayout(dp_shard=fsdp), InferenceLayout(tensor_parallel=tp), shape, wire_dtype="float32")
    ctx = mp.get_context("spawn")
    fsdp_store, transfer_store = serve_store(), serve_store()
    commands, replies = [ctx.Queue() for _ in range(fsdp)], ctx.Queue()
    procs = [ctx.Process(target=trainer, args=(str(ckpt), json.dumps(dataclasses.asdict(shape)), r, fsdp, tp,
                                               fsdp_store.port, transfer_store.port, commands[r], replies,
                                               transport))
             for r in range(fsdp)]
    for proc in procs:
        proc.start()
    llm.init_weight_transfer_engine({"init_info": init_info(
        store=transfer_store.address, replica=0, trainer=plan.trainer, inference=plan.inference,
        wire_dtype="float32", bucket_bytes=plan.bucket_bytes, timeout_s=300, digest=plan.digest,
        transport=transport)})

    def collect(kind: str) -> list[float]:
        got = [replies.get(timeout=600) for _ in range(fsdp)]
        bad = [g for g in got if g[1] != kind]
        if bad:
            raise SystemExit(f"trainer failed: {bad}")
        return [g[2] for g in got]

    collect("ready")
    times: dict[str, list[float]] = {"ours": [], "naive": []}
    trainer_s: dict[str, list[float]] = {"ours": [], "naive": []}
    try:
        for _ in range(rounds):
            for kind in ("ours", "naive"):
                t0 = time.perf_counter()
                for q in commands:
                    q.put((kind, str(naive_dir)))
                if kind == "ours":
                    llm.start_weight_update()
                    llm.update_weights({"update_info": {"version": 1}})
                    llm.finish_weight_update()
                    trainer_s[kind].append(max(collect(kind)))
                else:
                    trainer_s[kind].append(max(collect(kind)))
                    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(naive_dir),
                                                                 "is_checkpoint_format": True})
                llm.reset_prefix_cache()
                times[kind].append(time.perf_counter() - t0)
    finally:
        for q in commands:
            q.put(("stop",))
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    stats = plan.stats()
    model_bytes = shape.num_parameters * 4
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = [f"Model: Llama-shaped, hidden 512, 8 layers, heads 8/4 x 64, vocab 4096: {shape.num_parameters / 1e6:.1f} M "
            f"parameters, {model_bytes / 2**20:.0f} MiB in float32. Trainer FSDP2 over {fsdp} gloo ranks, vLLM (vllm-cpu "
            f"0.32) at TP {tp}; median of {rounds} rounds, each after a stand-in optimizer step.",
            "",
            "| path | bytes moved into vLLM | wall time, go -> weights live (median) | of which trainer side | all rounds |",
            "|---|---:|---:|---:|---|",
            f"| ours: local shards -> live params ({transport} p2p) | {sum(stats.received_per_inference_rank) / 2**20:.1f} MiB "
            f"| {med['ours']:.3f} s | {statistics.median(trainer_s['ours']):.3f} s | "
            f"{', '.join(f'{t:.3f}' for t in times['ours'])} |",
            f"| naive: full_tensor + safetensors in /dev/shm + reload_weights | {model_bytes / 2**20:.1f} MiB written, "
            f"{tp} x {model_bytes / 2**20:.1f} MiB read | {med['naive']:.3f} s | "
            f"{statistics.median(trainer_s['naive']):.3f} s | {', '.join(f'{t:.3f}' for t in times['naive'])} |",
            "", f"Speed-up: {med['naive'] / med['ours']:.1f}x."]
    engine = getattr(llm, "llm_engine", None)
    shutdown = getattr(engine, "shutdown", None)
    if shutdown:
        shutdown()
    shutil.rmtree(work, ignore_errors=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5, help="planner runs (best is reported)")
    ap.add_argument("--skip-update", action="store_true", help="skip the real vLLM update (3)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--fsdp", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--transport", choices=["gloo", "ucx"], default="gloo", help="weight transport of ours (3)")
    args = ap.parse_args()
    out = ["### Planner", ""] + bench_planner(args.repeat)
    out += ["", "### Bytes per inference rank (shipped configs)", ""] + bench_bytes()
    if not args.skip_update:
        out += ["", "### A real update on this machine: ours vs the naive path", ""]
        out += bench_update(tp=args.tp, fsdp=args.fsdp, rounds=args.rounds, transport=args.transport)
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
