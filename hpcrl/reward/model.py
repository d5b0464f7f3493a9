"""A reward model as the reward group's scorer: a Hugging Face sequence-classification model
(one label: its logit is the reward), run with transformers.

    scorer = RewardModelScorer("/models/my-rm", batch_size=16)
    results = scorer.score(samples)        # same order; a sample that fails is an error record

The text scored is the prompt followed by the completion, as the model's tokenizer encodes them
(truncated to `max_tokens` from the left, so the completion is kept). A failure on one batch is
retried sample by sample, so one bad sample yields one error record naming it, never a silent zero.
"""

from __future__ import annotations

import time

from hpcrl.errors import HpcrlError
from hpcrl.reward.types import RewardError, RewardResult, Sample


class RewardModelScorer:
    def __init__(self, model_path: str, *, batch_size: int = 16, max_tokens: int = 4096, device: str | None = None):
        try:
            import torch
            from transformers import AutoModelForSequenceClassification, AutoTokenizer
        except ImportError as err:
            raise RewardError(f"a reward model needs transformers and torch ({err})") from None
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
            self.model = AutoModelForSequenceClassification.from_pretrained(model_path)
        except (OSError, ValueError) as err:
            raise RewardError(f"reward.model_path {model_path!r} does not hold a sequence-classification model "
                              f"transformers can load ({err}). Fix: point it at a Hugging Face reward model "
                              "directory (config.json with a *ForSequenceClassification architecture)") from None
        if self.model.config.num_labels != 1:
            raise RewardError(f"reward model {model_path} has {self.model.config.num_labels} labels; a reward model "
                              "has one (its logit is the reward)")
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.tokenizer.truncation_side = "left"
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model.to(self.device).eval()
        self.batch_size, self.max_tokens = batch_size, max_tokens

    def _rewards(self, samples: list[Sample]) -> list[float]:
        import torch

        texts = [s.prompt + s.completion for s in samples]
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, truncation=True, max_length=self.max_tokens)
        with torch.no_grad():
            logits = self.model(**{k: v.to(self.device) for k, v in enc.items()}).logits
        values = logits[:, 0].float().cpu().tolist()
        bad = [s.id for s, v in zip(samples, values) if v != v or v in (float("inf"), float("-inf"))]
        if bad:
            raise HpcrlError(f"the reward model gave a non-finite score to {bad[:4]}")
        return values

    def score(self, samples: list[Sample]) -> list[RewardResult]:
        if len({s.id for s in samples}) != len(samples):
            raise RewardError("samples to score have repeated ids; give every completion its own id")
        out: list[RewardResult] = []
        for start in range(0, len(samples), self.batch_size):
            chunk = samples[start:start + self.batch_size]
            began = time.monotonic()
            try:
                values = self._rewards(chunk)
                spent = (time.monotonic() - began) / len(chunk)
                out += [RewardResult(id=s.id, prompt_id=s.prompt_id, reward=v, seconds=spent)
                        for s, v in zip(chunk, values)]
            except Exception:  # noqa: BLE001 - retried one by one so the error names its sample
                for sample in chunk:
                    began = time.monotonic()
                    try:
                        value = self._rewards([sample])[0]
                        out.append(RewardResult(id=sample.id, prompt_id=sample.prompt_id, reward=value,
                                                seconds=time.monotonic() - began))
                    except Exception as err:  # noqa: BLE001
                        out.append(RewardResult(id=sample.id, prompt_id=sample.prompt_id, reward=None,
                                                error=f"reward model failed: {type(err).__name__}: {err}",
                                                seconds=time.monotonic() - began))
        return out

    def close(self) -> None:
        self.model = None


def make_scorer(reward_config):
    """The scorer a run's reward config asks for: a RewardPool of `function`, or a reward model."""
    if reward_config.kind == "model":
        return RewardModelScorer(reward_config.model_path)
    from hpcrl.reward.pool import RewardPool
    return RewardPool(reward_config.function, workers=reward_config.workers, timeout_s=reward_config.timeout_s)
