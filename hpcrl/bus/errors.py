"""Typed errors of the control bus; each names the peer (group/replica/rank) it concerns.

All derive from `hpcrl.errors.HpcrlError` through `BusError`. A caller that wants to retry
on another replica catches `PeerDeadError`; `DeadlineExceeded` means the call's own deadline
passed (the peer may still be alive); `RemoteError` carries an endpoint's own exception.
"""

from __future__ import annotations

from hpcrl.errors import HpcrlError


class BusError(HpcrlError):
    """Something on the control bus failed."""


class SecretError(BusError):
    """The run's bus secret is missing, malformed, or readable by someone else."""


class HeadClosedError(BusError):
    """The head's bus is closed (the run is over): no call can be made or answered any more. Not a
    peer's death, so nothing retries it on another replica."""


class PeerError(BusError):
    """An error about one peer; `peer` is its name, "group/replica/rank"."""

    def __init__(self, peer: str, message: str) -> None:
        self.peer = peer
        super().__init__(f"peer {peer}: {message}")


class PeerDeadError(PeerError):
    """The peer is unhealthy (silent past heartbeat_timeout, replaced, or unreachable)."""


class UnknownPeerError(PeerError):
    """No peer of that name has registered with the head."""


class UnknownEndpointError(PeerError):
    """The peer does not expose the endpoint that was called."""

    def __init__(self, peer: str, endpoint: str, known: list[str], *, ready: bool = True) -> None:
        self.endpoint = endpoint
        if not ready:
            super().__init__(peer, f"is registered but not ready yet (still starting): no endpoint {endpoint!r}")
            return
        super().__init__(peer, f"has no endpoint {endpoint!r} (it exposes: {', '.join(sorted(known)) or 'none'})")


class DeadlineExceeded(PeerError):
    """A call did not complete before its deadline."""

    def __init__(self, peer: str, endpoint: str, timeout: float) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        super().__init__(peer, f"call to {endpoint!r} did not complete within {timeout:.3g} s")


class RemoteError(PeerError):
    """The endpoint raised; `error_type` and `remote_message` are what it raised."""

    def __init__(self, peer: str, endpoint: str, error_type: str, remote_message: str) -> None:
        self.endpoint = endpoint
        self.error_type = error_type
        self.remote_message = remote_message
        super().__init__(peer, f"endpoint {endpoint!r} raised {error_type}: {remote_message}")


class NoHealthyReplicaError(BusError):
    """A service has no healthy replica (or rank) to send a call to."""

    def __init__(self, group: str, detail: str) -> None:
        self.group = group
        super().__init__(f"group {group}: no healthy replica ({detail})")
