"""The trainer engine: a torchtitan model under FSDP2, trained with the configured algorithm's loss.

One `TrainerEngine` per trainer rank. It joins no process group itself: the role, `hpcrl run` (a
group of one, hpcrl.trainer.group) or a test initialises torch.distributed first (gloo on CPU,
NCCL on GPUs) and every rank builds the engine with the same options. Without a process group it
runs unsharded in one process (same API, float32 only: mixed precision is FSDP2's).

    head / role                            every trainer rank
    -----------                            ------------------
    batch = RolloutBatch(...)   --->       engine.train_step(batch.shard(rank, world)) -> StepMetrics
    train = TrainBatch(...)     --->       engine.train_share(train)     (this rank's rows: packed ones with
                                                                          micro_batch_tokens, planned for all ranks)
                                           engine.logprobs(batch)        (mismatch vs vLLM)
                                           engine.routed_experts(seqs)   (MoE: top-k vs vLLM's)
                                           engine.local_shards()         (weight transfer source)
                                           engine.save_checkpoint(dir)   (DCP; load_checkpoint resumes)

Micro-batches are right-padded rows (micro_batch_size), or with micro_batch_tokens packed: rows end to
end in one row, attention within each (hpcrl.trainer.batch.pack, docs/ARCHITECTURE.md "A step's
micro-batches"); the loss sees the same [rows, T] tensors either way.

Collectives: `train_step`, `logprobs`, `ref_logprobs`, `full_state_dict_hf` and the checkpoint
methods must be called by all ranks together (FSDP gathers parameters); ranks may pass different numbers of rows,
including none (the engine pads with empty micro-batches so the collectives line up).

Logprobs are of softmax(logits / temperature), temperature = inference.temperature: with a
temperature other than 1 the inference role must report vLLM's processed (not raw) logprobs.

The step's own cost beside the model's forward and backward is kept small (issue 30): logprobs
and the entropy metric come from one fused pass over the lm_head in chunks of tokens
(hpcrl.trainer.loss.linear_logprobs: no float32 [tokens, vocab] tensor, no boolean-index copy),
the micro-batches are on the device before the loop, and nothing inside the loop waits on the
device: the metrics stay device tensors until one read after the backward.

    PYTHONPATH=. python -m pytest tests/trainer -q     # runs it in 1 process and on 2, 3, 4 gloo ranks
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from hpcrl.algorithms import load_algorithm
from hpcrl.algorithms.base import Options, options_of
from hpcrl.algorithms.terms import Normaliser, local_counts
from hpcrl.config.model_shapes import ModelShape, shape_of
from hpcrl.errors import TrainerError
from hpcrl.models.blocks import has_router_bias
from hpcrl.plan.micro_batches import plan_micro_batches
from hpcrl.trainer import checkpoint, lora, routing, titan, weights
from hpcrl.trainer.batch import Packing, RolloutBatch, pack, pad_rows
from hpcrl.trainer.loss import DEFAULT_CHUNK_TOKENS, linear_logprobs
from hpcrl.trainer.parallel import make_dp_mesh, reshard, shard_decoder
from hpcrl.trainer.schedule import LrSchedule, lr_at

if TYPE_CHECKING:
    from hpcrl.config.schema import LoraConfig
    from hpcrl.trainer.types import TrainBatch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    shape: ModelShape
    """Architecture and sizes of the model."""
    weights_path: str = ""
    """HF checkpoint directory to load; empty = random initialisation (benchmarks)."""
    dtype: str = "float32"
    """Compute dtype: bfloat16 = bf16 mixed precision (fp32 master weights, fp32 reduction); CPU uses float32."""
    device: str = "cpu"
    """"cpu", or "cuda" (the current CUDA device of this process)."""
    max_seq_len: int = 4096
    """Longest row (prompt + completion) the RoPE cache covers."""
    rope_scaling: titan.RopeScaling | titan.YarnRopeScaling | None = None
    """Llama 3 RoPE scaling; None = read it from weights_path/config.json (or none without weights)."""
    temperature: float = 1.0
    """Logits are divided by this before logprobs (match the logprobs vLLM reports)."""
    seed: int = 0
    """Seed of random initialisation."""
    lr: float = 1e-6
    """Peak learning rate (AdamW)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    lr_schedule: LrSchedule = "constant"
    """After warmup: constant, linear or cosine (hpcrl.trainer.schedule)."""
    warmup_steps: int = 0
    """Steps of linear warmup."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of lr (linear and cosine)."""
    total_steps: int = 100
    """Optimizer steps of the run (the decay horizon)."""
    micro_batch_size: int = 1
    """Rows per forward/backward; gradients accumulate over a rank's rows."""
    micro_batch_tokens: int = 0
    """Above 0: packed micro-batches of at most this many tokens (hpcrl.trainer.batch.pack; micro_batch_size
    is then not used); 0: micro_batch_size rows, right-padded."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 = no clipping (the norm is still reported)."""
    activation_checkpointing: bool = False
    """Recompute each transformer block in backward."""
    dp_replicate: int = 1
    """Replicas of the model (HSDP outer axis); 1 = plain FSDP."""
    dp_shard: int = -1
    """Ranks each replica is sharded over; -1 = world size / dp_replicate."""
    loss: Options = Options()
    """The algorithm whose loss train_step calls (its name, hpcrl.algorithms) and its options (clips, KL,
    aggregation, ...): the run's [algorithm] table with max_tokens filled in (options_of)."""
    logprob_chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    """Tokens per chunk of the fused lm_head + log-softmax (bounds its float32 temporaries)."""
    logprob_recompute: bool = False
    """Recompute each chunk's logits in the backward instead of keeping [tokens, vocab] logits in
    the compute dtype (saves that memory for one more lm_head matmul)."""
    moe_aux_loss_coef: float = 0.0
    moe_bias_update_rate: float = 0.0
    """The router bias's auxiliary-loss-free update speed (algorithm.moe_bias_update_rate; 0 = kept as loaded)."""
    """Weight of the routers' load-balancing loss (hpcrl.trainer.routing) added to the step loss of a
    Mixture-of-Experts model; 0 = not added (the loss is then exactly the algorithm's). Qwen3-MoE was
    pretrained with 0.001 (router_aux_loss_coef in its config.json)."""
    compile_logprobs: bool | None = None
    """torch.compile the float32 part of each chunk; None = on CUDA, off on CPU. Measured on an H200
    (Llama-3 1B, bf16, batch 4 x 2048): the step 186.5 ms eager, 168.8 ms compiled, beside 168.3 ms
    for a plain cross-entropy loop (BENCHMARKS.md "Trainer"); on CPU inductor's build costs more
    than it saves in a short run."""
    lora: LoraConfig | None = None
    """[lora]: train LoRA adapters on the target linears, the base weights frozen (hpcrl.trainer.lora); the
    reference policy is then the model with its adapters off. None = train every weight."""

    def __post_init__(self) -> None:
        if self.compile_logprobs is None:
            object.__setattr__(self, "compile_logprobs", self.device == "cuda")
        if self.dtype not in _DTYPES:
            raise TrainerError(f"dtype {self.dtype!r} is not one of {', '.join(_DTYPES)}")
        if self.device not in ("cpu", "cuda"):
            raise TrainerError(f"device {self.device!r}: use 'cpu' or 'cuda'")
        if self.micro_batch_size < 1:
            raise TrainerError(f"micro_batch_size must be at least 1, got {self.micro_batch_size}")
        if self.micro_batch_tokens < 0:
            raise TrainerError(f"micro_batch_tokens must be 0 (rows, padded) or above, got {self.micro_batch_tokens}")
        if self.logprob_chunk_tokens < 1:
            raise TrainerError(f"logprob_chunk_tokens must be at least 1, got {self.logprob_chunk_tokens}")
        if not self.moe_aux_loss_coef >= 0:
            raise TrainerError(f"moe_aux_loss_coef must be >= 0, got {self.moe_aux_loss_coef}")
        if self.moe_aux_loss_coef > 0 and not _has_moe(self.shape):
            raise TrainerError(f"moe_aux_loss_coef = {self.moe_aux_loss_coef} but {self.shape.architecture} has "
                               "no Mixture-of-Experts block (no router to balance); set algorithm.moe_aux_loss_coef = 0")
        if not self.moe_bias_update_rate >= 0:
            raise TrainerError(f"moe_bias_update_rate must be >= 0, got {self.moe_bias_update_rate}")
        if self.moe_bias_update_rate > 0 and not has_router_bias(self.shape):
            raise TrainerError(f"moe_bias_update_rate = {self.moe_bias_update_rate} but {self.shape.architecture}'s "
                               "routers have no bias; set algorithm.moe_bias_update_rate = 0")
        if self.lora is not None and self.lora.dropout > 0 and self.activation_checkpointing:
            raise TrainerError("lora.dropout > 0 with trainer.activation_checkpointing: the recomputed forward would "
                               "draw other dropout masks than the first; set lora.dropout = 0 or turn checkpointing off")
        if self.weights_path and self.rope_scaling is None:
            # The checkpoint decides: a Llama 3.1+ config.json asks for scaled RoPE frequencies.
            object.__setattr__(self, "rope_scaling", weights.read_rope_scaling(self.weights_path))

    @classmethod
    def from_config(cls, config, *, device: str | None = None, **overrides) -> EngineOptions:
        """The options of a run's trainer, from an `hpcrl.config.Config`: the one place that maps the
        config ([trainer], [model], [algorithm]) to the engine, for the trainer role and `hpcrl run`
        alike. Device: cuda when the trainer has GPUs, where the model's dtype applies (CPU: float32);
        rows of up to config.max_model_len tokens (the RoPE cache gets one position to spare).
        `overrides` replace fields (tests, benchmarks)."""
        t, m = config.trainer, config.model
        device = device or ("cuda" if t.gpus_per_node > 0 else "cpu")
        values = dict(
            shape=shape_of(m), weights_path=m.path,
            max_seq_len=config.max_model_len + 1,
            dtype=m.dtype if device == "cuda" else "float32", device=device, seed=config.run.seed,
            temperature=config.inference.temperature or 1.0, lr=t.lr, betas=tuple(t.betas), eps=t.eps,
            weight_decay=t.weight_decay, lr_schedule=t.lr_schedule, warmup_steps=t.warmup_steps,
            min_lr_ratio=t.min_lr_ratio, total_steps=t.steps, micro_batch_size=t.micro_batch_size,
            micro_batch_tokens=t.micro_batch_tokens,
            grad_clip=t.grad_clip, activation_checkpointing=t.activation_checkpointing,
            dp_replicate=t.dp_replicate, dp_shard=t.dp_shard,
            loss=options_of(config),
            moe_aux_loss_coef=config.algorithm.moe_aux_loss_coef,
            moe_bias_update_rate=config.algorithm.moe_bias_update_rate, lora=config.lora)
        values.update(overrides)
        return cls(**values)


