"""Where the trainer-vs-vLLM logprob mismatch on a real model comes from (issue 43).

    PYTHONPATH=. .venv/bin/python tools/bench/bench_mismatch.py --model models/smollm2-135m-instruct
    PYTHONPATH=. .venv/bin/python tools/bench/bench_mismatch.py --model ... --json /tmp/mismatch.json

On the same tokens (chat prompts rendered with the model's own template and their answers, and one
longer multi-turn chat), the logprob of every token after the first from

    fp64         transformers in float64: the reference (its RoPE angles are float32, as in every path)
    hf-fp32      transformers in float32
    trainer      hpcrl's trainer (TrainerEngine.sequence_logprobs: the torchtitan model, one process)
    vllm         vLLM in float32 as hpcrl starts it (hpcrl.inference.engine.VllmEngine: the probe's
                 scoring call, prompt_logprobs), and the logprobs it reports while generating (greedy
                 answers, the rollouts' decode path)

each against fp64 (mean and max |diff|), beside what a sync that did not deliver the weights reads
(one weight tensor, then all, rounded through bfloat16: the alarm's upper side). Then, vLLM's engine in
this process, forward hooks on every op of every decoder layer record its inputs and outputs on one
scoring pass, and each op is recomputed from those very inputs in float64 and with torch's own float32
kernel: the op whose vLLM kernel is noisier than torch's float32 is one that adds error; the logprob
of each token is recomputed from vLLM's own logits with its log_softmax and with logits - logsumexp.
Last (unless --no-swap), the scoring is re-run with groups of vLLM's kernels replaced in the running
engine by torch's float32 ones (logprobs: logits - logsumexp; linear and lm_head: torch's linear for
oneDNN; attention: SDPA; norm: RMSNorm in torch) to show what each is worth end to end; with all of
them but the logprobs (the trainer takes the sampler's log_softmax, hpcrl.trainer.loss) vLLM's
logprobs equal the trainer's bitwise. Figures: BENCHMARKS.md "Logprob mismatch on a real
model"; what they mean: docs/FACTS.md "Logprob precision on CPU".

Single process, CPU, float32. About 10 min on the shared 2-core VM (vLLM's start, transformers twice,
six scoring passes with swaps), 3 min of it the float64 reference.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
import torch.nn.functional as F

SYSTEM = "You are a helpful assistant. Answer briefly."
CHATS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Tom has 23 apples and buys 19 more. How many apples does he have now?",
     "Tom has 23 + 19 = 42 apples."),
    ("Name three primary colours.", "Red, yellow and blue."),
    ("Write a haiku about the sea.", "Waves fold into foam,\nsalt wind carries gull voices,\nthe tide keeps its time."),
]
LONG = [
    ("Explain in a few sentences how a bicycle stays upright.",
     "A moving bicycle stays upright mostly because the rider steers into the direction of a fall: when it "
     "leans left, the front wheel turns left and brings the wheels back under the centre of mass. The fork's "
     "trail and the front wheel's gyroscopic effect help it steer itself, so a bicycle rolling fast enough "
     "can balance even without a rider for a while."),
    ("And why is it hard to balance when standing still?",
     "Standing still, there is no forward motion, so steering cannot move the wheels under you; only small "
     "shifts of your body weight are left, and those are slow and weak compared with steering."),
    ("Give me two tips for learning to ride.",
     "First, lower the saddle so both feet reach the ground, and push yourself along like on a balance bike "
     "until you can coast. Second, look ahead rather than at the front wheel, and pedal gently to keep a "
     "steady speed."),
    ("Summarise our conversation in one line.",
     "A bicycle balances by steering under its fall, which needs speed, and you learn it by coasting first "
     "and looking ahead."),
]


def render(tokenizer: Any, turns: list[tuple[str, str]]) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM}]
    for user, answer in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    ids = tokenizer.apply_chat_template(messages, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def prompt_only(tokenizer: Any, user: str) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


# ------------------------------------------------------------------------------------- comparisons

def diff_stats(values: list[list[float]], reference: list[list[float]]) -> dict[str, float]:
    """Mean and max |a - b| over all tokens of all sequences."""
    d = torch.cat([(torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)).abs()
                   for a, b in zip(values, reference, strict=True)])
    return {"mean": d.mean().item(), "max": d.max().item(), "tokens": d.numel()}


def op_error(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """An op's error against its float64 recomputation: rms and max of |out - ref| relative to rms(ref)."""
    diff = out.double() - ref
    scale = ref.pow(2).mean().sqrt().item() or 1.0
    return {"rel_rms": diff.pow(2).mean().sqrt().item() / scale, "rel_max": diff.abs().max().item() / scale}


