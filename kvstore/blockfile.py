"""Self-describing block files: safetensors bytes with kvserve metadata.

Layout (the safetensors format, so any safetensors reader can open a block)::

    u64 little-endian header length N | N bytes of JSON, space-padded so the
    payload starts 8-aligned | payload

The JSON holds one tensor "kv" (the payload: dtype/shape from the layout, or
uint8 when lz4-compressed) and ``__metadata__`` (all strings): key (hex),
fingerprint, layout, token_count, traffic_class, expires_at, checksum
(xxh3-128 of the *uncompressed* payload, hex), size (uncompressed bytes),
compression ("none" | "lz4"), tenant (namespace), format, and header_mac.

Integrity at rest is keyed (docs/security.md, "Integrity at rest and
quotas"): ``header_mac`` is BLAKE2b-128, keyed by a key derived from the
deployment secret (``BlockMac``, kvstore.integrity), over the whole header as
stored (length prefix, JSON, padding) with the tag's own 32 hex digits read as
zeros. It is the last field of the JSON, so a reader finds it at a fixed
distance from the end and checks it *before* parsing anything: only bytes a
key holder wrote are ever parsed. That header holds the payload's xxh3-128,
so the MAC binds key, tenant namespace, layout, size, fingerprint and payload
together without a second pass over the payload: whoever can write G3 or G4
but lacks the key cannot make a block, or move one to another key or tenant,
that a store accepts. A flipped metadata byte is caught as surely as a
flipped payload byte. Files of an older format (``kvserve-block-v1``, whose
header carried an unkeyed checksum) are rejected like forged ones: the store
treats them as absent and the block is recomputed.

``decode_block`` never returns bad data: truncation, garbage, a bad header, a
MAC or checksum mismatch or a wrong key all raise ``BlockCorruptError``. Hot
path: an uncompressed payload comes back as a view into the caller's buffer
(no copy), and ``encode_parts`` lets writers ``writev`` header and payload
without joining them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import struct
from dataclasses import dataclass
from typing import NamedTuple

import xxhash
from lz4.block import LZ4BlockError
from lz4.block import compress as lz4_compress
from lz4.block import decompress as lz4_decompress

FORMAT = "kvserve-block-v2"      # v2: keyed header MAC (v1 files read as corrupt)
KEY_BYTES = 16
CHECKSUM_BYTES = 16
MAX_HEADER_BYTES = 64 * 1024
_ALIGN = 8
_LEN = struct.Struct("<Q")
_LAYOUT = re.compile(r"^L(\d+)xH(\d+)xT(\d+)xD(\d+):(\w+)$")
# Layout dtype names -> (safetensors dtype, bytes per element).
_DTYPES: dict[str, tuple[str, int]] = {
    "float32": ("F32", 4), "float16": ("F16", 2), "bfloat16": ("BF16", 2),
    "float64": ("F64", 8), "float8_e4m3fn": ("F8_E4M3", 1), "float8_e5m2": ("F8_E5M2", 1),
    "int8": ("I8", 1), "uint8": ("U8", 1),
}
_COMPRESSIONS = ("none", "lz4")


class BlockCorruptError(ValueError):
    """Stored block bytes are unusable (truncated, garbage, bad header, wrong checksum or key)."""


class BlockFormatError(ValueError):
    """A block cannot be encoded as given (bad metadata or payload size)."""


MAC_KEY_BYTES = 32
MAC_BYTES = 16


class BlockMac:
    """The keyed tag every stored block header carries (BLAKE2b-128 keyed by a
    32-byte purpose-specific key, kvstore.integrity). The keyed state is built
    once and copied per tag: a tag over a ~600-byte header costs ~1 us."""

    __slots__ = ("_base", "keyed")

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, bytes) or len(key) not in (0, MAC_KEY_BYTES):
            raise BlockFormatError(f"a block MAC key is {MAC_KEY_BYTES} bytes (or empty: "
                                   "unkeyed, plain-text deployments only)")
        self.keyed = bool(key)
        self._base = hashlib.blake2b(key=key, digest_size=MAC_BYTES)

    def tag(self, data: bytes) -> str:
        h = self._base.copy()
        h.update(data)
        return h.hexdigest()

    def verify(self, data: bytes, tag: bytes) -> bool:
        """Whether ``tag`` (hex digits as stored) is this key's tag of ``data``."""
        return hmac.compare_digest(self.tag(data).encode(), tag)

    def __repr__(self) -> str:   # never the key
        return f"BlockMac(keyed={self.keyed})"


# Without a deployment secret (``--insecure`` only) the tag is an unkeyed hash: it
# still catches damage, not forgery.
UNKEYED = BlockMac(b"")


