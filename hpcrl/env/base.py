"""The environment interface users implement, and how `env.environment` names one.

    class Guess:                                   # any class with these two methods; no base class needed
        def reset(self, row: dict) -> list[Message]:
            return [{"role": "user", "content": row["prompt"]}]
        def step(self, messages: list[Message]) -> StepResult | tuple[list[Message], float | None, bool]:
            right = messages[-1]["content"].strip() == self.answer
            return StepResult(messages=[], reward=float(right), done=True)

    env.environment = "feedback"                   # a built-in: ENVIRONMENTS below
    env.environment = "my_package.envs:Guess"      # or "module:Class", like reward functions

An instance serves one episode: `reset(row)` once (row = {"id", "prompt", "answer"} and the row's extra
keys), then `step(conversation so far)` after each policy turn. The pool (hpcrl.env.pool) may drop an
instance at any time (its worker replaced, an idle episode evicted) and build a new one with
`reset(row)` before the next `step`, so an environment's state must follow from its row and the
conversation it is given: whatever `step` decides (which try this is, what a tool returned) it reads
from `messages`, and attributes set in `reset` are a cache of what the row says, never a record of
earlier steps. A class may define `check_at_start()` (a classmethod or staticmethod): each worker calls it
once as it starts, and if it raises, the pool does not start (python_tool: can a sandbox run here?).

A new built-in environment is one module (or a class in builtin.py) and one line in ENVIRONMENTS.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from typing import Protocol

from hpcrl.env.types import EnvError, Message
from hpcrl.workers.process import import_module

#: env.environment names of the built-in environments -> "module:Class".
ENVIRONMENTS: dict[str, str] = {
    "feedback": "hpcrl.env.builtin:Feedback",
    "python_tool": "hpcrl.env.builtin:PythonTool",
}


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """What one step gives back (a plain (messages, reward, done) tuple says the same)."""

    messages: list[Message] = field(default_factory=list)
    """Messages to append to the conversation (a tool's output, feedback): system, user or tool, never
    assistant (the policy writes those). [] if none."""
    reward: float | None = None
    """The episode's reward, usually with done; None: the run's [reward] scores the last policy turn."""
    done: bool = False


class Environment(Protocol):
    """What `env.environment` must name: a class whose instances have these two methods."""

    def reset(self, row: dict) -> list[Message]:
        """The episode's first messages: the conversation the policy answers first."""
        ...

    def step(self, messages: list[Message]) -> StepResult | tuple[list[Message], float | None, bool]:
        """The environment's answer to the conversation so far, the policy's turn last."""
        ...


def target(environment: str) -> str:
    """The "module:Class" that `environment` (a built-in name or "module:Class") names; EnvError if neither."""
    if ":" in environment:
        return environment
    if environment in ENVIRONMENTS:
        return ENVIRONMENTS[environment]
    close = difflib.get_close_matches(environment, list(ENVIRONMENTS), n=1)
    guess = f"did you mean {close[0]!r}? " if close else ""
    raise EnvError(f"env.environment = {environment!r} is neither a built-in environment nor \"module:Class\": "
                   f"{guess}the built-ins are {', '.join(ENVIRONMENTS)}; a class of your own is named as "
                   "\"my_package.my_module:MyEnvironment\"")


def resolve(environment: str) -> type:
    """Import the class `environment` names and check it has reset and step; EnvError names what is missing."""
    module_name, _, name = target(environment).partition(":")
    module = import_module(module_name, f"environment {environment!r}", EnvError)
    cls = getattr(module, name, None)
    if cls is None:
        raise EnvError(f"environment {environment!r}: {module_name} has no {name!r}")
    if not isinstance(cls, type):
        raise EnvError(f"environment {environment!r}: {module_name}.{name} is a {type(cls).__name__}, not a class "
                       "(name a class whose instances have reset(row) and step(messages))")
    missing = [method for method in ("reset", "step") if not callable(getattr(cls, method, None))]
    if missing:
        raise EnvError(f"environment {environment!r}: class {module_name}.{name} has no {' and no '.join(missing)} "
                       "method (an environment needs reset(row) -> messages and step(messages) -> StepResult)")
    return cls


class Malformed(Exception):
    """An environment returned something that is not what the interface says (the episode's error)."""


#: Roles an environment may write: reset may give an assistant message (a worked example), step may not.
RESET_ROLES = ("system", "user", "assistant", "tool")
STEP_ROLES = ("system", "user", "tool")


def checked_messages(value: object, *, what: str, roles: tuple[str, ...]) -> list[Message]:
    """`value` if it is a list of chat messages with these roles and str content (and JSON-safe), else Malformed."""
    if not isinstance(value, list):
        raise Malformed(f"{what} returned {type(value).__name__} {_short(value)}, not a list of messages "
                        '({"role": ..., "content": ...} dicts)')
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise Malformed(f"{what}: message {i} is {type(message).__name__} {_short(message)}, not a dict "
                            'with "role" and "content"')
        role, content = message.get("role"), message.get("content")
        if role not in roles:
            raise Malformed(f"{what}: message {i} has role {role!r}; an environment's messages here have the "
                            f"roles {', '.join(roles)}")
        if not isinstance(content, str):
            raise Malformed(f"{what}: message {i} ({role}) has content {_short(content)}, not a str")
        if not all(isinstance(key, str) for key in message):
            raise Malformed(f"{what}: message {i} has a key that is not a str")
        try:  # what the bus (msgpack) and the tokenizer take: UTF-8, so no lone surrogate ("\ud800")
            json.dumps(message, ensure_ascii=False, default=str).encode("utf-8")
        except UnicodeEncodeError as err:
            raise Malformed(f"{what}: message {i} ({role}) holds {err.object[err.start:err.end]!r}, a lone surrogate "
                            "that is not Unicode text (text decoded with errors=\"surrogateescape\"?): it cannot "
                            "be tokenized or sent") from None
    return value


def checked_step(value: object) -> StepResult:
    """A step's return (StepResult or (messages, reward, done)) as a StepResult, else Malformed."""
    if isinstance(value, StepResult):
        messages, reward, done = value.messages, value.reward, value.done
    elif isinstance(value, tuple) and len(value) == 3:
        messages, reward, done = value
    else:
        raise Malformed(f"step returned {type(value).__name__} {_short(value)}, not a StepResult or a "
                        "(messages, reward or None, done) tuple")
    messages = checked_messages(messages, what="step", roles=STEP_ROLES)
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise Malformed(f"step returned reward {_short(reward)}, not a number or None")
        if reward != reward or reward in (float("inf"), float("-inf")):
            raise Malformed(f"step returned reward {reward!r}, not a finite number")
        reward = float(reward)
    if not isinstance(done, bool):
        raise Malformed(f"step returned done = {_short(done)}, not True or False")
    return StepResult(messages=messages, reward=reward, done=done)


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
