"""LoRA adapters on torchtitan's linears: add them, switch them off (the reference policy), read and write them.

Each target linear (hpcrl.models.lora.adapted_weights, mapped to torchtitan's module through the family's
state-dict adapter, hpcrl.trainer.titan.hf_to_titan_names) gets two plain `nn.Linear` children without bias,
`lora_A` [rank, in] and `lora_B` [out, rank], and a forward hook that adds the update as PEFT's LoRA
`Linear.forward` computes it:

    y = base(x) + lora_B(lora_A(dropout(x))) * (alpha / rank)

The base module is untouched (its name, its parameter, its forward), so the HF <-> torchtitan map of the
base weights and the weight loader stay as they are; the adapters are children of the linears, hence of
the transformer blocks, and FSDP2 shards them with the block they sit in (Shard(0), torch.chunk rows,
like every parameter). The base is frozen (requires_grad False: no gradient, no optimizer state).

    adapters = add_adapters(model, shape, lora, hf_to_titan)   # on the meta model, before fully_shard
    adapters.initialise(model, seed=..., rank=...)              # A kaiming-uniform(a=sqrt(5)), B zero
    with adapters.off():                                        # the base model: the reference policy
        ...
    with adapters.training():                                   # dropout on (train_step's forwards only)
        ...

The lm_head (target "lm_head") gets its adapters and hook the same way, but the engine never calls it: its fused
lm_head + log-softmax (hpcrl.trainer.loss.linear_logprobs) takes the hidden states and the head's weight.
`Adapters.head_inputs` widens both by the adapter's rank instead, so that one matmul computes W h + (s B)(A h)
with s = alpha / rank, summed as vLLM's LogitsProcessorWithLoRA sums it (the base logits plus the low-rank
term from B already scaled in its slot):

    hidden' = [h, A dropout(h)]   [..., hidden + rank]     weight' = [W, s B]   [vocab, hidden + rank]

(The merged weight W + s B A would be one [vocab, hidden] tensor less, but it rounds each of its elements:
on the tiny run's adapter its logprobs were 3x further from float64 than vLLM's sum, 1.7e-5 against 6e-6 at
logits up to 27; the widened pair's were 6e-6.) The cost is a copy of the micro-batch's hidden states and of
the head's weight, each `rank` columns wider. With the adapters off both are the base's, untouched.

Initialisation: A is drawn on the CPU for the whole tensor from a generator seeded with the run's seed
(every adapter in checkpoint order), and each rank copies its rows: the same adapters on any number of
ranks. B is zero, so the model at step 0 is the base model bit for bit (x + 0 = x).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch
from torch import Tensor, nn

from hpcrl.config.schema import LoraConfig
from hpcrl.errors import TrainerError
from hpcrl.models import ModelShape
from hpcrl.models.lora import HEAD_TARGET, adapted_weights, adapter_parameters
from hpcrl.trainer.weights import parameters_by_hf_name, set_rows

#: The file of a PEFT adapter directory holding the tensors, and the one holding its config.
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"


@dataclass
class _Switch:
    """What every adapter's hook reads: on or off (the reference), and dropout while training."""

    scale: float
    dropout: float
    enabled: bool = True
    training: bool = False
    generator: torch.Generator | None = None
    """Draws the dropout masks of a step (seeded per step: `Adapters.seed_dropout`)."""


