"""Logging in one style: an entry point calls `setup_logging` once; every module logs through
`logging.getLogger(__name__)`; nothing else touches handlers or levels.

    setup_logging(run_dir, "run", 0, verbose, stream="stdout")  # hpcrl run: logs/run/rank0.log + the terminal
    stderr_to_log(log_file)                                     # hpcrl run without -v: fd 2, its processes' too
    setup_logging(run_dir, "head", 0, verbose)                  # the head: logs/head/rank0.log + stderr
    setup_logging(run_dir, "inference", 3, verbose)             # a group task, whose output already is its log
    setup_logging(None, "hpcrl", 0, verbose)                    # other commands: the terminal only

    logging.getLogger(PROGRESS).info(line, extra={"keep": True})   # the per-step line (hpcrl.rl.loop)

Where records go:

    log file   RUN_DIR/logs/<group>/rank<k>.log: every logger at INFO (hpcrl's at DEBUG with
               verbose), as "<time> <group>: <message>"; records of other libraries (vLLM,
               torch, Python's warnings as logger py.warnings) also name their level, logger and
               process, as "<time> <group>: <LEVEL> <logger> (<process> pid <pid>): <message>"
    terminal   stderr (or stdout): hpcrl's records and the progress line; other libraries' errors.
               Other libraries' warnings only without a log file to keep them; with verbose,
               every library's records down to INFO.

Text that bypasses logging - C++ warnings of torch, Python's warnings and vLLM's log lines in a
process that has not configured logging yet (vLLM's EngineCore before it applies the
configuration below) - goes to file descriptor 2. `stderr_to_log` points this process's fd 2,
which the processes it starts inherit, at the log file (hpcrl run does, unless verbose), while
sys.stderr (tracebacks, "hpcrl: error: ...") stays on the terminal.

When the terminal already is the log file - a group task, whose stdout and stderr srun (or the
local executor) sends to logs/<group>/rank<k>.log - one handler writes everything there.

On a terminal (a TTY), the progress line rewrites itself in place; a record with `keep` set
stays, and any other record is printed above the live line. Elsewhere (a pipe, a file) every
progress record is its own line.

vLLM configures logging itself when it builds an engine, in this process and in each EngineCore
and worker process it starts (vllm/logger.py): it applies the dictConfig JSON that
VLLM_LOGGING_CONFIG_PATH names. setup_logging writes its configuration to such a file beside the
log (rank<k>.logging.json) and points the variable at it, so every one of vLLM's processes logs
the way this one does. VLLM_LOGGING_LEVEL, when set, is the vllm logger's level (INFO otherwise).

This is a base module: it imports no hpcrl package, and vLLM's processes import it by name.
"""

from __future__ import annotations

import json
import logging
import logging.config
import os
import shutil
import sys
from pathlib import Path
from typing import Any, TextIO

from hpcrl.rundir import log_path

#: The logger of the per-step progress line: the terminal always shows it.
PROGRESS = "hpcrl.progress"
_STREAMS = ("stdout", "stderr")


def _within(name: str, parent: str) -> bool:
    """Whether logger `name` is `parent` or one of its children."""
    return name == parent or name.startswith(parent + ".")


def _is_hpcrl(name: str) -> bool:
    return _within(name, "hpcrl")


class TerminalFilter(logging.Filter):
    """What the terminal shows: hpcrl's records and the progress line, other libraries' errors, and
    their warnings unless a log file keeps them (`to_file`); with `verbose`, everything."""

    def __init__(self, verbose: bool = False, to_file: bool = False) -> None:
        super().__init__()
        self.verbose = verbose
        self.to_file = to_file

    def filter(self, record: logging.LogRecord) -> bool:
        if self.verbose or _is_hpcrl(record.name):
            return True
        return record.levelno >= (logging.ERROR if self.to_file else logging.WARNING)


