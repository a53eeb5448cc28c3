"""The batch-invariant attention kernel gives the same bits on every SIMD path
of this CPU (scalar, AVX2, AVX-512 where present), for the shapes prefill
and decode use: several segments, long key ranges with partial 16-key tails,
sliding windows, and head sizes with and without a specialised kernel."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from engine import bik

pytestmark = pytest.mark.skipif(not bik.available(), reason="native._bik not built")


@contextmanager
def _restoring_path() -> Iterator[None]:
    """The SIMD path in use before, back in use after (the tests switch it)."""
    before = bik.current_path()
    try:
        yield
    finally:
        bik.use_path(before)


def _attend(q: torch.Tensor, segs: list[bik.AttnSegment], kv_heads: int,
            window: int) -> torch.Tensor:
    out = torch.empty(q.shape[0], q.shape[1] * q.shape[2])
    bik.attend(q, segs, kv_heads, window, out)
    return out


def _queries(g: torch.Generator, shapes: list[tuple[int, int]], heads: int,
             head_dim: int) -> torch.Tensor:
    return torch.randn(sum(r for r, _ in shapes), heads, head_dim, generator=g)


def _segments(g: torch.Generator, shapes: list[tuple[int, int]], kv_heads: int,
              head_dim: int, spare: int) -> list[bik.AttnSegment]:
    """One segment per (rows, first position), each with its own random KV of
    ``spare`` slots past its last row, rows laid out in order."""
    segs, r0 = [], 0
    for r, start in shapes:
        kv = torch.randn(2, kv_heads, start + r + spare, head_dim, generator=g)
        segs.append(bik.AttnSegment(r0, r, start, kv))
        r0 += r
    return segs


@pytest.mark.parametrize("head_dim", [16, 48, 64, 128])
@pytest.mark.parametrize("window", [0, 37])
def test_every_simd_path_gives_the_same_bits(head_dim: int, window: int) -> None:
    g = torch.Generator().manual_seed(head_dim + window)
    heads, kv_heads = 6, 2
    # (rows, first position): a prefill chunk deep in a long context, a decode
    # row, a chunk from position 0, and one ending off a 16-key boundary.
    shapes = [(21, 1472), (1, 300), (40, 0), (9, 71)]
    q = _queries(g, shapes, heads, head_dim)
    segs = _segments(g, shapes, kv_heads, head_dim, spare=8)
    results = {}
    with _restoring_path():
        for path in bik.paths():
            bik.use_path(path)
            results[path] = _attend(q, segs, kv_heads, window)
            # A segment alone gives the same rows as in the batch (batch invariance).
            one = _attend(q[21:22], [bik.AttnSegment(0, 1, 300, segs[1].kv)], kv_heads, window)
            assert torch.equal(one, results[path][21:22]), path
    first = results[bik.paths()[0]]
    assert torch.isfinite(first).all()
    for path, out in results.items():
        assert torch.equal(out, first), f"{path} differs from {bik.paths()[0]}"


@pytest.mark.parametrize("n", [16, 70, 576, 1536])
def test_norm_and_swiglu_give_the_same_bits_on_every_path(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(37, n, generator=g) * 3
    w = torch.randn(n, generator=g)
    gu = torch.randn(37, 2 * n, generator=g) * 4
    gu[0, :5], gu[1, :5], gu[2, :3], gu[3, :3] = 0.0, -0.0, 100.0, -100.0   # exp's edges
    results = []
    with _restoring_path():
        for path in bik.paths():
            bik.use_path(path)
            results.append((bik.rms_norm(x, w, 1e-5), bik.silu_mul(gu)))
    for norm, silu in results[1:]:
        assert torch.equal(norm, results[0][0]) and torch.equal(silu, results[0][1])


@pytest.mark.parametrize("n", [19, 576])
def test_fused_add_norm_is_the_add_then_the_norm_on_every_path(n: int) -> None:
    """BIKernels' residual add + RMSNorm in one pass gives torch's add and the
    separate norm bit for bit, on strided rows too."""
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(41, n + 7, generator=g) * 3)[:, 3:3 + n]
    d = torch.randn(41, n, generator=g)
    w = torch.randn(n, generator=g)
    with _restoring_path():
        for path in bik.paths():
            bik.use_path(path)
            total, normed = bik.add_rms_norm(x, d, w, 1e-5)
            assert torch.equal(total, x + d), path
            assert torch.equal(normed, bik.rms_norm(x + d, w, 1e-5)), path
    with pytest.raises(ValueError, match="differ"):
        bik.add_rms_norm(x, d[:, :-1], w, 1e-5)


def test_rope_is_torch_rope_bit_for_bit() -> None:
    """bik's one-pass rotary embedding (what BIKernels uses) gives the torch
    version's bits on a strided q/k slice, so KV made before it stays valid."""
    from engine.kernels import TorchKernels
    from engine.model import RotaryTable

    g = torch.Generator().manual_seed(4)
    table = RotaryTable(64, 100_000.0, 4096, torch.device("cpu"), torch.float32)
    qkv = torch.randn(300, 15, 64, generator=g) * 5
    pos = torch.randint(0, 4096, (300,), generator=g)
    want = TorchKernels().rope(qkv[:, :12], pos, table.cos, table.sin)
    assert torch.equal(bik.rope(qkv[:, :12], pos, table.cos, table.sin), want)
    with pytest.raises(ValueError, match="outside the table"):
        bik.rope(qkv[:, :12], pos + 4096, table.cos, table.sin)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"),
                         [(9, 3, 64), (8, 2, 64), (4, 2, 32), (3, 3, 16), (6, 2, 48), (2, 1, 128)])
