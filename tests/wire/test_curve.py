"""wire/curve.py reads what pyzmq writes (and what its reader reads), and the config checks the keys."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq.auth

from wire.config import ConfigError, load_config
from wire.curve import (
    CurveKeyError,
    load_authorized_keys,
    load_key_pair,
    load_public_key,
    write_public_key,
)


@pytest.fixture
def certs(tmp_path: Path) -> tuple[Path, Path]:
    public, secret = zmq.auth.create_certificates(tmp_path, "gateway")
    return Path(public), Path(secret)


def test_reads_the_keys_pyzmq_writes_as_pyzmq_reads_them(certs: tuple[Path, Path]) -> None:
    public_file, secret_file = certs
    public, secret = zmq.auth.load_certificate(secret_file)
    pair = load_key_pair(secret_file)
    assert (pair.public_key, pair.secret_key) == (public, secret)
    assert load_public_key(public_file) == public
    assert zmq.curve_public(pair.secret_key) == pair.public_key  # a real pair
    assert pair.secret_key.decode() not in repr(pair)


def test_a_public_file_is_not_a_key_pair(certs: tuple[Path, Path]) -> None:
    with pytest.raises(CurveKeyError, match=r"gateway\.key: no secret-key in it"):
        load_key_pair(certs[0])


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("", "no public-key"),
        ('curve\n    public-key = "short"\n', "public-key is not a 40-character Z85 CURVE key"),
        ('curve\n    public-key = "' + "~" * 40 + '"\n', "not a 40-character Z85"),
        ('# public-key = "' + "a" * 40 + '"\n', "no public-key"),  # a comment is not a key
    ],
)
def test_malformed_files_name_the_file_and_the_fault(tmp_path: Path, text: str, error: str) -> None:
    path = tmp_path / "odd.key"
    path.write_text(text)
    with pytest.raises(CurveKeyError, match=error) as info:
        load_public_key(path)
    assert str(path) in str(info.value)


def test_missing_files_and_folders(tmp_path: Path) -> None:
    with pytest.raises(CurveKeyError, match="no such file"):
        load_key_pair(tmp_path / "gone.key_secret")
    with pytest.raises(CurveKeyError, match="is a directory"):
        load_public_key(tmp_path)
    with pytest.raises(CurveKeyError, match="no such directory"):
        load_authorized_keys(tmp_path / "gone")
    (tmp_path / "readme.txt").write_text("no keys here")
    with pytest.raises(CurveKeyError, match=r"no public key files \(\*\.key\)"):
        load_authorized_keys(tmp_path)


def test_authorized_keys_are_the_public_files_of_a_folder(tmp_path: Path) -> None:
    made = [zmq.auth.create_certificates(tmp_path, f"worker-{i}") for i in range(3)]
    keys = load_authorized_keys(tmp_path)  # the .key_secret files beside them are not read as entries
    assert keys == {zmq.auth.load_certificate(public)[0] for public, _ in made}
    assert keys == set(zmq.auth.load_certificates(str(tmp_path)))


def test_written_public_key_reads_back_with_pyzmq(tmp_path: Path) -> None:
    public, _ = zmq.curve_keypair()
    write_public_key(tmp_path / "gateway.key", public)
    assert zmq.auth.load_certificate(tmp_path / "gateway.key") == (public, None)
    with pytest.raises(CurveKeyError):
        write_public_key(tmp_path / "bad.key", b"not a key")


# ---- the config keys --------------------------------------------------------------------------


def config_with(tmp_path: Path, gateway: str) -> Path:
    path = tmp_path / "tierserve.toml"
    path.write_text(f"[gateway]\n{gateway}\n")
    return path


def test_curve_config_loads_with_both_keys(tmp_path: Path, certs: tuple[Path, Path]) -> None:
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    zmq.auth.create_certificates(authorized, "worker-1")
    path = config_with(
        tmp_path,
        f'worker_address = "tcp://127.0.0.1:5555"\ncurve_secret_key_file = "{certs[1]}"\n'
        f'curve_authorized_keys_dir = "{authorized}"',
    )
    gateway = load_config(path, env={}).gateway
    assert (gateway.curve_secret_key_file, gateway.curve_authorized_keys_dir) == (
        str(certs[1]),
        str(authorized),
    )
    assert load_config(env={}).gateway.worker_address == "tcp://127.0.0.1:0"  # the default: loopback


@pytest.mark.parametrize(
    ("gateway", "key", "error"),
    [
        ('curve_secret_key_file = "{secret}"', "gateway.curve_authorized_keys_dir", "CURVE needs it too"),
        ('curve_authorized_keys_dir = "{tmp}"', "gateway.curve_secret_key_file", "CURVE needs it too"),
        (
            'curve_secret_key_file = "{tmp}/missing.key_secret"\ncurve_authorized_keys_dir = "{tmp}"',
            "gateway.curve_secret_key_file",
            "missing.key_secret: no such file",
        ),
        (
            'curve_secret_key_file = "{public}"\ncurve_authorized_keys_dir = "{tmp}"',
            "gateway.curve_secret_key_file",
            "no secret-key in it",
        ),
        (
            'curve_secret_key_file = "{secret}"\ncurve_authorized_keys_dir = "{tmp}/nowhere"',
            "gateway.curve_authorized_keys_dir",
            "no such directory",
        ),
        (
            'worker_address = "127.0.0.1:5555"',
            "gateway.worker_address",
            "expected tcp://HOST:PORT or ipc://PATH",
        ),
    ],
)
def test_curve_config_mistakes_name_the_key(
    tmp_path: Path, certs: tuple[Path, Path], gateway: str, key: str, error: str
) -> None:
    text = gateway.format(secret=certs[1], public=certs[0], tmp=tmp_path)
    with pytest.raises(ConfigError, match=error) as info:
        load_config(config_with(tmp_path, text), env={})
    assert info.value.key == key
