"""Block accounting (exact state) and the pool tensor's one-gather export."""

from __future__ import annotations

import pytest
import torch

from engine.errors import PoolExhaustedError
from engine.kv_pool import BlockPool, KVLayout, KVStorage


def test_layout_name_and_bytes_for_smollm2_shape() -> None:
    lay = KVLayout(layers=30, kv_heads=3, block_tokens=64, head_dim=64, dtype="float32")
    assert lay.name == "L30xH3xT64xD64:float32"
    assert lay.block_shape == (30, 2, 3, 64, 64)
    assert lay.block_nbytes == 30 * 2 * 3 * 64 * 64 * 4


def test_allocate_release_and_exhaustion() -> None:
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free == 1
    with pytest.raises(PoolExhaustedError, match="need 2 blocks, 1 of 4 free"):
        pool.allocate(2)
    pool.release(a)
    assert pool.num_free == 4 and [pool.ref_count(b) for b in a] == [0, 0, 0]
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([0])


def test_cached_blocks_wait_in_lru_and_are_evicted_last() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    assert pool.cache(a[0], b"k0") and pool.cache(a[1], b"k1")
    assert not pool.cache(a[1], b"k1-again")         # a block has one key
    pool.release(a)                                   # refcount 0: kept, evictable
    assert pool.match([b"k0", b"k1", b"k2"]) == a and pool.num_cached == 2
    assert pool.num_free == 4
    b = pool.allocate(2)                              # the free list first
    assert set(b).isdisjoint(a) and pool.num_cached == 2 and pool.evicted_total == 0
    pool.acquire(pool.match([b"k0"]))                 # a hit pins k0
    c = pool.allocate(1)                              # must evict k1, never pinned k0
    assert c == [a[1]] and pool.match([b"k0", b"k1"]) == [a[0]]
    assert pool.evicted_total == 1
    with pytest.raises(PoolExhaustedError):
        pool.allocate(1)


def test_shared_block_survives_one_release() -> None:
    pool = BlockPool(2)
    (blk,) = pool.allocate(1)
    pool.cache(blk, b"k")
    pool.acquire([blk])
    pool.release([blk])
    assert pool.ref_count(blk) == 1 and pool.num_free == 1


def _storage() -> KVStorage:
    lay = KVLayout(layers=3, kv_heads=2, block_tokens=4, head_dim=8, dtype="float32")
    st = KVStorage(lay, num_blocks=10, device=torch.device("cpu"))
    st.data.copy_(torch.randn(st.data.shape, generator=torch.Generator().manual_seed(0)))
    return st


def test_export_is_the_documented_block_tensor() -> None:
    st = _storage()
    ids = torch.tensor([7, 2, 5])
    out = st.export(ids)
    assert out.shape == (3, 3, 2, 2, 4, 8) and out.is_contiguous()
    for i, b in enumerate(ids.tolist()):           # reference: block b, layer l, K/V c
        for layer in range(3):
            for c in range(2):
                assert torch.equal(out[i, layer, c], st.data[layer, c, :, b])
    buf = torch.empty_like(out)
    assert st.export(ids, out=buf) is buf and torch.equal(buf, out)


def test_import_scatters_blocks_and_tokens_round_trip() -> None:
    st = _storage()
    blocks = torch.randn(2, 3, 2, 2, 4, 8)
    ids = torch.tensor([4, 1])
    st.import_(ids, blocks)
    assert torch.equal(st.export(ids), blocks)
    slots = torch.tensor([4 * 4 + 1, 4 * 4 + 2, 1 * 4 + 0])     # block*B + offset
    toks = st.export_tokens(slots)
    assert toks.shape == (3, 2, 2, 3, 8)
    assert torch.equal(toks[:, :, :, 2], blocks[1, :, :, :, 0])
    st.import_tokens(slots, toks * 2)
    assert torch.equal(st.export_tokens(slots), toks * 2)


def test_gather_all_returns_tokens_in_table_order() -> None:
    st = _storage()
    kv = st.gather_all(torch.tensor([3, 0]))              # [L, 2, H, 2*B, D]
    assert kv.shape == (3, 2, 2, 8, 8)
    assert torch.equal(kv[:, :, :, :4], st.data[:, :, :, 3])
    assert torch.equal(kv[:, :, :, 4:], st.data[:, :, :, 0])
