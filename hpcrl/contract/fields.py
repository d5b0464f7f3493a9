"""Typed values to and from what msgpack carries: a type hint checks a wire value and builds it.

    encode(GenerateCall(prompts=[...], n=4, seed=7), GenerateCall)   # -> {"prompts": [{...}], "n": 4, ...}
    decode({"prompts": [...], "n": 4, "seed": 7}, GenerateCall, "inference.generate request")
    decode({"n": "4"}, GenerateCall, ...)   # MalformedError: ... field 'n' must be an int, got str '4'

The hints understood are those of the messages' dataclasses (hpcrl.contract.endpoints and the types
they hold): int, float (an int is taken too), str, bool, None, Any, list[T], dict[str, T], bare list
and dict, unions with None, and keyword-only dataclasses, sent as maps of their fields. A map must have
every field without a default, and no other; a value of the wrong type is refused, naming the path to
it ("prompts[2].token_ids[0]"). Lists of numbers are checked in one pass in C (the set of their
element types) and neither copied nor converted (3 x 1M tokens of a TrainBatch: 0.35 s measured
on the 2-core test machine under a load of 23, so well under that on a trainer's node).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any

from hpcrl.errors import HpcrlError

_PLAIN = {int: "an int", float: "a float", str: "a str", bool: "a bool"}
#: The Python types msgpack gives that a plain hint takes (no bool for a number; an int for a float).
_TAKES = {int: frozenset((int,)), float: frozenset((float, int)), str: frozenset((str,)), bool: frozenset((bool,))}


class MalformedError(HpcrlError):
    """A wire value does not have the declared type; `field` is the path to the first wrong part."""

    def __init__(self, what: str, field: str, problem: str) -> None:
        self.what = what
        self.field = field
        self.problem = problem
        super().__init__(f"{what}: {f'field {field!r} ' if field else ''}{problem}")


@functools.cache
def _fields(cls: type) -> tuple[dict[str, Any], frozenset[str]]:
    """A dataclass's field hints, and the names of those it cannot be made without."""
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    required = frozenset(f.name for f in fields
                         if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    return {f.name: hints[f.name] for f in fields}, required


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _fits(value: Any, hint: Any) -> bool:
    """Whether a plain value is of type `hint` (int, float, str, bool)."""
    return type(value) in _TAKES[hint]


def decode(value: Any, hint: Any, what: str) -> Any:
    """`value` as it came off the wire, checked against `hint` and built into it; MalformedError naming
    `what` (e.g. "inference.generate request from the head") and the field otherwise."""
    return _decode(value, hint, what, "")


def _decode(value: Any, hint: Any, what: str, path: str) -> Any:
    if hint is Any:
        return value
    if hint in _PLAIN:
        if not _fits(value, hint):
            raise MalformedError(what, path, f"must be {_PLAIN[hint]}, got {_shown(value)}")
        return value
    if hint is None or hint is type(None):
        if value is not None:
            raise MalformedError(what, path, f"must be None, got {_shown(value)}")
        return None
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return _decode_dataclass(value, hint, what, path)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"{what}: the hint {hint} is not a type or a type | None")
        return _decode(value, rest[0], what, path)
    if hint is list or origin is list:
        if type(value) is not list:
            raise MalformedError(what, path, f"must be a list, got {_shown(value)}")
        if not args or args[0] is Any:
            return value
        item = args[0]
        if item in _PLAIN:
            if not set(map(type, value)) <= _TAKES[item]:  # one pass in C; the loop only to name the element
                index, element = next((i, e) for i, e in enumerate(value) if not _fits(e, item))
                raise MalformedError(what, f"{path}[{index}]", f"must be {_PLAIN[item]}, got {_shown(element)}")
            return value
        return [_decode(element, item, what, f"{path}[{index}]") for index, element in enumerate(value)]
    if hint is dict or origin is dict:
        if type(value) is not dict:
            raise MalformedError(what, path, f"must be a map, got {_shown(value)}")
        key, item = args or (str, Any)
        for name in value:
            if type(name) is not key:
                raise MalformedError(what, path, f"must have {_PLAIN.get(key, key)} keys, got {_shown(name)}")
        if item is Any:
            return value
        return {name: _decode(element, item, what, f"{path}.{name}" if path else name)
                for name, element in value.items()}
    raise TypeError(f"{what}: the hint {hint} cannot cross the bus (see hpcrl.contract.fields)")


def _decode_dataclass(value: Any, cls: type, what: str, path: str) -> Any:
    if type(value) is not dict:
        raise MalformedError(what, path, f"must be a map of {cls.__name__}'s fields, got {_shown(value)}")
    hints, required = _fields(cls)
    missing = sorted(required - value.keys())
    if missing:
        raise MalformedError(what, _join(path, missing[0]), f"is missing ({cls.__name__} needs "
                             f"{', '.join(sorted(required))})")
    for name in value:
        if name not in hints:
            raise MalformedError(what, _join(path, str(name)), f"is not a field of {cls.__name__} "
                                 f"(its fields: {', '.join(hints)})")
    return cls(**{name: _decode(element, hints[name], what, _join(path, name)) for name, element in value.items()})


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def encode(value: Any, hint: Any) -> Any:
    """What msgpack sends of `value`, of type `hint`: dataclasses become maps of their fields (as
    `dataclasses.asdict` makes them), everything else goes as it is. Not checked: `decode` checks
    at the other end."""
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        hints, _ = _fields(hint)
        return {name: encode(getattr(value, name), field) for name, field in hints.items()}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        rest = [a for a in args if a is not type(None)]
        return None if value is None else encode(value, rest[0])
    if origin is list and args and _holds_dataclass(args[0]):
        return [encode(element, args[0]) for element in value]
    if origin is dict and len(args) == 2 and _holds_dataclass(args[1]):
        return {name: encode(element, args[1]) for name, element in value.items()}
    return value


@functools.cache
def _holds_dataclass(hint: Any) -> bool:
    """Whether values of `hint` contain a dataclass somewhere (so `encode` must walk them)."""
    if dataclasses.is_dataclass(hint):
        return True
    return any(_holds_dataclass(a) for a in typing.get_args(hint) if a is not Ellipsis)