class TerminalFormatter(logging.Formatter):
    """The message alone; a warning or error also says so, and names its logger if it is not hpcrl's."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if record.levelno >= logging.WARNING or not _is_hpcrl(record.name):
            where = "" if _is_hpcrl(record.name) else f" {record.name}"
            text = f"{record.levelname}{where}: {text}"
        return text


class FileFormatter(logging.Formatter):
    """"<time> <group>: <message>"; other libraries' records also name level, logger and process."""

    def __init__(self, group: str = "hpcrl") -> None:
        super().__init__(f"%(asctime)s {group}: %(message)s")
        self._other = logging.Formatter(f"%(asctime)s {group}: %(levelname)s %(name)s "
                                        "(%(processName)s pid %(process)d): %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record) if _is_hpcrl(record.name) else self._other.format(record)


class TerminalHandler(logging.Handler):
    """Writes to sys.stdout or sys.stderr as they are when a record comes (so a test's capture, or
    a redirection made after set-up, is honoured); on a TTY the progress line lives in place."""

    def __init__(self, stream: str = "stderr") -> None:
        super().__init__()
        if stream not in _STREAMS:
            raise ValueError(f"stream must be one of {_STREAMS}, not {stream!r}")
        self.stream_name = stream
        self._live = ""
        """The progress line now shown in place (without a newline), or ""."""

    @property
    def stream(self) -> TextIO:
        return getattr(sys, self.stream_name)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
            stream = self.stream
            tty = stream.isatty()
            if tty and record.name == PROGRESS and not getattr(record, "keep", False):
                width = shutil.get_terminal_size().columns - 1  # a wrapped line cannot be rewritten
                self._live = text.splitlines()[0][:width] if text else ""
                stream.write("\r\x1b[2K" + self._live)
            elif tty and self._live:  # above the live line, which is drawn again below it
                stream.write("\r\x1b[2K" + text + "\n" + ("" if record.name == PROGRESS else self._live))
                if record.name == PROGRESS:
                    self._live = ""
            else:
                stream.write(text + "\n")
            stream.flush()
        except RecursionError:
            raise
        except Exception:  # noqa: BLE001 - logging's own convention: report and go on
            self.handleError(record)

    def close(self) -> None:
        """Leave the terminal on a fresh line."""
        try:
            if self._live and self.stream.isatty():
                self.stream.write("\n")
                self.stream.flush()
        except (OSError, ValueError):
            pass
        self._live = ""
        super().close()


def _writes_to(stream: str, path: Path) -> bool:
    """Whether this process's stdout/stderr already is the file at `path` (srun --output, the
    local executor): then that stream is the log, and the file is not opened a second time."""
    try:
        fd = getattr(sys, f"__{stream}__").fileno()
        mine, there = os.fstat(fd), os.stat(path)
    except (AttributeError, OSError, ValueError):
        return False
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


def logging_config(log_file: Path | None, group: str, verbose: bool = False, *,
                   stream: str = "stderr") -> dict[str, Any]:
    """The dictConfig of setup_logging (pure but for looking at where `stream` goes); JSON-ready."""
    if stream not in _STREAMS:
        raise ValueError(f"stream must be one of {_STREAMS}, not {stream!r}")
    formatters: dict[str, Any] = {"file": {"()": f"{__name__}.FileFormatter", "group": group},
                                  "terminal": {"()": f"{__name__}.TerminalFormatter"}}
    handlers: dict[str, Any]
    if log_file is not None and _writes_to(stream, log_file):
        handlers = {"log": {"()": f"{__name__}.TerminalHandler", "stream": stream, "formatter": "file"}}
    else:
        handlers = {"terminal": {"()": f"{__name__}.TerminalHandler", "stream": stream, "formatter": "terminal",
                                 "filters": ["terminal"]}}
        if log_file is not None:
            handlers["file"] = {"class": "logging.FileHandler", "filename": str(log_file), "mode": "a",
                                "encoding": "utf-8", "formatter": "file"}
    vllm_level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": formatters,
        "filters": {"terminal": {"()": f"{__name__}.TerminalFilter", "verbose": verbose,
                                 "to_file": log_file is not None}},
        "handlers": handlers,
        "root": {"level": "INFO", "handlers": sorted(handlers)},
        "loggers": {
            "hpcrl": {"level": "DEBUG" if verbose else "INFO"},
            # vLLM's own configuration gives its logger a handler and stops propagation: undo both.
            "vllm": {"level": vllm_level, "handlers": [], "propagate": True},
        },
    }


def setup_logging(run_dir: Path | str | None, group: str, rank: int = 0, verbose: bool = False, *,
                  stream: str = "stderr") -> Path | None:
    """Set up this process's logging (see the module docstring); returns the log file, or None
    without a run directory. For entry points only; calling it again replaces the set-up."""
    log_file = None if run_dir is None else log_path(Path(run_dir).absolute(), group, rank)
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
    config = logging_config(log_file, group, verbose, stream=stream)
    text = json.dumps(config, indent=2) + "\n"  # before dictConfig, which may change what it is given
    logging.config.dictConfig(config)
    logging.captureWarnings(True)  # Python's warnings: records of logger py.warnings
    if log_file is not None:
        # vLLM applies the same configuration in each of its processes (see the module docstring).
        vllm_config = log_file.with_name(log_file.stem + ".logging.json")
        tmp = vllm_config.with_name(f".{vllm_config.name}.tmp{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, vllm_config)
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(vllm_config)
        os.environ["VLLM_CONFIGURE_LOGGING"] = "1"
    return log_file


def stderr_to_log(log_file: Path) -> None:
    """Point file descriptor 2 of this process, and so of every process it starts from now on, at
    `log_file` (appending, as its FileHandler does); sys.stderr, Python's own writes (tracebacks,
    "hpcrl: error: ..."), keeps the terminal. See the module docstring; for entry points only."""
    terminal = os.dup(2)
    log_fd = os.open(log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    sys.stderr.flush()
    os.dup2(log_fd, 2)
    os.close(log_fd)
    sys.stderr = os.fdopen(terminal, "w", buffering=1, encoding=sys.stderr.encoding, errors=sys.stderr.errors)
