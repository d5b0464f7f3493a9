"""What hpcrl runs inside vLLM's workers: the worker extension, and on CPU the spin patch.

    LLM(..., worker_extension_cls=hpcrl.inference.vllm_llm.WORKER_EXTENSION)   # this module's class
    llm.collective_rpc("hpcrl_receive_weights", args=(3,))   # start, update, finish in one round trip

vLLM imports `worker_extension_cls` in every worker process before it loads the model
(vllm/v1/worker/worker_base.py). Importing this module there does two things, both idempotent:

- it imports hpcrl.transfer.vllm_engine, which registers hpcrl's weight-transfer engine ("hpcrl")
  in that worker's registry, where vLLM creates the engine (CPU workers are spawned, so the
  client's registration would not reach them);
- it imports the run's model family modules (model.family_modules, named to the worker by the
  environment start_llm set: hpcrl.models.FAMILY_MODULES_ENV), so that a family from outside hpcrl
  is known here too: its shape, its load hooks, its vLLM model class (serve_families);
- on CPU it cuts the workers' busy loop (quiet_idle_workers). vLLM's worker busy-loops
  (sched_yield) for a second after every message it reads from its engine
  (vllm/distributed/device_communicators/shm_broadcast.py, SpinCondition, busy_loop_s = 1), so a
  worker that the head calls every step spins a core for good. On a GPU node that core is the
  inference node's own; on CPUs it is the trainer's: a tiny-model train step went from 0.03 s to
  0.8-1.1 s beside a spinning worker in the local Slurm hetjob. The patch cuts the spin to 5 ms
  (then the worker sleeps on its notify socket, woken within microseconds). A one-rank engine on
  CPU has no such queue: hpcrl runs its worker inside the engine core (hpcrl.inference.vllm_llm).

The client side (building the LLM, shutting it down) is hpcrl.inference.vllm_llm.
"""

from __future__ import annotations

import hashlib
import os
from typing import Protocol

import torch

import hpcrl.transfer.vllm_engine  # noqa: F401 - registers "hpcrl" in this worker's weight-transfer registry
from hpcrl.inference.vllm_llm import serve_families
from hpcrl.models import FAMILY_MODULES_ENV

#: Seconds a vLLM worker on CPU keeps busy-looping after a read before it sleeps (vLLM: 1 s).
CPU_WORKER_SPIN_S = 0.005


def quiet_idle_workers(spin_s: float = CPU_WORKER_SPIN_S) -> None:
    """On CPU platforms, make this process's vLLM workers busy-loop at most `spin_s` after a read
    (see the module docstring); idempotent, and nothing on GPUs."""
    from vllm.distributed.device_communicators import shm_broadcast
    from vllm.platforms import current_platform

    condition = shm_broadcast.SpinCondition
    if not current_platform.is_cpu() or getattr(condition.wait, "hpcrl_spin_s", None) is not None:
        return
    original = condition.wait

    def wait(self, timeout_ms: int | None = None) -> None:
        if self.is_reader and self.busy_loop_s > spin_s:
            self.busy_loop_s = spin_s
        return original(self, timeout_ms)

    # A monkeypatch (module docstring): mypy cannot follow a marked function put in a method's place.
    wait.hpcrl_spin_s = spin_s  # type: ignore[attr-defined]  # the mark that makes this idempotent
    condition.wait = wait  # type: ignore[method-assign]  # the patch itself


quiet_idle_workers()
serve_families([m for m in os.environ.get(FAMILY_MODULES_ENV, "").split(",") if m])


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


class _ModelRunner(Protocol):
    """What the extension uses of the vLLM Worker's model runner (GPU or CPU)."""

    def get_model(self) -> torch.nn.Module: ...


class _WeightUpdates(Protocol):
    """vLLM's Worker methods of one weight update (vllm/v1/worker/gpu_worker.py; the CPU worker inherits them)."""

    def start_weight_update(self) -> None: ...
    def update_weights(self, update_info: dict) -> None: ...
    def finish_weight_update(self) -> None: ...