@dataclass(frozen=True, kw_only=True)
class StepMetrics:
    """What one optimizer step did, summed over all trainer ranks."""

    step: int
    loss: float
    policy_loss: float
    kl: float
    """Token-mean KL to the reference (0 when kl_coef = 0)."""
    entropy: float
    """Token-mean entropy of the policy over completion tokens: of softmax(logits / temperature), the
    distribution vLLM samples from (the logprobs' distribution)."""
    clip_fraction: float
    clip_fraction_low: float
    clip_fraction_high: float
    grad_norm: float
    """Global gradient norm before clipping."""
    lr: float
    completion_tokens: int
    sequences: int
    tokens_per_s: float
    """(prompt + completion) tokens of the step / wall time of the step."""
    step_time_s: float
    sampling_logprob_diff: float = 0.0
    """Token-mean |trainer logprob - vLLM's sampling logprob| of the batch's completion tokens, from the
    step's own forward (before the update). At policy lag 0 the batch was sampled with exactly these
    weights, so this is the train-inference mismatch; at lag > 0 it adds the policy's drift since."""
    moe_aux_loss: float = 0.0
    """Mixture-of-Experts models: the routers' load-balancing loss of the step (hpcrl.trainer.routing:
    k when balanced, up to E when collapsed), a token-weighted mean over the micro-batches, measured
    whether or not moe_aux_loss_coef adds it to the loss; 0 for a dense model."""
    time_rank_busy_max_s: float = 0.0
    time_rank_busy_min_s: float = 0.0
    """On CPU: the most and least CPU time a trainer rank spent in the step's forwards and backwards (its
    process's CPU time over the micro-batch loop). A rank waiting in a collective for a slower one blocks
    without using the CPU, so this is each rank's own work, which the step's wall time hides (FSDP2's
    collectives make every rank's step as long as the slowest's). 0 on a GPU, where the host's CPU time is
    not the kernels'. Their ratio is 1.0 when the ranks did equal work (trainer.micro_batch_tokens balances
    their tokens)."""

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


