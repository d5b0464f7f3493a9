"""RL algorithms: one module each, behind a registry keyed by `algorithm.name`.

    algorithm = load_algorithm("dapo")           # the module's ALGORITHM (hpcrl.algorithms.base.Algorithm)
    algorithm.options                            # its [algorithm] keys: a dataclass of base.option fields
    algorithm.defaults                           # [algorithm] keys it sets unless the user did
    algorithm.select(groups, settings, wanted=8) # head: advantages, which groups train
    algorithm.loss(logprobs=..., ...)            # trainer: this micro-batch's share of the step loss

An algorithm says four things, each in its own module (grpo.py, dapo.py, gspo.py, dr_grpo.py,
reinforce_pp.py): its options (the keys of [algorithm] beyond the shared ones of base.Options, each
declared once, with its doc and bounds: config builds the table from them), how a step's prompts and
samples are chosen (group size, dynamic sampling / filtering: `more_prompts`, `max_rounds`), the
advantages (per sequence or per token) and the loss the trainer calls. The tensor terms they share
(ratios, clipping, aggregation, KL, group advantages) are in terms.py. The head and the trainer never
test an algorithm's own option: they ask its functions.

This package sits at the bottom of the layers beside hpcrl.models: config imports this registry to
check `algorithm.name` and to build the [algorithm] table, so importing it, or any algorithm module,
must not import torch (`hpcrl plan` never does): torch is imported inside the functions that compute
on tensors. To add an algorithm: a module defining ALGORITHM (and its options), one line in
ALGORITHMS; or, outside hpcrl, `algorithm.name = "package.module:NAME"` naming an Algorithm in a
module that every process of the run can import (the head and the trainer ranks import it by name).
"""

from __future__ import annotations

import difflib
import importlib
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hpcrl.errors import ConfigError

if TYPE_CHECKING:
    from hpcrl.algorithms.base import Algorithm, Options

#: algorithm.name -> the module defining its ALGORITHM.
ALGORITHMS = {
    "grpo": "hpcrl.algorithms.grpo",
    "dapo": "hpcrl.algorithms.dapo",
    "gspo": "hpcrl.algorithms.gspo",
    "dr_grpo": "hpcrl.algorithms.dr_grpo",
    "reinforce_pp": "hpcrl.algorithms.reinforce_pp",
}

#: The algorithm of a config that names none.
DEFAULT_ALGORITHM = "grpo"

#: algorithm.name = "package.module:NAME": an Algorithm defined outside hpcrl.
_EXTERNAL_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def check_name(name: object, *, key: str = "algorithm.name") -> str:
    """`name` if it is a registered algorithm or of the form "module:NAME", else a ConfigError at `key`
    listing the known names."""
    if isinstance(name, str) and (name in ALGORITHMS or _EXTERNAL_RE.match(name)):
        return name
    close = difflib.get_close_matches(str(name), list(ALGORITHMS), n=1)
    guess = f"did you mean {close[0]!r}? " if close else ""
    raise ConfigError(key=key, problem=f"unknown algorithm {name!r}; the known algorithms are "
                                       f"{', '.join(ALGORITHMS)}",
                      fix=f'{guess}write e.g. name = "grpo", or name = "my_package.my_module:ALGORITHM" for an '
                          "Algorithm (hpcrl.algorithms.base) defined outside hpcrl")


def load_algorithm(name: str, *, key: str = "algorithm.name") -> Algorithm:
    """The algorithm `name` names: a registered one (its module's ALGORITHM), or the Algorithm NAME of
    module `module` for "module:NAME". ConfigError at `key` for an unknown name, a module that cannot be
    imported, a missing attribute or one that is not an Algorithm."""
    from hpcrl.algorithms.base import Algorithm

    if check_name(name, key=key) in ALGORITHMS:
        return importlib.import_module(ALGORITHMS[name]).ALGORITHM
    module_name, _, attribute = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(key=key, problem=f"{name!r}: cannot import module {module_name!r} ({err})",
                          fix="check the module's name, and that it is importable in every process of the run "
                              "(installed, or on PYTHONPATH on every node)") from None
    algorithm = getattr(module, attribute, None)
    if algorithm is None:
        defined = [n for n, v in vars(module).items() if isinstance(v, Algorithm)]
        raise ConfigError(key=key, problem=f"{name!r}: module {module_name} has no {attribute!r}",
                          fix=f"name one of its Algorithms: {', '.join(f'{module_name}:{n}' for n in defined)}"
                              if defined else f"define {attribute} = Algorithm(...) (hpcrl.algorithms.base) in it")
    if not isinstance(algorithm, Algorithm):
        raise ConfigError(key=key, problem=f"{name!r} is a {type(algorithm).__name__}, not an Algorithm",
                          fix="name an instance of hpcrl.algorithms.base.Algorithm (name, options, select, loss)")
    return algorithm


def algorithm_options(values: Mapping[str, Any] | None = None, /, **keys: Any) -> Options:
    """The [algorithm] options of `values` and `keys` (the keys of the table): an instance of the named
    algorithm's options class, its defaults under the keys given. `algorithm_options()` is GRPO's."""
    table = {**(values or {}), **keys}
    algorithm = load_algorithm(table.get("name", DEFAULT_ALGORITHM))
    return algorithm.options(**{**algorithm.defaults, **table})
