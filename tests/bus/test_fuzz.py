"""Fuzz: thousands of malformed, forged, replayed, too large and misaddressed messages thrown
on raw ZeroMQ sockets at a live head and at a live worker. Neither crashes, none is accepted
(every one is dropped and counted under a reason), and both still serve genuine calls after.

The attacker also holds captured genuine traffic (messages once delivered, signed with the
run's secret) to replay and to mutate, which is the strongest position short of the secret.
"""

from __future__ import annotations

import secrets
import time

import msgpack
import pytest
import zmq
from bus_helpers import RUN_ID, LoopThread, echo_worker, fast_config, seal_raw
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpcrl.bus import PeerInfo, Router
from hpcrl.bus.router import routing_id
from hpcrl.bus.secret import Secret
from hpcrl.bus.wire import PROTOCOL_VERSION, TRAILER_BYTES, Counters, Kind, Opener, Sealer
from hpcrl.bus.zap import as_client, guard

MAX_BYTES, MAX_FRAMES = 4096, 8
PER_EXAMPLE, EXAMPLES = 60, 100  # 6,000 messages at each of the two targets

values = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.text(max_size=12), st.binary(max_size=12))
bodies = st.dictionaries(st.text(max_size=6), values, max_size=4) | values
seeds = st.integers(0, 2**31)
attacks = st.one_of(
    st.tuples(st.just("garbage"), st.lists(st.binary(max_size=120), min_size=1, max_size=6)),
    st.tuples(st.just("forged"), st.sampled_from(list(Kind)), bodies, st.binary(min_size=32, max_size=32)),
    st.tuples(st.just("flip"), st.sampled_from(list(Kind)), bodies, seeds, seeds, st.integers(1, 255)),
    st.tuples(st.just("drop_frame"), st.sampled_from(list(Kind)), bodies, seeds),
    st.tuples(st.just("dup_frame"), st.sampled_from(list(Kind)), bodies, seeds),
    st.tuples(st.just("truncate"), st.sampled_from(list(Kind)), bodies, st.integers(0, TRAILER_BYTES)),
    st.tuples(st.just("version"), st.integers(0, 255).filter(lambda v: v != PROTOCOL_VERSION), st.booleans()),
    st.tuples(st.just("too_large"), st.integers(MAX_BYTES, 3 * MAX_BYTES), st.booleans()),
    st.tuples(st.just("replay"), seeds, st.booleans()),
    st.tuples(st.just("bad_header"), st.binary(max_size=80)),
    st.tuples(st.just("bad_kind"), st.one_of(st.integers(-3, 0), st.integers(max(Kind) + 1, 300)), bodies),
    st.tuples(st.just("misaddressed"), st.sampled_from(list(Kind)), st.binary(min_size=16, max_size=16)),
)


