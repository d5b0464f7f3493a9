"""The first code of each sandboxed process (hpcrl.workers.sandbox starts `python -I` this file in bubblewrap).

Standard library only: it runs before anything else in the new process and imports nothing of hpcrl.

    _sandbox_boot.py run   CONFIG   python_tool: solution.py's code alone; exit code 0 when it ran to its end
    _sandbox_boot.py serve CONFIG   code_tests' solution side (S): runs solution.py, then answers calls
    _sandbox_boot.py test  CONFIG   code_tests' tests side (T), in a sandbox of its own: reads tests.py first,
                                    runs it against proxies of the solution's names, reports the verdict

CONFIG (JSON) holds the limits and the file descriptors: "up" (a pipe: the boot writes "up" there before
any code runs, so a sandbox that failed to start is told from code that failed), "requests" and "replies"
(T -> S and S -> T), "verdict" (T -> the reward worker: the one channel the verdict travels on).

S and T share no file system, no PID namespace and no network: S cannot read the tests, patch T's
interpreter (builtins, compile, open) or write T's verdict. Between them, frames of a 4-byte length
and JSON (at most MAX_FRAME bytes, MAX_DEPTH deep), carrying plain data only: None, bool, int, float
(non-finite ones too), complex, str, bytes, list, tuple, set, frozenset, dict, each of the exact type
(a subclass of int is not an int). Anything else of the solution's is a handle: in T a Remote that
can be called, iterated, indexed and asked for attributes (each a call to S), equal only to itself,
with no truth value, so an object whose __eq__ says True to everything is never equal to an answer.
An exception raised in S is raised in T as the same builtin type (others as SolutionError); S's end
(os._exit, a limit) is SolutionEnded, which `except Exception` in the tests does not catch.
"""

import builtins
import json
import os
import resource
import struct
import sys
import traceback
from typing import Any

MAX_FRAME = 4 << 20
MAX_DEPTH = 100
_SEQUENCES: dict[type, str] = {list: "l", tuple: "t", set: "S", frozenset: "F"}
_MAKERS = {"l": list, "t": tuple, "S": set, "F": frozenset}


class ProtocolError(BaseException):
    """The solution's process sent something that is not a frame of the protocol."""


class SolutionEnded(BaseException):
    """The solution's process ended (or stopped answering) before the tests finished."""


class SolutionError(Exception):
    """An exception of the solution's that is not a builtin type: its type name and message."""