def checksum(payload: bytes | bytearray | memoryview) -> bytes:
    """The 16-byte xxh3-128 digest stored with every block (fast enough for every read)."""
    return xxhash.xxh3_128_digest(payload)


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """What a block is; travels with it in every tier. ``size`` = uncompressed payload bytes."""

    key: bytes
    fingerprint: str
    layout: str
    token_count: int
    traffic_class: str
    expires_at: float
    checksum: bytes = b""
    size: int = 0
    tenant: str = "default"      # the tenant namespace that stored it (docs/security.md)

    def __post_init__(self) -> None:
        if not isinstance(self.key, bytes) or len(self.key) != KEY_BYTES:
            raise BlockFormatError(f"BlockMeta.key must be {KEY_BYTES} bytes, got {self.key!r:.60}")
        if self.checksum and len(self.checksum) != CHECKSUM_BYTES:
            raise BlockFormatError(f"BlockMeta.checksum must be {CHECKSUM_BYTES} bytes or empty")
        if self.token_count < 0 or self.size < 0:
            raise BlockFormatError("BlockMeta.token_count and size must be >= 0")
        if not math.isfinite(self.expires_at):
            raise BlockFormatError("BlockMeta.expires_at must be finite")

    @property
    def key_hex(self) -> str:
        return self.key.hex()


class EncodedBlock(NamedTuple):
    """Header bytes and the payload to write after them (a view, not a copy)."""

    header: bytes
    body: memoryview
    meta: BlockMeta           # with checksum and size filled in

    @property
    def nbytes(self) -> int:
        return len(self.header) + self.body.nbytes


class DecodedBlock(NamedTuple):
    meta: BlockMeta
    payload: memoryview


class BlockHeader(NamedTuple):
    """A parsed header: the metadata and where the stored payload lies in the file."""

    meta: BlockMeta
    compression: str
    data_start: int           # absolute offset of the stored payload
    data_end: int


_MAC_FIELD = b'"header_mac":"'
_MAC_HEX = 2 * MAC_BYTES
_MAC_BLANK = b"0" * _MAC_HEX
_JSON_END = b'"}}'      # the tag's closing quote, then __metadata__'s and the document's


def _mac_at(head: bytes) -> int:
    """Offset of the tag's hex digits in a whole header (it ends the JSON)."""
    end = len(head.rstrip(b" "))
    at = end - len(_JSON_END) - _MAC_HEX
    if head[end - len(_JSON_END):end] != _JSON_END or \
            head[at - len(_MAC_FIELD):at] != _MAC_FIELD:
        raise BlockCorruptError("block header carries no MAC (format v1, or not a kvserve block)")
    return at


def _tensor_entry(layout: str, nbytes: int) -> tuple[str, list[int]]:
    m = _LAYOUT.match(layout)
    dtype, itemsize = _DTYPES.get(m.group(5) if m else "", ("U8", 1))
    if m:
        layers, heads, tokens, dim = (int(g) for g in m.groups()[:4])
        shape = [layers, 2, heads, tokens, dim]
        if math.prod(shape) * itemsize == nbytes:
            return dtype, shape
    if nbytes % itemsize:
        return "U8", [nbytes]
    return dtype, [nbytes // itemsize]


def encode_parts(payload: bytes | bytearray | memoryview, meta: BlockMeta,
                 lz4: bool = False, *, mac: BlockMac = UNKEYED) -> EncodedBlock:
    """Header + body for writers that can scatter-write (``os.writev``); the
    header is tagged with ``mac``."""
    view = memoryview(payload).cast("B")
    digest = checksum(view)
    if meta.checksum and meta.checksum != digest:
        raise BlockCorruptError(f"block {meta.key_hex}: payload does not match the checksum "
                                "supplied with it")
    if meta.size and meta.size != view.nbytes:
        raise BlockFormatError(f"block {meta.key_hex}: meta.size {meta.size} != payload "
                               f"{view.nbytes} bytes")
    body = memoryview(lz4_compress(view, store_size=False)) if lz4 else view
    dtype, shape = ("U8", [body.nbytes]) if lz4 else _tensor_entry(meta.layout, view.nbytes)
    md = {
        "format": FORMAT, "key": meta.key.hex(), "fingerprint": meta.fingerprint,
        "layout": meta.layout, "token_count": str(meta.token_count),
        "traffic_class": meta.traffic_class, "expires_at": repr(float(meta.expires_at)),
        "checksum": digest.hex(), "size": str(view.nbytes),
        "compression": "lz4" if lz4 else "none", "tenant": meta.tenant,
        "header_mac": _MAC_BLANK.decode(),     # last: see _mac_at
    }
    tensor = {"dtype": dtype, "shape": shape, "data_offsets": [0, body.nbytes]}
    text = json.dumps({"kv": tensor, "__metadata__": md}, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + _LEN.size) % _ALIGN)
    head = bytearray(_LEN.pack(len(text)) + text)
    at = _mac_at(bytes(head))
    tag = mac.tag(bytes(head)).encode()
    if len(tag) != _MAC_HEX:
        raise BlockFormatError(f"a block MAC is {_MAC_HEX} hex digits, got {len(tag)}")
    head[at:at + _MAC_HEX] = tag
    full = BlockMeta(meta.key, meta.fingerprint, meta.layout, meta.token_count,
                     meta.traffic_class, meta.expires_at, digest, view.nbytes, meta.tenant)
    return EncodedBlock(bytes(head), body, full)