class HpcrlWorkerExtension:
    """Methods vLLM mixes into its Worker (`worker_extension_cls`), called with `collective_rpc`."""

    model_runner: _ModelRunner  # the Worker's (an annotation only: vLLM refuses extension names the Worker has)

    def hpcrl_receive_weights(self, version: int) -> None:
        """One whole update in one call: the Worker's own start_weight_update, update_weights and
        finish_weight_update, in turn, with their bookkeeping (a failed update ends the session, as
        there). LLM's three calls are three round trips to the engine core, each about 0.4 ms on CPU,
        on the critical path of every step. A LoRA plan's update is the engine's receive_adapter instead
        (hpcrl.transfer.vllm_lora)."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is not None and getattr(engine, "lora", None) is not None:
            # A LoRA plan: the adapter into a LoRA slot of its own. Not through the Worker's session: its
            # finish_weight_update drops every adapter (reset_lora_state), as after new base weights.
            from vllm.config import set_current_vllm_config

            with set_current_vllm_config(getattr(self, "vllm_config")):  # noqa: B009 - the Worker's
                engine.receive_adapter(version)
            return
        worker: _WeightUpdates = self  # type: ignore[assignment]  # mixed into vLLM's Worker, which has them
        worker.start_weight_update()
        worker.update_weights({"version": version})
        worker.finish_weight_update()

    def hpcrl_weight_digests(self) -> dict[str, str]:
        """sha256 of every weight this rank computes with: non-empty parameters, and for layers whose
        weight vLLM repacked (CPU), the effective matrix read back through the packed kernel
        (cpu_linear(I) = I W^T = W^T: exact, one non-zero product per output)."""
        model = self.model_runner.get_model()
        out = {name: _sha(p) for name, p in model.named_parameters() if p.numel()}
        with torch.no_grad():
            for name, module in model.named_modules():
                kernel = getattr(module, "cpu_linear", None)
                size = getattr(module, "input_size_per_partition", None)
                if kernel is None or size is None:
                    continue
                dtype = next((p.dtype for p in module.parameters()), torch.float32)
                eye = torch.eye(size, dtype=dtype)
                out[f"{name}.weight@kernel"] = _sha(kernel(eye, module.weight, None).t().contiguous())
        return out

    def hpcrl_lora_slots(self) -> list[int | None]:
        """The adapter id in each of this rank's LoRA slots (None: free); [] without LoRA."""
        manager = getattr(self.model_runner.get_model(), "lora_manager", None)
        return list(manager.lora_index_to_id) if manager is not None else []

    def hpcrl_lora_digests(self, adapter_id: int) -> dict[str, str]:
        """sha256 of adapter `adapter_id`'s slot in every LoRA layer of this rank (each slice's A and B, as the
        LoRA kernels read them: `<module>.lora_a_stacked.<slice>`); {} if the adapter is not in a slot."""
        manager = getattr(self.model_runner.get_model(), "lora_manager", None)
        if manager is None or adapter_id not in manager.lora_index_to_id:
            return {}
        index = manager.lora_index_to_id.index(adapter_id)
        out = {}
        for name, module in manager.modules.items():
            for stacked in ("lora_a_stacked", "lora_b_stacked"):
                tensors = getattr(module, stacked, ())
                for i, t in enumerate((tensors,) if isinstance(tensors, torch.Tensor) else tensors):
                    out[f"{name}.{stacked}.{i}"] = _sha(t[index])
        return out

    def hpcrl_seed_sampling(self, seed: int) -> None:
        """Seed this rank's default torch generators (CPU and every accelerator): the randomness vLLM's
        sampler draws for requests without a seed of their own (forward_cpu's Gumbel seeds, the
        native path's exponential noise, FlashInfer's seed and offset). Every TP rank gets the same."""
        torch.manual_seed(seed)

    def hpcrl_eager_helpers(self) -> None:
        """Run this worker's torch.compile'd functions eagerly (CPU with enforce_eager, where the model
        itself is eager): what is left compiled there is the sampler's helpers (vLLM 0.32:
        batched_count_greater_than in v1/sample/ops/logprobs.py, the top-k/top-p mask in
        topk_topp_sampler.py), whose inductor build made the first request with logprobs take 2.4 s
        instead of 0.06 s on a 2-core VM, and each new batch shape recompiled."""
        torch._dynamo.config.disable = True

    def hpcrl_last_update(self) -> dict:
        """Bytes and seconds (start_s, receive_s, finish_s) of this rank's last received update."""
        engine = getattr(self, "weight_transfer_engine", None)
        return dict(getattr(engine, "last", {}) or {})
