"""What the inference group returns: plain data the head can use without importing vLLM."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from hpcrl.errors import HpcrlError


class InferenceError(HpcrlError):
    """The vLLM engine failed to start or to generate."""


@dataclass(frozen=True, kw_only=True)
class Completion:
    """One sampled completion of one prompt."""

    prompt_id: str
    index: int
    """Which of the prompt's n samples this is."""
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    """vLLM's logprob of each sampled token, under the weights that sampled it."""
    text: str
    finish_reason: str
    weight_version: int

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Completion:
        return cls(**data)
