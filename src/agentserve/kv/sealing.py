"""Sealing one block file: integrity and authenticity always, confidentiality on request.

A lower tier's files outlive the process and sit where other processes (or people) can touch
them, so nothing read back is trusted until its HMAC checks: a truncated, edited or foreign file
is a `SealError`, never a wrong block. With encryption on, the payload is also AES-256-GCM
ciphertext (the header, which names the identity and hash, stays readable but authenticated).

Blob layout (integers little-endian):

| bytes | field            | notes                                                           |
|-------|------------------|-----------------------------------------------------------------|
| 4     | magic            | `ASKV`                                                          |
| 1     | format version   | 1                                                               |
| 1     | flags            | bit 0: body encrypted; every other bit must be 0                |
| 4     | header length H  | u32                                                             |
| H     | header           | the caller's bytes, never encrypted                             |
| 12    | nonce            | only when encrypted: fresh random per seal                      |
| 8     | body length B    | u64                                                             |
| B     | body             | the payload, or AES-GCM ciphertext + 16-byte tag (AAD: header)  |
| 32    | HMAC-SHA256      | over every preceding byte, under the HMAC key                   |

Keys: one 32-byte master key; HKDF-SHA256 derives a separate key per purpose, so the MAC key and
the cipher key are never the same bytes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import secrets
import string
import struct
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

MAGIC = b"ASKV"
VERSION = 1
FLAG_ENCRYPTED = 0x01
KEY_BYTES = 32
NONCE_BYTES = 12
MAC_BYTES = 32
_PREFIX = struct.Struct("<4sBBI")  # magic, version, flags, header length
_BODY_LEN = struct.Struct("<Q")
_MIN_BLOB = _PREFIX.size + _BODY_LEN.size + MAC_BYTES
_HMAC_INFO = b"agentserve kv hmac v1"
_AEAD_INFO = b"agentserve kv aead v1"
_KEY_FORMS = "64 hex digits or the base64 of exactly 32 bytes"


class SealError(Exception):
    """A blob that is malformed, truncated, edited, or sealed under other keys."""


@dataclass(frozen=True, slots=True)
class SealKeys:
    hmac_key: bytes = field(repr=False)  # HKDF(master, info=_HMAC_INFO)
    aead_key: bytes | None = field(default=None, repr=False)  # None: blobs are not encrypted

    def __post_init__(self) -> None:
        if len(self.hmac_key) != KEY_BYTES:
            raise ValueError(f"hmac_key must be {KEY_BYTES} bytes")
        if self.aead_key is not None and len(self.aead_key) != KEY_BYTES:
            raise ValueError(f"aead_key must be {KEY_BYTES} bytes")


def _hkdf(master: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(master)


def derive_keys(master: bytes, encrypt: bool) -> SealKeys:
    if len(master) != KEY_BYTES:
        raise ValueError(f"the master key must be {KEY_BYTES} bytes, got {len(master)}")
    return SealKeys(_hkdf(master, _HMAC_INFO), _hkdf(master, _AEAD_INFO) if encrypt else None)


def parse_key(text: str) -> bytes:
    """The master key from text: 64 hex digits, or base64 of exactly 32 bytes."""
    s = text.strip()
    if len(s) == 2 * KEY_BYTES and all(c in string.hexdigits for c in s):
        return bytes.fromhex(s)
    try:
        raw = base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) == KEY_BYTES:
        return raw
    # The text itself is never echoed: it may be a mistyped secret.
    raise ValueError(f"a KV master key must be {_KEY_FORMS} (got {len(s)} characters)")


def load_or_create_key(key_path: Path, store_dir: Path | None) -> bytes:
    """The master key at key_path, created (0o600, parents 0o700) if absent.

    Two processes racing to create it end with the same key: the file appears complete under its
    name in one atomic step, and the loser reads the winner's.
    """
    key_path = Path(key_path)
    if store_dir is not None and key_path.resolve().is_relative_to(Path(store_dir).resolve()):
        raise ValueError(
            f"the KV key file {key_path} is inside the store directory {store_dir} it protects: "
            "anyone who can write the store could then forge its files; put the key outside it"
        )
    with suppress(FileNotFoundError):
        return _read_key(key_path)
    _make_private_dirs(key_path.parent)
    _create_key(key_path)
    return _read_key(key_path)


def _read_key(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    with os.fdopen(fd, "r") as f:
        if os.fstat(f.fileno()).st_mode & 0o077:
            raise ValueError(
                f"the KV key file {path} is accessible by group or others; "
                f"run `chmod 600 {path}`"
            )
        text = f.read()
    try:
        return parse_key(text)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def _make_private_dirs(directory: Path) -> None:
    missing = []
    while not directory.exists():
        missing.append(directory)
        directory = directory.parent
    for d in reversed(missing):
        with suppress(FileExistsError):
            os.mkdir(d, 0o700)


def _create_key(path: Path) -> None:
    # Written in full under a private temp name, then hard-linked to the real name: link fails
    # if the name exists (we lost the race) and never exposes a partly written key.
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(8)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(os.urandom(KEY_BYTES).hex() + "\n")
            f.flush()
            os.fsync(f.fileno())
        with suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        with suppress(OSError):
            os.unlink(tmp)


def seal(
    keys: SealKeys,
    header: bytes,
    payload: bytes | memoryview,
    urandom: Callable[[int], bytes] = os.urandom,
) -> bytes:
    body: bytes | memoryview = memoryview(payload).cast("B")
    if len(header) >= 1 << 32:
        raise ValueError("header too long")
    flags, nonce = 0, b""
    if keys.aead_key is not None:
        nonce = urandom(NONCE_BYTES)
        if len(nonce) != NONCE_BYTES:
            raise ValueError(f"urandom returned {len(nonce)} bytes, not {NONCE_BYTES}")
        body = AESGCM(keys.aead_key).encrypt(nonce, body, header)
        flags = FLAG_ENCRYPTED
    parts = [
        _PREFIX.pack(MAGIC, VERSION, flags, len(header)),
        header,
        nonce,
        _BODY_LEN.pack(len(body)),
        body,
    ]
    mac = hmac.new(keys.hmac_key, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(part)
    parts.append(mac.digest())
    return b"".join(parts)


def unseal(keys: SealKeys, blob: bytes) -> tuple[bytes, bytes]:
    """(header, payload) of a blob sealed under keys; SealError for anything else."""
    try:
        return _unseal(keys, memoryview(blob))
    except (struct.error, ValueError, OverflowError) as e:
        raise SealError(f"malformed blob: {type(e).__name__}") from e


def _unseal(keys: SealKeys, view: memoryview) -> tuple[bytes, bytes]:
    if len(view) < _MIN_BLOB:
        raise SealError(f"truncated: {len(view)} bytes")
    end = len(view) - MAC_BYTES
    # The MAC first: nothing below parses bytes that an attacker could have chosen.
    expected = hmac.new(keys.hmac_key, view[:end], hashlib.sha256).digest()
    if not hmac.compare_digest(expected, view[end:]):
        raise SealError("authentication failed: truncated, edited, or sealed under another key")
    view = view[:end]
    magic, version, flags, header_len = _PREFIX.unpack_from(view)
    if magic != MAGIC or version != VERSION or flags & ~FLAG_ENCRYPTED:
        raise SealError(f"unknown format: magic {bytes(magic)!r} version {version} flags {flags}")
    encrypted = bool(flags & FLAG_ENCRYPTED)
    if encrypted != (keys.aead_key is not None):
        raise SealError("encrypted blob without a decryption key" if encrypted else
                        "plain blob where encryption is required")
    pos = _PREFIX.size + header_len
    header = bytes(view[_PREFIX.size:pos])
    nonce = bytes(view[pos:pos + NONCE_BYTES]) if encrypted else b""
    pos += len(nonce)
    if pos + _BODY_LEN.size > end or len(header) != header_len:
        raise SealError("truncated header")
    (body_len,) = _BODY_LEN.unpack_from(view, pos)
    pos += _BODY_LEN.size
    if pos + body_len != end:
        raise SealError(f"body length {body_len} does not match the blob")
    body = view[pos:end]
    if keys.aead_key is None:
        return header, bytes(body)
    try:
        return header, AESGCM(keys.aead_key).decrypt(nonce, body, header)
    except InvalidTag:
        raise SealError("decryption failed: ciphertext or header edited") from None
