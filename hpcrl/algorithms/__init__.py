"""RL algorithms: one module each, behind a registry keyed by `algorithm.name`.

    algorithm = load_algorithm("dapo")           # the module's ALGORITHM (hpcrl.algorithms.base.Algorithm)
    algorithm.defaults                           # [algorithm] keys it sets unless the user did
    algorithm.select(groups, settings, wanted=8) # head: advantages, which groups train
    algorithm.loss(logprobs=..., ...)            # trainer: this micro-batch's share of the step loss

An algorithm says three things, each in its own module (grpo.py, dapo.py, gspo.py, dr_grpo.py):
how a step's prompts and samples are chosen (group size, dynamic sampling / filtering), the
advantages (per sequence or per token) and the loss the trainer calls. The tensor terms they share
(ratios, clipping, aggregation, KL, group advantages) are in terms.py.

This package sits at the bottom of the layers beside hpcrl.models: config imports this registry to
check `algorithm.name` and to read an algorithm's defaults, so importing it, or any algorithm
module, must not import torch (`hpcrl plan` never does): torch is imported inside the functions
that compute on tensors. To add an algorithm: a module defining ALGORITHM, one line in ALGORITHMS.
"""

from __future__ import annotations

import difflib
import importlib
from typing import TYPE_CHECKING

from hpcrl.errors import ConfigError

if TYPE_CHECKING:
    from hpcrl.algorithms.base import Algorithm

#: algorithm.name -> the module defining its ALGORITHM.
ALGORITHMS = {
    "grpo": "hpcrl.algorithms.grpo",
    "dapo": "hpcrl.algorithms.dapo",
    "gspo": "hpcrl.algorithms.gspo",
    "dr_grpo": "hpcrl.algorithms.dr_grpo",
}


def check_name(name: object, *, key: str = "algorithm.name") -> str:
    """`name` if it is a registered algorithm, else a ConfigError at `key` listing the known names."""
    if isinstance(name, str) and name in ALGORITHMS:
        return name
    close = difflib.get_close_matches(str(name), list(ALGORITHMS), n=1)
    guess = f"did you mean {close[0]!r}? " if close else ""
    raise ConfigError(key=key, problem=f"unknown algorithm {name!r}; the known algorithms are "
                                       f"{', '.join(ALGORITHMS)}",
                      fix=f'{guess}write e.g. name = "grpo" (a new algorithm is a module in hpcrl/algorithms/ '
                          "and a line in its ALGORITHMS registry)")


def load_algorithm(name: str) -> Algorithm:
    """The registered algorithm `name` (its module's ALGORITHM); ConfigError for an unknown name."""
    module = importlib.import_module(ALGORITHMS[check_name(name)])
    return module.ALGORITHM
