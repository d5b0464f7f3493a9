"""Slurm host lists: "n[2-3,5],gpu01" -> ["n2", "n3", "n5", "gpu01"] (pure).

Zero padding is kept ("gpu[001-003]"); several bracket groups in one name are expanded as a
product ("r[1-2]n[1-2]"). `scontrol show hostnames` does the same, but needs Slurm.
"""

from __future__ import annotations

import re

from hpcrl.errors import SlurmError

_RANGE_RE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_ranges(inner: str, whole: str) -> list[str]:
    out = []
    for item in inner.split(","):
        match = _RANGE_RE.match(item)
        if not match:
            raise SlurmError(f"cannot read host list {whole!r}: {item!r} is not a number or a range")
        low, high = match.group(1), match.group(2) or match.group(1)
        width = len(low)
        out += [f"{n:0{width}d}" for n in range(int(low), int(high) + 1)]
    return out


def expand_nodelist(text: str) -> list[str]:
    """Every host name of a Slurm host list, in order."""
    hosts: list[str] = []
    for part in _split_top_level(text.strip()):
        names = [""]
        rest = part
        while rest:
            bracket = rest.find("[")
            if bracket == -1:
                names = [n + rest for n in names]
                break
            close = rest.find("]", bracket)
            if close == -1:
                raise SlurmError(f"cannot read host list {text!r}: unclosed '['")
            prefix = rest[:bracket]
            names = [n + prefix + s for n in names for s in _expand_ranges(rest[bracket + 1:close], text)]
            rest = rest[close + 1:]
        hosts += names
    return hosts
