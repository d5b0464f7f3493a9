"""The resource plan: what a run asks of Slurm, and whether it fits in memory.

Pure: a validated `Config` and the model's `ModelShape` in, a `ResourcePlan` out; no files,
no Slurm. `hpcrl plan` prints it; the launcher renders its components into sbatch blocks.

Memory estimates (per GPU, or per node on CPU) are deliberately simple and on the safe side:

  trainer   fp32 master params + fp32 grads + AdamW (2 x fp32), all / dp_shard
            + reference model when kl_coef > 0: fp32, / dp_shard (it is built like the policy,
              as fp32 shards that FSDP casts to the compute dtype when it gathers them)
            + two gathered blocks in compute dtype (FSDP prefetch)
            + the gathered root unit (embedding, final norm, output head) in compute dtype,
              of the policy and, when kl_coef > 0, of the reference: a root is not resharded
              after forward, and the reference's stays gathered until the step's backward is done
              (FSDP2 gathers into tensors of its own, even in fp32 on one rank: on CPU too)
            + activations: per token per block ~ (7h + 2kv + 4f) x dtype bytes for a dense decoder
              (the model family's `activation_values_per_token`), or only the block inputs with
              activation checkpointing (plus one block recomputed)
            + fp32 logits and their log-softmax for one micro-batch
            (a micro-batch's tokens: trainer.micro_batch_tokens when set, the packed micro-batch's
              budget; else micro_batch_size rows of max_prompt_tokens + max_tokens)
            + a fixed runtime overhead (CUDA context, NCCL buffers)
            Mixture-of-Experts (Qwen3-MoE): every expert is a parameter like any other, so the fp32
              state above counts all E experts of every block / dp_shard (FSDP2 shards whole
              experts, no expert parallelism in the trainer); a gathered block holds all E experts;
              a token's activations count its top k experts (`activation_values_per_token`: k
              dispatched copies of 2h + 4 moe_f, plus the router's E scores), not all E. The
              load-balancing loss keeps [E] per block (hpcrl.trainer.routing): nothing per token.
            LoRA ([lora], hpcrl.trainer.lora): the base is frozen, so gradients and AdamW states are the
              adapters' only (fp32, / dp_shard); params_fp32 counts the base's fp32 shards and the
              adapters'; no reference model and no second gathered root (the reference is the policy
              with its adapters off); a gathered block holds its adapters too, and a token's
              activations add each adapted linear's input to B (rank values) and the update it adds
              (the linear's output width)
  inference weights / TP (embedding and head vocab-split), then the KV-cache budget
            gpu_memory_utilization x memory - weights - activation reserve, or kv_cache_gib when set.

Checked against measurements (tests/plan/test_resources.py): Llama-3 1B, FSDP on one H100, batch
4 x 2048, no checkpointing: 39.9 GiB measured (docs/FACTS.md), 41.7 GiB estimated; Llama-3 70B on
64 H100s (configs/llama70b_grpo.toml): about 47 GiB measured, 47.4 GiB estimated; and the bytes of
the reference model and of the gathered roots that a bf16 step of a small model holds on CPU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TypedDict

from hpcrl.config.components import Component, make_components
from hpcrl.config.model_shapes import DTYPE_BYTES, ModelShape
from hpcrl.config.schema import Config
from hpcrl.models.lora import adapter_parameters
from hpcrl.models.shape import Experts
from hpcrl.plan.transfer.speed import host_round_trip_warning

GIB = 1024**3
#: CUDA context, NCCL buffers, allocator slack per GPU.
GPU_RUNTIME_OVERHEAD = 3.0 * GIB
#: vLLM's reserve for activations / sampler / CUDA graphs per GPU.
INFERENCE_ACTIVATION_RESERVE = 2.0 * GIB
#: Python, torch and vLLM processes on a CPU node.
CPU_RUNTIME_OVERHEAD = 1.0 * GIB


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Bytes one device (GPU, or CPU node) holds, by part; `capacity` 0 means unknown."""

    device: str
    parts: dict[str, int]
    capacity: int

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool:
        return self.capacity == 0 or self.total <= self.capacity


class ModelSummary(TypedDict):
    """The model of a plan, as `hpcrl plan` shows it (sizes from its config.json or preset)."""

    architecture: str
    preset: str
    path: str
    parameters: int
    dtype: str
    bytes: int
    """Of the weights in `dtype`."""
    layers: int
    hidden_size: int
    heads: int
    kv_heads: int
    vocab_size: int


