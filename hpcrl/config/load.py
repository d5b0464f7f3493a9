"""Load a run configuration: experiment TOML over a cluster profile, then --set overrides.

    profile  launch/<cluster>.toml      (lowest)
    file     configs/<experiment>.toml
    --set    trainer.lr=1e-5            (highest)

Tables merge key by key; the later source wins. Every error names the file that set the key
(or "--set"), the line where the TOML gives it, the dotted key, the problem and the fix.
Below all of them lie the defaults of the configured algorithm (algorithm.name, hpcrl.algorithms):
an algorithm may set its own value of a key (its Algorithm.defaults), which applies unless a source
sets that key itself.
Relative paths (model.path, data.source, run.run_dir, ...) are made absolute against the
current directory, so the resolved config can be copied into the run directory and used from
anywhere; $VAR, ${VAR} and ~ in them are expanded, and an unset variable is an error naming it.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcrl.algorithms import DEFAULT_ALGORITHM, load_algorithm
from hpcrl.config.build import build
from hpcrl.config.checks import check_config
from hpcrl.config.model_shapes import ModelShape
from hpcrl.config.schema import Config
from hpcrl.errors import ConfigError

#: Where `--cluster NAME` looks for launch/NAME.toml besides explicit paths.
LAUNCH_DIR_ENV = "HPCRL_LAUNCH_DIR"


@dataclass(frozen=True)
class _Source:
    """One input: a TOML file or the command line, with its text for locating lines."""

    name: str
    text: str | None = None

    def line_of(self, dotted: str) -> int | None:
        return find_line(self.text, dotted) if self.text is not None else None


def _split_key(key: str) -> list[str]:
    return [part.strip().strip("\"'") for part in key.split(".")]


_HEADER_RE = re.compile(r"^\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_ASSIGN_RE = re.compile(r"^([A-Za-z0-9_\-.\"' ]+?)\s*=")


def find_line(text: str, dotted: str) -> int | None:
    """Line (1-based) where TOML `text` sets `dotted`, else the line of its nearest table header."""
    want = _split_key(dotted)
    table: list[str] = []
    best: tuple[int, int] | None = None  # (matched depth, line)
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        header = _HEADER_RE.match(line)
        if header:
            table = _split_key(header.group(1))
            key = table
        else:
            assign = _ASSIGN_RE.match(line)
            if not assign:
                continue
            key = table + _split_key(assign.group(1))
        if key == want:
            return number
        depth = len(key)
        if key == want[:depth] and (best is None or depth > best[0]):
            best = (depth, number)
    return best[1] if best else None


def read_toml(path: Path) -> dict[str, Any]:
    """Parse a TOML file; a syntax error becomes a ConfigError with file and line."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(file=str(path), key="", problem="file not found",
                          fix="check the path (it is relative to the current directory)") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as err:
        raise ConfigError(file=str(path), key="", problem=f"cannot be read: {err}",
                          fix="give a readable UTF-8 TOML file") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        match = re.search(r"at line (\d+)", str(err))
        line = int(match.group(1)) if match else None
        if "Cannot overwrite a value" in str(err) or "Cannot declare" in str(err):
            raise _duplicate_error(path, text, line) from None
        raise ConfigError(file=str(path), line=line, key="",
                          problem=f"not valid TOML: {err}",
                          fix="correct the TOML syntax at that line (strings need quotes)") from None


def _duplicate_error(path: Path, text: str, line: int | None) -> ConfigError:
    """A key set twice, or a table declared twice: tomllib says only "Cannot overwrite a value" (or "Cannot
    declare ('t',) twice"), at a line that may be the end of the file; name the key and both lines."""
    seen: dict[tuple[str, ...], int] = {}
    table: tuple[str, ...] = ()
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        header = _HEADER_RE.match(stripped)
        if header:
            table = tuple(_split_key(header.group(1)))
            if stripped.startswith("[["):
                continue  # an array of tables may repeat
            key, what = table, "table"
        else:
            assign = _ASSIGN_RE.match(stripped)
            if not assign:
                continue
            key, what = table + tuple(_split_key(assign.group(1))), "key"
        if key in seen:
            dotted = ".".join(key)
            if what == "table":
                return ConfigError(file=str(path), line=number, key=dotted,
                                   problem=f"table [{dotted}] is declared twice (lines {seen[key]} and {number})",
                                   fix=f"merge the two [{dotted}] tables into one: TOML allows each table once")
            return ConfigError(file=str(path), line=number, key=dotted,
                               problem=f"is set twice (lines {seen[key]} and {number})",
                               fix="keep one of the two lines: TOML allows each key once per table")
        seen[key] = number
    return ConfigError(file=str(path), line=line, key="", problem="not valid TOML: a key or table is given twice",
                       fix="keep one of them: TOML allows each key and table once")


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a","b","c"], value); the value is read as TOML, else as a bare string."""
    key, sep, raw = text.partition("=")
    parts = _split_key(key)
    if not sep or not all(re.match(r"^[A-Za-z0-9_-]+$", p) for p in parts):
        raise ConfigError(file="--set", key=key.strip(), problem=f"{text!r} is not of the form key.sub=value",
                          fix="write it like --set trainer.lr=1e-5")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return parts, value


def _merge(base: dict, top: dict, origins: dict[str, _Source], source: _Source,
           prefix: str = "") -> dict:
    """Merge `top` over `base` (new dict), recording which source set each dotted key."""
    out = dict(base)
    for key, value in top.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value, origins, source, dotted)
        else:
            out[key] = value
            _record(value, dotted, origins, source)
    return out


