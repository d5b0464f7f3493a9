"""The model-output terms the trainer engine needs besides an algorithm's loss: token logprobs, entropy.

An algorithm's loss (clipping, aggregation, KL, normalisation over the step) is in hpcrl.algorithms
(its module, and the shared terms in hpcrl/algorithms/terms.py); the engine (engine.py) calls the
configured one on each micro-batch.

`linear_logprobs` is what the engine runs: the lm_head matmul, a float32 log-softmax (vLLM's logprob
kernel: _chunk_forward), the gather of each target's logprob and the entropy, in one pass over chunks
of tokens, the way fused linear-cross-entropy kernels do it. A float32 [tokens, vocab] tensor never
exists (only one chunk's), and nothing is copied by boolean indexing. The backward is written out (`_LinearLogprobs`): the
gradient of the logits, (onehot - softmax) x grad / temperature, is formed chunk by chunk from the
saved logsumexp, then two matmuls give the gradients of the hidden states and of the lm_head weight.
The logits are kept for the backward in the compute dtype (bf16 on GPUs, where the plain
cross-entropy loop keeps a float32 log-softmax as well) and overwritten there by their gradient;
with `recompute=True` they are not kept, and each chunk's logits are recomputed in the backward (an
extra tokens x vocab x hidden matmul for [tokens, vocab] of memory). `token_logprobs` and
`entropy_from_logits` are the plain reference (tests/trainer/test_loss.py checks the two agree).

Run the tests: `python -m pytest tests/trainer/test_loss.py -q`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
from torch import Tensor

#: Tokens per chunk of the fused logprob: float32 temporaries are 2 x chunk x vocab x 4 bytes.
DEFAULT_CHUNK_TOKENS = 1024

# ------------------------------------------------------------------------------- token terms

def token_logprobs(logits: Tensor, targets: Tensor, *, temperature: float = 1.0) -> Tensor:
    """log p(target) under softmax(logits / temperature), in float32. logits [..., V], targets [...]."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return -torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none").view(targets.shape)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy (nats) of softmax(logits) over the last dim, in float32."""
    logits = logits.float()
    logp = logits.log_softmax(dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


# ------------------------------------------------------------------ fused linear + logprob

def _chunk_forward(logits: Tensor, targets: Tensor, temperature: float,
                   with_entropy: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """(logprob of each target, logsumexp, entropy or None) of one chunk of logits [c, V], in float32.

    The logprobs are torch's float32 log_softmax, gathered: the very kernel vLLM's sampler reports its
    logprobs with (Sampler.compute_logprobs), so logits equal to the bit give logprobs equal to the bit.
    logits - logsumexp is closer to float64 on a large vocabulary (BENCHMARKS.md "Logprob mismatch on a
    real model"), but what an importance ratio needs is the sampler's own figure. The logsumexp, which
    the backward's softmax is formed from, stays the accurate one."""
    z = logits.float()  # a view when the logits are float32 already
    if temperature != 1.0:
        z = z / temperature
    picked = z.log_softmax(dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return picked, torch.logsumexp(z, dim=-1), None
    # one exp pass for both: e = exp(z - max), lse = max + log sum e, and
    # H = -sum p log p = lse - sum p z with p = e / sum e
    top = z.amax(dim=-1, keepdim=True)
    e = torch.sub(z, top).exp_()
    total = e.sum(dim=-1)
    lse = top.squeeze(-1) + total.log()
    return picked, lse, lse - torch.linalg.vecdot(e, z) / total


def _chunk_grad(logits: Tensor, targets: Tensor, lse: Tensor, grad: Tensor, temperature: float) -> Tensor:
    """d logp / d logits x grad for one chunk: (onehot(target) - softmax) x grad / temperature, computed
    in float32 and returned in the logits' dtype (compiled, the cast fuses into the kernel)."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    scale = (grad / temperature).unsqueeze(-1)
    d = torch.sub(z, lse.unsqueeze(-1)).exp_().mul_(-scale)
    return d.scatter_add_(-1, targets.unsqueeze(-1), scale).to(logits.dtype)


@cache
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=True)


class _LinearLogprobs(torch.autograd.Function):
    """logprobs = log_softmax(hidden @ weight.T / temperature)[target], entropy as a side output."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, chunk: int,
                recompute: bool, with_entropy: bool, compiled: bool):
        n = hidden.shape[0]
        forward_fn = _compiled(_chunk_forward) if compiled else _chunk_forward
        # Inside forward grad mode is off; whether a backward will follow is ctx.needs_input_grad.
        keep = not recompute and any(ctx.needs_input_grad[:2])
        logits = torch.nn.functional.linear(hidden, weight) if keep else None
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else None
        for start in range(0, n, chunk):
            rows = slice(start, start + chunk)
            piece = logits[rows] if logits is not None else torch.nn.functional.linear(hidden[rows], weight)
            logp[rows], lse[rows], piece_entropy = forward_fn(piece, targets[rows], temperature, with_entropy)
            if entropy is not None and piece_entropy is not None:
                entropy[rows] = piece_entropy
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.logits = logits  # not saved_tensors: the backward overwrites it with its own gradient
        ctx.settings = (temperature, chunk, compiled)
        if entropy is None:
            entropy = torch.zeros(0, dtype=torch.float32, device=hidden.device)
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor, _grad_entropy: Tensor):
        hidden, weight, targets, lse = ctx.saved_tensors
        temperature, chunk, compiled = ctx.settings
        grad_fn = _compiled(_chunk_grad) if compiled else _chunk_grad
        grad_logp = grad_logp.float()
        logits, ctx.logits = ctx.logits, None
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        grad_hidden = grad_weight = None
        n = hidden.shape[0]
        if logits is not None:  # kept: its chunks become d loss / d logits in place, then two matmuls
            for start in range(0, n, chunk):
                rows = slice(start, start + chunk)
                logits[rows] = grad_fn(logits[rows], targets[rows], lse[rows], grad_logp[rows], temperature)
            if want_hidden:
                grad_hidden = logits @ weight
            if want_weight:
                grad_weight = logits.t() @ hidden
            return grad_hidden, grad_weight, None, None, None, None, None, None
        # recomputed: each chunk's logits again; the weight's gradient summed in float32
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        total = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        for start in range(0, n, chunk):
            rows = slice(start, start + chunk)
            piece = torch.nn.functional.linear(hidden[rows], weight)
            d = grad_fn(piece, targets[rows], lse[rows], grad_logp[rows], temperature)
            if grad_hidden is not None:
                grad_hidden[rows] = d @ weight
            if total is not None:
                if total.dtype == d.dtype:
                    total.addmm_(d.t(), hidden[rows])
                else:
                    total += (d.t() @ hidden[rows]).float()
        grad_weight = None if total is None else total.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def linear_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, *, temperature: float = 1.0,
                    chunk_tokens: int = DEFAULT_CHUNK_TOKENS, recompute: bool = False,
                    entropy: bool = False, compiled: bool = False) -> tuple[Tensor, Tensor | None]:
    """(logprob of each target, entropy or None) under softmax(hidden @ weight.T / temperature).

    hidden [..., D] (compute dtype), weight [V, D] (the lm_head), targets [...] int64; both results
    are float32 of targets' shape. The logprobs are differentiable (in hidden and weight); the
    entropy is a metric, without gradient. `chunk_tokens` bounds the float32 temporaries;
    `recompute` drops the logits after the forward (see the module docstring); `compiled` runs
    each chunk's float32 part under torch.compile.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    shape = targets.shape
    flat = hidden.reshape(-1, hidden.shape[-1])
    logp, ent = _LinearLogprobs.apply(flat, weight, targets.reshape(-1), temperature, chunk_tokens,
                                      recompute, entropy, compiled)
    return logp.view(shape), ent.view(shape) if entropy else None
