"""The prompt KV host buffer: byte pieces, shared memory, expiry, limits."""

from __future__ import annotations

import os

import pytest
import torch

from service.errors import HandleExpired, Overloaded
from service.kv_buffer import KVAssembler, KVBuffer, KVShape


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _kv(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # [layers, 2, kv_heads, n, head_dim]
    return torch.arange(3 * 2 * 2 * n * 8, dtype=torch.float32).reshape(3, 2, 2, n, 8).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pieces_reassemble_exactly(dtype: torch.dtype) -> None:
    kv = _kv(37, dtype)
    token_bytes = KVShape.of(kv).token_nbytes
    buf = KVBuffer(ttl_s=10, max_bytes=1 << 20, chunk_bytes=64 * 1024, shm_dir="")
    entry = buf.put("r1", kv)
    pieces = list(buf.pieces(entry))
    assert sum(p.token_count for p in pieces) == 37
    assert all(len(p.data) == p.token_count * token_bytes for p in pieces)
    asm = KVAssembler(KVShape.of(kv), 37)
    for p in pieces:
        asm.add(p)
    assert torch.equal(asm.done(), kv)


def test_small_chunks_split_along_tokens() -> None:
    kv = torch.randn(30, 2, 3, 100, 64)          # 46080 bytes per token
    buf = KVBuffer(ttl_s=10, max_bytes=1 << 30, chunk_bytes=64 * 1024, shm_dir="")
    pieces = list(buf.pieces(buf.put("r", kv)))
    assert [p.token_count for p in pieces][:2] == [1, 1]
    assert len(pieces) == 100
    asm = KVAssembler(KVShape.of(kv), 100)
    for p in pieces:
        asm.add(p)
    assert torch.equal(asm.done(), kv)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this machine")
def test_shared_memory_piece_and_cleanup() -> None:
    kv = _kv(20)
    buf = KVBuffer(ttl_s=10, max_bytes=1 << 20, chunk_bytes=1 << 20, shm_dir="/dev/shm")
    entry = buf.put("r", kv)
    piece = buf.shm_piece(entry)
    assert piece.data == b"" and piece.size == kv.numel() * 4
    assert buf.shm_piece(entry).shm_name == piece.shm_name      # written once
    asm = KVAssembler(KVShape.of(kv), 20)
    assert asm.shm_visible(piece.shm_name)
    asm.add(piece)
    got = asm.done()
    assert torch.equal(got, kv)
    assert buf.release("r") is True
    assert not os.path.exists(f"/dev/shm/{piece.shm_name}")
    assert buf.stats().bytes == 0
    # The whole-prompt piece is mapped, not copied: it stays readable after the
    # file is gone, and writing to it never reaches another reader.
    assert torch.equal(got, kv)
    got.zero_()
    assert torch.equal(got, torch.zeros_like(kv))


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this machine")
def test_short_or_released_shared_memory_is_refused() -> None:
    kv = _kv(20)
    buf = KVBuffer(ttl_s=10, max_bytes=1 << 20, chunk_bytes=1 << 20, shm_dir="/dev/shm")
    piece = buf.shm_piece(buf.put("r", kv))
    os.truncate(f"/dev/shm/{piece.shm_name}", piece.size // 2)
    with pytest.raises(ValueError, match="short"):
        KVAssembler(KVShape.of(kv), 20).add(piece)
    buf.release("r")
    gone = buf.put("g", kv)
    buf.release("g")                    # released before its first pull
    with pytest.raises(HandleExpired, match="released"):
        buf.shm_piece(gone)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"kvserve-kv-{os.getpid()}-")]


def test_expiry_and_release_say_why() -> None:
    clock = Clock()
    buf = KVBuffer(ttl_s=5, max_bytes=1 << 20, chunk_bytes=1 << 20, clock=clock)
    buf.put("a", _kv(4))
    buf.put("b", _kv(4))
    clock.t += 6
    with pytest.raises(HandleExpired, match="expired"):
        buf.get("a")
    assert buf.release("b") is False               # expired before decode let go
    assert buf.sweep() == 0
    with pytest.raises(HandleExpired, match="never prefilled"):
        buf.get("zzz")
    buf.put("c", _kv(4))
    assert buf.release("c") is True
    with pytest.raises(HandleExpired, match="released"):
        buf.get("c")


def test_full_buffer_refuses_and_frees_on_expiry() -> None:
    clock = Clock()
    one = _kv(16).numel() * 4
    buf = KVBuffer(ttl_s=5, max_bytes=2 * one, chunk_bytes=1 << 20, clock=clock)
    buf.put("a", _kv(16))
    buf.put("b", _kv(16))
    with pytest.raises(Overloaded, match="buffer full"):
        buf.put("c", _kv(16))
    clock.t += 6
    buf.put("c", _kv(16))                          # expired entries made room
    assert buf.stats().entries == 1 and buf.stats().expired == 2


def test_room_is_checked_before_the_handle_and_its_expiry_is_kept() -> None:
    """Prefill answers before the KV is buffered: the room check and the expiry
    it promises in the handle must hold for the put that follows."""
    clock = Clock()
    one = _kv(16).numel() * 4
    buf = KVBuffer(ttl_s=5, max_bytes=2 * one, chunk_bytes=1 << 20, clock=clock)
    promised = buf.expiry()
    buf.check_room(2 * one)
    clock.t += 1                                   # the copy-out takes a while
    assert buf.put("a", _kv(16), expires_at=promised).expires_at == promised == 1005.0
    buf.put("b", _kv(16))
    with pytest.raises(Overloaded, match="buffer full"):
        buf.check_room(1)
    clock.t += 4
    with pytest.raises(HandleExpired, match="expired"):
        buf.get("a")                               # at the promised time, not a second later


def test_assembler_rejects_bad_pieces() -> None:
    kv = _kv(8)
    shape = KVShape.of(kv)
    buf = KVBuffer(ttl_s=5, max_bytes=1 << 20, chunk_bytes=1 << 20)
    (piece,) = list(buf.pieces(buf.put("r", kv)))
    asm = KVAssembler(shape, 9)
    asm.add(piece)
    with pytest.raises(ValueError, match="ended after 8 of 9"):
        asm.done()
    with pytest.raises(ValueError, match="bytes"):
        KVAssembler(shape, 8).add(type(piece)(0, 8, piece.data[:-4]))
    with pytest.raises(ValueError, match="bad shared-memory name"):
        KVAssembler(shape, 8).add(type(piece)(0, 8, shm_name="../etc/passwd", size=len(piece.data)))
