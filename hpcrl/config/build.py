"""Turn plain TOML tables into the typed dataclasses of `hpcrl.config.schema`.

Checks every value against the field's annotation (str, int, float, bool, a union of those, Literal,
list, dict, nested dataclass, dict of dataclasses), rejects unknown keys with a "did you mean",
builds a table whose class depends on its values (a dataclass with `table_class(table)`: [algorithm],
whose keys are the configured algorithm's options, hpcrl.algorithms.base.Options),
and reports missing required keys. Every float must be finite (TOML has nan and inf, which no
key can use) and every integer must fit in 64 bits; bounds of single keys live in schema.py. Errors carry the dotted key; the loader adds file and line.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from functools import cache
from typing import Any, Literal

from hpcrl.errors import ConfigError

#: Every integer key fits a signed 64-bit integer (TOML's own range, which tomllib does not enforce).
INT_MIN, INT_MAX = -(2**63), 2**63 - 1
#: A UTF-16 surrogate on its own: what Python makes of bytes that are not UTF-8 on a command line.
_SURROGATE = re.compile("[\ud800-\udfff]")
_TYPE_WORDS = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}
_EXAMPLES = {str: '"text"', int: "1", float: "0.5", bool: "true"}


def _describe(value: Any) -> str:
    kind = {str: "a string", bool: "a boolean", int: "an integer", float: "a number",
            list: "an array", dict: "a table"}.get(type(value), type(value).__name__)
    shown = repr(value) if not isinstance(value, dict) else "{...}"
    return f"{shown} ({kind})"


def _toml_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_literal(v)}" for k, v in value.items()) + " }"
    return repr(value)


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def table_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of `cls` that are keys of its table: all but those marked "derived" (filled in from
    another key by code, e.g. hpcrl.algorithms.base.Options.max_tokens from inference.max_tokens)."""
    return [f for f in dataclasses.fields(cls) if "derived" not in f.metadata]


def field_example(cls: type, name: str) -> str:
    """A TOML line that would be valid for field `name` of `cls`, for error fixes."""
    fld = next(f for f in dataclasses.fields(cls) if f.name == name)
    if "example" in fld.metadata:
        return f"{name} = {_toml_literal(fld.metadata['example'])}"
    if fld.default is not dataclasses.MISSING:
        return f"{name} = {_toml_literal(fld.default)}"
    if fld.default_factory is not dataclasses.MISSING:
        return f"{name} = {_toml_literal(fld.default_factory())}"
    hint = _hints(cls)[name]
    if typing.get_origin(hint) is Literal:
        return f"{name} = {_toml_literal(typing.get_args(hint)[0])}"
    return f"{name} = {_EXAMPLES.get(hint, '...')}"


def _convert(value: Any, hint: Any, key: str, example: str) -> Any:
    """Check `value` against type `hint`; return it converted (int -> float, lists copied)."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value in choices and type(value) is type(choices[0]):
            return value
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint_text = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(key=key, problem=f"must be one of {', '.join(map(repr, choices))}; got {_describe(value)}",
                          fix=f"{hint_text}write e.g. {example}")
    if origin in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) > 1 and all(a in _TYPE_WORDS for a in args):  # a simple value of any of these types
            words = " or ".join(_TYPE_WORDS[a] for a in args)
            match = next((a for a in args if type(value) is a), None)
            if match is None:
                raise ConfigError(key=key, problem=f"expected {words}, got {_describe(value)}",
                                  fix=f"write it as {words}, e.g. {example}")
            return _convert(value, match, key, example)
        return _convert(value, args[0], key, example)
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(key=key, problem=f"expected an array, got {_describe(value)}",
                              fix=f"write it as an array, e.g. {example}")
        return [_convert(v, item, f"{key}[{i}]", example) for i, v in enumerate(value)]
    if origin is dict:
        _, item = typing.get_args(hint)
        if not isinstance(value, dict):
            raise ConfigError(key=key, problem=f"expected a table, got {_describe(value)}",
                              fix=f"write it as a table [{key}] with one key per entry")
        sample = _EXAMPLES.get(item) or next((_EXAMPLES[a] for a in typing.get_args(item) if a in _EXAMPLES), "...")
        return {k: _convert(v, item, f"{key}.{k}", f"{k} = {sample}") for k, v in value.items()}
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if isinstance(value, dict) and hasattr(hint, "table_class"):
            hint = hint.table_class(value)  # a table whose keys depend on its values: [algorithm] on its name
        return build(hint, value, key)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:  # TOML caps no integer; tomllib reads any
            raise ConfigError(key=key, problem=f"a {len(str(value))}-digit number is beyond any float",
                              fix=f"write a realistic value, e.g. {example}") from None
    if type(value) is not hint:
        want = _TYPE_WORDS.get(hint, getattr(hint, "__name__", str(hint)))
        raise ConfigError(key=key, problem=f"expected {want}, got {_describe(value)}",
                          fix=f"write it as {want}, e.g. {example}")
    if hint is float and not math.isfinite(value):
        raise ConfigError(key=key, problem=f"must be a finite number, got {value}",
                          fix=f"write a number, e.g. {example}")
    if hint is str and (surrogate := _SURROGATE.search(value)):
        raise ConfigError(key=key, problem=f"holds a lone surrogate (U+{ord(surrogate.group()):04X}, at character "
                          f"{surrogate.start()}), which is not Unicode text (a command line in another encoding than "
                          "UTF-8 gives one)", fix="write the value in UTF-8")
    if hint is int and not INT_MIN <= value <= INT_MAX:
        raise ConfigError(key=key, problem=f"{value} does not fit in a 64-bit integer (torch, numpy and Slurm "
                          "count in at most 64 bits)", fix=f"write a realistic value, e.g. {example}")
    return value


def build(cls: type, table: Any, prefix: str) -> Any:
    """Build dataclass `cls` from TOML table `table` found at dotted key `prefix`."""
    section = f"[{prefix}]" if prefix else "the top level"
    if not isinstance(table, dict):
        raise ConfigError(key=prefix, problem=f"expected a table, got {_describe(table)}",
                          fix=f"write it as a table: a line {section} followed by key = value lines")
    fields = {f.name: f for f in table_fields(cls)}
    for name in table:
        if name not in fields:
            close = difflib.get_close_matches(name, list(fields), n=1, cutoff=0.6)
            guess = f"did you mean {close[0]!r}? " if close else ""
            owner = cls.owner_of(name) if hasattr(cls, "owner_of") else ""  # [algorithm]: another algorithm's key
            raise ConfigError(key=f"{prefix}.{name}" if prefix else name,
                              problem=f"unknown key {name!r} in {section}" + (f" ({owner})" if owner else ""),
                              fix=f"{guess}valid keys are: {', '.join(fields)}")
    kwargs = {}
    hints = _hints(cls)
    for name, fld in fields.items():
        key = f"{prefix}.{name}" if prefix else name
        if name not in table:
            if fld.default is dataclasses.MISSING and fld.default_factory is dataclasses.MISSING:
                raise ConfigError(key=key, problem=f"required key {name!r} is missing from {section}",
                                  fix=f"add a line {field_example(cls, name)} under {section}")
            continue
        kwargs[name] = _convert(table[name], hints[name], key, field_example(cls, name))
    try:
        return cls(**kwargs)
    except ConfigError as err:
        # __post_init__ names keys relative to its own table.
        full = f"{prefix}.{err.key}" if prefix and err.key else err.key or prefix
        raise ConfigError(key=full, problem=err.problem, fix=err.fix) from None
