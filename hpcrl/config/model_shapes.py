"""Model shapes from a preset name or a Hugging Face config.json, without any weights.

Everything the planners need to know about a model (parameter names and shapes, parameter
count, KV-cache bytes per token) comes from a `ModelShape` (hpcrl.models, re-exported here with
`from_hf_config`). Presets cover the shipped configs; a checkpoint directory of any registered
family (Llama, Qwen2, Qwen3: hpcrl.models) works through its config.json.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from hpcrl.errors import ConfigError
from hpcrl.models import ModelShape, from_hf_config, import_families
from hpcrl.models.presets import PRESETS

if TYPE_CHECKING:
    from hpcrl.config.schema import ModelConfig

__all__ = ["DTYPE_BYTES", "PRESETS", "ModelShape", "from_hf_config", "load_shape", "preset", "shape_of"]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def preset(name: str) -> ModelShape:
    """The preset called `name`; an unknown name is a ConfigError with the closest match."""
    if name in PRESETS:
        return PRESETS[name]
    close = difflib.get_close_matches(name, list(PRESETS), n=1)
    guess = f"did you mean {close[0]!r}? " if close else ""
    raise ConfigError(key="model.preset", problem=f"unknown model preset {name!r}",
                      fix=f"{guess}known presets: {', '.join(PRESETS)}; or set model.path to a checkpoint")


def shape_of(model: ModelConfig) -> ModelShape:
    """The shape of the run's model (`load_shape`), after importing the run's family modules."""
    import_families(model.family_modules)
    return load_shape(preset_name=model.preset, path=model.path)


def load_shape(*, preset_name: str, path: str) -> ModelShape:
    """The model's shape: the preset when named, else config.json under `path`."""
    if preset_name:
        return preset(preset_name)
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ConfigError(key="model.path", problem=f"{config_file} does not exist",
                          fix="point model.path at a Hugging Face checkpoint directory, or make the tiny "
                              "model with `python tools/make_tiny_model.py`, or set model.preset")
    try:
        return from_hf_config(json.loads(config_file.read_text()), where=str(config_file))
    except json.JSONDecodeError as err:
        raise ConfigError(key="model.path", problem=f"{config_file} is not valid JSON ({err})",
                          fix="restore the checkpoint's config.json") from None