def _record(value: Any, dotted: str, origins: dict[str, _Source], source: _Source) -> None:
    origins[dotted] = source
    if isinstance(value, dict):
        for key, sub in value.items():
            _record(sub, f"{dotted}.{key}", origins, source)


def find_profile(name: str, config_path: Path) -> Path:
    """The cluster profile file for `--cluster NAME` (a path, or NAME looked up in launch/ dirs)."""
    if name.endswith(".toml") or os.sep in name:
        return Path(name)
    dirs = [Path.cwd() / "launch", config_path.resolve().parent.parent / "launch"]
    if os.environ.get(LAUNCH_DIR_ENV):
        dirs.insert(0, Path(os.environ[LAUNCH_DIR_ENV]))
    for folder in dirs:
        if (folder / f"{name}.toml").is_file():
            return folder / f"{name}.toml"
    known = sorted({p.stem for d in dirs if d.is_dir() for p in d.glob("*.toml")})
    raise ConfigError(file=str(config_path), key="run.cluster",
                      problem=f"no cluster profile {name!r} (looked for {name}.toml in "
                              f"{', '.join(str(d) for d in dict.fromkeys(dirs))})",
                      fix=f"use one of: {', '.join(known) or 'none found'}, or give a path to a profile")


_UNSET_VAR_RE = re.compile(r"\$(\w+|\{[^}]*\})")


def expand_path(value: str, key: str) -> str:
    """`value` with $VAR, ${VAR} and ~ expanded (as a shell would for a Slurm user's paths), made absolute
    against the current directory. A variable that is not set is a ConfigError naming it: left as it was,
    it would become a directory literally named "$VAR"."""
    expanded = os.path.expandvars(value)
    unset = _UNSET_VAR_RE.search(expanded)
    if unset:
        name = unset.group(1).strip("{}")
        raise ConfigError(key=key, problem=f"{value!r} uses ${name}, which is not set in the environment",
                          fix=f"export {name} before running hpcrl, or write the path out in full "
                              "($VAR, ${VAR} and ~ are expanded; a literal $ followed by a name cannot be written)")
    return str(Path(expanded).expanduser().absolute())


def _absolute_paths(tree: dict) -> None:
    """Make the config's path-valued keys absolute against the current directory (expand_path)."""
    for table, key in (("model", "path"), ("reward", "model_path"), ("run", "run_dir"),
                       ("cluster", "slurm_conf")):
        value = tree.get(table, {}).get(key) if isinstance(tree.get(table), dict) else None
        if isinstance(value, str) and value:
            tree[table][key] = expand_path(value, f"{table}.{key}")
    data = tree.get("data")
    for key in ("source", "eval_source"):
        if isinstance(data, dict) and isinstance(data.get(key), str):
            source = data[key]
            if source and not source.startswith("builtin:"):
                data[key] = expand_path(source, f"data.{key}")


def _merge_algorithm_defaults(tree: dict[str, Any]) -> None:
    """Put the configured algorithm's defaults (hpcrl.algorithms) under the [algorithm] table: each
    applies only where no source set the key, so a key the user set always wins."""
    table = tree.get("algorithm", {})
    if not isinstance(table, dict):
        return  # build() reports a non-table with its fix
    defaults = load_algorithm(table.get("name", DEFAULT_ALGORITHM)).defaults  # a ConfigError at algorithm.name if unknown
    if defaults:
        tree["algorithm"] = {**defaults, **table}


def load_config(path: str | Path, *, cluster: str | None = None,
                overrides: Iterable[str] = ()) -> Config:
    """Read, merge, type-check and cross-check one run configuration."""
    return load_config_and_shape(path, cluster=cluster, overrides=overrides)[0]


def load_config_and_shape(path: str | Path, *, cluster: str | None = None,
                          overrides: Iterable[str] = ()) -> tuple[Config, ModelShape]:
    """`load_config`, also returning the model's shape that the cross-checks read."""
    path = Path(path)
    experiment = read_toml(path)
    file_source = _Source(str(path), path.read_text())
    origins: dict[str, _Source] = {}
    tree: dict[str, Any] = {}

    run_table = experiment.get("run")
    profile_name = cluster or (run_table.get("cluster") if isinstance(run_table, dict) else None)
    if profile_name:
        if not isinstance(profile_name, str):
            raise ConfigError(file=str(path), line=file_source.line_of("run.cluster"), key="run.cluster",
                              problem=f"expected a string, got {profile_name!r}",
                              fix='write it like cluster = "local"')
        profile_path = find_profile(profile_name, path)
        tree = _merge(tree, read_toml(profile_path), origins, _Source(str(profile_path), profile_path.read_text()))
    tree = _merge(tree, experiment, origins, file_source)
    cli = _Source("--set")
    for text in overrides:
        parts, value = parse_override(text)
        nested: Any = value
        for part in reversed(parts):
            nested = {part: nested}
        try:
            tree = _merge(tree, nested, origins, cli)
        except AttributeError:
            raise ConfigError(file="--set", key=".".join(parts), problem="sets a key inside a value that is not a table",
                              fix="check the dotted key (e.g. trainer.lr, groups.trainer.partition)") from None

    def locate(err: ConfigError) -> ConfigError:
        key = err.key
        while key and key not in origins:
            key = key.rpartition(".")[0]
        source = origins.get(key, file_source) if key else file_source
        return err.located(file=source.name, line=source.line_of(err.key) if err.key else None)

    try:
        _absolute_paths(tree)
        _merge_algorithm_defaults(tree)
        config = build(Config, tree, "")
        shape = check_config(config)
    except ConfigError as err:
        raise locate(err) from None
    return config, shape