# ---------------------------------------------------------------------------------------- transformers

def hf_model(path: str, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    return model


def hf_logprobs(model: Any, sequences: list[list[int]], *, layers: bool = False) -> tuple[list, list]:
    """Logprob of every token after the first of each sequence, in the model's dtype; with `layers`, the
    residual stream after each decoder layer of each sequence too."""
    out, streams = [], []
    with torch.no_grad():
        for seq in sequences:
            result = model(torch.tensor([seq]), output_hidden_states=layers)
            lp = torch.log_softmax(result.logits[0], dim=-1)
            out.append(lp[:-1].gather(1, torch.tensor(seq[1:])[:, None])[:, 0].tolist())
            if layers:
                # hidden_states[i + 1] is layer i's output; the last one has the final norm applied.
                streams.append([h[0] for h in result.hidden_states[1:-1]])
    return out, streams


def negative_controls(model: Any, sequences: list[list[int]], base: list[list[float]]) -> dict[str, dict]:
    """What a sync that did not deliver the weights whole reads: transformers float32 with one weight
    tensor (layer 15's down_proj), then all of them, rounded through bfloat16, against `base` (float32).
    Changes `model`'s weights."""
    out = {}
    with torch.no_grad():
        layer = model.model.layers[len(model.model.layers) // 2]
        layer.mlp.down_proj.weight.copy_(layer.mlp.down_proj.weight.bfloat16().float())
        out["one tensor through bfloat16"] = diff_stats(hf_logprobs(model, sequences)[0], base)
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
        out["every weight through bfloat16"] = diff_stats(hf_logprobs(model, sequences)[0], base)
    return out


# --------------------------------------------------------------------------------------------- trainer

def trainer_logprobs(path: str, sequences: list[list[int]]) -> list[list[float]]:
    from hpcrl.config.model_shapes import load_shape
    from hpcrl.trainer.engine import EngineOptions, TrainerEngine

    engine = TrainerEngine(EngineOptions(shape=load_shape(preset_name="", path=path), weights_path=path,
                                         max_seq_len=max(map(len, sequences)) + 1, dtype="float32", device="cpu"))
    values = engine.sequence_logprobs(sequences)
    del engine
    return values


# ------------------------------------------------------------------------------------------------ vLLM

def start_vllm(path: str, max_len: int) -> Any:
    """hpcrl's engine as `hpcrl run` starts it on CPU (VllmEngine: float32, enforce_eager, raw
    logprobs, prefix caching, the worker extension), its engine core in this process so that the model
    can be reached."""
    from hpcrl.inference.engine import VllmEngine

    return VllmEngine(model_path=path, tensor_parallel=1, on_cpu=True, dtype="float32", seed=0,
                      max_model_len=max_len, gpu_memory_utilization=0.2, enforce_eager=True, temperature=1.0,
                      top_p=1.0, top_k=-1, max_tokens=1, kv_cache_gib=0.25, engine_core_here=True)


def vllm_model(engine: Any) -> Any:
    return engine.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model


def vllm_generated(engine: Any, prompts: list[list[int]], max_tokens: int) -> tuple[list, list]:
    """Greedy answers to `prompts` with the logprob vLLM reports for each generated token (the decode
    path the rollouts' logprobs come from): (prompt + answer token ids, answer logprobs)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0)
    outputs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    seqs, lps = [], []
    for prompt, output in zip(prompts, outputs):
        sample = output.outputs[0]
        seqs.append(prompt + list(sample.token_ids))
        lps.append([step[t].logprob for step, t in zip(sample.logprobs, sample.token_ids)])
    return seqs, lps


class OpTap:
    """Forward hooks on vLLM's Llama modules: the first call's inputs (cloned before the call: vLLM's
    fused norm and its rotary embedding work in place) and outputs of each, on one scoring pass of one
    sequence (the prefill of all its tokens)."""

    KINDS = ("RMSNorm", "QKVParallelLinear", "RowParallelLinear", "MergedColumnParallelLinear", "SiluAndMul",
             "Attention", "LogitsProcessor", "LlamaDecoderLayer")

    def __init__(self, model: Any, tokens: int) -> None:
        self.records: dict[str, tuple] = {}
        self.pending: dict[str, tuple] = {}
        self.handles = []
        self.tokens = tokens
        for name, module in model.named_modules():
            if type(module).__name__ in self.KINDS or name.endswith("rotary_emb"):
                self.handles.append(module.register_forward_pre_hook(self._before(name), with_kwargs=True))
                self.handles.append(module.register_forward_hook(self._after(name)))

    def _before(self, name: str):
        def record(module, args, kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            first = tensors[-1] if name.endswith("logits_processor") else tensors[0] if tensors else None
            wanted = (self.tokens - 1, self.tokens) if name.endswith("logits_processor") else (self.tokens,)
            if name not in self.records and first is not None and first.shape[0] in wanted:
                self.pending[name] = (tuple(map(_clone, args)), {k: _clone(v) for k, v in kwargs.items()})
        return record

    def _after(self, name: str):
        def record(module, args, output):
            if name in self.pending:
                out = tuple(map(_clone, output)) if isinstance(output, tuple) else _clone(output)
                self.records[name] = (*self.pending.pop(name), out)
        return record

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _clone(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def hf_weights(ref: Any) -> dict[str, torch.Tensor]:
    """The float64 reference's parameters by vLLM's fused names (qkv_proj, gate_up_proj), float64."""
    sd = {k.removeprefix("model."): v for k, v in ref.state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    layers = ref.config.num_hidden_layers
    for i in range(layers):
        p = f"layers.{i}."
        out[p + "self_attn.qkv_proj"] = torch.cat([sd[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        out[p + "self_attn.o_proj"] = sd[p + "self_attn.o_proj.weight"]
        out[p + "mlp.gate_up_proj"] = torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])
        out[p + "mlp.down_proj"] = sd[p + "mlp.down_proj.weight"]
    out["embed"] = sd["embed_tokens.weight"]
    return out


def rope_reference(positions: torch.Tensor, x: torch.Tensor, heads: int, head_dim: int, theta: float,
                   dtype: torch.dtype) -> torch.Tensor:
    """Neox-style RoPE (rotate_half) of x [T, heads * head_dim], float32 angles as every path has them,
    the rotation itself in `dtype`."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    angles = torch.outer(positions.float(), inv_freq)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    x = x.to(dtype).view(x.shape[0], heads, head_dim)
    a, b = x[..., :head_dim // 2], x[..., head_dim // 2:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1).view(x.shape[0], -1)


def attention_reference(q, k, v, heads: int, kv_heads: int, head_dim: int, dtype) -> torch.Tensor:
    T = q.shape[0]
    q = q.to(dtype).view(T, heads, head_dim).transpose(0, 1)
    k = k.to(dtype).view(T, kv_heads, head_dim).transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
    v = v.to(dtype).view(T, kv_heads, head_dim).transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
    out = F.scaled_dot_product_attention(q[None].contiguous(), k[None].contiguous(), v[None].contiguous(),
                                         is_causal=True)[0]  # 4-D: torch's fused (flash) CPU kernel, as models call it
    return out.transpose(0, 1).reshape(T, heads * head_dim)


def rms_norm(x, weight, eps, dtype):
    x = x.to(dtype)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.to(dtype)


def op_table(records: dict[str, tuple], weights: dict[str, torch.Tensor], cfg: Any, model: Any) -> list[dict]:
    """Each recorded op of vLLM's `model` recomputed from its recorded inputs in float64 and with torch's
    float32: the error of vLLM's kernel and of torch's, both against float64."""
    modules = dict(model.named_modules())
    H, KV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    D = getattr(cfg, "head_dim", None) or D
    eps, theta = cfg.rms_norm_eps, cfg.rope_parameters["rope_theta"] if hasattr(cfg, "rope_parameters") \
        else cfg.rope_theta
    rows: dict[str, dict[str, list]] = {}

    def add(kind: str, vllm_out, ref, torch_out) -> None:
        row = rows.setdefault(kind, {"vllm": [], "torch": []})
        row["vllm"].append(op_error(vllm_out, ref))
        row["torch"].append(op_error(torch_out, ref))

    for name, (args, kwargs, out) in records.items():
        module = name.rsplit(".", 1)[-1]
        key = name.removeprefix("model.")
        if module in ("input_layernorm", "post_attention_layernorm", "norm"):
            x = args[0]
            residual = args[1] if len(args) > 1 else kwargs.get("residual")
            w = modules[name].weight.detach()
            if residual is not None:
                total64 = x.double() + residual.double()
                add("RMSNorm + residual add", out[0], rms_norm(total64, w, eps, torch.float64),
                    rms_norm(x + residual, w, eps, torch.float32))
            else:
                add("RMSNorm", out, rms_norm(x, w, eps, torch.float64), rms_norm(x, w, eps, torch.float32))
        elif module in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            W = weights[key]
            y = out[0] if isinstance(out, tuple) else out
            add(f"linear {module}", y, F.linear(args[0].double(), W), F.linear(args[0], W.float()))
        elif module == "rotary_emb":
            positions, q, k = args[:3]
            q_out, k_out = out[0], out[1]
            add("rotary embedding (q)", q_out, rope_reference(positions, q, H, D, theta, torch.float64),
                rope_reference(positions, q, H, D, theta, torch.float32))
            add("rotary embedding (k)", k_out, rope_reference(positions, k, KV, D, theta, torch.float64),
                rope_reference(positions, k, KV, D, theta, torch.float32))
        elif module == "attn":
            q, k, v = args[:3]
            add("attention (CPU_ATTN)", out.view(out.shape[0], -1),
                attention_reference(q, k, v, H, KV, D, torch.float64),
                attention_reference(q, k, v, H, KV, D, torch.float32))
        elif module == "act_fn":
            x = args[0]
            half = x.shape[-1] // 2
            ref = F.silu(x[:, :half].double()) * x[:, half:].double()
            add("SiluAndMul", out, ref, F.silu(x[:, :half]) * x[:, half:])
        elif module == "logits_processor":
            hidden = args[-1]
            W = weights["embed"]
            add("lm_head (tied embedding)", out[:, :W.shape[0]], F.linear(hidden.double(), W),
                F.linear(hidden, W.float()))
    table = []
    for kind, row in rows.items():
        v = {m: max(r[m] for r in row["vllm"]) for m in ("rel_rms", "rel_max")}
        t = {m: max(r[m] for r in row["torch"]) for m in ("rel_rms", "rel_max")}
        vm = sum(r["rel_rms"] for r in row["vllm"]) / len(row["vllm"])
        tm = sum(r["rel_rms"] for r in row["torch"]) / len(row["torch"])
        table.append({"op": kind, "calls": len(row["vllm"]), "vllm_rel_rms_mean": vm, "torch_rel_rms_mean": tm,
                      "vllm_rel_max": v["rel_max"], "torch_rel_max": t["rel_max"], "ratio": vm / tm if tm else None})
    return table


def precise_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax in float32 as logits - logsumexp(logits): torch's logsumexp sums the exponentials
    with its cascaded reduction, log_softmax's CPU kernel with a running float32 accumulator."""
    z = logits.float()
    return z - torch.logsumexp(z, dim=-1, keepdim=True)


def logprob_table(records: dict[str, tuple], tokens: list[int]) -> list[dict]:
    """From vLLM's own float32 logits of the recorded pass: the logprob of each actual next token by
    vLLM's Sampler.compute_logprobs (torch's log_softmax, float32) and by logits - logsumexp, each
    against float64 log_softmax of the same logits (absolute, in nats)."""
    from vllm.v1.sample.sampler import Sampler

    (_, _, logits) = records["logits_processor"]
    logits = logits[:len(tokens) - 1]
    targets = torch.tensor(tokens[1:logits.shape[0] + 1])[:, None]
    ref = logits.double().log_softmax(-1).gather(1, targets)[:, 0]
    rows = []
    for name, fn in (("vLLM Sampler.compute_logprobs (torch log_softmax, fp32)", Sampler.compute_logprobs),
                     ("logits - logsumexp(logits), fp32", precise_logprobs)):
        d = (fn(logits).gather(1, targets)[:, 0].double() - ref).abs()
        rows.append({"kernel": name, "mean": d.mean().item(), "max": d.max().item()})
    return rows


def layer_table(records: dict[str, tuple], ref_streams: list, f32_streams: list) -> list[dict]:
    """The residual stream after each decoder layer: vLLM's (hidden + residual) and transformers fp32's,
    each against float64 (relative rms)."""
    rows = []
    for i, (r64, r32) in enumerate(zip(ref_streams, f32_streams)):
        _, _, out = records[f"model.layers.{i}"]
        stream = out[0].double() + out[1].double()
        rows.append({"layer": i, "vllm": op_error(stream, r64)["rel_rms"], "hf_fp32": op_error(r32, r64)["rel_rms"]})
    return rows


# ------------------------------------------------------------------------------------------------ swaps

def swap_ops(model: Any, weights: dict[str, torch.Tensor], cfg: Any, which: set[str]) -> list:
    """Replace vLLM's kernels of `which` ("linear", "attention", "norm", "lm_head") by torch float32 ones
    in place; returns what undo() needs."""
    undo: list = []
    if "logprobs" in which:
        from vllm.v1.sample.sampler import Sampler

        undo.append((Sampler, "compute_logprobs", Sampler.__dict__["compute_logprobs"]))
        Sampler.compute_logprobs = staticmethod(precise_logprobs)
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    eps = cfg.rms_norm_eps
    for name, module in model.named_modules():
        key = name.removeprefix("model.")
        module_name = name.rsplit(".", 1)[-1]
        if "linear" in which and key in weights and hasattr(module, "cpu_linear"):
            W = weights[key].float()
            undo.append((module, "cpu_linear", module.cpu_linear))
            module.cpu_linear = lambda x, weight, bias, W=W: F.linear(x, W, bias)
        if "lm_head" in which and module_name in ("lm_head", "embed_tokens") and hasattr(module, "cpu_linear"):
            W = weights["embed"].float()
            undo.append((module, "cpu_linear", module.cpu_linear))
            module.cpu_linear = lambda x, weight, bias, W=W: F.linear(x, W, bias)
        if "attention" in which and module_name == "attn" and type(module).__name__ == "Attention":
            impl = module.impl
            undo.append((impl, "forward", impl.forward))
            impl.forward = _sdpa_forward(impl.forward, H, KV, D)
        if "norm" in which and type(module).__name__ == "RMSNorm":
            undo.append((module, "forward", module.forward))
            module.forward = _torch_norm(module, eps)
    return undo


def _sdpa_forward(kernel, H, KV, D):
    """vLLM's CPU attention (kept: it also writes the KV cache), its output replaced by torch's float32
    SDPA over the step's own q, k, v (prefill of whole sequences, which is all scoring does)."""
    def forward(layer, query, key, value, kv_cache, attn_metadata, output, *rest, **kwargs):
        result = kernel(layer, query, key, value, kv_cache, attn_metadata, output, *rest, **kwargs)
        if attn_metadata is None:
            return result
        starts = attn_metadata.query_start_loc.tolist()
        out = output.view(output.shape[0], -1)
        for a, b in zip(starts[:-1], starts[1:]):
            if b - a > 1:  # a whole prompt (scoring); one-token decode steps keep vLLM's result
                out[a:b] = attention_reference(query[a:b].reshape(b - a, -1), key[a:b].reshape(b - a, -1),
                                               value[a:b].reshape(b - a, -1), H, KV, D, torch.float32)
        return output
    return forward


def _torch_norm(module, eps):
    def forward(x, residual=None):
        if residual is not None:
            total = x + residual
            return rms_norm(total, module.weight, eps, torch.float32), total
        return rms_norm(x, module.weight, eps, torch.float32)
    return forward


def undo_swaps(undo: list) -> None:
    for obj, attr, value in reversed(undo):
        setattr(obj, attr, value)


# ------------------------------------------------------------------------------------------------- main

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="HF checkpoint directory (float32)")
    parser.add_argument("--json", default="", help="also write every figure to this file")
    parser.add_argument("--no-swap", action="store_true", help="skip the end-to-end kernel swaps")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    chats = [render(tokenizer, [c]) for c in CHATS]
    long = render(tokenizer, LONG)
    sequences = chats + [long]
    prompts = [prompt_only(tokenizer, user) for user, _ in CHATS]
    print(f"{len(chats)} chats of {[len(s) for s in chats]} tokens and one of {len(long)}; "
          f"threads {torch.get_num_threads()}", flush=True)
    report: dict[str, Any] = {"sequences": [len(s) for s in sequences]}

    ref = hf_model(args.model, torch.float64)
    cfg = ref.config
    weights = hf_weights(ref)
    lp64, streams64 = hf_logprobs(ref, sequences, layers=True)
    hf32 = hf_model(args.model, torch.float32)
    lp32, streams32 = hf_logprobs(hf32, sequences, layers=True)
    report["broken"] = negative_controls(hf32, chats, lp32[:len(chats)])
    del hf32
    lp_trainer = trainer_logprobs(args.model, sequences)
    print(f"references done at {time.monotonic() - started:.0f} s", flush=True)

    engine = start_vllm(args.model, max(map(len, sequences)) + 64)
    lp_vllm = engine.token_logprobs(sequences)
    generated, lp_decode = vllm_generated(engine, prompts, max_tokens=32)
    ref_generated, _ = hf_logprobs(ref, generated)
    ref_decode = [r[len(p) - 1:] for r, p in zip(ref_generated, prompts)]
    paths = {
        "transformers fp32": diff_stats(lp32, lp64),
        "trainer (hpcrl, fp32)": diff_stats(lp_trainer, lp64),
        "vLLM scoring (prompt_logprobs)": diff_stats(lp_vllm, lp64),
        "vLLM generating (decode logprobs)": diff_stats(lp_decode, ref_decode),
        "trainer vs vLLM scoring (the probe)": diff_stats(lp_trainer, lp_vllm),
        "trainer vs transformers fp32": diff_stats(lp_trainer, lp32),
    }
    short = {"vLLM scoring, chats only": diff_stats(lp_vllm[:-1], lp64[:-1]),
             "vLLM scoring, long chat only": diff_stats(lp_vllm[-1:], lp64[-1:]),
             "transformers fp32, chats only": diff_stats(lp32[:-1], lp64[:-1]),
             "transformers fp32, long chat only": diff_stats(lp32[-1:], lp64[-1:])}
    report["paths"] = {**paths, **short}
    print("\n| a sync that did not deliver the weights (transformers fp32 vs itself) | mean | max |\n|---|---|---|")
    for name, st in report["broken"].items():
        print(f"| {name} | {st['mean']:.2e} | {st['max']:.2e} |")
    print("\n| path | vs float64: mean | max | tokens |\n|---|---|---|---|")
    for name, s in {**paths, **short}.items():
        print(f"| {name} | {s['mean']:.2e} | {s['max']:.2e} | {s['tokens']} |")

    model = vllm_model(engine)
    tap = OpTap(model, len(long))
    engine.token_logprobs([long])
    tap.close()
    ops = op_table(tap.records, weights, cfg, model)
    report["logprob_kernels"] = logprob_table({k.rsplit(".", 1)[-1]: v for k, v in tap.records.items()}, long)
    layers = layer_table(tap.records, streams64[-1], streams32[-1])
    report["ops"], report["layers"] = ops, layers
    print(f"\nops on the long chat ({len(long)} tokens), error relative to rms(float64 output); mean over calls")
    print("| op | calls | vLLM rel rms | torch fp32 rel rms | vLLM/torch | vLLM rel max | torch rel max |")
    print("|---|---|---|---|---|---|---|")
    for r in ops:
        print(f"| {r['op']} | {r['calls']} | {r['vllm_rel_rms_mean']:.2e} | {r['torch_rel_rms_mean']:.2e} | "
              f"{r['ratio']:.2f} | {r['vllm_rel_max']:.2e} | {r['torch_rel_max']:.2e} |")
    print("\n| logprob of the actual token from vLLM's own logits | vs float64 log_softmax: mean | max |")
    print("|---|---|---|")
    for r in report["logprob_kernels"]:
        print(f"| {r['kernel']} | {r['mean']:.2e} | {r['max']:.2e} |")
    print("\nresidual stream after each layer, rel rms vs float64: layer: vLLM / transformers fp32")
    print("  ".join(f"{r['layer']}: {r['vllm']:.1e}/{r['hf_fp32']:.1e}" for r in layers))

    if not args.no_swap:
        report["swaps"] = {}
        print("\n| vLLM with torch's kernel for | scoring vs float64: mean | max | vs trainer (probe): mean | max |\n"
              "|---|---|---|---|---|")
        # "logprobs" makes vLLM's sampler the accurate one (logits - logsumexp): closer to float64, further from
        # the trainer, which takes the sampler's log_softmax; without it, the rest of vLLM's kernels swapped
        # give the trainer's logprobs to the bit.
        for which in (set(), {"logprobs"}, {"linear", "lm_head"}, {"attention"},
                      {"logprobs", "linear", "lm_head"}, {"attention", "linear", "lm_head", "norm"}):
            undo = swap_ops(model, weights, cfg, which)
            try:
                lp_now = engine.token_logprobs(sequences)
                s = diff_stats(lp_now, lp64)
            finally:
                undo_swaps(undo)
            label = ", ".join(sorted(which)) or "(none: as shipped)"
            report["swaps"][label] = {**s, "vs trainer": diff_stats(lp_now, lp_trainer)}
            t = report["swaps"][label]["vs trainer"]
            print(f"| {label} | {s['mean']:.2e} | {s['max']:.2e} | {t['mean']:.2e} | {t['max']:.2e} |", flush=True)
    engine.close()
    report["seconds"] = time.monotonic() - started
    print(f"\n{report['seconds']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