@dataclass
class Adapters:
    """The adapters added to one model: their names (HF adapter name -> torchtitan parameter name) and switch."""

    names: dict[str, str]
    """{HF adapter name (hpcrl.models.lora.adapter_parameters): torchtitan parameter name}, checkpoint order."""
    config: LoraConfig
    switch: _Switch = field(repr=False, default_factory=lambda: _Switch(1.0, 0.0))

    @contextmanager
    def off(self) -> Iterator[None]:
        """The base model: every adapter adds nothing (the reference policy of the KL term)."""
        self.switch.enabled = False
        try:
            yield
        finally:
            self.switch.enabled = True

    def seed_dropout(self, *, seed: int, step: int, rank: int, device: torch.device) -> None:
        """Seed the dropout masks of optimizer step `step` on this rank from the run's seed: a resumed run draws
        the masks it would have drawn (the global RNG, which a checkpoint does not hold, is not used)."""
        if self.switch.dropout > 0:
            self.switch.generator = torch.Generator(device=device).manual_seed(
                (seed * 1_000_003 + step) * 65_537 + rank)

    @contextmanager
    def training(self) -> Iterator[None]:
        """Dropout on the adapters' input (config.dropout) for the forwards inside."""
        self.switch.training = True
        try:
            yield
        finally:
            self.switch.training = False

    def head_inputs(self, model: nn.Module, hidden: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
        """The (hidden states, lm_head weight) the fused logprob takes: `hidden` and `weight` (the head's, as
        titan.output_weight gives it) as they are, or, when the head has an adapter and the adapters are on,
        [h, A dropout(h)] and [W, (alpha / rank) B] (module docstring)."""
        if HEAD_TARGET not in self.config.targets or not self.switch.enabled:
            return hidden, weight
        head = model.get_submodule(self.head)
        lora_a, lora_b = cast(nn.Linear, head.lora_A), cast(nn.Linear, head.lora_B)
        x = hidden
        if self.switch.training and self.switch.dropout > 0:  # as the hook drops a linear's input
            keep = torch.empty_like(x).bernoulli_(1 - self.switch.dropout, generator=self.switch.generator)
            x = x * keep / (1 - self.switch.dropout)
        return (torch.cat([hidden, lora_a(x)], dim=-1),
                torch.cat([weight, lora_b.weight * self.switch.scale], dim=-1))

    @property
    def head(self) -> str:
        """torchtitan's name of the adapted lm_head module."""
        return self.names[f"{HEAD_TARGET}.lora_A.weight"][: -len(".lora_A.weight")]

    def parameters(self, model: nn.Module, *, rank: int = 0) -> dict[str, Tensor]:
        """{HF adapter name: parameter} of `model` (the adapters are its only trainable parameters)."""
        return parameters_by_hf_name(model, self.names, rank=rank)

    def initialise(self, model: nn.Module, *, seed: int, rank: int = 0) -> None:
        """A kaiming-uniform(a=sqrt(5)) as PEFT draws it, from a CPU generator seeded with `seed`; B zero."""
        generator = torch.Generator().manual_seed(seed)
        for name, param in self.parameters(model, rank=rank).items():
            full = torch.empty(param.shape, dtype=torch.float32)
            if name.endswith(".lora_A.weight"):
                nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)
            else:
                full.zero_()
            set_rows(param, full)

    def load(self, model: nn.Module, directory: str | Path, *, rank: int = 0) -> None:
        """Every adapter from a PEFT directory's adapter_model.safetensors (lora.init_from; names and shapes
        were checked against the model by the config checks)."""
        from safetensors.torch import load_file

        from hpcrl.models.lora import PEFT_PREFIX

        tensors = load_file(str(Path(directory) / PEFT_WEIGHTS))
        for name, param in self.parameters(model, rank=rank).items():
            full = tensors.get(PEFT_PREFIX + name)
            if full is None or tuple(full.shape) != tuple(param.shape):
                raise TrainerError(f"rank {rank}: {directory}/{PEFT_WEIGHTS} has no {PEFT_PREFIX + name} of shape "
                                   f"{tuple(param.shape)}; point lora.init_from at an adapter of this model, rank "
                                   "and targets")
            set_rows(param, full)


def add_adapters(model: nn.Module, shape: ModelShape, lora: LoraConfig, hf_to_titan: dict[str, str]) -> Adapters:
    """Give every target linear of `model` (torchtitan's, not yet sharded) `lora_A` and `lora_B` and the hook
    that adds them. Returns the adapters' names and switch (the caller freezes the base: TrainerEngine)."""
    switch = _Switch(scale=lora.alpha / lora.rank, dropout=lora.dropout)
    names = adapter_names(shape, lora, hf_to_titan)
    dims = dict(adapter_parameters(shape, lora.rank, lora.targets))
    for hf_a in names:
        if not hf_a.endswith(".lora_A.weight"):
            continue
        hf_b = hf_a.replace(".lora_A.", ".lora_B.")
        module_name = names[hf_a][: -len(".lora_A.weight")]
        linear = model.get_submodule(module_name)
        if not isinstance(linear, nn.Linear):
            raise TrainerError(f"{hf_a} adapts torchtitan's {module_name}, a {type(linear).__name__}, not a linear "
                               "layer; remove its target from lora.targets")
        device, dtype = linear.weight.device, linear.weight.dtype
        (rank, inp), (out, _) = dims[hf_a], dims[hf_b]
        linear.lora_A = nn.Linear(inp, rank, bias=False, device=device, dtype=dtype)
        linear.lora_B = nn.Linear(rank, out, bias=False, device=device, dtype=dtype)
        linear.register_forward_hook(_adapter_hook(switch))
    return Adapters(names=names, config=lora, switch=switch)


def adapter_names(shape: ModelShape, lora: LoraConfig, hf_to_titan: dict[str, str]) -> dict[str, str]:
    """{HF adapter name: torchtitan parameter name} in checkpoint order: an adapter is a child of the linear
    whose weight the family's state-dict adapter maps its target's weight to."""
    names = {}
    for hf_weight in adapted_weights(shape, lora.targets):
        titan_module, hf_module = hf_to_titan[hf_weight][: -len(".weight")], hf_weight[: -len(".weight")]
        for part in ("lora_A", "lora_B"):
            names[f"{hf_module}.{part}.weight"] = f"{titan_module}.{part}.weight"
    return names


def _adapter_hook(switch: _Switch):
    """The forward hook of one adapted linear: PEFT's `result + lora_B(lora_A(dropout(x))) * scaling`."""

    def hook(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
        if not switch.enabled:
            return output
        x = args[0]
        if switch.training and switch.dropout > 0:  # nn.Dropout's x * mask / (1 - p), the mask from the step's generator
            keep = torch.empty_like(x).bernoulli_(1 - switch.dropout, generator=switch.generator)
            x = x * keep / (1 - switch.dropout)
        lora_a, lora_b = cast(nn.Linear, module.lora_A), cast(nn.Linear, module.lora_B)
        return output + lora_b(lora_a(x)) * switch.scale

    return hook
