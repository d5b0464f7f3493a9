"""The fact tools/bench/bench_mismatch.py named as most of the real model's logprob mismatch (docs/FACTS.md
"Logprob precision on CPU"): torch's float32 log_softmax on CPU, what vLLM's sampler reports, loses a
peaked distribution's tail over a large vocabulary; logits - logsumexp, the trainer's kernel until it
took the sampler's own (hpcrl.trainer.loss), does not. If torch's kernel changes, this fails: measure
the floor again."""

from __future__ import annotations

import importlib.util

import pytest
import torch


@pytest.fixture(scope="module")
def bench(repo):
    spec = importlib.util.spec_from_file_location("bench_mismatch", repo / "tools" / "bench" / "bench_mismatch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def peaked_logits(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """64 rows of float32 logits over `vocab` tokens, one token holding nearly all the mass (a confident
    model's), and a target token per row."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, vocab, generator=generator) * 3
    logits[:, 7] += 25
    return logits, torch.randint(0, vocab, (64, 1), generator=generator)


def mean_error(logprobs: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> float:
    reference = logits.double().log_softmax(-1).gather(1, targets)
    return (logprobs.gather(1, targets).double() - reference).abs().mean().item()


def test_float32_log_softmax_loses_a_peaked_tail_over_a_real_vocabulary_and_logsumexp_does_not(bench):
    logits, targets = peaked_logits(49_152)  # SmolLM2's vocabulary
    log_softmax = mean_error(logits.log_softmax(-1, dtype=torch.float32), logits, targets)
    logsumexp = mean_error(bench.precise_logprobs(logits), logits, targets)
    assert log_softmax > 3e-6 > 1e-6 > logsumexp, (log_softmax, logsumexp)


def test_over_a_small_vocabulary_both_are_at_float32_rounding(bench):
    logits, targets = peaked_logits(512)  # the tiny model's: its probe reads 1e-7
    assert mean_error(logits.log_softmax(-1, dtype=torch.float32), logits, targets) < 1e-6
    assert mean_error(bench.precise_logprobs(logits), logits, targets) < 1e-6
