"""Names of the built-in prompt tasks and reward functions, so a config can be checked before anything runs.

The tasks live in hpcrl.data.builtin and the reward functions in hpcrl.reward.builtin, both above
config in the layers (docs/ARCHITECTURE.md), so config keeps their names only. tests/config/test_builtin_names.py
checks each list against what its module defines: adding a task or a function means adding its
name here.
"""

#: `data.source = "builtin:NAME"`: the generated tasks of hpcrl.data.builtin.BUILTIN_TASKS, in its order.
BUILTIN_TASK_NAMES = ("echo", "arithmetic", "reverse", "parity", "guess", "word_problems", "repeat_x")

#: The module of the built-in reward functions, and `reward.function = "hpcrl.reward.builtin:NAME"` names.
BUILTIN_REWARD_MODULE = "hpcrl.reward.builtin"
BUILTIN_REWARD_FUNCTIONS = ("exact_match", "length_credit", "math_answer", "format_ok", "boxed_format", "math_verify", "code_tests")

#: `env.environment = "NAME"`: the built-in environments of hpcrl.env.base.ENVIRONMENTS, in its order
#: (anything else must be "module:Class").
BUILTIN_ENVIRONMENTS = ("feedback", "python_tool")
