"""A client that floods a head's bus port with junk, as anyone who can reach the port could.

    python tests/bus/flood_proc.py ADDRESS --big-mib 12 --burst 100 --rate 20 [--max-gib 3] [--token-of RUN_DIR]
    python tests/bus/flood_proc.py ADDRESS --multipart 300 --big-mib 1 [--token-of RUN_DIR]

It knows no secret. With --token-of it presents the run's PLAIN token (hpcrl.bus.zap), as a sniffer
of the network could (the token crosses in clear); without, its connection is refused at the
handshake. --multipart N: one message of N frames of --big-mib MiB (libzmq assembles a message
whole before the head sees it), again on a new connection after each handshake (libzmq does not
retry a refused one), printing "handshake failed" or "handshake passed" each time; once admitted,
it stays connected.
 First a burst: --burst frames of --big-mib MiB as fast as the head takes them
(blocking sends: the head's libzmq stops reading a connection whose queue is full). Then rounds,
--rate per second: one frame of --big-mib MiB, eight frames of 4 KiB, eight of 10 bytes, and a
message of three 1 KiB frames. The big and 4 KiB frames carry the protocol's version byte, so that
only the MAC can refuse them. Prints "flooding" after the burst; stops sending (but stays connected) after
--max-gib GiB, so a head without limits cannot take the machine's memory.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("address")
    ap.add_argument("--big-mib", type=float, default=12.0)
    ap.add_argument("--burst", type=int, default=100)
    ap.add_argument("--rate", type=float, default=20.0)
    ap.add_argument("--max-gib", type=float, default=3.0)
    ap.add_argument("--multipart", type=int, default=0)
    ap.add_argument("--token-of", default="")
    opts = ap.parse_args()

    import zmq

    if opts.multipart:
        return multipart(opts)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 4)
    if opts.token_of:
        _present_token(sock, opts.token_of)
    sock.connect(opts.address)
    from hpcrl.bus.wire import PROTOCOL_VERSION, TRAILER_BYTES

    def junk(size: int) -> bytes:
        """Random bytes with the protocol's version byte in place: only the MAC can refuse them."""
        frame = bytearray(os.urandom(size))
        frame[-TRAILER_BYTES] = PROTOCOL_VERSION
        return bytes(frame)

    big, small = junk(int(opts.big_mib * (1 << 20))), junk(4096)
    pieces = [os.urandom(1024) for _ in range(3)]
    sent, limit, rounds = 0, opts.max_gib * (1 << 30), 0
    for _ in range(opts.burst):
        sock.send(big, copy=False)
        sent += len(big)
    print("flooding", flush=True)
    started = time.monotonic()
    while sent < limit:
        if opts.rate > 0:  # 0: as fast as the head reads
            time.sleep(max(0.0, started + rounds / opts.rate - time.monotonic()))
        sock.send(big, copy=False)
        for _ in range(8):
            sock.send(small)
            sock.send(b"0123456789")
        sock.send_multipart(pieces)
        sent += len(big) + 8 * (len(small) + 10) + 3 * 1024
        rounds += 1
    print(f"sent {sent} bytes in {rounds} rounds", flush=True)
    time.sleep(3600)
    return 0


def _present_token(sock, run_dir: str) -> None:
    from hpcrl.bus.secret import load_secret
    from hpcrl.bus.zap import as_client
    as_client(sock, load_secret(run_dir))


def multipart(opts: argparse.Namespace) -> int:
    """--multipart rounds: each a new connection with the message queued before its handshake ends."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    frames = [os.urandom(int(opts.big_mib * (1 << 20)))] * opts.multipart
    failed = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    print("flooding", flush=True)
    while True:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if opts.token_of:
            _present_token(sock, opts.token_of)
        monitor = sock.get_monitor_socket(failed | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sock.connect(opts.address)  # the pipe exists from here until a refused handshake drops it
        try:
            sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:  # refused before the message was queued: not a round
            queued = False
        else:
            queued = True
        event = recv_monitor_message(monitor)["event"]
        if queued:
            print("handshake failed" if event & failed else "handshake passed", flush=True)
        if not event & failed:  # admitted (the run's token): stay connected while the message goes
            time.sleep(3600)
        sock.disable_monitor()
        monitor.close()
        sock.close()


if __name__ == "__main__":
    sys.exit(main())
