"""The wire format of the control bus: seal and open authenticated multipart messages.

Pure (no sockets): the transport hands frames in and out. One message is

    [header + trailer, buffer_0, ..., buffer_n]

    header   msgpack array [kind, seq, sender, to, body]
             kind    `Kind` (int); seq: the sender's sequence number, strictly increasing
             sender  the sending process's incarnation id (16 random bytes, new per process)
             to      the receiver's incarnation id (b"" only on REGISTER, before it is known)
             body    a msgpack value, by kind (see head.py / worker.py)
    trailer  the last 33 bytes of the first frame: 1 byte protocol version + 32 bytes
             HMAC-SHA256(secret, "hpcrl-bus" | version | frame count | for the header and each
             buffer: its 8-byte length and its bytes)
    buffer_i raw bytes (small tensors/arrays), sent without copying, never deserialized here

Most messages are that one frame (a header-only message costs one ZeroMQ frame each way, which
is most of a small call's cost). The MAC covers every frame and the frame boundaries, so a frame
cannot be altered, dropped, added or moved. `Opener.open` checks, in this order and before
deserializing anything: frame count and total size (`too_large`), trailer length, version, MAC; only then
unpacks the header (no ext types, no pickle), checks its shape, the addressee, and that seq is
above the last one seen from that sender (replays). Anything else is dropped and counted in
`Counters` by reason.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import msgpack

from hpcrl.bus.secret import Secret

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 2  # 2: the trailer ends the header frame (1: it was a frame of its own)
MAC_BYTES = 32
TRAILER_BYTES = 1 + MAC_BYTES
INCARNATION_BYTES = 16
_DOMAIN = b"hpcrl-bus"
_VERSION_BYTE = bytes([PROTOCOL_VERSION])
#: Frames up to this many bytes are MAC'd in one update with their length (a copy cheaper than a call).
_JOIN_BELOW = 4096

#: Reasons a message is dropped at the wire level.
WIRE_DROPS = ("truncated", "too_large", "version", "bad_mac", "malformed", "replay", "misaddressed")


class Kind(IntEnum):
    REGISTER = 1   # worker -> head: PeerInfo + endpoints
    WELCOME = 2    # head -> worker: registration accepted, heartbeat settings
    HEARTBEAT = 3  # both ways
    REQUEST = 4    # head -> worker: call an endpoint
    REPLY = 5      # worker -> head: result or error of a request
    BYE = 6        # either way: I am leaving (with my exit code) / you must leave (with this code)
    READY = 7      # worker -> head: I serve these endpoints now (after a REGISTER that said not ready)


_KINDS = {int(k): k for k in Kind}


@dataclass(frozen=True, kw_only=True)
class Payload:
    """A value plus raw buffers (bytes-like: bytes, memoryview, numpy/torch CPU arrays)."""

    value: Any = None
    buffers: tuple = ()


@dataclass(kw_only=True, slots=True)  # not frozen: a frozen __init__ costs microseconds per message
class Envelope:
    """One opened, authenticated message."""

    kind: Kind
    seq: int
    sender: bytes
    to: bytes
    body: Any
    buffers: tuple[memoryview, ...] = ()


class Counters:
    """How many messages were accepted, and dropped by reason. `snapshot()` for a copy."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = dict.fromkeys(("accepted", *WIRE_DROPS), 0)

    def accept(self) -> None:
        self._counts["accepted"] += 1

    def drop(self, reason: str, detail: str = "") -> None:
        self._counts[reason] = self._counts.get(reason, 0) + 1
        log.debug("bus: dropped a message (%s) %s", reason, detail)

    def count(self, name: str) -> None:
        """Count an event that is not a drop (late replies, failed sends)."""
        self._counts[name] = self._counts.get(name, 0) + 1

    @property
    def dropped(self) -> int:
        return sum(self.refused().values())

    def refused(self) -> dict[str, int]:
        """Dropped messages by reason, only the reasons seen (wire reasons and the head's drop_*)."""
        return {k: v for k, v in self._counts.items() if v and (k in WIRE_DROPS or k.startswith("drop_"))}

    def snapshot(self) -> dict[str, int]:
        snap = dict(self._counts)
        snap["dropped"] = self.dropped
        return snap


def _as_bytes_view(buf: Any) -> memoryview:
    view = memoryview(buf)
    if not view.contiguous:
        raise ValueError("bus buffers must be contiguous (call .contiguous() / np.ascontiguousarray)")
    return view.cast("B") if (view.format != "B" or view.ndim != 1) else view


_openssl_hmac_new: Callable[..., Any] | None
try:
    from _hashlib import hmac_new as _openssl_hmac_new
except ImportError:  # a Python built without OpenSSL's HMAC: the standard wrapper does the same
    _openssl_hmac_new = None


def _keyed_hmac(key: bytes, msg: bytes) -> Any:
    """An HMAC-SHA256 state keyed with `key` that has absorbed `msg` (copy(), update(), digest()).

    OpenSSL's HMAC object straight from `_hashlib` when this Python has it: the same state that
    `hmac.new` wraps, without the Python-level wrapper's cost on every copy/update/digest."""
    if _openssl_hmac_new is not None:
        return _openssl_hmac_new(key, msg, digestmod="sha256")
    return hmac.new(key, msg, hashlib.sha256)


