"""A task's exit code to the head, sent after the task ended by the process that outlived it.

    link = FarewellLink()                  # before fork: shared by the task and its supervisor
    ... task:        Worker(..., incarnation=link.incarnation); link.welcomed(worker.head_incarnation)
    ... supervisor:  send_farewell(link, address=..., secret=..., code=task's exit status, reason=...)

A group task runs under a supervisor process (hpcrl.roles.reaper) that waits for it. Whatever ends
the task - its own exit, an exception, kill -9, the OOM killer - the supervisor sees the status, so
the supervisor is the one that tells the head: a BYE {"code", "reason", "by": "supervisor"} sealed
with the task's own incarnation id and the run's secret. The head accepts it on any connection
(the MAC proves who sent it), once per peer (hpcrl.bus.router). Its sequence number starts above
anything the task can have sent, so the head's replay check passes it exactly once.

What the supervisor needs from the task - its incarnation and the head's - lives in a few bytes of
anonymous shared memory (`FarewellLink`), made before the fork. Nothing is said when the task
never got a WELCOME (it never registered: the head names it as "never registered"), nor when the
supervisor dies with it (a power loss: the head's heartbeat timeout covers that).
"""

from __future__ import annotations

import mmap
import secrets

from hpcrl.bus.secret import Secret
from hpcrl.bus.wire import INCARNATION_BYTES, Kind, Sealer

#: Sequence number the farewell is sent with: above anything a task sends in its life (2**62 messages).
FAREWELL_SEQ = 2**62
_SIZE = 1 + 2 * INCARNATION_BYTES  # welcomed flag | task incarnation | head incarnation


class FarewellLink:
    """Shared memory between a task and its supervisor: the task's incarnation id (chosen here,
    before the fork) and, once the head welcomed the task, the head's incarnation id."""

    def __init__(self) -> None:
        self._mem = mmap.mmap(-1, _SIZE)  # MAP_SHARED | MAP_ANONYMOUS: one page seen by both after fork
        self._mem[1:1 + INCARNATION_BYTES] = secrets.token_bytes(INCARNATION_BYTES)

    @property
    def incarnation(self) -> bytes:
        return bytes(self._mem[1:1 + INCARNATION_BYTES])

    def welcomed(self, head_incarnation: bytes) -> None:
        """The task was admitted by the head whose incarnation id this is."""
        if len(head_incarnation) != INCARNATION_BYTES:
            raise ValueError(f"an incarnation id is {INCARNATION_BYTES} bytes")
        self._mem[1 + INCARNATION_BYTES:] = head_incarnation
        self._mem[0] = 1

    @property
    def head_incarnation(self) -> bytes | None:
        """The head's incarnation id once the task was welcomed; None before."""
        return bytes(self._mem[1 + INCARNATION_BYTES:]) if self._mem[0] else None


def send_farewell(link: FarewellLink, *, address: str, secret: Secret, code: int, reason: str,
                  timeout: float = 2.0) -> bool:
    """Tell the head at `address` that the task of `link` exited with `code`. False when there is
    nobody to tell (never welcomed) or the message could not leave within `timeout`."""
    head = link.head_incarnation
    if head is None:
        return False
    from hpcrl.bus.channel import send_once  # zmq only here, in the supervisor, after the task ended

    frames = Sealer(secret, link.incarnation, last_seq=FAREWELL_SEQ).seal(
        Kind.BYE, {"reason": reason, "code": code, "by": "supervisor"}, to=head)
    return send_once(address, frames, secret=secret, timeout=timeout)
