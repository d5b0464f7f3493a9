"""One vLLM engine serving LoRA (hpcrl's VllmEngine with [lora]) against trainer ranks sending PEFT adapters.

Run by test_vllm_lora_oracle.py as a subprocess in its own session (as oracle_driver.py). The adapters are made by
peft (get_peft_model on the tiny model + save_pretrained: adapter_config.json and adapter_model.safetensors), with
non-zero A and B drawn from a seed per version. For each version: that many trainer ranks hold the adapter's
tensors as FSDP2 Shard(0) local shards (torch.chunk rows, under PEFT's names without its prefix), the LoRA plan
moves them into a LoRA slot of the engine (versions 0, 1, ... as a run syncs them; adapter id = version + 1), and the driver prints one JSON line with
the slot's digests beside those of vLLM's own loading of the same PEFT directory (another adapter id), greedy
generations (base model, the synced version through the engine's own generate, vLLM's loading) and which
versions are resident. (A request for an evicted version is not tried: vLLM would look for its adapter at its
path, and a LoRAAdapterNotFoundError inside the engine core's step kills the engine: docs/FACTS.md.)

    python tests/transfer/lora_oracle_driver.py MODEL_DIR --preset tiny-llama --tp 1 --fsdp 2,3,1,2 --work DIR
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["1+2=", "rev abc:", "hello world", "7*6="]
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
#: Adapter ids of vLLM's own loadings (the references), far from the versions.
REFERENCE_ID = 1000


def make_adapter(model_dir: str, out: Path, *, rank: int, alpha: float, seed: int) -> Path:
    """A PEFT adapter directory for `model_dir` with every A and B drawn from `seed` (non-zero: it changes the
    model's output, unlike PEFT's initial B = 0)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(TARGETS)))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.save_pretrained(out)
    return out


def lora_plan(spec: dict, dp: int):
    from hpcrl.config.model_shapes import PRESETS
    from hpcrl.plan.transfer.layout import InferenceLayout, TrainerLayout
    from hpcrl.plan.transfer.planner import plan

    return plan(TrainerLayout(dp_shard=dp), InferenceLayout(tensor_parallel=spec["tp"], lora_rank=spec["rank"],
                                                            lora_targets=TARGETS),
                PRESETS[spec["preset"]], wire_dtype="float32", bucket_bytes=1 << 16)


