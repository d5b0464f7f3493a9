"""What a Mixture-of-Experts model's routers decided: the load-balancing loss and the top-k experts.

A `RouterTap` hooks every MoE block's router (torchtitan's TokenChoiceTopKRouter, found by
hpcrl.trainer.titan.moe_routers) for the forwards run inside it, and keeps each block's softmax
scores [B, L, E] (with their graph) and top-k expert ids [B, L, K]. The forward itself is not
changed: a model without the tap computes bit for bit what it computes with it. Hooks fire only
inside the `with`, so the activation-checkpoint recompute in the backward adds nothing.

    with RouterTap(model) as tap:
        hidden = titan.hidden_states(model, tokens)
    aux = load_balancing_loss(tap.records, valid)       # differentiable, in the routers' weights
    ids = tap.top_k(num_layers)                         # [B, L, num_layers, K], -1 at dense blocks

The load-balancing loss is the Switch Transformer's, as Qwen's MoE models are trained with it
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
    """One MoE block's routing in one forward."""

    layer: int
    """Index of the block in the decoder."""
    scores: Tensor
    """[B, L, E] softmax probability of every expert (float32; keeps its graph in a grad forward)."""
    expert_ids: Tensor
    """[B, L, K] the top-k experts each token was sent to (unordered)."""


class RouterTap:
    """Forward hooks on every MoE router of `model`, recording while inside `with` (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        from hpcrl.trainer import titan

        self.routers = titan.moe_routers(model)
        self.records: list[RouterRecord] = []
        self._handles: list[Any] = []

    def __enter__(self) -> RouterTap:
        self.records = []
        for layer, router in self.routers.items():
            self._handles.append(router.register_forward_hook(self._hook(layer)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, layer: int):
        def record(_module, _inputs, outputs) -> None:
            _top_scores, expert_ids, scores = outputs
            self.records.append(RouterRecord(layer=layer, scores=scores, expert_ids=expert_ids))
        return record

    def top_k(self, num_layers: int) -> Tensor:
        """[B, L, num_layers, K] int64 expert ids of the recorded forward; -1 at blocks without experts."""
        import torch

        if not self.records:
            raise TrainerError("no router ran inside the RouterTap: the model has no MoE block, "
                               "or no forward ran inside `with`")
        first = self.records[0].expert_ids
        out = torch.full((*first.shape[:2], num_layers, first.shape[-1]), -1, dtype=torch.long, device=first.device)
        for record in self.records:
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


def load_balancing_loss(records: Sequence[RouterRecord], valid: Tensor) -> Tensor:
    """Mean over the recorded MoE blocks of E x sum_e f_e x P_e over the `valid` tokens [B, L]
    (see the module docstring); 0 (with a graph) when no token is valid. float32 scalar."""
    import torch

    if not records:
        raise TrainerError("load_balancing_loss needs the routing of at least one MoE block")
    weights = valid.to(torch.float32).unsqueeze(-1)  # [B, L, 1]
    count = weights.sum().clamp(min=1.0)
    losses = []
    for record in records:
        experts = record.scores.shape[-1]
        chosen = torch.zeros_like(record.scores).scatter_(-1, record.expert_ids, 1.0)  # [B, L, E], no graph
        fraction = (chosen * weights).sum(dim=(0, 1)) / count  # f_e: sums to K over the experts
        probability = (record.scores * weights).sum(dim=(0, 1)) / count  # P_e: sums to 1
        losses.append(experts * (fraction * probability).sum())
    return torch.stack(losses).mean()


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
