"""Token logprobs and entropy against values worked out by hand, and the fused chunked pass against
an unchunked float64 reference (hpcrl/trainer/loss.py).

The losses themselves are tested with the algorithms: tests/algorithms.
"""

from __future__ import annotations

import math

import pytest
import torch

from hpcrl.trainer.loss import entropy_from_logits, linear_logprobs, token_logprobs

LOG = math.log


def test_token_logprobs_and_entropy_match_softmax_by_hand():
    logits = torch.tensor([[0.0, LOG(3.0)]])  # probabilities 1/4, 3/4
    assert token_logprobs(logits, torch.tensor([1])).item() == pytest.approx(LOG(0.75))
    assert token_logprobs(logits, torch.tensor([0]), temperature=2.0).item() == pytest.approx(
        LOG(1 / (1 + math.sqrt(3))))
    assert entropy_from_logits(logits).item() == pytest.approx(-(0.25 * LOG(0.25) + 0.75 * LOG(0.75)))


def _reference_terms(hidden, weight, targets, temperature):
    """Logprobs and entropy of softmax(hidden @ weight.T / temperature), unchunked, in float64."""
    logp = torch.log_softmax((hidden.double() @ weight.double().T) / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(dim=-1)


@pytest.mark.parametrize("recompute", [False, True], ids=["kept-logits", "recomputed-logits"])
@pytest.mark.parametrize("chunk_tokens", [1, 4, 7, 23, 24, 1000])
def test_chunked_linear_logprobs_equal_the_unchunked_float64_reference_with_their_gradients(chunk_tokens, recompute):
    # 2 rows x 12 positions = 24 tokens: chunks of 7 and 23 leave a short last chunk
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 12, 16, generator=gen, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 50, (2, 12), generator=gen)
    upstream = torch.randn(2, 12, generator=gen, dtype=torch.float64)
    want_logp, want_entropy = _reference_terms(hidden, weight, targets, 0.7)
    (want_logp * upstream).sum().backward()
    want_grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    logp, entropy = linear_logprobs(hidden, weight, targets, temperature=0.7, chunk_tokens=chunk_tokens,
                                    recompute=recompute, entropy=True)
    (logp.double() * upstream).sum().backward()

    assert logp.dtype == entropy.dtype == torch.float32 and logp.shape == entropy.shape == (2, 12)
    torch.testing.assert_close(logp.double(), want_logp, rtol=0, atol=5e-5)  # float32 against float64
    torch.testing.assert_close(entropy.double(), want_entropy.detach(), rtol=0, atol=5e-5)  # float32 against float64
    torch.testing.assert_close(hidden.grad, want_grads[0].float(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(weight.grad, want_grads[1].float(), rtol=1e-4, atol=1e-5)
    assert not entropy.requires_grad


@pytest.mark.parametrize("entropy", [False, True], ids=["logprobs", "with-entropy"])
def test_on_the_same_logits_the_trainers_logprobs_are_vllms_samplers_to_the_bit(entropy):
    """vLLM reports logprobs with Sampler.compute_logprobs; logits - logsumexp, the trainer's kernel before,
    differs from it in the last bits on a real vocabulary, and that difference was most of the trainer-vs-vLLM
    mismatch on SmolLM2 (BENCHMARKS.md "Logprob mismatch on a real model")."""
    from vllm.v1.sample.sampler import Sampler

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, 32, generator=gen)
    weight = torch.randn(32_000, 32, generator=gen) * 0.5
    targets = torch.randint(0, 32_000, (64,), generator=gen)
    logits = torch.nn.functional.linear(hidden, weight)  # the one chunk's logits, as the trainer forms them
    vllm = Sampler.compute_logprobs(logits).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    logp, _ = linear_logprobs(hidden, weight, targets, chunk_tokens=64, entropy=entropy)
    assert torch.equal(logp, vllm)
    before = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    assert not torch.equal(before, vllm)  # the test tells the two kernels apart


def test_linear_logprobs_without_gradients_or_entropy_give_the_same_logprobs():
    gen = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(30, 8, generator=gen), torch.randn(40, 8, generator=gen)
    targets = torch.randint(0, 40, (30,), generator=gen)
    with torch.no_grad():
        logp, entropy = linear_logprobs(hidden, weight, targets, chunk_tokens=8)
    assert entropy is None
    torch.testing.assert_close(logp, token_logprobs(hidden @ weight.T, targets), rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_compiled_chunks_give_the_eager_logprobs_entropy_and_gradients():
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 12, 16, generator=gen, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 50, (2, 12), generator=gen)
    results = []
    for compiled in (False, True):
        logp, entropy = linear_logprobs(hidden, weight, targets, temperature=0.7, chunk_tokens=7, entropy=True,
                                        compiled=compiled)
        logp.sum().backward()
        results.append((logp.detach(), entropy, hidden.grad, weight.grad))
        hidden.grad = weight.grad = None
    for eager, compiled in zip(*results, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("recompute", [False, True], ids=["kept-logits", "recomputed-logits"])
def test_bfloat16_linear_logprobs_on_cuda_match_cross_entropy_over_the_same_bfloat16_logits(recompute, compiled):
    gen = torch.Generator(device="cuda").manual_seed(2)
    hidden = torch.randn(3, 700, 64, device="cuda", generator=gen).bfloat16().requires_grad_()
    weight = (0.3 * torch.randn(5000, 64, device="cuda", generator=gen)).bfloat16().requires_grad_()
    targets = torch.randint(0, 5000, (3, 700), device="cuda", generator=gen)
    upstream = torch.randn(3, 700, device="cuda", generator=gen)
    want = token_logprobs(torch.nn.functional.linear(hidden, weight), targets, temperature=0.9)
    (want * upstream).sum().backward()
    want_grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    logp, entropy = linear_logprobs(hidden, weight, targets, temperature=0.9, chunk_tokens=512,
                                    recompute=recompute, entropy=True, compiled=compiled)
    (logp * upstream).sum().backward()

    # a chunk's matmul may round a bf16 logit one ulp away from the full matmul's: loose bounds
    # on single values, tight on the mean
    torch.testing.assert_close(logp, want, rtol=0, atol=2e-2)
    assert float((logp - want).abs().mean()) < 1e-4
    with torch.no_grad():
        want_entropy = entropy_from_logits(torch.nn.functional.linear(hidden, weight).float() / 0.9)
    torch.testing.assert_close(entropy, want_entropy, rtol=0, atol=2e-2)
    assert float((entropy - want_entropy).abs().mean()) < 1e-4
    for got, expected in zip((hidden.grad, weight.grad), want_grads, strict=True):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
