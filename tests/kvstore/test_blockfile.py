"""Block files: safetensors-compatible, self-describing, and never decoded wrong."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
from safetensors.numpy import load

from kvstore.blockfile import (
    FORMAT,
    UNKEYED,
    BlockCorruptError,
    BlockFormatError,
    BlockMac,
    BlockMeta,
    checksum,
    decode_block,
    encode_block,
    encode_parts,
    parse_header,
)

LAYOUT = "L2xH3xT4xD5:float32"


def block(seed: int = 0) -> tuple[np.ndarray, BlockMeta]:
    rng = np.random.default_rng(seed)
    kv = rng.standard_normal((2, 2, 3, 4, 5)).astype(np.float32)  # [L, 2, H, T, D]
    meta = BlockMeta(key=rng.bytes(16), fingerprint="ab" * 16, layout=LAYOUT, token_count=4,
                     traffic_class="chat", expires_at=1_700_000_000.25)
    return kv, meta


@pytest.mark.parametrize("lz4", [False, True])
def test_round_trip_keeps_payload_and_metadata(lz4: bool) -> None:
    kv, meta = block()
    data = encode_block(kv.tobytes(), meta, lz4=lz4)
    got_meta, payload = decode_block(data, expect_key=meta.key)
    assert bytes(payload) == kv.tobytes()
    assert got_meta.key == meta.key and got_meta.layout == LAYOUT
    assert got_meta.fingerprint == meta.fingerprint and got_meta.token_count == 4
    assert got_meta.traffic_class == "chat" and got_meta.expires_at == meta.expires_at
    assert got_meta.checksum == checksum(kv.tobytes()) and got_meta.size == kv.nbytes


def test_file_is_safetensors_with_layout_shape() -> None:
    kv, meta = block()
    tensors = load(encode_block(kv, meta))  # a numpy array is a buffer too
    np.testing.assert_array_equal(tensors["kv"], kv)
    packed = load(encode_block(kv.tobytes(), meta, lz4=True))
    assert packed["kv"].dtype == np.uint8


def test_header_is_aligned_and_self_describing() -> None:
    kv, meta = block()
    parts = encode_parts(kv.tobytes(), meta)
    assert len(parts.header) % 8 == 0
    (n,) = struct.unpack("<Q", parts.header[:8])
    md = json.loads(parts.header[8:8 + n])["__metadata__"]
    assert md["format"] == FORMAT and md["compression"] == "none"
    assert md["key"] == meta.key.hex() and md["checksum"] == checksum(kv.tobytes()).hex()
    assert parse_header(parts.header).meta == parts.meta


def test_uncompressed_payload_is_a_view_not_a_copy() -> None:
    kv, meta = block()
    data = bytearray(encode_block(kv.tobytes(), meta))
    _, payload = decode_block(data)
    data[-1] ^= 0xFF  # visible through the view => no copy was made
    assert payload[-1] == data[-1]


def test_unknown_layout_falls_back_to_flat_tensor() -> None:
    kv, meta = block()
    odd = BlockMeta(meta.key, "fp", "custom-layout", 4, "agent", 0.0)
    assert load(encode_block(kv.tobytes(), odd))["kv"].shape == (kv.nbytes,)
    _, payload = decode_block(encode_block(b"", odd))
    assert payload.nbytes == 0


def corruptions(data: bytes) -> dict[str, bytes]:
    hlen = 8 + struct.unpack("<Q", data[:8])[0]
    flip = bytearray(data)
    flip[hlen + 7] ^= 0x01
    header_flip = bytearray(data)
    header_flip[hlen // 2] ^= 0x20
    return {
        "empty": b"",
        "short length": data[:5],
        "cut in header": data[:hlen - 3],
        "cut in payload": data[:hlen + 10],
        "one byte short": data[:-1],
        "trailing bytes": data + b"\x00",
        "payload bit flip": bytes(flip),
        "header byte flip": bytes(header_flip),
        "garbage": os.urandom(len(data)),
        "huge header length": struct.pack("<Q", 2**40) + data[8:],
        "zero header length": struct.pack("<Q", 0) + data[8:],
        "not json": data[:8] + b"{" * (hlen - 8) + data[hlen:],
    }


@pytest.mark.parametrize("lz4", [False, True])
def test_every_corruption_raises(lz4: bool) -> None:
    kv, meta = block(3)
    data = encode_block(kv.tobytes(), meta, lz4=lz4)
    for name, bad in corruptions(data).items():
        with pytest.raises(BlockCorruptError):
            decode_block(bad)
            pytest.fail(f"{name}: decoded")


def test_wrong_key_and_wrong_supplied_checksum() -> None:
    kv, meta = block()
    data = encode_block(kv.tobytes(), meta)
    with pytest.raises(BlockCorruptError, match="expected"):
        decode_block(data, expect_key=bytes(16))
    lying = BlockMeta(meta.key, "fp", LAYOUT, 4, "chat", 0.0, checksum=bytes(16))
    with pytest.raises(BlockCorruptError, match="checksum"):
        encode_block(kv.tobytes(), lying)


def test_meta_validation() -> None:
    with pytest.raises(BlockFormatError, match="16 bytes"):
        BlockMeta(b"short", "fp", LAYOUT, 4, "chat", 0.0)
    with pytest.raises(BlockFormatError, match="token_count"):
        BlockMeta(bytes(16), "fp", LAYOUT, -1, "chat", 0.0)
    with pytest.raises(BlockFormatError, match="finite"):
        BlockMeta(bytes(16), "fp", LAYOUT, 1, "chat", float("nan"))
    kv, meta = block()
    with pytest.raises(BlockFormatError, match="size"):
        encode_block(kv.tobytes(), BlockMeta(meta.key, "fp", LAYOUT, 4, "chat", 0.0, size=7))


def test_any_single_bit_flip_in_header_or_payload_is_caught() -> None:
    kv, meta = block(5)
    data = encode_block(kv.tobytes(), meta)
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x01 << (i % 8)
        with pytest.raises(BlockCorruptError):
            decode_block(bytes(bad))
            pytest.fail(f"flip at byte {i} decoded")


def test_the_header_mac_is_keyed_and_checked_before_parsing() -> None:
    kv, meta = block(6)
    key_a, key_b = BlockMac(bytes(range(32))), BlockMac(bytes(range(1, 33)))
    data = encode_block(kv.tobytes(), meta, mac=key_a)
    assert bytes(decode_block(data, meta.key, mac=key_a).payload) == kv.tobytes()
    for wrong in (key_b, UNKEYED):                   # another deployment, or no key at all
        with pytest.raises(BlockCorruptError, match="MAC mismatch"):
            decode_block(data, mac=wrong)
    # A header that only a parser would accept (valid JSON, right fields) but whose
    # tag is not the key's is refused before it is parsed: same error, whatever it says.
    hlen = 8 + struct.unpack("<Q", data[:8])[0]
    forged = data[:hlen].replace(b'"tenant":"default"', b'"tenant":"victim!"')
    assert len(forged) == hlen and forged != data[:hlen]
    with pytest.raises(BlockCorruptError, match="MAC mismatch"):
        parse_header(forged, mac=key_a)
    with pytest.raises(BlockCorruptError, match="no MAC"):   # format v1 carried none
        parse_header(data[:hlen].replace(b'"header_mac"', b'"header_chk"'), mac=key_a)