class TrainerEngine:
    """Policy (and frozen reference) model, optimizer and the RL step (the algorithm's loss) of one trainer rank."""

    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        if options.device == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        if not self.distributed and options.dtype != "float32":
            raise TrainerError("mixed precision runs through FSDP: initialise torch.distributed first "
                               "(a world of 1 is fine), or use dtype float32")
        self.hf_names = titan.hf_to_titan_names(options.shape)
        self.moe = _has_moe(options.shape)
        self.mesh = make_dp_mesh(dp_replicate=options.dp_replicate, dp_shard=options.dp_shard,
                                 device_type=self.device.type) if self.distributed else None
        self.adapters: lora.Adapters | None = None
        self.model = self._build(trainable=True)
        if options.weights_path:
            weights.load_hf_weights(self.model, self.hf_names, options.weights_path, rank=self.rank)
        if self.adapters is not None:
            self.adapters.initialise(self.model, seed=options.seed, rank=self.rank)
            if self.adapters.config.init_from:
                self.adapters.load(self.model, self.adapters.config.init_from, rank=self.rank)
        self.reference = None
        if options.loss.kl_coef > 0 and self.adapters is None:  # with LoRA: the model with its adapters off
            self.reference = self._build(trainable=False)
            weights.copy_weights(self.model, self.reference, self.hf_names, rank=self.rank)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=options.lr, betas=options.betas,
            eps=options.eps, weight_decay=options.weight_decay, fused=self.device.type == "cuda")
        self.step = 0
        self._base: dict[str, str] | None = None

    @classmethod
    def from_config(cls, config, *, device: str | None = None, **overrides) -> TrainerEngine:
        return cls(EngineOptions.from_config(config, device=device, **overrides))

    def _build(self, *, trainable: bool):
        o = self.options
        model = titan.build_model(o.shape, max_seq_len=o.max_seq_len, rope_scaling=o.rope_scaling, device="meta")
        if o.lora is not None and trainable:
            self.adapters = lora.add_adapters(model, o.shape, o.lora, self.hf_names)
        if o.activation_checkpointing and trainable:
            titan.apply_activation_checkpointing(model)
        if self.mesh is not None:
            mixed = _DTYPES[o.dtype] if o.dtype != "float32" else None
            shard_decoder(model, titan.transformer_blocks(model), self.mesh, param_dtype=mixed)
        model.to_empty(device=self.device)
        torch.manual_seed(o.seed)
        titan.init_states(model, device=self.device)
        titan.set_trainable(model, trainable)
        if self.adapters is not None and trainable:
            model.requires_grad_(False)  # the base is frozen: no gradient, no optimizer state
            for param in self.adapters.parameters(model, rank=self.rank).values():
                param.requires_grad_(True)
        model.train(trainable)
        return model

    # ------------------------------------------------------------------------------ helpers

    def _all_reduce(self, values: Tensor, *, op: str = "sum", read: bool = True) -> Tensor:
        """Sum (or max) over all trainer ranks; identity without a process group. On the host
        (a read: waits for the device) unless read=False."""
        if self.distributed:
            values = values.to(self.device)
            dist.all_reduce(values, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return values.cpu() if read else values

    def _micro_batches(self, batch: RolloutBatch, plan: list[list[int]] | None = None, *,
                       packed: bool | None = None) -> list[_Micro]:
        """This rank's micro-batches, then idle ones up to the largest count of any rank, on the
        device (copied before the loop, so no copy inside it waits for the device).

        Packed (options.micro_batch_tokens, or `packed`): the rows of `plan` (lists of row indices; [] an
        idle micro-batch), or else the rows packed here by first-fit decreasing up to the budget
        (hpcrl.plan.micro_batches); padded: micro_batch_size consecutive rows."""
        o = self.options
        if packed is None:
            packed = o.micro_batch_tokens > 0
        if not packed:
            starts = range(0, batch.size, o.micro_batch_size)
            chunks = [_Micro(list(range(i, min(i + o.micro_batch_size, batch.size))), mb, None)
                      for i, mb in zip(starts, batch.micro_batches(o.micro_batch_size), strict=True)]
        else:
            if plan is None:
                longest = int(batch.lengths.max()) if batch.size else 0
                budget = o.micro_batch_tokens or max(longest, 1)  # a plan of its own: no larger than needed
                plan = [list(m) for m in plan_micro_batches(batch.lengths.tolist(), ranks=1, budget=budget).ranks[0]]
            chunks = []
            for rows in plan:
                mb = batch.take(rows) if rows else _idle_batch(batch)
                chunks.append(_Micro(rows, mb, pack(mb)))
        most = int(self._all_reduce(torch.tensor([len(chunks)], dtype=torch.float64), op="max")[0])
        idle = _idle_batch(batch)
        chunks += [_Micro([], idle, pack(idle) if packed else None)] * (most - len(chunks))
        return [self._to_device(micro) for micro in chunks]

    def _to_device(self, micro: _Micro) -> _Micro:
        if self.device.type == "cpu":
            return micro
        mb = micro.batch
        moved: dict[str, Any] = {
            f.name: None if getattr(mb, f.name) is None
            else getattr(mb, f.name).pin_memory().to(self.device, non_blocking=True) for f in fields(mb)}
        return _Micro(micro.rows, RolloutBatch(**moved),
                      None if micro.packing is None else micro.packing.to(self.device))

    def _forward_logprobs(self, model, micro: _Micro, *, entropy: bool = False) -> tuple[Tensor, Tensor | None]:
        """(logprobs [b, T] aligned with the micro-batch's tokens, 0 at t = 0; entropy [b, T] likewise, or None).

        Every position's hidden state goes through the fused lm_head + log-softmax, the last one
        too (its target is a stand-in): slicing it off first would copy the hidden states and
        their gradient for one position in T. Packed, the forward runs over the packed row and its
        outputs are gathered back into the [b, T] layout (0 where no token is predicted), which the
        algorithm's loss takes as it takes the padded one.
        """
        o = self.options
        packing = micro.packing
        if packing is None:
            tokens = micro.batch.tokens
            hidden = titan.hidden_states(model, tokens)
        else:
            tokens = packing.tokens
            hidden = titan.hidden_states(model, tokens, positions=packing.positions,
                                         documents=titan.Documents(packing.bounds))
        targets = torch.roll(tokens, -1, dims=1)  # position t predicts token t + 1
        weight = titan.output_weight(model)
        if self.adapters is not None:  # an adapted lm_head: [h, A h] and [W, (alpha / rank) B] (hpcrl.trainer.lora)
            hidden, weight = self.adapters.head_inputs(model, hidden, weight)
        logp, ent = linear_logprobs(hidden, weight, targets, temperature=o.temperature,
                                    chunk_tokens=o.logprob_chunk_tokens, recompute=o.logprob_recompute,
                                    entropy=entropy, compiled=bool(o.compile_logprobs))
        if packing is not None:
            return packing.unpack(logp), None if ent is None else packing.unpack(ent)
        shift = (1, -1)  # to token alignment: drop the last position, 0 at t = 0
        return (torch.nn.functional.pad(logp, shift),
                None if ent is None else torch.nn.functional.pad(ent, shift))

    def _logprobs_of(self, model, batch: RolloutBatch) -> Tensor:
        out = torch.zeros(batch.tokens.shape, dtype=torch.float32, device=self.device)
        with torch.no_grad():
            for micro in self._micro_batches(batch):
                logp, _ = self._forward_logprobs(model, micro)
                if micro.rows:  # idle micro-batches give nothing back
                    out[torch.tensor(micro.rows, device=self.device), :logp.shape[1]] = logp
        self._reshard(model)
        return out.cpu()

    def _reshard(self, model) -> None:
        if self.mesh is not None:
            reshard(model)

    # ---------------------------------------------------------------------------- public API

    def logprobs(self, batch: RolloutBatch) -> Tensor:
        """[B, T] logprob of each token under the current policy (0 at t = 0). Collective."""
        return self._logprobs_of(self.model, batch)

    def sequence_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Logprob of every token after the first of each sequence (what vLLM's prompt_logprobs
        gives), under the current policy. Collective: every rank passes the same sequences."""
        rows = pad_rows(sequences, [1] * len(sequences), [[0.0] * (len(s) - 1) for s in sequences],
                        [0.0] * len(sequences))
        values = self.logprobs(rows)
        return [values[i, 1:len(seq)].tolist() for i, seq in enumerate(sequences)]

    def routed_experts(self, sequences: list[list[int]]) -> list[Tensor]:
        """The trainer's top-k experts of every token of each sequence under the current policy:
        [len(sequence), num_layers, K] int64 each, -1 at blocks without experts; vLLM's
        CompletionOutput.routed_experts has the same layout (hpcrl.trainer.routing.routing_mismatch
        compares them). Collective: every rank passes the same sequences."""
        if not self.moe:
            raise TrainerError(f"{self.options.shape.architecture} has no Mixture-of-Experts block: "
                               "there is no routing to report")
        rows = pad_rows(sequences, [1] * len(sequences), [[0.0] * (len(s) - 1) for s in sequences],
                        [0.0] * len(sequences))
        tap = routing.RouterTap(self.model, keep_ids=True, differentiable=False)
        out: list[Tensor] = []
        with torch.no_grad():
            for micro in self._micro_batches(rows, packed=False):  # a diagnostic: padded rows, whatever the options
                with tap:
                    titan.hidden_states(self.model, micro.batch.tokens)
                ids = tap.top_k(self.options.shape.num_layers).cpu()
                out.extend(ids[i] for i in range(micro.batch.size))
        self._reshard(self.model)
        # idle micro-batches come last and are dropped here
        return [out[i][:len(seq)] for i, seq in enumerate(sequences)]

    def ref_logprobs(self, batch: RolloutBatch) -> Tensor:
        """[B, T] logprobs under the frozen reference (needs kl_coef > 0; with LoRA: the base model, the
        adapters off). Collective."""
        if self.adapters is not None:
            with self.adapters.off():
                return self._logprobs_of(self.model, batch)
        if self.reference is None:
            raise TrainerError("there is no reference model: it is built only when algorithm.kl_coef > 0")
        return self._logprobs_of(self.reference, batch)

    def lr(self, step: int | None = None) -> float:
        o = self.options
        return lr_at(self.step if step is None else step, peak=o.lr, total_steps=o.total_steps,
                     warmup_steps=o.warmup_steps, schedule=o.lr_schedule, min_lr_ratio=o.min_lr_ratio)

    def train_share(self, batch: TrainBatch) -> StepMetrics:
        """One optimizer step on this rank's share of the step's whole batch (every rank passes the same):
        with micro_batch_tokens, the rows and packed micro-batches hpcrl.plan.micro_batches plans for this
        rank (equal tokens and micro-batch counts over the ranks); else TrainBatch.shard's contiguous rows in
        micro_batch_size micro-batches. Collective."""
        o = self.options
        if not o.micro_batch_tokens:
            return self.train_step(batch.shard(self.rank, self.world_size).rows())
        plan = plan_micro_batches(batch.lengths(), ranks=self.world_size, budget=o.micro_batch_tokens)
        mine = batch.take(list(plan.rows(self.rank)))
        micro_batches, start = [], 0
        for rows in plan.ranks[self.rank]:  # as indices into this rank's rows
            micro_batches.append(list(range(start, start + len(rows))))
            start += len(rows)
        return self.train_step(mine.rows(), micro_batches=micro_batches)

    def train_step(self, batch: RolloutBatch, *, micro_batches: list[list[int]] | None = None) -> StepMetrics:
        """One optimizer step on this rank's rows of the step's batch, minimising the configured
        algorithm's loss (options.loss.name). `micro_batches`: the rows of each packed micro-batch
        (indices into `batch`; [] an idle one), as planned for every rank (train_share); None: the
        engine cuts its own (see _micro_batches). Collective."""
        start = time.perf_counter()
        o = self.options
        algorithm = load_algorithm(o.loss.name)
        counts = self._all_reduce(torch.cat([local_counts(batch.completion_mask),
                                             batch.lengths.sum().double().view(1)]))
        norm = Normaliser(tokens=float(counts[0]), sequences=float(counts[1]))
        lr = self.lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        # loss, policy, kl, clipped low, clipped high, entropy sum, |logp - old logp| sum, MoE
        # load-balancing share: device tensors, read once after the loop (a read inside it would
        # wait for the device)
        sums = torch.zeros(8, dtype=torch.float64, device=self.device)
        if self.adapters is not None:
            self.adapters.seed_dropout(seed=o.seed, step=self.step, rank=self.rank, device=self.device)
        tap = routing.RouterTap(self.model, differentiable=o.moe_aux_loss_coef > 0) if self.moe else None
        loads: dict[int, Tensor] = {}  # MoE block -> [E] the step's valid tokens per expert (the bias update)
        busy = time.process_time()
        for micro in self._micro_batches(batch, micro_batches, packed=True if micro_batches is not None else None):
            mb = micro.batch
            ref = mb.ref_logprobs
            if o.loss.kl_coef > 0 and ref is None:
                ref = self._reference_forward(micro)
            with self._adapters_training():
                if tap is None:
                    logp, entropy = self._forward_logprobs(self.model, micro, entropy=True)
                else:
                    tap.valid = (routing.valid_tokens(mb.completion_mask) if micro.packing is None
                                 else micro.packing.valid)
                    with tap:
                        logp, entropy = self._forward_logprobs(self.model, micro, entropy=True)
            mask = mb.completion_mask
            share = algorithm.loss(logprobs=logp, old_logprobs=mb.old_logprobs, advantages=mb.advantages,
                                   mask=mask, settings=o.loss, norm=norm, ref_logprobs=ref)
            loss, balance = share.loss, torch.zeros((), device=self.device)
            if tap is not None and tap.valid is not None:
                # this micro-batch's token-weighted share of the step's load-balancing loss: a
                # metric, and with a coefficient > 0 a term of the loss
                balance = routing.load_balancing_loss(tap.records) * (tap.valid.sum() / max(float(counts[2]), 1.0))
                if o.moe_bias_update_rate > 0:
                    for record in tap.records:
                        loads[record.layer] = loads.get(record.layer, 0) + record.fraction * tap.valid.sum()
                tap.records = []
                if o.moe_aux_loss_coef > 0:
                    loss = loss + o.moe_aux_loss_coef * balance
            loss.backward()
            with torch.no_grad():  # masked by multiplying (where: padding may hold -inf), never by indexing
                assert entropy is not None
                diff = torch.where(mask, (logp - mb.old_logprobs).abs(), 0.0)
                sums += torch.stack([loss.detach().double(), share.policy_loss, share.kl,
                                     share.clipped_low, share.clipped_high,
                                     (entropy * mask).sum().double(), diff.sum().double(),
                                     balance.detach().double()])
            del logp, entropy, share, loss, balance
        if self.reference is not None:
            self._reshard(self.reference)  # its no-grad forwards left the root gathered
        # every rank's CPU time in the loop, each in its own slot: the sum gives them all (StepMetrics)
        ranks = torch.zeros(self.world_size, dtype=torch.float64, device=self.device)
        ranks[self.rank] = time.process_time() - busy
        # the step's one read of the device: metrics and gradient norm together, before the
        # optimizer step (a non-finite norm must stop it)
        totals = torch.cat([self._all_reduce(torch.cat([sums, ranks]), read=False),
                            self._clip_gradients().to(self.device, torch.float64).view(1)]).cpu()
        grad_norm = self._check_grad_norm(float(totals[-1]))
        busy_s = totals[8:-1].tolist() if self.device.type == "cpu" else [0.0]
        if loads:
            self._update_router_bias(loads)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        elapsed = time.perf_counter() - start
        tokens = max(norm.tokens, 1.0)
        return StepMetrics(
            step=self.step, loss=float(totals[0]), policy_loss=float(totals[1]), kl=float(totals[2]),
            entropy=float(totals[5]) / tokens, clip_fraction=float(totals[3] + totals[4]) / tokens,
            clip_fraction_low=float(totals[3]) / tokens, clip_fraction_high=float(totals[4]) / tokens,
            grad_norm=grad_norm, lr=lr, completion_tokens=int(norm.tokens), sequences=int(norm.sequences),
            tokens_per_s=float(counts[2]) / elapsed, step_time_s=elapsed,
            sampling_logprob_diff=float(totals[6]) / tokens, moe_aux_loss=float(totals[7]),
            time_rank_busy_max_s=max(busy_s), time_rank_busy_min_s=min(busy_s))

    def _update_router_bias(self, loads: dict[int, Tensor]) -> None:
        """Auxiliary-loss-free balancing (DeepSeek-V3), torchtitan's rule (components/optimizer.py
        `_update_expert_bias`): over every rank's completion tokens of the step, each MoE block's bias moves
        by rate x sign(mean load - expert's load), centred to sum 0. Padding and prompt tokens do not count
        (torchtitan counts every token: pretraining has neither)."""
        layers = sorted(loads)
        total = self._all_reduce(torch.stack([loads[layer] for layer in layers]).double(), read=False)
        biases = titan.router_biases(self.model)
        rate = self.options.moe_bias_update_rate
        with torch.no_grad():
            for load, layer in zip(total, layers):
                delta = rate * torch.sign(load.mean() - load)
                delta -= delta.mean()
                local, first = weights.local_rows(biases[layer])
                local += delta[first:first + local.shape[0]].to(local.dtype)

    def _reference_forward(self, micro: _Micro) -> Tensor:
        """The micro-batch's logprobs under the reference: the frozen copy, or with LoRA the base model (the
        policy's own weights with its adapters off: no second copy)."""
        with torch.no_grad():
            if self.adapters is None:
                return self._forward_logprobs(self.reference, micro)[0]
            with self.adapters.off():
                return self._forward_logprobs(self.model, micro)[0]

    def _adapters_training(self):
        """LoRA's dropout on for the policy's forward of a step (a no-op without LoRA)."""
        return self.adapters.training() if self.adapters is not None else contextlib.nullcontext()

    def _clip_gradients(self) -> Tensor:
        """Clip the gradients to options.grad_clip; the global norm before clipping (not read)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.options.grad_clip if self.options.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return norm

    def _check_grad_norm(self, value: float) -> float:
        if not math.isfinite(value):
            raise TrainerError(f"rank {self.rank}: gradient norm is {value} at step {self.step}; "
                               "lower trainer.lr or check the batch's old_logprobs and advantages")
        return value

    def local_shards(self) -> dict[str, weights.LocalShard]:
        """{hf_name: LocalShard(tensor, global_shape, dim0_offset)} of this rank: what the weight transfer
        sends. With LoRA only the adapters, under their PEFT names (hpcrl.models.lora.adapter_parameters).
        No communication."""
        self._reshard(self.model)  # a no-op unless something left parameters gathered
        names = self.hf_names if self.adapters is None else self.adapters.names
        return weights.local_shards(self.model, names, rank=self.rank, sharded=self.mesh is not None)

    def full_state_dict_hf(self) -> dict[str, Tensor]:
        """{hf_name: full CPU tensor} on every rank (for tests and HF export; with LoRA the frozen base).
        Collective."""
        return weights.full_state_dict_hf(self.model, self.hf_names, rank=self.rank)

    def adapter_state_dict(self) -> dict[str, Tensor]:
        """{HF adapter name: full CPU tensor} on every rank, in checkpoint order (LoRA only). Collective."""
        if self.adapters is None:
            raise TrainerError("this trainer has no LoRA adapters: add a [lora] table to the config")
        return weights.full_state_dict_hf(self.model, self.adapters.names, rank=self.rank)

    def save_checkpoint(self, directory) -> None:
        """Model, optimizer and step under `directory` (DCP, one file per rank). Collective. With LoRA the
        adapters and their optimizer state only, and the base model's path and hash (checkpoint.BASE_FILE)."""
        lora_run = self.adapters is not None
        checkpoint.save(self.model, self.optimizer, self.step, directory, adapters_only=lora_run)
        if lora_run and self.rank == 0:
            checkpoint.write_base(directory, self._base_identity())

    def load_checkpoint(self, directory) -> None:
        """Resume from `directory`, written by any number of ranks. Collective. The reference
        model is not saved: it is the initial weights, reloaded from the checkpoint path at start
        (with LoRA the base, which must be the one the checkpoint names: checked first, by rank 0)."""
        lora_run = self.adapters is not None
        why = checkpoint.base_mismatch(directory, self._base_identity() if lora_run else None) if self.rank == 0 else ""
        if float(self._all_reduce(torch.tensor([float(bool(why))], dtype=torch.float64), op="max")[0]):
            raise TrainerError(why or f"rank {self.rank}: rank 0 refused checkpoint {directory} (its log says why)")
        self.step = checkpoint.load(self.model, self.optimizer, directory, rank=self.rank, adapters_only=lora_run)

    def _base_identity(self) -> dict[str, str]:
        """The base model's path and hash (hashed once: checkpoint.base_identity reads every byte)."""
        if self._base is None:
            self._base = checkpoint.base_identity(self.options.weights_path)
        return self._base

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def _has_moe(shape: ModelShape) -> bool:
    return shape.experts() is not None


class _Micro(NamedTuple):
    """One micro-batch: its rows (indices into the rank's batch; [] for an idle one), those rows as a
    right-padded batch (what the loss reads), and their packing (None: the forward runs on the padded rows)."""

    rows: list[int]
    batch: RolloutBatch
    packing: Packing | None


def _idle_batch(like: RolloutBatch) -> RolloutBatch:
    """One row with no completion tokens: runs forward and backward (joining FSDP's collectives)
    and adds exactly zero to the loss and the gradients."""
    return RolloutBatch(tokens=torch.zeros(1, 2, dtype=torch.long),
                        completion_mask=torch.zeros(1, 2, dtype=torch.bool), old_logprobs=torch.zeros(1, 2),
                        advantages=torch.zeros(1) if like.advantages.dim() == 1 else torch.zeros(1, 2),
                        ref_logprobs=None if like.ref_logprobs is None else torch.zeros(1, 2))