@pytest.mark.parametrize("window", [0, 45])
def test_attention_tiles_give_the_scalar_bits(heads: int, kv_heads: int, head_dim: int,
                                              window: int) -> None:
    """The SIMD attention's tiles (several keys and several (row, head) pairs
    per pass, key blocks of 64, the 8-key halving tree) against the scalar
    path bit for bit: key counts on and off every tile edge (3 keys, 8 keys,
    64-key blocks), rows of one tile with different key counts, GQA groups of
    1 to 4 heads, several segments, and rows whose scores tie at a signed zero
    or push the weights to the exp clamp."""
    g = torch.Generator().manual_seed(heads * 1000 + head_dim + window)
    # (rows, first position): keys 191..203 across a block edge, one row just
    # past a block, rows with fewer keys than one tile, 123..129 across 128.
    shapes = [(13, 190), (1, 64), (5, 0), (7, 122)]
    q = _queries(g, shapes, heads, head_dim)
    q[0] = 0.0                    # every score +0
    q[1] = -0.0                   # every score a signed zero
    q[2] *= 40.0                  # weights down to exp's clamp
    segs = _segments(g, shapes, kv_heads, head_dim, spare=3)
    with _restoring_path():
        bik.use_path("scalar")
        want = _attend(q, segs, kv_heads, window)
        for path in bik.paths():
            bik.use_path(path)
            assert torch.equal(_attend(q, segs, kv_heads, window), want), path
    assert torch.isfinite(want).all()


