"""Config -> TOML text: the resolved copy kept in the run directory (config.toml).

Loading the dump with `load_config` gives back an equal Config (tests check the round trip),
so a run directory alone is enough to resume or inspect a run.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from hpcrl.config.build import table_fields
from hpcrl.config.schema import Config


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table: an entry of reward.functions
        return "{" + ", ".join(f"{key} = {_value(v)}" for key, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} as a TOML value")


def _table(name: str, table: dict[str, Any], out: list[str]) -> None:
    scalars = {k: v for k, v in table.items() if not isinstance(v, dict)}
    tables = {k: v for k, v in table.items() if isinstance(v, dict)}
    out.append(f"[{name}]")
    out += [f"{key} = {_value(value)}" for key, value in scalars.items()]
    out.append("")
    for key, sub in tables.items():
        _table(f"{name}.{json.dumps(key) if not key.isidentifier() else key}", sub, out)


def _keys(table: Any) -> dict[str, Any]:
    """A table's keys and values: its dataclass as a dict, without the fields code fills in (table_fields)."""
    keys = {f.name for f in table_fields(type(table))}
    return {k: v for k, v in dataclasses.asdict(table).items() if k in keys}


def dump_toml(config: Config) -> str:
    """The TOML text of a resolved config (every field, defaults included)."""
    out = ["# Resolved configuration of this run (profile + experiment + --set), written by hpcrl.", ""]
    for field in dataclasses.fields(config):
        if getattr(config, field.name) is None:  # an optional table left out ([lora])
            continue
        _table(field.name, _keys(getattr(config, field.name)) if field.name != "groups"
               else {k: _keys(v) for k, v in config.groups.items()}, out)
    return "\n".join(out)
