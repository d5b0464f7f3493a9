"""What a Mixture-of-Experts model's routers decided: the load-balancing loss and the top-k experts.

A `RouterTap` hooks every MoE block's router (torchtitan's TokenChoiceTopKRouter, found by
hpcrl.trainer.titan.moe_routers) for the forwards run inside it, and reduces each block's softmax
scores [B, L, E] and top-k expert ids [B, L, K] to two [E] vectors as the router returns them (the
probability one keeps its graph), and keeps the ids only when asked. The forward itself is not
changed: a model without the tap computes bit for bit what it computes with it. Hooks fire only
inside the `with`, so the activation-checkpoint recompute in the backward adds nothing.

    tap = RouterTap(model, keep_ids=True)
    tap.valid = valid_tokens(completion_mask)           # the tokens that count (None: all)
    with tap:
        hidden = titan.hidden_states(model, tokens)
    aux = load_balancing_loss(tap.records)              # differentiable, in the routers' weights
    ids = tap.top_k(num_layers)                         # [B, L, num_layers, K], -1 at dense blocks

A sigmoid router's (DeepSeek-V3) scores are normalised to sum 1 per token first, as DeepSeek-V3's
sequence-wise balance loss takes them. The load-balancing loss is the Switch Transformer's, as Qwen's MoE models are trained with it
(transformers' `load_balancing_loss_func`, `router_aux_loss_coef` in their config.json): per MoE
block, E x sum_e f_e x P_e, where f_e is the fraction of the (valid) tokens that chose expert e
among their top k and P_e the mean softmax probability of e; the engine averages it over the MoE
blocks. It is k when routing is perfectly balanced and grows to E when every token picks the same
experts with all its probability. transformers pools the blocks' tokens before the product; here
each block is balanced on its own (Megatron's per-layer form), so one block's imbalance cannot be
hidden by another's. Only P_e carries a gradient (f_e counts discrete choices).

`routing_mismatch` compares the trainer's top-k with vLLM's (CompletionOutput.routed_experts,
[tokens, layers, K]) for the same sequence: the fraction of (token, MoE block) whose expert sets
differ. It needs no torch, so the head can compute it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hpcrl.errors import TrainerError

if TYPE_CHECKING:
    from torch import Tensor, nn


@dataclass(frozen=True, kw_only=True)
class RouterRecord:
    """One MoE block's routing in one forward, reduced over the tokens as soon as the router ran."""

    layer: int
    """Index of the block in the decoder."""
    fraction: Tensor
    """[E] f_e: the share of the valid tokens that chose expert e among their top k (sums to K; no graph)."""
    probability: Tensor
    """[E] P_e: the mean softmax probability of expert e over the valid tokens (float32; keeps its graph
    in a grad forward, through the router's softmax)."""
    expert_ids: Tensor | None = None
    """[B, L, K] the top-k experts of every token (unordered), when the tap keeps them."""


def block_record(layer: int, scores: Tensor, expert_ids: Tensor, valid: Tensor | None,
                 *, keep_ids: bool = False, differentiable: bool = True) -> RouterRecord:
    """The record of one router's output: scores [B, L, E] (softmax), expert_ids [B, L, K], valid [B, L]
    (None: every token). Reduced to [E] vectors at once, so no per-token tensor outlives the forward
    (under activation checkpointing a kept [tokens, E] score tensor would be memory the recompute saves);
    P keeps its graph when `differentiable`."""
    import torch

    weights = (torch.ones(scores.shape[:2], device=scores.device) if valid is None
               else valid.to(device=scores.device, dtype=torch.float32)).unsqueeze(-1)  # [B, L, 1]
    count = weights.sum().clamp(min=1.0)
    with torch.no_grad():
        chosen = torch.zeros_like(scores).scatter_(-1, expert_ids, 1.0)  # [B, L, E]
        fraction = (chosen * weights).sum(dim=(0, 1)) / count
    with torch.set_grad_enabled(differentiable and torch.is_grad_enabled()):
        probability = (scores * weights).sum(dim=(0, 1)) / count
    return RouterRecord(layer=layer, fraction=fraction, probability=probability,
                        expert_ids=expert_ids if keep_ids else None)


