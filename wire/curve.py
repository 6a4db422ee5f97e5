"""CURVE keys for the worker links, read from ZeroMQ's standard certificate files.

    gateway.key_secret   public-key + secret-key   the gateway's ROUTER (CURVE server)
    gateway.key          public-key                 given to workers (--curve-server-key-file)
    worker-1.key_secret  public-key + secret-key   a worker's DEALER (CURVE client)
    authorized/*.key     public-key                 the workers a gateway lets in

The files are what ``zmq.auth.create_certificates`` writes (``tierserve keys generate``) and what
``zmq.auth.load_certificate`` reads: ZPL text with ``public-key = "<Z85>"`` and ``secret-key = "<Z85>"``
lines under ``curve``. They are parsed here with the standard library, as ``load_certificate`` does, so
the config can be validated without ZeroMQ; keys come back as the 40-character Z85 bytes libzmq's
``CURVE_*KEY`` options take. Every mistake is a :class:`CurveKeyError` that names the file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "CurveKeyError",
    "CurveKeyPair",
    "load_authorized_keys",
    "load_key_pair",
    "load_public_key",
    "write_public_key",
]

# 32 key bytes in Z85 (ZeroMQ RFC 32): 40 characters of this alphabet.
_Z85_KEY = re.compile(rb"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")
PUBLIC_KEY_SUFFIX = ".key"  # what create_certificates names public files; a directory is scanned for them


class CurveKeyError(ValueError):
    """A key file that is missing, unreadable, or not a ZeroMQ certificate with the key asked for."""


@dataclass(frozen=True, slots=True)
class CurveKeyPair:
    """One side's own keys (Z85). ``repr`` leaves the secret out, so a logged pair leaks nothing."""

    public_key: bytes
    secret_key: bytes = field(repr=False)


def _read(path: Path) -> tuple[bytes | None, bytes | None]:
    """``(public, secret)`` as written in the file, either None when absent (load_certificate's rules)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CurveKeyError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise CurveKeyError(f"{path}: is a directory, not a key file") from None
    except OSError as exc:
        raise CurveKeyError(f"{path}: cannot read it ({exc.strerror})") from None
    public = secret = None
    for raw in data.splitlines():
        line = raw.strip()
        if line.startswith(b"#"):
            continue
        for name in (b"public-key", b"secret-key"):
            if line.startswith(name) and b"=" in line:
                value = line.split(b"=", 1)[1].strip(b" \t'\"")
                if not _Z85_KEY.fullmatch(value):
                    raise CurveKeyError(f"{path}: {name.decode()} is not a 40-character Z85 CURVE key")
                if name == b"public-key":
                    public = value
                else:
                    secret = value
    return public, secret


def load_key_pair(path: str | Path) -> CurveKeyPair:
    """A ``.key_secret`` file: both keys, or :class:`CurveKeyError`."""
    path = Path(path)
    public, secret = _read(path)
    if secret is None:
        raise CurveKeyError(f"{path}: no secret-key in it (a public .key file? give the .key_secret one)")
    if public is None:
        raise CurveKeyError(f"{path}: no public-key in it")
    return CurveKeyPair(public, secret)


def load_public_key(path: str | Path) -> bytes:
    """The public key of a ``.key`` (or ``.key_secret``) file, or :class:`CurveKeyError`."""
    path = Path(path)
    public, _ = _read(path)
    if public is None:
        raise CurveKeyError(f"{path}: no public-key in it")
    return public


def load_authorized_keys(directory: str | Path) -> frozenset[bytes]:
    """The public keys of every ``*.key`` file in ``directory`` (as ``zmq.auth.load_certificates``
    collects them); :class:`CurveKeyError` when it is not a directory or holds no key, since a gateway
    that lets no worker in is a mistake, not a setting."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CurveKeyError(f"{directory}: no such directory")
    keys = frozenset(load_public_key(path) for path in sorted(directory.glob(f"*{PUBLIC_KEY_SUFFIX}")))
    if not keys:
        raise CurveKeyError(f"{directory}: no public key files (*{PUBLIC_KEY_SUFFIX}) in it")
    return keys


def write_public_key(path: str | Path, public_key: bytes) -> None:
    """A ``.key`` file holding ``public_key`` in the format ``create_certificates`` writes, for the
    other side of a link (serve hands its own workers the gateway's public key this way)."""
    if not _Z85_KEY.fullmatch(public_key):
        raise CurveKeyError("not a 40-character Z85 CURVE key")
    text = (
        "#   ****  a CURVE public key, written by tierserve  ****\n"
        "#   ZeroMQ CURVE Public Certificate: safe to share\n"
        "metadata\n"
        "curve\n"
        f'    public-key = "{public_key.decode("ascii")}"\n'
    )
    Path(path).write_text(text)
