"""Zero-copy protobuf wire codec for the two bulk messages, PutChunk and
GetChunk (proto/kvstore.proto).

Why: the generated classes copy a bytes field on parse and again on access,
and serializing copies once more; at 1-4 MiB per message that is most of a
transfer's cost. Here a block's bytes are written once into the outgoing
message (``b"".join``) and read as a ``memoryview`` slice of the incoming one.
The output is ordinary protobuf, so any generated client or server still
interoperates; the small sub-messages (headers) go through the generated
classes. Parsing is strict: truncated fields, bad varints and unknown wire
types raise ``WireError`` (the service answers INVALID_ARGUMENT).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from proto import kvstore_pb2

_LEN, _VARINT, _I64, _I32 = 2, 0, 1, 5
_DOUBLE = struct.Struct("<d")


class WireError(ValueError):
    """Bytes that are not a valid message of the expected type."""


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise WireError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift >= 64:
            raise WireError("varint longer than 10 bytes")


def _fields(raw: bytes | memoryview) -> list[tuple[int, int, int | memoryview]]:
    """(field number, wire type, value) of every field; LEN values are views."""
    buf = memoryview(raw)
    pos, out = 0, []
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        number, wtype = key >> 3, key & 7
        if number == 0:
            raise WireError("field number 0")
        if wtype == _VARINT:
            value, pos = _read_varint(buf, pos)
            out.append((number, wtype, value))
        elif wtype == _LEN:
            n, pos = _read_varint(buf, pos)
            if pos + n > len(buf):
                raise WireError(f"field {number}: {n} bytes announced, {len(buf) - pos} left")
            out.append((number, wtype, buf[pos:pos + n]))
            pos += n
        elif wtype in (_I64, _I32):
            n = 8 if wtype == _I64 else 4
            if pos + n > len(buf):
                raise WireError(f"field {number}: truncated fixed-width value")
            out.append((number, wtype, buf[pos:pos + n]))
            pos += n
        else:
            raise WireError(f"field {number}: unsupported wire type {wtype}")
    return out


def _len_field(number: int, size: int) -> bytes:
    return _varint(number << 3 | _LEN) + _varint(size)


def _sub(cls: type, value: int | memoryview, what: str) -> object:
    if not isinstance(value, memoryview):
        raise WireError(f"{what}: expected a length-delimited field")
    try:
        return cls.FromString(value.tobytes())
    except DecodeError as exc:
        raise WireError(f"{what}: {exc}") from None


# -- PutChunk ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PutPart:
    header: kvstore_pb2.PutHeader | None = None
    data: memoryview | None = None


def encode_put_header(header: kvstore_pb2.PutHeader) -> bytes:
    return kvstore_pb2.PutChunk(header=header).SerializeToString()


def encode_put_data(payload: memoryview) -> bytes:
    return b"".join((_len_field(2, payload.nbytes), payload))


def decode_put_chunk(raw: bytes) -> PutPart:
    header, data = None, None
    for number, _wtype, value in _fields(raw):
        if number == 1:
            header, data = _sub(kvstore_pb2.PutHeader, value, "PutChunk.header"), None
        elif number == 2:
            if not isinstance(value, memoryview):
                raise WireError("PutChunk.data: expected bytes")
            header, data = None, value  # oneof: the last one wins, as in protobuf
    return PutPart(header, data)  # type: ignore[arg-type]


# -- GetChunk ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class GetPart:
    header: kvstore_pb2.BlockHeader | None
    data: memoryview
    shm_name: str = ""
    shm_offset: int = 0
    missing: bool = False
    shm_valid_until: float = 0.0
    shm_reuse_gen: int = 0
    more: tuple[GetPart, ...] = ()   # descriptor-only chunks of the next blocks, in order

    def parts(self) -> tuple[GetPart, ...]:
        """This chunk, then the ones it carries in ``more``."""
        return (self, *self.more)


def get_chunk_prefix(header: kvstore_pb2.BlockHeader | None, data_size: int) -> bytes:
    """Everything of a GetChunk before its data bytes."""
    head = b""
    if header is not None:
        h = header.SerializeToString()
        head = _len_field(1, len(h)) + h
    return head + (_len_field(2, data_size) if data_size else b"")


def encode_get_chunk(msg: kvstore_pb2.GetChunk) -> bytes:
    """Small chunks (misses, shared-memory descriptors) go through protobuf."""
    return msg.SerializeToString()


def encode_get_chunks(msgs: list[kvstore_pb2.GetChunk]) -> bytes:
    """Descriptor-only chunks of consecutive blocks as ONE message: the first,
    carrying the rest in ``more``."""
    first = kvstore_pb2.GetChunk()
    first.CopyFrom(msgs[0])
    first.more.extend(msgs[1:])
    return first.SerializeToString()


def decode_get_chunk(raw: bytes | memoryview, *, nested: bool = False) -> GetPart:
    kw: dict[str, object] = {}
    more: list[GetPart] = []
    data = memoryview(b"")
    header = None
    for number, wtype, value in _fields(raw):
        if number == 1:
            header = _sub(kvstore_pb2.BlockHeader, value, "GetChunk.header")
        elif number == 2 and isinstance(value, memoryview):
            data = value
        elif number == 3 and isinstance(value, memoryview):
            kw["shm_name"] = value.tobytes().decode()
        elif number == 4 and wtype == _VARINT:
            kw["shm_offset"] = value
        elif number == 5 and wtype == _VARINT:
            kw["missing"] = bool(value)
        elif number == 6 and wtype == _I64 and isinstance(value, memoryview):
            kw["shm_valid_until"] = _DOUBLE.unpack(value)[0]
        elif number == 7 and wtype == _VARINT:
            kw["shm_reuse_gen"] = value
        elif number == 8 and isinstance(value, memoryview):
            if nested:
                raise WireError("GetChunk.more: a carried chunk carries no more chunks")
            sub = decode_get_chunk(value, nested=True)
            if sub.header is None or sub.data.nbytes:
                raise WireError("GetChunk.more: carried chunks are headers without data")
            more.append(sub)
    return GetPart(header, data, more=tuple(more), **kw)  # type: ignore[arg-type]
