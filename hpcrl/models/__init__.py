"""Model families: one folder per Hugging Face architecture, and the registry that finds them.

    shape = from_hf_config(json.load(open("config.json")))     # asks the family of its "architectures"
    shape.family.vllm_parameters(shape)                         # ModelShape.family == family_for(arch)

The bottom layer of hpcrl (beside algorithms): pure Python, imports only hpcrl.errors. Planner,
trainer and vLLM adapter ask a shape's family (hpcrl/models/family.py says who asks what); no
module outside this package tests an architecture's name.

To add a family: a folder here whose `FAMILY` is a `Family` (most are a `DenseDecoder` with a hook
or two overridden, see llama/, qwen2/, qwen3/), and one `register` line below.

A family from outside the package: a module that calls `register(FAMILY)` when imported, named in
the run's config (`model.family_modules = ["my_pkg.my_family"]`). Every process of a run imports
it (`import_families`) before it reads a shape: the head and the trainer ranks through
hpcrl.config.model_shapes.shape_of, the inference tasks too, and vLLM's processes through the
environment (FAMILY_MODULES_ENV, set by hpcrl.inference.vllm_llm.start_llm and read by the worker
extension, hpcrl.inference.vllm_worker). tests/models/external_family.py is one.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any

from hpcrl.errors import ConfigError
from hpcrl.models import deepseek_v3, llama, qwen2, qwen3, qwen3_moe
from hpcrl.models.family import Family, TitanModel
from hpcrl.models.layout import Piece, SourceTensor, VllmParam
from hpcrl.models.shape import ModelShape

__all__ = ["FAMILY_MODULES_ENV", "Family", "ModelShape", "Piece", "SourceTensor", "TitanModel", "VllmParam",
           "architectures", "family_for", "families", "from_hf_config", "import_families", "register"]

#: The environment variable naming the run's family modules (comma-separated) to vLLM's processes.
FAMILY_MODULES_ENV = "HPCRL_FAMILY_MODULES"

_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Make `family` the one for its architecture (ConfigError if another family already has it)."""
    known = _FAMILIES.get(family.architecture)
    if known is not None and known is not family:
        raise ConfigError(key="model", problem=f"two model families claim architecture {family.architecture!r} "
                                               f"({type(known).__name__} and {type(family).__name__})",
                          fix="register one family per Hugging Face architecture")
    _FAMILIES[family.architecture] = family
    return family


register(llama.FAMILY)
register(qwen2.FAMILY)
register(qwen3.FAMILY)
register(qwen3_moe.FAMILY)
register(deepseek_v3.FAMILY)


def import_families(modules: Sequence[str]) -> None:
    """Import each module of `modules` (idempotent), which registers its family; ConfigError naming
    model.family_modules when one cannot be imported."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise ConfigError(key="model.family_modules", problem=f"cannot import model family module {module!r} ({err})",
                              fix="name a module on the PYTHONPATH of every process of the run, which calls "
                                  "hpcrl.models.register(FAMILY) when imported") from None


def families() -> tuple[Family, ...]:
    """Every registered family."""
    return tuple(_FAMILIES.values())


def architectures() -> tuple[str, ...]:
    """The Hugging Face architectures hpcrl knows how to train, serve and reshard."""
    return tuple(_FAMILIES)


def family_for(architecture: str, *, where: str = "the model") -> Family:
    """The family of `architecture`; ConfigError naming the known architectures if none has it."""
    family = _FAMILIES.get(architecture)
    if family is None:
        raise ConfigError(key="model.path", problem=f"{where} has architecture {architecture!r}, which hpcrl cannot train",
                          fix=f"use a checkpoint of one of: {', '.join(_FAMILIES)} (or add a model family: "
                              "hpcrl/models/__init__.py)")
    return family


def from_hf_config(config: Mapping[str, Any], *, where: str = "config.json") -> ModelShape:
    """Shape from a Hugging Face config.json dict, read by the family of its first architecture."""
    family = family_for((config.get("architectures") or ["?"])[0], where=where)
    try:
        return family.shape_from_hf_config(config)
    except KeyError as err:
        raise ConfigError(key="model.path", problem=f"{where} lacks {err.args[0]!r}",
                          fix="point model.path at a complete Hugging Face checkpoint") from None
