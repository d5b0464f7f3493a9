"""The per-run bus secret: 0600 on disk, refused when others can read it, never shown."""

from __future__ import annotations

import logging
import os
import stat

import pytest

from hpcrl.bus.errors import SecretError
from hpcrl.bus.secret import SECRET_FILE, Secret, create_secret, load_secret
from hpcrl.errors import HpcrlError


def test_secret_file_is_32_random_bytes_readable_only_by_its_owner(tmp_path):
    secret = create_secret(tmp_path)
    path = tmp_path / SECRET_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes() == secret.key and len(secret.key) == 32
    assert load_secret(tmp_path) == secret
    assert create_secret(tmp_path.with_name(tmp_path.name + "-other")) != secret
    assert not [p for p in tmp_path.iterdir() if p.name != SECRET_FILE]  # no temp file left


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660])
def test_secret_readable_by_group_or_others_is_refused(tmp_path, mode):
    create_secret(tmp_path)
    os.chmod(tmp_path / SECRET_FILE, mode)
    with pytest.raises(SecretError, match="chmod 600"):
        load_secret(tmp_path)


def test_existing_secret_is_never_overwritten(tmp_path):
    first = create_secret(tmp_path)
    with pytest.raises(SecretError, match="already exists"):
        create_secret(tmp_path)
    assert load_secret(tmp_path) == first


def test_missing_or_short_secret_is_a_typed_error(tmp_path):
    with pytest.raises(SecretError, match="does not exist"):
        load_secret(tmp_path)
    fd = os.open(tmp_path / SECRET_FILE, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"short")
    os.close(fd)
    with pytest.raises(HpcrlError, match="holds 5 bytes"):
        load_secret(tmp_path)


def test_secret_never_appears_in_repr_str_or_logs(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    secret = create_secret(tmp_path)
    logging.getLogger("hpcrl.bus").info("loaded %s / %r", secret, secret)
    shown = repr(secret) + str(secret) + f"{secret}" + caplog.text
    assert secret.key.hex() not in shown and repr(secret.key) not in shown
    assert "hidden" in repr(secret)
    with pytest.raises(TypeError):
        import pickle
        pickle.dumps(secret)


def test_secret_of_the_wrong_size_is_refused():
    with pytest.raises(SecretError):
        Secret(b"x" * 31)
