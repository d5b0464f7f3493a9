"""The wire format alone (no sockets): what is accepted, and what is dropped under which name."""

from __future__ import annotations

import secrets

import msgpack
import pytest
from bus_helpers import seal_raw

from hpcrl.bus.secret import Secret
from hpcrl.bus.wire import PROTOCOL_VERSION, TRAILER_BYTES, Counters, Kind, Opener, Sealer

A, B = b"A" * 16, b"B" * 16


def pair(secret=None, *, max_bytes=1 << 20, max_frames=8):
    secret = secret or Secret(secrets.token_bytes(32))
    counters = Counters()
    return Sealer(secret, A), Opener(secret, me=B, counters=counters, max_bytes=max_bytes,
                                     max_frames=max_frames), counters


def test_sealed_message_opens_with_its_header_and_untouched_buffers():
    sealer, opener, counters = pair()
    blob = bytes(range(256)) * 100
    env = opener.open(sealer.seal(Kind.REQUEST, {"ep": "x", "a": [1, 2]}, to=B, buffers=[blob, memoryview(b"xy")]))
    assert env.kind == Kind.REQUEST and env.body == {"ep": "x", "a": [1, 2]} and env.sender == A
    assert [bytes(b) for b in env.buffers] == [blob, b"xy"]
    assert counters.snapshot()["dropped"] == 0


def test_message_signed_with_a_wrong_secret_is_rejected():
    sealer, _, _ = pair()
    _, opener, counters = pair()  # another secret
    assert opener.open(sealer.seal(Kind.HEARTBEAT, to=B)) is None
    assert counters.snapshot()["bad_mac"] == 1


def test_replayed_message_is_dropped_and_counted():
    sealer, opener, counters = pair()
    first, second = sealer.seal(Kind.HEARTBEAT, to=B), sealer.seal(Kind.HEARTBEAT, to=B)
    assert opener.open(second) is not None
    assert opener.open(second) is None and opener.open(first) is None  # same, and older
    assert counters.snapshot()["replay"] == 2


def with_version(frame: bytes, version: int) -> bytes:
    damaged = bytearray(frame)
    damaged[-TRAILER_BYTES] = version
    return bytes(damaged)


def test_every_kind_of_damage_has_its_own_counter():
    sealer, opener, counters = pair(max_bytes=2048, max_frames=4)
    good = sealer.seal(Kind.REQUEST, {"a": 1}, to=B, buffers=[b"payload"])
    assert len(good) == 2 and bytes(good[1]) == b"payload"  # the trailer ends the header frame
    flipped = [bytearray(f) for f in good]
    flipped[1][0] ^= 1
    cases = {
        "truncated": [good[0][:TRAILER_BYTES]],  # no room for a header before the trailer
        "empty": [],
        "too_large": [good[0], b"x" * 4096],
        "too_many_frames": [good[0], b"", b"", b"", good[-1]],
        "version": [with_version(good[0], 9), good[1]],
        "bad_mac": [bytes(f) for f in flipped],
        "dropped_buffer": [good[0]],
    }
    for name, frames in cases.items():
        assert opener.open(frames) is None, name
    snap = counters.snapshot()
    assert snap["truncated"] == 2 and snap["too_large"] == 2 and snap["version"] == 1 and snap["bad_mac"] == 2
    assert snap["accepted"] == 0 and snap["dropped"] == len(cases)


def test_header_only_message_is_one_frame_and_an_older_version_is_refused():
    sealer, opener, counters = pair()
    frames = sealer.seal(Kind.HEARTBEAT, to=B)
    assert len(frames) == 1 and frames[0][-TRAILER_BYTES] == PROTOCOL_VERSION
    secret = Secret(secrets.token_bytes(32))
    _, opener, counters = pair(secret)
    old = seal_raw(secret.key, msgpack.packb([3, 1, A, B, None]), version=PROTOCOL_VERSION - 1)
    assert opener.open(old) is None and counters.snapshot()["version"] == 1


def test_message_for_another_receiver_is_dropped():
    secret = Secret(secrets.token_bytes(32))
    sealer, opener, counters = pair(secret)
    assert opener.open(sealer.seal(Kind.HEARTBEAT, to=b"C" * 16)) is None
    assert opener.open(sealer.seal(Kind.HEARTBEAT, to=b"")) is None  # only REGISTER may omit it
    assert opener.open(sealer.seal(Kind.REGISTER, {}, to=b"")) is not None
    assert counters.snapshot()["misaddressed"] == 2


def test_authentic_but_malformed_header_is_dropped_not_deserialized_further():
    secret = Secret(secrets.token_bytes(32))
    _, opener, counters = pair(secret)
    for header in (b"\xc1", msgpack.packb([1, 2, 3]), msgpack.packb([1, 1, A, B, msgpack.ExtType(5, b"x")]),
                   msgpack.packb([99, 1, A, B, None]), msgpack.packb([3, -1, A, B, None])):
        assert opener.open(seal_raw(secret.key, header)) is None
    assert counters.snapshot()["malformed"] == 5


def test_sending_an_unserializable_body_raises_type_error_before_anything_is_sent():
    sealer, _, _ = pair()
    with pytest.raises(TypeError):
        sealer.seal(Kind.REPLY, {"x": object()}, to=B)