def encode_block(payload: bytes | bytearray | memoryview, meta: BlockMeta,
                 lz4: bool = False, *, mac: BlockMac = UNKEYED) -> bytes:
    """The whole block file as one bytes object (one copy of the payload)."""
    parts = encode_parts(payload, meta, lz4, mac=mac)
    return b"".join((parts.header, parts.body))


def header_length(prefix: bytes | bytearray | memoryview) -> int:
    """Total header bytes (8 + N) from the first 8 bytes of a block file."""
    if len(prefix) < _LEN.size:
        raise BlockCorruptError(f"block truncated: {len(prefix)} bytes, no header length")
    (n,) = _LEN.unpack_from(prefix)
    if n == 0 or n > MAX_HEADER_BYTES:
        raise BlockCorruptError(f"block header length {n} out of range (max {MAX_HEADER_BYTES})")
    return _LEN.size + n


def parse_header(head: bytes | bytearray | memoryview, *,
                 mac: BlockMac = UNKEYED) -> BlockHeader:
    """Verify the MAC of the header in the file's first ``header_length`` bytes, then
    parse it (payload not needed): a header that ``mac`` did not tag is corrupt."""
    hlen = header_length(head)
    if len(head) < hlen:
        raise BlockCorruptError(f"block truncated inside its header ({len(head)} < {hlen} bytes)")
    raw = bytes(head[:hlen])
    at = _mac_at(raw)
    if not mac.verify(raw[:at] + _MAC_BLANK + raw[at + _MAC_HEX:], raw[at:at + _MAC_HEX]):
        raise BlockCorruptError("block header MAC mismatch (forged, damaged, or written under "
                                "another deployment secret)")
    try:
        doc = json.loads(raw[_LEN.size:])
        md = doc["__metadata__"]
        tensor = doc["kv"]
        start, end = (int(x) for x in tensor["data_offsets"])
        if md["format"] != FORMAT:
            raise BlockCorruptError(f"unknown block format {md['format']!r} (want {FORMAT})")
        compression = md["compression"]
        if compression not in _COMPRESSIONS:
            raise BlockCorruptError(f"unknown compression {compression!r}")
        meta = BlockMeta(
            key=bytes.fromhex(md["key"]), fingerprint=md["fingerprint"], layout=md["layout"],
            token_count=int(md["token_count"]), traffic_class=md["traffic_class"],
            expires_at=float(md["expires_at"]), checksum=bytes.fromhex(md["checksum"]),
            size=int(md["size"]), tenant=md["tenant"])
    except BlockCorruptError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise BlockCorruptError(f"bad block header: {type(exc).__name__}: {exc}") from None
    if not 0 <= start <= end or len(meta.checksum) != CHECKSUM_BYTES:
        raise BlockCorruptError("bad block header: data offsets or checksum malformed")
    if compression == "none" and end - start != meta.size:
        raise BlockCorruptError(f"bad block header: {end - start} stored bytes != size {meta.size}")
    return BlockHeader(meta, compression, hlen + start, hlen + end)


def decode_block(data: bytes | bytearray | memoryview, expect_key: bytes | None = None, *,
                 mac: BlockMac = UNKEYED) -> DecodedBlock:
    """Verified (meta, payload): header MAC, key, length and payload checksum. The
    payload is a view into ``data`` unless compressed."""
    view = memoryview(data).cast("B")
    head = parse_header(view[:header_length(view)], mac=mac)
    meta = head.meta
    if expect_key is not None and meta.key != expect_key:
        raise BlockCorruptError(f"block holds key {meta.key_hex}, expected {expect_key.hex()}")
    if head.data_end != view.nbytes:
        raise BlockCorruptError(f"block {meta.key_hex}: {view.nbytes} bytes on hand, header "
                                f"says {head.data_end} (truncated or trailing garbage)")
    stored = view[head.data_start:head.data_end]
    if head.compression == "lz4":
        try:
            payload = memoryview(lz4_decompress(stored, uncompressed_size=meta.size))
        except LZ4BlockError as exc:
            raise BlockCorruptError(f"block {meta.key_hex}: lz4 payload corrupt ({exc})") from None
        if payload.nbytes != meta.size:
            raise BlockCorruptError(f"block {meta.key_hex}: lz4 payload decompressed to "
                                    f"{payload.nbytes} bytes, header says {meta.size}")
    else:
        payload = stored
    if checksum(payload) != meta.checksum:
        raise BlockCorruptError(f"block {meta.key_hex}: checksum mismatch")
    return DecodedBlock(meta, payload)


__all__ = ["FORMAT", "MAC_KEY_BYTES", "UNKEYED", "BlockCorruptError", "BlockFormatError",
           "BlockHeader", "BlockMac", "BlockMeta", "DecodedBlock", "EncodedBlock", "checksum",
           "decode_block", "encode_block", "encode_parts", "header_length", "parse_header"]
