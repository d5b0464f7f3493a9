"""The report protocol between group processes and the head: TCP, one JSON object per line.

A stand-in for the ZeroMQ bus (hpcrl.bus), kept in this one module so it can be swapped:

    task -> head   {"v": 1, "type": "hello", "identity": {group, replica, rank, node, ...}, "pid": N}
    head -> task   {"v": 1, "type": "exit", "code": C}     when the head wants the task to end
    task -> head   {"v": 1, "type": "bye", "code": C}      the code the task is about to exit with

The head (ReportServer) is single-threaded: `poll()` returns events from every connection.
A task (report_and_wait) blocks until the head says how to exit; if the head goes away the
connection closes and the task exits with HEAD_LOST. Nothing here is pickle; lines longer than
MAX_LINE are refused.
"""

from __future__ import annotations

import json
import selectors
import socket
from dataclasses import dataclass, field
from typing import Any

from hpcrl.errors import HpcrlError

VERSION = 1
MAX_LINE = 64 * 1024
#: Exit code of a task whose head went away before telling it how to exit.
HEAD_LOST = 75


class ReportError(HpcrlError):
    """A peer broke the report protocol (bad line, wrong version, unknown message)."""


def encode(message: dict[str, Any]) -> bytes:
    return (json.dumps({"v": VERSION, **message}, separators=(",", ":")) + "\n").encode()


def decode(line: bytes, peer: str) -> dict[str, Any]:
    try:
        message = json.loads(line)
    except ValueError as err:
        raise ReportError(f"{peer} sent a line that is not JSON ({err}): {line[:120]!r}") from None
    if not isinstance(message, dict) or message.get("v") != VERSION or "type" not in message:
        raise ReportError(f"{peer} sent {line[:120]!r}: expected a report message of version {VERSION}")
    return message


@dataclass
class _Conn:
    sock: socket.socket
    peer: str
    buffer: bytes = b""


@dataclass(frozen=True)
class Event:
    """Something a task did: kind is "message" (with `message`), "closed" or "error" (with `error`)."""

    kind: str
    conn: int
    peer: str
    message: dict[str, Any] = field(default_factory=dict)
    error: str = ""


class ReportServer:
    """The head's end: listens on an ephemeral port (held from bind to close, so no race)."""

    def __init__(self, advertise_host: str, bind_host: str = "0.0.0.0") -> None:
        self._listener = socket.create_server((bind_host, 0), backlog=256)
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._conns: dict[int, _Conn] = {}
        self.address = f"{advertise_host}:{self._listener.getsockname()[1]}"

    def poll(self, timeout: float) -> list[Event]:
        events: list[Event] = []
        for key, _ in self._selector.select(timeout):
            if key.data is None:
                sock, addr = self._listener.accept()
                sock.setblocking(False)
                self._conns[sock.fileno()] = _Conn(sock, f"{addr[0]}:{addr[1]}")
                self._selector.register(sock, selectors.EVENT_READ, sock.fileno())
                continue
            events += self._read(key.data)
        return events

    def _read(self, conn_id: int) -> list[Event]:
        conn = self._conns[conn_id]
        try:
            data = conn.sock.recv(65536)
        except (ConnectionResetError, TimeoutError):
            data = b""
        if not data:
            self._drop(conn_id)
            return [Event("closed", conn_id, conn.peer)]
        conn.buffer += data
        events = []
        while b"\n" in conn.buffer:
            line, conn.buffer = conn.buffer.split(b"\n", 1)
            try:
                events.append(Event("message", conn_id, conn.peer, message=decode(line, conn.peer)))
            except ReportError as err:
                self._drop(conn_id)
                return events + [Event("error", conn_id, conn.peer, error=str(err))]
        if len(conn.buffer) > MAX_LINE:
            self._drop(conn_id)
            events.append(Event("error", conn_id, conn.peer, error=f"{conn.peer} sent a line over {MAX_LINE} bytes"))
        return events

    def send(self, conn_id: int, message: dict[str, Any]) -> None:
        conn = self._conns.get(conn_id)
        if conn is None:
            return  # the task is already gone; its step's exit code tells the rest
        conn.sock.setblocking(True)
        try:
            conn.sock.sendall(encode(message))
        except OSError:
            pass  # same: a closed peer shows up as a "closed" event or in its exit code
        finally:
            conn.sock.setblocking(False)

    def _drop(self, conn_id: int) -> None:
        conn = self._conns.pop(conn_id, None)
        if conn is not None:
            self._selector.unregister(conn.sock)
            conn.sock.close()

    def close(self) -> None:
        for conn_id in list(self._conns):
            self._drop(conn_id)
        self._selector.close()
        self._listener.close()


def _read_line(sock: socket.socket, buffer: bytearray) -> bytes | None:
    while b"\n" not in buffer:
        chunk = sock.recv(4096)
        if not chunk:
            return None
        buffer += chunk
        if len(buffer) > MAX_LINE:
            raise ReportError(f"the head sent a line over {MAX_LINE} bytes")
    line, _, rest = bytes(buffer).partition(b"\n")
    buffer[:] = rest
    return line


class ReportClient:
    """A task's end of the protocol: hello on connect, then wait for the exit word, then bye.

    A task that works while it waits (the RL roles) calls `wait_exit()` from a thread.
    """

    def __init__(self, address: str, identity: dict[str, Any], *, pid: int, connect_timeout_s: float = 60.0) -> None:
        self.address = address
        host, _, port = address.rpartition(":")
        try:
            self._sock = socket.create_connection((host, int(port)), timeout=connect_timeout_s)
        except OSError as err:
            raise ReportError(f"cannot reach the head at {address}: {err}") from None
        self._sock.settimeout(None)
        self._sock.sendall(encode({"type": "hello", "identity": identity, "pid": pid}))
        self._buffer = bytearray()

    def wait_exit(self) -> int | None:
        """The code the head says to exit with; None when the head went away first."""
        try:
            line = _read_line(self._sock, self._buffer)
        except OSError:
            return None
        if line is None:
            return None
        message = decode(line, f"head {self.address}")
        if message["type"] == "exit":
            return int(message["code"])
        raise ReportError(f"head {self.address} sent unknown message type {message['type']!r}")

    def bye(self, code: int) -> None:
        """Tell the head the code this task exits with (ignored when the head is gone)."""
        try:
            self._sock.sendall(encode({"type": "bye", "code": code}))
        except OSError:
            pass

    def close(self) -> None:
        self._sock.close()


def report_and_wait(address: str, identity: dict[str, Any], *, pid: int,
                    connect_timeout_s: float = 60.0, given_code: int | None = None) -> int:
    """Say hello to the head, wait for its exit instruction, say bye; return the exit code.

    `given_code`, when set, is the code the task exits with whatever the head says.
    """
    client = ReportClient(address, identity, pid=pid, connect_timeout_s=connect_timeout_s)
    try:
        said = client.wait_exit()
        if said is None:
            return HEAD_LOST if given_code is None else given_code
        code = said if given_code is None else given_code
        client.bye(code)
        return code
    finally:
        client.close()