class Attacker:
    """Turns attack descriptions into frames. `genuine` signs as a real peer (for mutations and
    replays); `captured` holds genuine messages already delivered; `me` is the target's id."""

    def __init__(self, secret: Secret, genuine: Sealer, captured: list[list[bytes]], me: bytes) -> None:
        self.secret, self.genuine, self.captured, self.me = secret, genuine, captured, me

    def frames(self, attack) -> list[bytes]:
        name, *args = attack
        return getattr(self, name)(*args)

    def _fresh(self, kind, body):
        return [bytes(f) for f in self.genuine.seal(kind, body, to=self.me, buffers=[b"buf", b"fer"])]

    def _signed(self, header: bytes, version: int = PROTOCOL_VERSION) -> list[bytes]:
        return seal_raw(self.secret.key, header, version=version)

    def garbage(self, frames):
        return frames

    def forged(self, kind, body, key):
        return [bytes(f) for f in Sealer(Secret(key), secrets.token_bytes(16)).seal(kind, body, to=self.me)]

    def flip(self, kind, body, frame_seed, byte_seed, xor):
        frames = self._fresh(kind, body)
        i = frame_seed % len(frames)
        f = bytearray(frames[i])
        f[byte_seed % len(f)] ^= xor
        frames[i] = bytes(f)
        return frames

    def drop_frame(self, kind, body, seed):
        frames = self._fresh(kind, body)
        del frames[seed % len(frames)]
        return frames

    def dup_frame(self, kind, body, seed):
        frames = self._fresh(kind, body)
        i = seed % len(frames)
        return frames[:i] + [frames[i]] + frames[i:]

    def truncate(self, kind, body, keep):
        frames = self._fresh(kind, body)  # the header frame cut to no more than a trailer's length
        return [frames[0][:keep], *frames[1:]]

    def version(self, version, resign):
        frames = self._fresh(Kind.HEARTBEAT, None)
        if resign:  # authentic, but of another protocol version
            return self._signed(frames[0][:-TRAILER_BYTES], version)
        damaged = bytearray(frames[0])
        damaged[-TRAILER_BYTES] = version
        return [bytes(damaged), *frames[1:]]

    def too_large(self, size, by_frames):
        if by_frames:
            return [bytes(f) for f in self.genuine.seal(Kind.HEARTBEAT, None, to=self.me, buffers=[b"x"] * MAX_FRAMES)]
        # Frames under the limit that add up to more: a frame above it would close the connection in
        # libzmq (ZMQ_MAXMSGSIZE) before the bus could count it.
        return [bytes(f) for f in self.genuine.seal(Kind.REQUEST, None, to=self.me, buffers=[b"x" * (size // 4 + 1)] * 4)]

    def replay(self, seed, _):
        return self.captured[seed % len(self.captured)]

    def bad_header(self, header):
        return self._signed(header)

    def bad_kind(self, kind, body):
        return self._signed(msgpack.packb([kind, 2**50, self.genuine.incarnation, self.me, body]))

    def misaddressed(self, kind, to):
        return [bytes(f) for f in self.genuine.seal(kind, {"x": 1}, to=to if to != self.me else b"x" * 16)]


def dropped(counters: dict) -> int:
    return counters["dropped"]


def wait_until(check, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def throw(attacker: Attacker, send, counters, sent: list[int]):
    """The hypothesis test body: throw one batch, wait until all of it is dropped."""
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.lists(attacks, min_size=PER_EXAMPLE, max_size=PER_EXAMPLE))
    def batch(batch_attacks):
        before = counters()
        for attack in batch_attacks:
            send(attacker.frames(attack))
        sent[0] += len(batch_attacks)
        wait_until(lambda: dropped(counters()) - dropped(before) >= len(batch_attacks), "messages went missing")
        after = counters()
        assert after["accepted"] == before["accepted"], (before, after)
        assert dropped(after) - dropped(before) == len(batch_attacks)
    batch()


@pytest.mark.timeout(120)
def test_head_drops_every_malformed_forged_and_replayed_frame_and_keeps_serving(secret, short_dir):
    thread = LoopThread()
    ctx = zmq.Context.instance()
    socks = []
    try:
        head = Router(run_id=RUN_ID, secret=secret, address=f"ipc://{short_dir}/fuzz-head",
                    config=fast_config(heartbeat_interval=1.0, heartbeat_timeout=60.0,
                                       max_message_bytes=MAX_BYTES, max_frames=MAX_FRAMES))
        thread.call(head.start())
        # A genuine peer whose traffic the attacker captured: it registers and heartbeats.
        genuine = Sealer(secret, secrets.token_bytes(16))
        peer_sock = ctx.socket(zmq.DEALER)
        peer_sock.setsockopt(zmq.ROUTING_ID, routing_id(genuine.incarnation))
        attacker_sock = ctx.socket(zmq.DEALER)
        socks += [peer_sock, attacker_sock]
        for s in socks:
            s.setsockopt(zmq.LINGER, 0)
            as_client(s, secret)  # the attacker sniffed the PLAIN token (it crosses in clear), not the secret
            s.connect(head.address)
        info = PeerInfo(run_id=RUN_ID, group="captured", replica=0)
        captured = [[bytes(f) for f in genuine.seal(Kind.REGISTER, {"peer": info.to_wire(), "t": time.time(),
                                                                    "endpoints": {}, "ready": True})]]
        peer_sock.send_multipart(captured[0])
        wait_until(lambda: head.is_healthy("captured/0/0"), "the genuine peer did not register")
        for _ in range(20):
            captured.append([bytes(f) for f in genuine.seal(Kind.HEARTBEAT, None, to=head.incarnation)])
            peer_sock.send_multipart(captured[-1])
        wait_until(lambda: head.counters()["accepted"] == 21, "genuine heartbeats were not accepted")

        attacker = Attacker(secret, genuine, captured, head.incarnation)
        turn = [0]

        def send(frames):  # alternate: the genuine peer's own connection, and a stranger's
            turn[0] += 1
            (peer_sock if turn[0] % 2 else attacker_sock).send_multipart(frames)

        sent = [0]
        throw(attacker, send, head.counters, sent)
        counters = head.counters()
        assert sent[0] >= 5000 and counters["accepted"] == 21
        assert counters["dropped"] == sent[0]
        assert {k for k, v in counters.items() if v} >= {"truncated", "too_large", "version", "bad_mac",
                                                         "malformed", "replay", "misaddressed"}
        # Still alive and serving genuine workers.
        assert thread.is_alive()
        worker = echo_worker(secret, head.address)
        serving = thread.spawn(worker.serve())

        async def call():
            await head.wait_for_peers("inf", 1, timeout=10)
            return await head.request("inf/0/0", "echo", "after the storm", timeout=5)
        assert thread.call(call())["args"] == "after the storm"
        thread.loop.call_soon_threadsafe(worker.stop)
        serving.result(5)
        thread.call(head.close())
    finally:
        for s in socks:
            s.close(linger=0)
        thread.close()


@pytest.mark.timeout(120)
def test_worker_drops_every_malformed_forged_and_replayed_frame_and_keeps_serving(secret, short_dir):
    thread = LoopThread()
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)  # plays the head, with the run's secret
    router.setsockopt(zmq.LINGER, 0)
    gate = guard(router, secret)  # workers present the run's PLAIN token
    address = f"ipc://{short_dir}/fuzz-worker"
    router.bind(address)
    try:
        worker = echo_worker(secret, address, config=fast_config(max_message_bytes=MAX_BYTES, max_frames=MAX_FRAMES))
        serving = thread.spawn(worker.serve())
        head = Sealer(secret, secrets.token_bytes(16))
        opener = Opener(secret, me=head.incarnation, counters=Counters(), max_bytes=1 << 20, max_frames=8)
        assert router.poll(10_000), "the worker did not register"
        identity, *frames = router.recv_multipart()
        registration = opener.open(frames)
        assert registration.kind == Kind.REGISTER and registration.body["peer"]["group"] == "inf"
        me = registration.sender

        def deliver(frames):
            router.send_multipart([identity, *frames])

        captured = [[bytes(f) for f in head.seal(Kind.WELCOME, {"hb": 1.0, "hbt": 60.0}, to=me)]]
        deliver(captured[0])
        for _ in range(20):
            captured.append([bytes(f) for f in head.seal(Kind.HEARTBEAT, None, to=me)])
            deliver(captured[-1])
        wait_until(lambda: worker.counters()["accepted"] == 21, "genuine head messages were not accepted")

        sent = [0]
        throw(Attacker(secret, head, captured, me), deliver, worker.counters, sent)
        counters = worker.counters()
        assert sent[0] >= 5000 and counters["accepted"] == 21 and counters["dropped"] == sent[0]
        assert not serving.done(), "the worker stopped serving"
        # Still serving genuine requests.
        deliver([bytes(f) for f in head.seal(Kind.REQUEST, {"id": 1, "ep": "echo", "a": "still here", "ttl": 5.0}, to=me)])
        while True:
            assert router.poll(5_000), "no reply from the worker"
            _, *frames = router.recv_multipart()
            reply = opener.open(frames)
            if reply is not None and reply.kind == Kind.REPLY:
                break
        assert reply.body["ok"] and reply.body["r"]["args"] == "still here"
        deliver([bytes(f) for f in head.seal(Kind.BYE, {"reason": "test over"}, to=me)])
        assert serving.result(5).name == "SHUTDOWN"
    finally:
        router.close(linger=0)
        gate.release()
        thread.close()
