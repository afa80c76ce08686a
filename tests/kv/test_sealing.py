"""Sealed block blobs: round trips, every edit or truncation refused, keys per purpose, and the
master key file (created private, shared by racing processes, kept out of the store)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import random
import stat
import struct
import threading
from pathlib import Path

import pytest

from agentserve.kv.sealing import (
    MAC_BYTES,
    NONCE_BYTES,
    SealError,
    derive_keys,
    load_or_create_key,
    parse_key,
    seal,
    unseal,
)

MASTER = bytes(range(32))
HEADER = b'{"identity":"m","block_hash":7}'
PAYLOAD = bytes(random.Random(0).randbytes(3000))


@pytest.mark.parametrize("encrypt", [False, True])
def test_round_trip_plain_and_encrypted(encrypt):
    keys = derive_keys(MASTER, encrypt)
    blob = seal(keys, HEADER, memoryview(PAYLOAD))
    assert unseal(keys, blob) == (HEADER, PAYLOAD)
    assert (PAYLOAD[:64] in blob) is not encrypt  # encryption hides the payload
    assert HEADER in blob  # the header stays readable (authenticated, not secret)
    assert unseal(keys, seal(keys, b"", b"")) == (b"", b"")


def test_payload_views_are_sealed_by_their_bytes():
    keys = derive_keys(MASTER, False)
    words = memoryview(bytearray(PAYLOAD[:64])).cast("I")  # 16 four-byte items
    assert unseal(keys, seal(keys, HEADER, words))[1] == PAYLOAD[:64]


def test_encrypted_seals_use_a_fresh_nonce_each_time():
    keys = derive_keys(MASTER, True)
    a, b = seal(keys, HEADER, PAYLOAD), seal(keys, HEADER, PAYLOAD)
    assert a != b
    assert unseal(keys, a) == unseal(keys, b) == (HEADER, PAYLOAD)
    nonces = []
    seal(keys, HEADER, PAYLOAD, urandom=lambda n: nonces.append(n) or b"\x01" * n)
    assert nonces == [NONCE_BYTES]


@pytest.mark.parametrize("encrypt", [False, True])
def test_flipping_any_byte_is_refused(encrypt):
    keys = derive_keys(MASTER, encrypt)
    blob = seal(keys, HEADER, PAYLOAD)
    header_end = 10 + len(HEADER)
    positions = set(range(0, header_end + NONCE_BYTES + 8 + 16))  # prefix, header, nonce, length
    positions |= set(range(header_end, len(blob), 37))  # across the body
    positions |= set(range(len(blob) - MAC_BYTES - 16, len(blob)))  # GCM tag and HMAC
    for pos in sorted(positions):
        edited = bytearray(blob)
        edited[pos] ^= 1 << (pos % 8)
        with pytest.raises(SealError):
            unseal(keys, bytes(edited))


@pytest.mark.parametrize("encrypt", [False, True])
def test_every_truncation_is_refused(encrypt):
    keys = derive_keys(MASTER, encrypt)
    blob = seal(keys, HEADER, PAYLOAD)
    lengths = set(range(0, 80)) | set(range(0, len(blob), 41)) | set(range(len(blob) - 50, len(blob)))
    for n in sorted(lengths):
        with pytest.raises(SealError):
            unseal(keys, blob[:n])
    with pytest.raises(SealError):
        unseal(keys, blob + b"\x00")


@pytest.mark.parametrize("encrypt", [False, True])
def test_another_master_key_is_refused(encrypt):
    blob = seal(derive_keys(MASTER, encrypt), HEADER, PAYLOAD)
    with pytest.raises(SealError):
        unseal(derive_keys(bytes(32), encrypt), blob)


def test_encryption_must_match_on_both_sides():
    # Same master, so the HMAC checks: the flags are what refuses.
    plain, secret = derive_keys(MASTER, False), derive_keys(MASTER, True)
    with pytest.raises(SealError, match="without a decryption key"):
        unseal(plain, seal(secret, HEADER, PAYLOAD))
    with pytest.raises(SealError, match="encryption is required"):
        unseal(secret, seal(plain, HEADER, PAYLOAD))


def _remac(hmac_key: bytes, body: bytes) -> bytes:
    return body + hmac.new(hmac_key, body, hashlib.sha256).digest()


def test_gcm_refuses_an_edit_even_under_a_valid_hmac():
    keys = derive_keys(MASTER, True)
    blob = bytearray(seal(keys, HEADER, PAYLOAD)[:-MAC_BYTES])
    blob[-20] ^= 0x80  # inside the ciphertext
    with pytest.raises(SealError, match="decryption failed"):
        unseal(keys, _remac(keys.hmac_key, bytes(blob)))


@pytest.mark.parametrize("encrypt", [False, True])
def test_malformed_but_authenticated_blobs_raise_only_seal_error(encrypt):
    keys = derive_keys(MASTER, encrypt)
    flags = 1 if encrypt else 0
    rng = random.Random(1)
    crafted = [
        b"XXXX" + bytes([1, flags]) + struct.pack("<I", 0) + struct.pack("<Q", 0),  # magic
        b"ASKV" + bytes([2, flags]) + struct.pack("<I", 0) + struct.pack("<Q", 0),  # version
        b"ASKV" + bytes([1, flags | 4]) + struct.pack("<I", 0) + struct.pack("<Q", 0),  # flags
        b"ASKV" + bytes([1, flags]) + struct.pack("<I", 2**32 - 1) + b"\x00" * 30,  # header len
        b"ASKV" + bytes([1, flags]) + struct.pack("<I", 0) + b"\x00" * 12 + struct.pack("<Q", 2**64 - 1),
    ]
    crafted += [rng.randbytes(rng.randrange(0, 200)) for _ in range(200)]
    crafted += [b"ASKV" + bytes([1, flags]) + rng.randbytes(rng.randrange(0, 60)) for _ in range(200)]
    for body in crafted:
        with pytest.raises(SealError):
            unseal(keys, _remac(keys.hmac_key, body))


def test_keys_per_purpose_differ_and_are_deterministic():
    keys = derive_keys(MASTER, True)
    assert keys.aead_key is not None and len(keys.hmac_key) == len(keys.aead_key) == 32
    assert keys.hmac_key != keys.aead_key
    assert MASTER not in (keys.hmac_key, keys.aead_key)
    assert derive_keys(MASTER, True) == keys
    assert derive_keys(MASTER, False).hmac_key == keys.hmac_key
    assert derive_keys(MASTER, False).aead_key is None
    assert derive_keys(bytes(32), True).hmac_key != keys.hmac_key
    assert MASTER.hex() not in repr(keys) and repr(keys.hmac_key) not in repr(keys)
    with pytest.raises(ValueError):
        derive_keys(b"short", False)


def test_parse_key_accepts_hex_and_base64_and_nothing_else():
    assert parse_key(MASTER.hex()) == MASTER
    assert parse_key(MASTER.hex().upper() + "\n") == MASTER
    assert parse_key(base64.b64encode(MASTER).decode()) == MASTER
    bad = [
        "",
        MASTER.hex()[:-1],  # 63 hex digits
        MASTER.hex() + "00",  # 33 bytes
        "zz" * 32,
        base64.b64encode(MASTER[:31]).decode(),
        base64.b64encode(MASTER + b"x").decode(),
        base64.b64encode(MASTER).decode()[:-2] + "!!",
    ]
    for text in bad:
        with pytest.raises(ValueError, match="64 hex digits or the base64 of exactly 32 bytes"):
            parse_key(text)


def test_load_or_create_key_creates_a_private_file_and_reads_it_back(tmp_path):
    path = tmp_path / "conf" / "deep" / "kv.key"
    key = load_or_create_key(path, tmp_path / "store")
    assert len(key) == 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "conf").stat().st_mode) == 0o700
    assert parse_key(path.read_text()) == key
    assert load_or_create_key(path, tmp_path / "store") == key
    assert load_or_create_key(tmp_path / "other.key", None) != key
    assert sorted(p.name for p in path.parent.iterdir()) == ["kv.key"]  # no temp file left


def test_racing_creators_all_get_the_winners_key(tmp_path):
    path = tmp_path / "kv.key"
    barrier = threading.Barrier(8)
    keys: list[bytes] = []

    def create() -> None:
        barrier.wait()
        keys.append(load_or_create_key(path, None))

    threads = [threading.Thread(target=create) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(keys) == 8 and len(set(keys)) == 1
    assert parse_key(path.read_text()) == keys[0]
    assert os.listdir(tmp_path) == ["kv.key"]


def test_load_or_create_key_refuses_a_key_inside_the_store(tmp_path):
    store = tmp_path / "store"
    with pytest.raises(ValueError, match="inside the store directory"):
        load_or_create_key(store / "kv.key", store)
    with pytest.raises(ValueError, match="inside the store directory"):
        load_or_create_key(tmp_path / "x" / ".." / "store" / "ns" / "kv.key", store)
    assert not store.exists()  # refused before creating anything


def test_load_or_create_key_refuses_a_key_others_can_read(tmp_path):
    path = tmp_path / "kv.key"
    path.write_text(MASTER.hex())
    path.chmod(0o644)
    with pytest.raises(ValueError, match=f"chmod 600 {path}"):
        load_or_create_key(path, None)
    path.chmod(0o600)
    assert load_or_create_key(path, None) == MASTER


def test_load_or_create_key_refuses_a_malformed_key_file(tmp_path: Path):
    path = tmp_path / "kv.key"
    path.write_text("not a key")
    path.chmod(0o600)
    with pytest.raises(ValueError, match=str(path)):
        load_or_create_key(path, None)
