"""The per-run bus secret: 32 random bytes in `<run_dir>/bus.secret`, mode 0600.

`create_secret` writes it once (temp file created 0600, fsynced, renamed); `load_secret` reads
it and refuses a file that group or others can read, or that another user owns. The `Secret`
object never shows its bytes in repr/str, so it cannot leak into logs by accident.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from hpcrl.bus.errors import SecretError

SECRET_FILE = "bus.secret"
SECRET_BYTES = 32


class Secret:
    """The run's HMAC key. `key` holds the bytes; repr and str never do."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, bytes) or len(key) != SECRET_BYTES:
            raise SecretError(f"a bus secret is {SECRET_BYTES} bytes, got {len(key) if isinstance(key, bytes) else type(key).__name__}")
        self._key = key

    @property
    def key(self) -> bytes:
        return self._key

    def __repr__(self) -> str:
        return "Secret(<hidden>)"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        import hmac
        return isinstance(other, Secret) and hmac.compare_digest(self._key, other._key)

    def __hash__(self) -> int:
        return id(self)

    def __reduce__(self):  # never pickled: a secret is loaded from its file by each process
        raise TypeError("a bus Secret cannot be pickled; load it from the run directory")


def secret_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / SECRET_FILE


def create_secret(run_dir: str | os.PathLike) -> Secret:
    """Write a fresh secret to `<run_dir>/bus.secret` (0600) and return it; refuses to overwrite."""
    path = secret_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        raise SecretError(f"{path} already exists; a run keeps its secret (delete it only to start a new run)")
    key = secrets.token_bytes(SECRET_BYTES)
    tmp = path.with_name(f".{SECRET_FILE}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the umask may only remove bits, but be explicit
        os.write(fd, key)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    return Secret(key)


def load_secret(run_dir: str | os.PathLike) -> Secret:
    """Read `<run_dir>/bus.secret`; refuse it unless it is ours, 0600 (or stricter) and 32 bytes."""
    path = secret_path(run_dir)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise SecretError(f"{path} does not exist; `hpcrl submit` writes it (or call create_secret)") from None
    except OSError as exc:
        raise SecretError(f"cannot open {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise SecretError(f"{path} belongs to uid {st.st_uid}, not to us (uid {os.getuid()}); refusing it")
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SecretError(f"{path} has mode {stat.S_IMODE(st.st_mode):04o}: group or others can reach it; "
                              f"refusing it. Fix: chmod 600 {path}")
        key = os.read(fd, SECRET_BYTES + 1)
    finally:
        os.close(fd)
    if len(key) != SECRET_BYTES:
        raise SecretError(f"{path} holds {len(key)} bytes, a bus secret is {SECRET_BYTES}")
    return Secret(key)