def _limit(config: dict) -> None:
    """This process's limits, inherited by all it starts (the cgroup, where there is one, bounds them all)."""
    cpu = int(config["cpu_s"] + 0.999)
    memory = config["memory_mib"] * 1024 * 1024
    for limit, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, (memory, memory)),
                         (resource.RLIMIT_NPROC, (config["processes"],) * 2),
                         (resource.RLIMIT_FSIZE, (config["output_kib"] * 1024,) * 2), (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(limit, value)


def _send(fd: int, message: object) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    view = memoryview(struct.pack(">I", len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = os.read(fd, min(size - len(data), 1 << 20))
        if not chunk:
            raise SolutionEnded("the code ended the process before the tests finished")
        data += chunk
    return data


def _receive(fd: int) -> object:
    (size,) = struct.unpack(">I", _read_exact(fd, 4))
    if size > MAX_FRAME:
        raise ProtocolError(f"the solution's process sent a frame of {size} bytes (at most {MAX_FRAME})")
    try:
        return json.loads(_read_exact(fd, size))
    except (ValueError, RecursionError):
        raise ProtocolError("the solution's process sent a frame that is not JSON") from None


def encode(value: Any, handle, depth: int = 0) -> list:
    """Plain data as tagged lists (module docstring); anything else as handle(value)."""
    kind = type(value)
    if value is None:
        return ["n"]
    if kind is bool:
        return ["b", value]
    if kind is int:
        try:
            return ["i", str(value)]
        except ValueError:  # more digits than str() converts
            return handle(value)
    if kind is float:
        return ["f", value.hex()]
    if kind is complex:
        return ["c", value.real.hex(), value.imag.hex()]
    if kind is str:
        return ["s", value]
    if kind is bytes:
        return ["y", value.hex()]
    if depth < MAX_DEPTH and kind is dict:
        return ["d", [[encode(k, handle, depth + 1), encode(v, handle, depth + 1)] for k, v in value.items()]]
    if depth < MAX_DEPTH and kind in _SEQUENCES:
        return [_SEQUENCES[kind], [encode(item, handle, depth + 1) for item in value]]
    return handle(value)


def decode(item: object, resolve, depth: int = 0) -> object:
    """The value of a tagged list; resolve(item) makes a handle's object. ProtocolError if malformed."""
    try:
        return _decode(item, resolve, depth)
    except (TypeError, ValueError, IndexError, OverflowError, RecursionError):
        raise ProtocolError("the solution's process sent a malformed value") from None


def _decode(item, resolve, depth):
    if depth > MAX_DEPTH or type(item) is not list or not item or type(item[0]) is not str:
        raise ValueError(item)
    tag, rest = item[0], item[1:]
    if tag == "n" and not rest:
        return None
    if tag == "b" and type(rest[0]) is bool:
        return rest[0]
    if tag == "i" and type(rest[0]) is str:
        return int(rest[0])
    if tag == "f":
        return float.fromhex(rest[0])
    if tag == "c":
        return complex(float.fromhex(rest[0]), float.fromhex(rest[1]))
    if tag == "s" and type(rest[0]) is str:
        return rest[0]
    if tag == "y":
        return bytes.fromhex(rest[0])
    if tag in _MAKERS and type(rest[0]) is list:
        return _MAKERS[tag](_decode(x, resolve, depth + 1) for x in rest[0])
    if tag == "d" and type(rest[0]) is list:
        return {_decode(k, resolve, depth + 1): _decode(v, resolve, depth + 1) for k, v in rest[0]}
    if tag == "h":
        return resolve(item)
    raise ValueError(item)


def _reason(err: BaseException) -> str:
    """The last line of an exception's traceback (what a failing run is scored 0 with)."""
    try:
        return traceback.format_exception_only(type(err), err)[-1].strip()[:300]
    except Exception:  # noqa: BLE001 - a message that cannot be formatted
        return type(err).__name__


def _run_solution(scope: dict) -> None:
    with open("/hpcrl/solution.py") as f:
        source = f.read()
    exec(compile(source, "solution.py", "exec"), scope)


def run(config: dict) -> int:
    """python_tool: the code alone; 0 when it ran to its end."""
    try:
        _run_solution({"__name__": "__main__", "__builtins__": builtins})
    except SystemExit as stop:
        return 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1
    except BaseException:  # noqa: BLE001 - the code's own failure: its traceback is what the model sees
        traceback.print_exc()
        return 1
    return 0


def serve(config: dict) -> int:
    """S: run solution.py, send its top-level names, then answer each request until the tests end."""
    requests, replies = config["requests"], config["replies"]
    objects: list = []

    def handle(value: object) -> list:
        objects.append(value)
        return ["h", len(objects) - 1, type(value).__qualname__[:100]]

    def resolve(item: list) -> object:
        return objects[item[1]]

    scope = {"__name__": "__main__", "__builtins__": builtins}
    try:
        _run_solution(scope)
    except SystemExit as stop:
        _send(replies, ["failed", f"solution.py exited (sys.exit({stop.code!r:.100})) before the tests finished"])
        return 1
    except BaseException as err:  # noqa: BLE001 - the code's own failure: the tests fail with its reason
        traceback.print_exc()
        _send(replies, ["failed", _reason(err)])
        return 1
    _send(replies, ["ready", {name: encode(value, handle) for name, value in scope.items()
                              if type(name) is str and not name.startswith("__")}])
    while True:
        try:
            request = _receive(requests)
        except SolutionEnded:
            return 0  # the tests ended
        _send(replies, _answer(request, resolve, handle))


def _answer(request, resolve, handle) -> list:
    """One request of T's: [op, handle, ...]; the reply ["ok", value] | ["raise", type, message] | ["stop"]."""
    try:
        op, target, args = request[0], resolve(["h", request[1]]), request[2:]
        if op == "call":
            result = target(*[decode(a, resolve) for a in args[0]], **{k: decode(v, resolve) for k, v in args[1]})
        elif op == "getattr":
            result = getattr(target, args[0])
        elif op == "getitem":
            result = target[decode(args[0], resolve)]
        elif op in ("iter", "len", "repr", "str"):
            builtin: Any = {"iter": iter, "len": len, "repr": repr, "str": str}[op]
            result = builtin(target)
        elif op == "next":
            try:
                result = next(target)
            except StopIteration:
                return ["stop"]
        else:
            return ["raise", "TypeError", f"unknown request {op!r}"]
        return ["ok", encode(result, handle)]
    except BaseException as err:  # noqa: BLE001 - the solution's exception, raised again in T
        return ["raise", type(err).__name__[:100], _reason(err).partition(": ")[2]]


class Remote:
    """In T: an object of the solution's, living in S (module docstring)."""

    __slots__ = ("_id", "_kind")

    def __init__(self, ident: int, kind: str):
        self._id, self._kind = ident, kind

    def __call__(self, *args, **kwargs):
        return _ask("call", self, [_encode_arg(a) for a in args], [[k, _encode_arg(v)] for k, v in kwargs.items()])

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _ask("getattr", self, name)

    def __getitem__(self, key):
        return _ask("getitem", self, _encode_arg(key))

    def __iter__(self):
        return _ask("iter", self)

    def __next__(self):
        return _ask("next", self)

    def __len__(self) -> int:
        size = _ask("len", self)
        if type(size) is not int:
            raise TypeError(f"len() of the solution's {self._kind} is not an int")
        return size

    def __repr__(self) -> str:
        text = _ask("repr", self)
        return text if type(text) is str else f"<{self._kind}>"

    def __str__(self) -> str:
        text = _ask("str", self)
        return text if type(text) is str else f"<{self._kind}>"

    def __eq__(self, other) -> bool:
        return type(other) is Remote and other._id == self._id

    def __ne__(self, other) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(("Remote", self._id))

    def __bool__(self) -> bool:
        raise TypeError(f"the solution gave a {self._kind} object where a plain value (bool, int, str, ...) is "
                        "needed")


_FDS: dict = {}


def _encode_arg(value: object) -> list:
    def handle(item: object) -> list:
        if type(item) is Remote:
            return ["h", item._id]
        raise TypeError(f"the tests passed a {type(item).__name__} to the solution: only plain data and the "
                        "solution's own objects cross to it")
    return encode(value, handle)


def _remote(item: list) -> Remote:
    if len(item) != 3 or type(item[1]) is not int or type(item[2]) is not str:
        raise ValueError(item)
    return Remote(item[1], item[2])


def _ask(op: str, target: Remote, *args: object) -> object:
    _send(_FDS["requests"], [op, target._id, *args])
    reply = _receive(_FDS["replies"])
    if type(reply) is list and reply[:1] == ["ok"] and len(reply) == 2:
        return decode(reply[1], _remote)
    if type(reply) is list and reply == ["stop"]:
        raise StopIteration
    if type(reply) is list and len(reply) == 3 and reply[0] == "raise" and all(type(x) is str for x in reply[1:]):
        raise _exception(reply[1], reply[2])
    raise ProtocolError("the solution's process sent a malformed reply")


def _exception(name: str, message: str) -> BaseException:
    kind = getattr(builtins, name, None)
    if isinstance(kind, type) and issubclass(kind, Exception) and not issubclass(kind, StopIteration):
        try:
            return kind(message)
        except Exception:  # noqa: BLE001 - a builtin exception with other arguments (UnicodeDecodeError)
            pass
    return SolutionError(f"{name}: {message}" if message else name)


def test(config: dict) -> int:
    """T: read tests.py, then run it against S's names; the verdict on the verdict pipe alone."""
    with open("/hpcrl/tests.py") as f:
        tests = f.read()
    _FDS.update(requests=config["requests"], replies=config["replies"])
    verdict: dict = {"passed": False}
    try:
        code = compile(tests, "tests.py", "exec")
        first = _receive(config["replies"])
        if type(first) is list and len(first) == 2 and first[0] == "failed" and type(first[1]) is str:
            verdict["reason"] = first[1][:300]
        elif type(first) is list and len(first) == 2 and first[0] == "ready" and type(first[1]) is dict:
            scope = {name: decode(value, _remote) for name, value in first[1].items()}
            scope.update(__name__="__main__", __builtins__=builtins)
            exec(code, scope)
            verdict = {"passed": True}
        else:
            raise ProtocolError("the solution's process sent a malformed first frame")
    except BaseException as err:  # noqa: BLE001 - a failing test: its last line is the reason
        verdict["reason"] = str(err) if isinstance(err, (SolutionEnded, ProtocolError)) else _reason(err)
    os.write(config["verdict"], (json.dumps(verdict) + "\n").encode())
    return 0


def main() -> None:
    mode, config = sys.argv[1], json.loads(sys.argv[2])
    os.write(config["up"], b"up\n")
    os.close(config["up"])
    _limit(config)
    code = {"run": run, "serve": serve, "test": test}[mode](config)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