@dataclass(frozen=True, kw_only=True)
class ResourcePlan:
    run_name: str
    executor: str
    layout: str
    components: list[Component]
    trainer_mesh: dict[str, int]
    inference_layout: dict[str, int]
    model: ModelSummary
    trainer_memory: MemoryEstimate
    inference_memory: MemoryEstimate
    kv_cache_tokens: int
    """Tokens the KV cache of one replica holds (all its TP ranks together)."""
    spare_nodes: int = 0
    """Idle nodes held in the allocation for lost tasks (cluster.spare_nodes; layout split only)."""
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    """What the config chose that costs the run (a weight transport that stages through the host)."""

    @property
    def recovery(self) -> str:
        """What a lost node costs this run: a requeue, or a start again on a spare node inside the job."""
        if self.layout == "hetjob":
            return ("a lost node requeues the hetjob (Slurm 22.05 ends a hetjob on any node failure); recovery "
                    'inside the job needs layout = "split" with cluster.spare_nodes')
        if not self.spare_nodes:
            return ("a lost node requeues the job (cluster.spare_nodes = 0); a killed trainer rank whose node lives "
                    "starts the trainer group again in place from its newest checkpoint, same job")
        return (f"{self.spare_nodes} spare node(s), idle in the allocation (--no-kill): a lost inference replica "
                "or reward task starts again on one, and the trainer group from its newest checkpoint (in place, or "
                "with a spare for a lost node), same job; a lost head node or no spare left requeues the job")

    @property
    def inference_fits(self) -> bool:
        """The inference memory fits and its KV cache holds one sequence of max_model_len (vLLM refuses to
        start otherwise)."""
        return self.inference_memory.fits and self.kv_cache_tokens >= self.inference_layout["max_model_len"]

    @property
    def fits(self) -> bool:
        return self.trainer_memory.fits and self.inference_fits

    def to_dict(self) -> dict:
        out = asdict(self)
        for key in ("trainer_memory", "inference_memory"):
            estimate = getattr(self, key)
            out[key].update(total=estimate.total, fits=estimate.fits)
        for comp, data in zip(self.components, out["components"]):
            data["tasks"] = comp.tasks
        out["fits"] = self.fits
        out["recovery"] = self.recovery
        return out


def _trainer_memory(config: Config, shape: ModelShape) -> MemoryEstimate:
    t, alg = config.trainer, config.algorithm
    compute = DTYPE_BYTES[config.model.dtype] if t.gpus_per_node else 4
    shard = t.world_size // t.dp_replicate if t.dp_shard == -1 else t.dp_shard
    params = shape.num_parameters
    # a micro-batch's positions: its token budget when packed, else micro_batch_size rows padded to the longest
    tokens = t.micro_batch_tokens or t.micro_batch_size * (config.data.max_prompt_tokens + config.inference.max_tokens)
    trained, lora_block, lora_per_token = _lora_sizes(config, shape)
    reference = alg.kl_coef > 0 and config.lora is None  # with LoRA the reference is the policy, adapters off
    roots = 2 if reference else 1
    root_params = shape.root_parameters  # not params - layers x the largest block: blocks may differ (MoE)
    block_per_token = (shape.family.activation_values_per_token(shape) + lora_per_token) * compute
    if t.activation_checkpointing:
        activations = tokens * (shape.hidden_size * compute * shape.num_layers + block_per_token)
    else:
        activations = tokens * block_per_token * shape.num_layers
    parts = {
        "params_fp32": 4 * (params + trained * (config.lora is not None)) // shard,
        "grads_fp32": 4 * trained // shard,
        "adamw_states": 8 * trained // shard,
        "reference_model": 4 * params // shard if reference else 0,
        "gathered_blocks": 2 * compute * (shape.layer_parameters + lora_block),
        "gathered_roots": roots * compute * root_params,
        "activations": activations,
        "logits_fp32": 2 * 4 * tokens * shape.vocab_size,
        "runtime": int(GPU_RUNTIME_OVERHEAD if t.gpus_per_node else CPU_RUNTIME_OVERHEAD),
    }
    if t.gpus_per_node:
        return MemoryEstimate(device="GPU", parts=parts, capacity=int(config.cluster.gpu_mem_gib * GIB))
    # On CPU every rank of a node shares its RAM.
    per_node = {k: v * t.ranks_on_each_node for k, v in parts.items()}
    return MemoryEstimate(device="CPU node", parts=per_node,
                          capacity=int(config.cluster.mem_per_node_gib * GIB))