class _Mac:
    """HMAC over the frames (each bytes or a flat byte view, so len() counts bytes) for one key:
    the keyed HMAC state is computed once and copied per message."""

    def __init__(self, key: bytes, version: bytes = _VERSION_BYTE) -> None:
        self._keyed = _keyed_hmac(key, _DOMAIN + version)
        self._by_count: dict[int, Any] = {}

    def digest(self, frames: Sequence[Any], count: int) -> bytes:
        base = self._by_count.get(count)
        if base is None:
            base = self._keyed.copy()
            base.update(count.to_bytes(4, "big"))
            if len(self._by_count) < 256:  # counts are bounded by max_frames; keep the cache so too
                self._by_count[count] = base
        mac = base.copy()
        for frame in frames:
            if len(frame) <= _JOIN_BELOW:  # one update of a short copy costs less than two
                mac.update(len(frame).to_bytes(8, "big") + frame)
            else:  # buffers are fed as they are, never copied
                mac.update(len(frame).to_bytes(8, "big"))
                mac.update(frame)
        return mac.digest()


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack ext type {code} is not allowed on the bus")


class Sealer:
    """Signs outgoing messages of one process; owns its incarnation id and sequence counter."""

    def __init__(self, secret: Secret, incarnation: bytes, *, last_seq: int = 0) -> None:
        """`last_seq`: the next message gets last_seq + 1 (a process speaking for another, after
        it, starts above anything that one can have sent: see hpcrl.bus.farewell)."""
        if len(incarnation) != INCARNATION_BYTES:
            raise ValueError(f"an incarnation id is {INCARNATION_BYTES} bytes")
        self._mac = _Mac(secret.key)
        self._pack = msgpack.Packer(use_bin_type=True).pack  # reused: cheaper than packb
        self.incarnation = incarnation
        self._seq = last_seq

    def __repr__(self) -> str:
        return f"Sealer(incarnation={self.incarnation.hex()}, seq={self._seq})"

    def seal(self, kind: Kind, body: Any = None, *, to: bytes = b"", buffers: Iterable[Any] = ()) -> list:
        self._seq += 1
        header = self._pack([int(kind), self._seq, self.incarnation, to, body])
        if not buffers:  # most messages: one frame
            return [header + _VERSION_BYTE + self._mac.digest((header,), 1)]
        views = [_as_bytes_view(b) for b in buffers]
        return [header + _VERSION_BYTE + self._mac.digest([header, *views], 1 + len(views)), *views]


class Opener:
    """Authenticates incoming messages for one receiver (`me`: its incarnation id)."""

    def __init__(self, secret: Secret, *, me: bytes, counters: Counters, max_bytes: int, max_frames: int) -> None:
        self._mac = _Mac(secret.key)
        self.me = me
        self.counters = counters
        self.max_bytes = max_bytes
        self.max_frames = max_frames
        self._last_seq: dict[bytes, int] = {}

    def __repr__(self) -> str:
        return f"Opener(me={self.me.hex()}, senders={len(self._last_seq)})"

    def open(self, frames: list, max_bytes: int | None = None) -> Envelope | None:
        """The authenticated message, or None (counted by reason). `max_bytes`: a tighter size limit
        for this message than the opener's own (the head's, for connections of no registered peer)."""
        drop = self.counters.drop
        if not frames:
            return drop("truncated", "no frames")
        if len(frames) > self.max_frames:
            return drop("too_large", f"{len(frames)} frames")
        # Frames are bytes or flat byte memoryviews (as the channel delivers them): len() is bytes.
        total = 0
        for frame in frames:
            total += len(frame)
        if total > (self.max_bytes if max_bytes is None else max_bytes):
            return drop("too_large", f"{total} bytes")
        first = frames[0]
        if len(first) <= TRAILER_BYTES:
            return drop("truncated", f"first frame of {len(first)} bytes, no room for a header and a trailer")
        version = first[-TRAILER_BYTES]
        if version != PROTOCOL_VERSION:
            return drop("version", f"version {version}, we speak {PROTOCOL_VERSION}")
        header = first[:-TRAILER_BYTES]
        body_frames = [header, *frames[1:]] if len(frames) > 1 else (header,)
        if not hmac.compare_digest(self._mac.digest(body_frames, len(body_frames)), first[1 - TRAILER_BYTES:]):
            return drop("bad_mac")
        try:
            header = msgpack.unpackb(header, raw=False, strict_map_key=False, ext_hook=_no_ext)
        except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as exc:
            return drop("malformed", f"header does not unpack: {exc}")
        if not (isinstance(header, list) and len(header) == 5):
            return drop("malformed", "header is not a 5-element array")
        kind, seq, sender, to, body = header
        if not (isinstance(kind, int) and kind in _KINDS and isinstance(seq, int)
                and seq > 0 and isinstance(sender, bytes) and len(sender) == INCARNATION_BYTES
                and isinstance(to, bytes)):
            return drop("malformed", "header fields of the wrong type")
        if to != self.me and not (to == b"" and kind == Kind.REGISTER):
            return drop("misaddressed", f"to {to.hex()}")
        if seq <= self._last_seq.get(sender, 0):
            return drop("replay", f"seq {seq} from {sender.hex()}")
        self._last_seq[sender] = seq
        return Envelope(kind=_KINDS[kind], seq=seq, sender=sender, to=to, body=body,
                        buffers=tuple(frames[1:]))