class RouterTap:
    """Forward hooks on every MoE router of `model`, recording while inside `with` (see the module docstring).

    `valid` [B, L] says which tokens of the next forwards count (None: all); `keep_ids` keeps every
    token's top-k ids (for `top_k`), which a training step does not need; `differentiable` keeps the
    graph of P (a load-balancing loss to backward), else the records are only measurements."""

    def __init__(self, model: nn.Module, *, keep_ids: bool = False, differentiable: bool = True) -> None:
        from hpcrl.trainer import titan

        self.routers = titan.moe_routers(model)
        self.blocks = titan.transformer_blocks(model)
        self.keep_ids = keep_ids
        self.differentiable = differentiable
        self.valid: Tensor | None = None
        self.records: list[RouterRecord] = []
        self._pending: dict[int, tuple[Tensor, Tensor]] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> RouterTap:
        # The router's hook only keeps its outputs; the block's hook (outside an activation-checkpoint
        # wrapper, which is the block itself then) reduces them: ops inside the checkpointed region
        # would save tensors its recompute, without the hook, does not.
        self.records, self._pending = [], {}
        for layer, router in self.routers.items():
            self._handles.append(router.register_forward_hook(self._keep(layer)))
            self._handles.append(self.blocks[layer].register_forward_hook(self._reduce(layer)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _keep(self, layer: int):
        def keep(module, _inputs, outputs) -> None:
            _top_scores, expert_ids, scores = outputs
            if getattr(module, "score_func", "softmax") == "sigmoid":
                # a sigmoid router's scores do not sum to 1: normalised per token, as DeepSeek-V3's balance
                # loss takes them, so P_e is a probability again and the loss is k when balanced
                scores = scores / scores.sum(dim=-1, keepdim=True)
            self._pending[layer] = (scores, expert_ids)
        return keep

    def _reduce(self, layer: int):
        def reduce(_module, _inputs, _outputs) -> None:
            scores, expert_ids = self._pending.pop(layer)
            self.records.append(block_record(layer, scores, expert_ids, self.valid, keep_ids=self.keep_ids,
                                             differentiable=self.differentiable))
        return reduce

    def top_k(self, num_layers: int) -> Tensor:
        """[B, L, num_layers, K] int64 expert ids of the recorded forward; -1 at blocks without experts."""
        import torch

        kept = [r for r in self.records if r.expert_ids is not None]
        if not kept:
            raise TrainerError("no router's top-k was recorded: the model has no MoE block, no forward ran "
                               "inside `with`, or the RouterTap was made without keep_ids=True")
        first = kept[0].expert_ids
        assert first is not None
        out = torch.full((*first.shape[:2], num_layers, first.shape[-1]), -1, dtype=torch.long, device=first.device)
        for record in kept:
            assert record.expert_ids is not None
            out[:, :, record.layer] = record.expert_ids
        return out


def valid_tokens(completion_mask: Tensor) -> Tensor:
    """[B, T] bool: the tokens of each row up to its last completion token (padding and empty rows
    excluded), the ones the load-balancing loss counts. On the mask's device."""
    import torch

    if completion_mask.shape[0] == 0:
        return torch.zeros_like(completion_mask, dtype=torch.bool)
    positions = torch.arange(1, completion_mask.shape[1] + 1, device=completion_mask.device)
    length = (positions * completion_mask).amax(dim=1, keepdim=True)
    return positions.unsqueeze(0) <= length


def load_balancing_loss(records: Sequence[RouterRecord]) -> Tensor:
    """Mean over the recorded MoE blocks of E x sum_e f_e x P_e (see the module docstring); 0 when no
    token was valid. float32 scalar, differentiable in P."""
    import torch

    if not records:
        raise TrainerError("load_balancing_loss needs the routing of at least one MoE block")
    return torch.stack([r.fraction.numel() * (r.fraction * r.probability).sum() for r in records]).mean()


def routing_mismatch(trainer: Sequence[Any], inference: Sequence[Any], *, moe_layers: Sequence[int]) -> float:
    """Fraction of (token, MoE block) whose top-k expert sets differ between two routings of the same
    sequence, each [tokens, layers, K] (nested lists, numpy arrays or tensors): the trainer's
    (`TrainerEngine.routed_experts`) and vLLM's (CompletionOutput.routed_experts). Compared over the
    tokens both cover (vLLM's ends one token early: the last sampled token is never run) and the
    blocks in `moe_layers`; 0.0 when there is nothing to compare."""
    trainer_rows, inference_rows = _rows(trainer), _rows(inference)
    tokens = min(len(trainer_rows), len(inference_rows))
    differ = total = 0
    for t in range(tokens):
        for layer in moe_layers:
            total += 1
            differ += set(trainer_rows[t][layer]) != set(inference_rows[t][layer])
    return differ / total if total else 0.0


def _rows(routing: Any) -> list:
    return routing.tolist() if hasattr(routing, "tolist") else list(routing)
