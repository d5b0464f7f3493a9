"""Run configuration: TOML -> frozen dataclasses, with errors that name file, line, key and fix."""

from hpcrl.config.groups import GROUP_NAMES
from hpcrl.config.load import load_config
from hpcrl.config.model_shapes import ModelShape, load_shape, shape_of
from hpcrl.config.schema import Config

__all__ = ["GROUP_NAMES", "Config", "ModelShape", "load_config", "load_shape", "shape_of"]