def _lora_sizes(config: Config, shape: ModelShape) -> tuple[int, int, int]:
    """(trained parameters, adapter parameters of the largest block, adapter activations per token per
    block): every parameter, 0, 0 without [lora]."""
    if config.lora is None:
        return shape.num_parameters, 0, 0
    adapters = list(adapter_parameters(shape, config.lora.rank, config.lora.targets))
    per_layer: dict[str, int] = {}
    for name, (rows, cols) in adapters:
        layer = name.split(".")[2]
        per_layer[layer] = per_layer.get(layer, 0) + rows * cols
    outputs = sum(rows for name, (rows, _) in adapters if name.endswith(".lora_B.weight"))
    per_token = (config.lora.rank * len(adapters) // 2 + outputs) // max(shape.num_layers, 1)
    return sum(per_layer.values()), max(per_layer.values(), default=0), per_token


def _inference_memory(config: Config, shape: ModelShape) -> tuple[MemoryEstimate, int]:
    inf = config.inference
    dtype = DTYPE_BYTES[config.model.dtype] if inf.gpus_per_node else 4
    tp = inf.tensor_parallel
    weights = dtype * shape.num_parameters // tp
    if inf.gpus_per_node:
        capacity = int(config.cluster.gpu_mem_gib * GIB)
        budget = int(inf.gpu_memory_utilization * capacity)
        kv_cache = int(inf.kv_cache_gib * GIB) or budget - weights - int(INFERENCE_ACTIVATION_RESERVE)
        parts = {"weights": weights, "activation_reserve": int(INFERENCE_ACTIVATION_RESERVE),
                 "kv_cache": max(kv_cache, 0)}
        estimate = MemoryEstimate(device="GPU", parts=parts, capacity=budget)
    else:
        capacity = int(config.cluster.mem_per_node_gib * GIB)
        # vLLM on CPU: gpu_memory_utilization is the fraction of RAM given to the KV cache (kv_cache_gib:
        # the size of each tensor-parallel rank's).
        kv_cache = int(inf.kv_cache_gib * GIB) * tp or int(inf.gpu_memory_utilization * (capacity or 16 * GIB))
        parts = {"weights": weights * tp, "kv_cache": kv_cache, "runtime": int(CPU_RUNTIME_OVERHEAD)}
        estimate = MemoryEstimate(device="CPU node", parts=parts, capacity=capacity)
    tokens = max(kv_cache, 0) // shape.family.kv_bytes_per_token(shape, dtype, tp)
    return estimate, tokens


def _moe_note(config: Config, shape: ModelShape, experts: Experts) -> str:
    t = config.trainer
    shard = t.world_size // t.dp_replicate if t.dp_shard == -1 else t.dp_shard
    per_rank = -(-experts.num_experts // shard)
    return (f"experts: {experts.parameters / 1e9:.2f} B of the {shape.num_parameters / 1e9:.2f} B parameters "
            f"({100 * experts.parameters / shape.num_parameters:.0f}%), FSDP-sharded whole: up to {per_rank} of "
            f"every block's {experts.num_experts} per trainer rank; activations count each token through its "
            f"top {experts.top_k}")


def plan_resources(config: Config, shape: ModelShape) -> ResourcePlan:
    """The resource plan of a validated config (see the module docstring for the estimates)."""
    t, inf = config.trainer, config.inference
    components = make_components(config)
    trainer_memory = _trainer_memory(config, shape)
    inference_memory, kv_tokens = _inference_memory(config, shape)
    max_len = config.max_model_len
    notes = []
    if config.cluster.gpus_per_node == -1 and (t.gpus_per_node or inf.gpus_per_node):
        notes.append(f"no cluster profile: assumed {config.cluster.gpu_mem_gib:g} GiB per GPU "
                     "(use --cluster NAME or set cluster.gpu_mem_gib)")
    if not trainer_memory.fits:
        notes.append(f"trainer does NOT fit: {trainer_memory.total / GIB:.1f} GiB per "
                     f"{trainer_memory.device} > {trainer_memory.capacity / GIB:.1f} GiB; shard over more "
                     f"ranks, lower {'micro_batch_tokens' if t.micro_batch_tokens else 'micro_batch_size'}, "
                     "or turn on activation_checkpointing")
    if not inference_memory.fits:
        notes.append(f"inference does NOT fit: {inference_memory.total / GIB:.1f} GiB per {inference_memory.device} > "
                     f"{inference_memory.capacity / GIB:.1f} GiB; raise tensor_parallel, or lower kv_cache_gib")
    experts = shape.experts()
    if experts is not None:
        notes.append(_moe_note(config, shape, experts))
    if kv_tokens < max_len:
        notes.append(f"inference does NOT fit: the KV cache holds {kv_tokens} tokens per replica, "
                     f"fewer than one sequence of {max_len}; raise tensor_parallel, gpu_memory_utilization or kv_cache_gib")
    shard = t.world_size // t.dp_replicate if t.dp_shard == -1 else t.dp_shard
    return ResourcePlan(
        run_name=config.run.name,
        executor=config.cluster.executor,
        layout=config.cluster.layout,
        components=components,
        trainer_mesh={"world_size": t.world_size, "dp_replicate": t.dp_replicate, "dp_shard": shard},
        inference_layout={"replicas": inf.replicas, "tensor_parallel": inf.tensor_parallel,
                          "gpus": inf.replicas * inf.tensor_parallel if inf.gpus_per_node else 0,
                          "max_model_len": max_len},
        model={"architecture": shape.architecture, "preset": config.model.preset,
               "path": config.model.path, "parameters": shape.num_parameters,
               "dtype": config.model.dtype,
               "bytes": shape.num_parameters * DTYPE_BYTES[config.model.dtype],
               "layers": shape.num_layers, "hidden_size": shape.hidden_size,
               "heads": shape.num_heads, "kv_heads": shape.num_kv_heads, "vocab_size": shape.vocab_size},
        trainer_memory=trainer_memory,
        inference_memory=inference_memory,
        kv_cache_tokens=kv_tokens,
        spare_nodes=config.cluster.spare_nodes,
        notes=notes,
        warnings=[w for w in (host_round_trip_warning(config),) if w],
    )