@pytest.mark.parametrize("block_tokens", [16, 64])
@pytest.mark.parametrize("window", [0, 37])
def test_reading_the_pool_through_block_tables_gives_the_mirrors_bits(
        block_tokens: int, window: int) -> None:
    """The engine's CPU attention reads a sequence's keys in the paged pool
    (engine/attention.py): scattered blocks, in any order, give exactly what
    the same keys laid out contiguously give, on every SIMD path and layer."""
    g = torch.Generator().manual_seed(block_tokens + window)
    layers, kv_heads, heads, d, nb = 2, 3, 9, 64, 64
    pool = torch.randn(layers, 2, kv_heads, nb, block_tokens, d, generator=g)
    shapes = [(21, 700), (1, 300), (40, 0), (9, 71), (1, 16 * block_tokens - 1)]
    perm = torch.randperm(nb, generator=g)
    segs, mirrors, r0, used = [], [], 0, 0
    for r, start in shapes:
        need = -(-(start + r) // block_tokens)
        if used + need > nb:
            used = 0                      # tables may share blocks: reads only
        table = perm[used:used + need].to(torch.int64)
        used += need
        segs.append(bik.PagedSegment(r0, r, start, table))
        mirrors.append(pool[:, :, :, table].reshape(layers, 2, kv_heads, need * block_tokens, d)
                       .contiguous())
        r0 += r
    q = torch.randn(r0, heads, d, generator=g)
    plan = bik.PagedAttention(pool, segs)
    with _restoring_path():
        for path in bik.paths():
            bik.use_path(path)
            for layer in range(layers):
                paged = torch.empty(r0, heads * d)
                plan(layer, q, window, paged)
                want = _attend(q, [bik.AttnSegment(s.row0, s.rows, s.q_start, m[layer])
                                   for s, m in zip(segs, mirrors, strict=True)],
                               kv_heads, window)
                assert torch.equal(paged, want), (path, layer)


def test_a_block_table_outside_the_pool_is_refused() -> None:
    """The kernel trusts the tables: they are checked when the plan is made."""
    pool = torch.zeros(1, 2, 1, 4, 16, 16)
    with pytest.raises(ValueError, match="outside the pool"):
        bik.PagedAttention(pool, [bik.PagedSegment(0, 1, 20, torch.tensor([0, 4]))])
    with pytest.raises(ValueError, match="table has 1 blocks"):
        bik.PagedAttention(pool, [bik.PagedSegment(0, 1, 20, torch.tensor([0]))])
    with pytest.raises(ValueError, match="power of two"):
        bik.PagedAttention(torch.zeros(1, 2, 1, 4, 12, 16),
                           [bik.PagedSegment(0, 1, 0, torch.tensor([0]))])


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
@pytest.mark.parametrize("window", [0, 29])
def test_wide_items_give_the_scalar_bits_through_block_tables(head_dim: int,
                                                              window: int) -> None:
    """The AVX-512 attention on items of many (row, head) pairs (a GQA group
    of 8 and many rows: up to 48 pairs an item, where a score kernel that
    pays per item rather than per pair would take over) against the scalar
    path bit for bit, read through a block table of 16-key blocks: causal
    rows whose keys end at every offset of a 16-key tile, a chunk from
    position 0, a decode row, sliding windows (the rows still at key 0 share
    an item, each later row is one of its own), and rows of +0, -0 and
    exp-clamping queries."""
    g = torch.Generator().manual_seed(head_dim * 10 + window)
    heads, kv_heads, bt, nb = 8, 1, 16, 48
    pool = torch.randn(1, 2, kv_heads, nb, bt, head_dim, generator=g)
    shapes = [(37, 0), (50, 203), (1, 95)]
    perm = torch.randperm(nb, generator=g)
    segs, mirrors, r0, used = [], [], 0, 0
    for r, start in shapes:
        need = -(-(start + r) // bt)
        table = perm[used:used + need].to(torch.int64)
        used += need
        segs.append(bik.PagedSegment(r0, r, start, table))
        mirrors.append(pool[0, :, :, table].reshape(2, kv_heads, need * bt, head_dim))
        r0 += r
    q = torch.randn(r0, heads, head_dim, generator=g)
    q[40], q[41], q[42] = 0.0, -0.0, q[42] * 40.0
    plan = bik.PagedAttention(pool, segs)
    mirror_segs = [bik.AttnSegment(s.row0, s.rows, s.q_start, m.contiguous())
                   for s, m in zip(segs, mirrors, strict=True)]
    with _restoring_path():
        bik.use_path("scalar")
        want = _attend(q, mirror_segs, kv_heads, window)
        for path in bik.paths():
            bik.use_path(path)
            got = torch.empty(r0, heads * head_dim)
            plan(0, q, window, got)
            assert torch.equal(got, want), path
    assert torch.isfinite(want).all()