def trainer_rank(adapter: str, spec: dict, rank: int, world: int, store: str, results) -> None:
    """Send this rank's Shard(0) rows of every adapter tensor (hpcrl.models.lora names) as FSDP2 holds them."""
    try:
        from safetensors.torch import load_file

        from hpcrl.models.lora import PEFT_PREFIX
        from hpcrl.plan.transfer.layout import chunk_rows
        from hpcrl.transfer.trainer import TrainerSender

        tensors = {k.removeprefix(PEFT_PREFIX): v for k, v in load_file(f"{adapter}/adapter_model.safetensors").items()}
        p = lora_plan(spec, world)
        shards = {}
        for s in p.sources:
            a, e = chunk_rows(s.shape[0], world)[rank]
            shards[s.name] = tensors[s.name][a:e].contiguous()
        sender = TrainerSender.connect(p, rank=rank, store=store, timeout_s=120)
        sent = sender.send(shards)
        sender.close()
        results.put((rank, "ok", sent))
    except BaseException as err:  # noqa: BLE001 - reported to the driver
        results.put((rank, type(err).__name__, f"{err}\n{traceback.format_exc()[-1500:]}"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--preset", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--fsdp", default="2,3,1,2", help="trainer sizes, one synced version each (versions 0, 1, ...)")
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--alpha", type=float, default=8.0)
    ap.add_argument("--versions", type=int, default=3, help="versions resident at once (max_policy_lag + 1)")
    ap.add_argument("--references", type=int, default=2, help="versions compared with vLLM's own loading")
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    os.environ["PYTHONPATH"] = f"{REPO}:{os.environ.get('PYTHONPATH', '')}"
    if args.tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % os.cpu_count()) for i in range(args.tp)))
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    from hpcrl.data.prompts import Prompt
    from hpcrl.inference.engine import VllmEngine
    from hpcrl.rendezvous.meet import serve_store
    from hpcrl.transfer.vllm_lora import adapter_id, slot_path

    work = Path(args.work)
    spec = {"preset": args.preset, "tp": args.tp, "rank": args.rank}
    adapters = [make_adapter(args.model, work / f"adapter-{v}", rank=args.rank, alpha=args.alpha, seed=1 + v)
                for v in range(len(args.fsdp.split(",")))]
    t0 = time.perf_counter()
    _keeper = serve_store()  # before vLLM starts: its workers inherit the stores' secret
    # The references take one slot beside the resident versions while compared (then removed).
    engine = VllmEngine(model_path=args.model, tensor_parallel=args.tp, on_cpu=True, dtype="float32", seed=0,
                        max_model_len=128, gpu_memory_utilization=0.15, enforce_eager=True, temperature=1.0,
                        top_p=1.0, top_k=-1, max_tokens=12, kv_cache_gib=0.05, weight_transfer=True,
                        lora_rank=args.rank, lora_alpha=args.alpha, lora_versions=args.versions)
    llm = engine.llm
    greedy = SamplingParams(temperature=0.0, max_tokens=12)

    def generate(lora_request=None) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, greedy, lora_request=lora_request,
                                                                   use_tqdm=False)]

    def version_request(v: int) -> LoRARequest:  # what a request started on version v holds
        return LoRARequest(lora_name=f"hpcrl-policy-{v}", lora_int_id=adapter_id(v), lora_path=slot_path(v))

    base = generate()
    print(json.dumps({"event": "engine", "seconds": time.perf_counter() - t0}), flush=True)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "safetensors.torch", "hpcrl.transfer.trainer", "hpcrl.plan.transfer.planner"])
    digests: dict[int, list[dict]] = {}
    generations: dict[int, list[list[int]]] = {}
    for version, (entry, adapter) in enumerate(zip(args.fsdp.split(","), adapters)):
        k = int(entry)
        p = lora_plan(spec, k)
        store = serve_store()
        results = ctx.Queue()
        procs = [ctx.Process(target=trainer_rank, args=(str(adapter), spec, r, k, store.address, results))
                 for r in range(k)]
        for proc in procs:
            proc.start()
        engine.connect_transfer(p, store=store.address, timeout_s=120)
        t1 = time.perf_counter()
        engine.receive_weights(version)
        sync_s = time.perf_counter() - t1
        trainers = [results.get(timeout=180) for _ in procs]
        for proc in procs:
            proc.join(timeout=30)
        digests[version] = llm.collective_rpc("hpcrl_lora_digests", args=(adapter_id(version),))
        chunk = engine.generate([Prompt(id=str(i), text=t, answer="") for i, t in enumerate(PROMPTS)], n=1, seed=0,
                                temperature=0.0)
        generations[version] = [g[0].token_ids for g in chunk]
        event = {"event": "update", "version": version, "fsdp": k, "trainers": trainers, "sync_s": sync_s,
                 "plan_bytes": int(p.elements().sum()) * p.itemsize,
                 "last": llm.collective_rpc("hpcrl_last_update"), "digests": digests[version],
                 "generation": generations[version], "generation_base": base,
                 "generation_lora_request": generate(engine.lora_request())}
        if version < args.references:
            ref_id = REFERENCE_ID + version
            reference = LoRARequest(lora_name=f"peft-{version}", lora_int_id=ref_id, lora_path=str(adapter))
            event["generation_reference"] = generate(reference)
            event["digests_reference"] = llm.collective_rpc("hpcrl_lora_digests", args=(ref_id,))
            # The train-inference mismatch probe's logprobs (engine.token_logprobs) come from the synced version too,
            # for a group of sequences as the probe scores them (several in one call: vllm#29955 crashed the engine).
            sequences = [event["generation_reference"][0], event["generation_reference"][0][:-2]]
            expected = []
            for sequence in sequences:
                scored = llm.generate([{"prompt_token_ids": sequence}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                                      lora_request=reference, use_tqdm=False)[0].prompt_logprobs
                expected.append([step[token].logprob for step, token in zip(scored[1:], sequence[1:])])
            event["logprobs_equal"] = engine.token_logprobs(sequences) == expected
            llm.llm_engine.remove_lora(ref_id)  # its slot back to the versions
        event["slots"] = llm.collective_rpc("hpcrl_lora_slots")  # per TP rank: the adapter id in each slot
        resident = [v for v in range(0, version + 1) if all(adapter_id(v) in ids for ids in event["slots"])]
        # Every earlier version still resident computes as when it was synced (a request started on it finishes on it).
        event["earlier"] = {v: {"digests_equal": llm.collective_rpc("hpcrl_lora_digests",
                                                                    args=(adapter_id(v),)) == digests[v],
                                "generation_equal": generate(version_request(v)) == generations[v]}
                            for v in resident if v != version}
        event["resident"] = resident
        print(json.dumps(event), flush=True)
        store = None
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
