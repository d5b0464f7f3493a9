"""Config's lists of built-in names (hpcrl/config/builtin_names.py) match what data and reward define."""

from __future__ import annotations

import inspect

from hpcrl.config.builtin_names import BUILTIN_REWARD_FUNCTIONS, BUILTIN_REWARD_MODULE, BUILTIN_TASK_NAMES
from hpcrl.data import BUILTIN_TASKS
from hpcrl.reward import builtin


def test_config_knows_every_builtin_task_by_name_in_the_registry_order():
    assert BUILTIN_TASK_NAMES == tuple(BUILTIN_TASKS)


def test_config_knows_every_builtin_reward_function_by_name_in_the_module_order():
    public = tuple(name for name, value in vars(builtin).items()
                   if inspect.isfunction(value) and not name.startswith("_") and value.__module__ == builtin.__name__)
    assert BUILTIN_REWARD_MODULE == builtin.__name__
    assert BUILTIN_REWARD_FUNCTIONS == public
