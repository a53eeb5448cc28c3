"""Tiers: round trips, capacity and LRU order, integrity, atomicity, restarts, and
the same-host shared-memory path (a real second process)."""

from __future__ import annotations

import itertools
import os
import random
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import fsspec
import pytest

from kvstore.blockfile import BlockCorruptError, BlockMeta, checksum, encode_block
from kvstore.tiers import ShmReader, Tier, TierError, open_tier, tier_schemes
from kvstore.tiers.arena import PAGE, SMALL_GRAIN, GraceArena, SizeClassArena, class_size
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostTier
from kvstore.tiers.objstore import ObjectTier

ROOT = Path(__file__).resolve().parents[2]
PAYLOAD = 3000          # bytes per test block
CAP = 11_000            # room for exactly 3 blocks in every tier (G2 slots 3008 B, files ~3.5 KB)


def make(n: int = PAYLOAD, seed: int | None = None) -> tuple[bytes, bytes, BlockMeta]:
    rng = random.Random(seed)
    key, payload = rng.randbytes(16), rng.randbytes(n)
    return key, payload, BlockMeta(key, "fp" * 16, "L1xH1xT1xD1:float32", 64, "chat", 1e9)


TierFactory = Callable[..., Tier]


def _url(kind: str, tmp: Path) -> str:
    return {
        "g2": "mem://t",
        "g3-path": str(tmp / "g3"),
        "g3-url": f"file://{tmp}/g3u",
        "g4-memory": f"memory://kvs-{secrets.token_hex(4)}/blocks",
        "g4-local": f"fsspec+file://{tmp}/g4",
    }[kind]


@pytest.fixture(params=["g2", "g3-path", "g3-url", "g4-memory", "g4-local"])
def tier_factory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TierFactory]:
    url = _url(request.param, tmp_path)
    opened: list[Tier] = []

    def factory(**kw: object) -> Tier:
        kw.setdefault("capacity_bytes", CAP)
        t = open_tier(url, name="t", **kw)  # type: ignore[arg-type]
        opened.append(t)
        return t

    yield factory
    for t in opened:
        t.close()


# -- every tier ---------------------------------------------------------------

@pytest.mark.parametrize("lz4", [False, True])
def test_round_trip(tier_factory: TierFactory, lz4: bool) -> None:
    tier = tier_factory(lz4=lz4)
    key, payload, meta = make(seed=1)
    out = tier.put(key, payload, meta)
    assert out.stored and not out.existed and out.evicted == []
    hit = tier.get(key)
    assert hit is not None
    got_meta, got = hit
    assert bytes(got) == payload
    assert got_meta.checksum == checksum(payload) and got_meta.size == PAYLOAD
    assert got_meta.traffic_class == "chat" and got_meta.token_count == 64
    again = tier.put(key, payload, meta)
    assert again.stored and again.existed
    assert tier.contains(key) and [m.key for m in tier.scan()] == [key]
    s = tier.stats()
    assert (s.blocks, s.hits, s.misses, s.checksum_failures) == (1, 1, 0, 0)
    assert tier.get(bytes(16)) is None and tier.stats().misses == 1
    assert tier.delete(key) and not tier.delete(key)
    assert tier.get(key) is None and not tier.contains(key)
    assert tier.stats().blocks == 0 and tier.stats().used_bytes == 0


def test_capacity_and_lru_order(tier_factory: TierFactory) -> None:
    tier = tier_factory()
    blocks = [make(seed=i) for i in range(5)]
    for key, payload, meta in blocks[:3]:
        assert tier.put(key, payload, meta).stored
    assert tier.get(blocks[0][0]) is not None          # 0 becomes most recent: order 1, 2, 0
    out = tier.put(*blocks[3])
    assert [m.key for m in out.evicted] == [blocks[1][0]]
    assert out.evicted[0].size == PAYLOAD and out.evicted[0].traffic_class == "chat"
    out = tier.put(*blocks[4])
    assert [m.key for m in out.evicted] == [blocks[2][0]]
    present = {k for k, _, _ in blocks if tier.get(k) is not None}
    assert present == {blocks[0][0], blocks[3][0], blocks[4][0]}
    s = tier.stats()
    assert s.evictions == 2 and s.blocks == 3 and s.used_bytes <= s.capacity_bytes


def test_block_larger_than_capacity_is_refused(tier_factory: TierFactory) -> None:
    tier = tier_factory(capacity_bytes=1000)
    key, payload, meta = make(seed=2)
    out = tier.put(key, payload, meta)
    assert not out.stored and tier.get(key) is None


def test_key_and_checksum_mismatch_rejected(tier_factory: TierFactory) -> None:
    tier = tier_factory()
    key, payload, meta = make(seed=3)
    with pytest.raises(TierError, match=r"meta\.key"):
        tier.put(bytes(16), payload, meta)
    lying = BlockMeta(key, "fp", "x", 64, "chat", 0.0, checksum=bytes(16))
    with pytest.raises(BlockCorruptError):
        tier.put(key, payload, lying)
    assert tier.stats().blocks == 0


def test_on_evict_receives_the_payload(tier_factory: TierFactory) -> None:
    got: list[tuple[bytes, bytes]] = []
    tier = tier_factory(on_evict=lambda m, p: got.append((m.key, bytes(p))))
    blocks = [make(seed=10 + i) for i in range(4)]
    for b in blocks:
        tier.put(*b)
    assert got == [(blocks[0][0], blocks[0][1])]


def test_threads_share_a_tier_safely(tier_factory: TierFactory) -> None:
    tier = tier_factory(capacity_bytes=8 * 4096)
    blocks = [make(n=1000, seed=100 + i) for i in range(24)]
    errors: list[str] = []

    def worker(offset: int) -> None:
        for i in range(40):
            key, payload, meta = blocks[(i * 7 + offset) % len(blocks)]
            tier.put(key, payload, meta)
            hit = tier.get(key)
            if hit is not None and bytes(hit.payload) != payload:
                errors.append(key.hex())

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    s = tier.stats()
    assert s.used_bytes <= s.capacity_bytes and s.checksum_failures == 0



def test_put_many_round_trip(tier_factory: TierFactory) -> None:
    tier = tier_factory()
    b0, b1, b2 = (make(seed=20 + i) for i in range(3))
    assert tier.put(*b0).stored
    outs = tier.put_many([b1, b0, b2, b1])
    assert [(o.stored, o.existed, o.evicted) for o in outs] == [
        (True, False, []), (True, True, []), (True, False, []), (True, True, [])]
    for key, payload, _ in (b0, b1, b2):
        assert bytes(tier.get(key).payload) == payload  # type: ignore[union-attr]
    assert tier.put_many([]) == [] and tier.stats().blocks == 3


# -- registry -------------------------------------------------------------------

def test_registry_picks_tier_by_scheme(tmp_path: Path) -> None:
    assert {"", "file", "mem"} <= set(tier_schemes())
    cases = {"mem://": HostTier, str(tmp_path / "a"): DiskTier, f"file://{tmp_path}/b": DiskTier,
             "memory://reg/x": ObjectTier, f"fsspec+file://{tmp_path}/c": ObjectTier}
    for url, cls in cases.items():
        with open_tier(url, name="r", capacity_bytes=CAP) as t:
            assert type(t) is cls
    with pytest.raises(TierError, match="no fsspec filesystem"):
        open_tier("nosuchproto://x", name="r", capacity_bytes=CAP)
    with pytest.raises(TierError, match="tier name"):
        open_tier("mem://", name="bad name", capacity_bytes=CAP)
    with pytest.raises(ValueError, match="unknown eviction policy"):
        open_tier("mem://", name="r", capacity_bytes=CAP, policy="nope")


# -- G2 shared memory -----------------------------------------------------------

def test_g2_slot_is_readable_from_another_process() -> None:
    with open_tier("mem://", name="shm", capacity_bytes=CAP) as tier:
        assert isinstance(tier, HostTier)
        key, payload, meta = make(seed=4)
        tier.put(key, payload, meta)
        slot = tier.locate(key)
        assert slot is not None and slot.shm_name == tier.shm_name
        code = (
            "import sys\n"
            "from kvstore.tiers import ShmReader, ShmSlot\n"
            "name, off, size, ck = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]\n"
            "r = ShmReader()\n"
            "data = r.read(ShmSlot(name, off, size, bytes.fromhex(ck)))\n"
            "sys.stdout.write(bytes(data).hex())\n"
            "r.close()\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code, slot.shm_name, str(slot.offset), str(slot.size),
             slot.checksum.hex()], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert bytes.fromhex(out.stdout) == payload
        # The reader's exit must not have unlinked the store's segment.
        assert bytes(ShmReader().read(slot) or b"") == payload
        assert bytes(tier.get(key).payload) == payload  # type: ignore[union-attr]


def test_g2_scribbled_block_is_dropped_not_served() -> None:
    with open_tier("mem://", name="g2c", capacity_bytes=CAP) as tier:
        key, payload, meta = make(seed=5)
        tier.put(key, payload, meta)
        slot = tier.locate(key)
        assert slot is not None
        from kvstore.tiers.shm import attach_segment

        seg = attach_segment(slot.shm_name)
        seg.buf[slot.offset + 17] ^= 0xFF   # another process writes into the arena
        seg.close()
        assert tier.get(key) is None
        s = tier.stats()
        assert s.checksum_failures == 1 and s.blocks == 0 and not tier.contains(key)


def test_g2_reader_detects_reuse_of_a_located_slot() -> None:
    with open_tier("mem://", name="g2r", capacity_bytes=CAP, reuse_grace_s=60.0) as tier:
        assert isinstance(tier, HostTier)
        reader = ShmReader()
        blocks = [make(seed=20 + i) for i in range(4)]
        for b in blocks[:3]:
            tier.put(*b)
        slot = tier.locate(blocks[0][0])
        assert slot is not None and bytes(reader.read(slot) or b"") == blocks[0][1]
        tier.delete(blocks[0][0])
        # Grace holds the freed slot back; the arena is full, so it is reused early
        # and the generation bump tells the reader its slot info is stale.
        tier.put(*blocks[3])
        assert tier.early_reuses == 1
        assert tier.locate(blocks[3][0]).offset == slot.offset  # type: ignore[union-attr]
        assert reader.read(slot) is None
        reader.close()


def test_g2_grace_delays_reuse() -> None:
    with open_tier("mem://", name="g2g", capacity_bytes=4 * CAP, reuse_grace_s=60.0) as tier:
        a, b = make(seed=30), make(seed=31)
        tier.put(*a)
        off = tier.locate(a[0]).offset  # type: ignore[union-attr]
        tier.delete(a[0])
        tier.put(*b)  # space elsewhere: the freed slot stays quarantined
        assert tier.locate(b[0]).offset != off  # type: ignore[union-attr]
        assert tier.early_reuses == 0  # type: ignore[attr-defined]


@pytest.mark.gpu
def test_g2_is_pinned_with_cuda() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    with open_tier("mem://", name="pin", capacity_bytes=1 << 20) as tier:
        assert isinstance(tier, HostTier) and tier.pinned
        view = torch.frombuffer(tier._shm.buf, dtype=torch.uint8)
        assert view.is_pinned()
        del view  # drop the buffer export before the tier closes its segment


# -- G3 disk ----------------------------------------------------------------------

def test_g3_writes_are_atomic_and_content_addressed(tmp_path: Path) -> None:
    with open_tier(str(tmp_path), name="g3", capacity_bytes=CAP) as tier:
        blocks = [make(seed=40 + i) for i in range(3)]
        for b in blocks:
            tier.put(*b)
        files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
        assert not [p for p in files if p.name.endswith(".tmp")]
        want = sorted(tmp_path / k.hex()[:2] / k.hex()[2:4] / f"{k.hex()}.kvb"
                      for k, _, _ in blocks)
        assert files == want


def test_g3_reopen_rebuilds_contents_and_lru_order(tmp_path: Path) -> None:
    blocks = [make(seed=50 + i) for i in range(4)]
    with open_tier(str(tmp_path), name="g3", capacity_bytes=CAP) as tier:
        for i, b in enumerate(blocks[:3]):
            tier.put(*b)
            p = tier.path(b[0])  # type: ignore[attr-defined]
            os.utime(p, (1000 + i, 1000 + i))
        used = tier.stats().used_bytes
    # An interrupted write left a temp file behind.
    leftover = tmp_path / "ab" / "cd" / ".abcd.123.tmp"
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"half a block")
    with open_tier(str(tmp_path), name="g3", capacity_bytes=CAP) as tier:
        assert not leftover.exists()
        s = tier.stats()
        assert (s.blocks, s.used_bytes) == (3, used)
        assert bytes(tier.get(blocks[1][0]).payload) == blocks[1][1]  # type: ignore[union-attr]
        assert sorted(m.key for m in tier.scan()) == sorted(b[0] for b in blocks[:3])
        out = tier.put(*blocks[3])  # oldest mtime (block 0) goes first
        assert [m.key for m in out.evicted] == [blocks[0][0]]


def test_g3_reopen_with_smaller_capacity_evicts_oldest(tmp_path: Path) -> None:
    blocks = [make(seed=60 + i) for i in range(3)]
    with open_tier(str(tmp_path), name="g3", capacity_bytes=CAP) as tier:
        for i, b in enumerate(blocks):
            tier.put(*b)
            os.utime(tier.path(b[0]), (2000 + i, 2000 + i))  # type: ignore[attr-defined]
    with open_tier(str(tmp_path), name="g3", capacity_bytes=CAP // 2) as tier:
        assert tier.keys() == [blocks[2][0]]
        assert len(list(tmp_path.rglob("*.kvb"))) == 1


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_g3_hit_is_a_private_copy_not_a_view_of_the_file(tmp_path: Path) -> None:
    # Reads go into uninitialised buffers (no zero-fill): the payload must still be
    # exactly the stored bytes, and a later change to the file must not reach it.
    with open_tier(str(tmp_path), name="g3", capacity_bytes=CAP) as tier:
        key, payload, meta = make(seed=72)
        tier.put(key, payload, meta)
        hits = [tier.get(key) for _ in range(3)]
        assert all(h is not None and bytes(h.payload) == payload for h in hits)
        _flip(tier.path(key), tier.path(key).stat().st_size - 1)
        assert hits[0] is not None and bytes(hits[0].payload) == payload
        assert tier.get(key) is None and tier.stats().checksum_failures == 1


@pytest.mark.parametrize("damage", ["payload", "header", "truncate", "empty", "wrong-key"])
def test_g3_damaged_file_is_detected_counted_deleted(tmp_path: Path, damage: str) -> None:
    with open_tier(str(tmp_path), name="g3", capacity_bytes=CAP) as tier:
        assert isinstance(tier, DiskTier)
        key, payload, meta = make(seed=70)
        tier.put(key, payload, meta)
        path = tier.path(key)
        size = path.stat().st_size
        if damage == "payload":
            _flip(path, size - 100)
        elif damage == "header":
            _flip(path, 40)
        elif damage == "truncate":
            os.truncate(path, size - 1)
        elif damage == "empty":
            os.truncate(path, 0)
        else:  # a valid block of another key under this key's name
            _other, p2, m2 = make(seed=71)
            path.write_bytes(encode_block(p2, m2))
        assert tier.get(key) is None
        s = tier.stats()
        assert (s.checksum_failures, s.blocks, s.used_bytes) == (1, 0, 0)
        assert not path.exists()
        assert tier.get(key) is None and tier.stats().checksum_failures == 1


def test_g3_scan_reads_headers_only_and_drops_bad_headers(tmp_path: Path) -> None:
    with open_tier(str(tmp_path), name="g3", capacity_bytes=CAP) as tier:
        assert isinstance(tier, DiskTier)
        good, bad = make(seed=80), make(seed=81)
        tier.put(*good)
        tier.put(*bad)
        _flip(tier.path(good[0]), tier.path(good[0]).stat().st_size - 1)  # payload: scan can't see
        _flip(tier.path(bad[0]), 30)                                       # header: scan drops
        assert sorted(m.key for m in tier.scan()) == [good[0]]
        assert tier.stats().checksum_failures == 1
        assert tier.get(good[0]) is None  # the payload damage is caught on read
        assert tier.stats().checksum_failures == 2


# -- G4 object stores -------------------------------------------------------------

def test_g4_is_write_once_and_shared_between_nodes() -> None:
    url = f"memory://kvs-{secrets.token_hex(4)}/shared"
    with open_tier(url, name="n1", capacity_bytes=CAP) as a, \
            open_tier(url, name="n2", capacity_bytes=CAP) as b:
        key, payload, meta = make(seed=90)
        assert a.put(key, payload, meta).stored
        assert b.contains(key)                          # written by the other node
        assert b.put(key, payload, meta).existed        # not rewritten
        assert bytes(b.get(key).payload) == payload     # type: ignore[union-attr]


def test_g4_reopen_finds_objects_and_clears_temp(tmp_path: Path) -> None:
    url = f"fsspec+file://{tmp_path}/g4"
    key, payload, meta = make(seed=91)
    with open_tier(url, name="g4", capacity_bytes=CAP) as t:
        t.put(key, payload, meta)
    (tmp_path / "g4" / ".tmp").mkdir(exist_ok=True)
    (tmp_path / "g4" / ".tmp" / "junk").write_bytes(b"x")
    with open_tier(url, name="g4", capacity_bytes=CAP) as t:
        assert t.keys() == [key] and not (tmp_path / "g4" / ".tmp").exists()
        assert bytes(t.get(key).payload) == payload  # type: ignore[union-attr]


@pytest.mark.parametrize("kind", ["g4-memory", "g4-local"])
def test_g4_damaged_object_is_detected_counted_deleted(tmp_path: Path, kind: str) -> None:
    with open_tier(_url(kind, tmp_path), name="g4", capacity_bytes=CAP) as tier:
        assert isinstance(tier, ObjectTier)
        key, payload, meta = make(seed=92)
        tier.put(key, payload, meta)
        fs: fsspec.AbstractFileSystem = tier.fs
        data = bytearray(fs.cat_file(tier.path(key)))
        data[-5] ^= 0x10
        fs.pipe_file(tier.path(key), bytes(data))
        assert tier.get(key) is None
        assert tier.stats().checksum_failures == 1 and not fs.exists(tier.path(key))


# -- the arena --------------------------------------------------------------------

def test_class_sizes() -> None:
    assert class_size(0) == SMALL_GRAIN and class_size(1) == SMALL_GRAIN
    assert class_size(65) == 128 and class_size(PAGE - 1) == PAGE
    assert class_size(PAGE + 1) == 2 * PAGE and class_size(2_949_120) == 2_949_120


def test_arena_random_alloc_free_keeps_invariants() -> None:
    rng = random.Random(0)
    arena = SizeClassArena(1 << 20)
    live: dict[int, int] = {}
    for _ in range(3000):
        if live and rng.random() < 0.45:
            start = rng.choice(list(live))
            arena.free(start, live.pop(start))
        else:
            n = rng.choice([100, 3000, 3000, 3000, 9000, 70_000])
            start = arena.alloc(n)
            if start is not None:
                live[start] = n
        spans = sorted((s, s + class_size(n)) for s, n in live.items())
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
        assert arena.free_bytes + sum(class_size(n) for n in live.values()) == arena.size
    for start, n in live.items():
        arena.free(start, n)
    assert arena.largest_free() == arena.size  # everything coalesced back
    with pytest.raises(ValueError):
        arena.free(0, 100)


def test_grace_arena_quarantines_then_reuses() -> None:
    bumps: list[int] = []
    arena = GraceArena(2 * PAGE, 10.0, lambda: bumps.append(1))
    a = arena.alloc(PAGE, now=0.0)
    b = arena.alloc(PAGE, now=0.0)
    assert a is not None and b is not None
    assert arena.alloc(PAGE, now=0.0) is None and bumps == []  # full, nothing quarantined
    arena.free(a, PAGE, now=1.0)
    assert arena.alloc(PAGE, now=11.5) == a and bumps == []   # grace over: normal reuse
    arena.free(b, PAGE, now=20.0)
    assert arena.alloc(PAGE, now=21.0) == b and bumps == [1]  # early reuse: bump first


def test_g2_fragmentation_evicts_until_it_fits() -> None:
    with open_tier("mem://", name="frag", capacity_bytes=4 * PAGE, reuse_grace_s=0) as tier:
        small = [make(n=PAGE, seed=200 + i) for i in range(4)]
        for b in small:
            tier.put(*b)
        tier.delete(small[0][0])
        tier.delete(small[2][0])     # two free pages, not adjacent
        big = make(n=2 * PAGE, seed=210)
        out = tier.put(*big)
        assert out.stored and len(out.evicted) >= 1
        assert bytes(tier.get(big[0]).payload) == big[1]  # type: ignore[union-attr]
        assert tier.stats().used_bytes <= 4 * PAGE


def test_tier_timing_sanity(tmp_path: Path) -> None:
    """Tiny smoke on speed so a pathological slowdown (e.g. a per-byte loop) shows up."""
    with open_tier(str(tmp_path), name="speed", capacity_bytes=64 << 20, fsync=False) as tier:
        key, payload, meta = make(n=4 << 20, seed=300)
        t0 = time.perf_counter()
        tier.put(key, payload, meta)
        assert bytes(tier.get(key).payload) == payload  # type: ignore[union-attr]
        assert time.perf_counter() - t0 < 2.0


# -- G3 group commit (put_many) ---------------------------------------------------

def _g3_files(root: Path) -> tuple[list[str], list[str]]:
    """(block file names, temp file names) under a G3 directory."""
    names = [p.name for p in root.rglob("*") if p.is_file()]
    return sorted(n for n in names if n.endswith(".kvb")), [n for n in names if n.endswith(".tmp")]


def test_g3_put_many_evicts_in_batch_order(tmp_path: Path) -> None:
    got: list[tuple[bytes, bytes]] = []
    blocks = [make(seed=500 + i) for i in range(6)]
    b0, b1, b2, b3, b4, b5 = blocks
    with DiskTier(str(tmp_path), name="g3", capacity_bytes=CAP,
                  on_evict=lambda m, p: got.append((m.key, bytes(p)))) as tier:
        tier.put(*b0)
        # As a put() loop: b0's hit makes b1 and b2 the oldest; b3 and b4 evict them;
        # the repeat of b3 is a hit.
        outs = tier.put_many([b1, b2, b0, b3, b4, b3])
        assert [(o.stored, o.existed, [m.key for m in o.evicted]) for o in outs] == [
            (True, False, []), (True, False, []), (True, True, []),
            (True, False, [b1[0]]), (True, False, [b2[0]]), (True, True, [])]
        assert outs[3].evicted[0].size == PAYLOAD and outs[3].evicted[0].traffic_class == "chat"
        assert got == [(b1[0], b1[1]), (b2[0], b2[1])]
        assert _g3_files(tmp_path) == (sorted(f"{b[0].hex()}.kvb" for b in (b0, b3, b4)), [])
        s = tier.stats()
        assert (s.blocks, s.evictions) == (3, 2) and s.used_bytes <= CAP
        assert [m.key for m in tier.put(*b5).evicted] == [b0[0]]  # recency as the loop left it


def test_g3_put_many_restores_a_key_its_own_batch_evicted(tmp_path: Path) -> None:
    b0, b1, b2, b3 = (make(seed=520 + i) for i in range(4))
    with DiskTier(str(tmp_path), name="g3", capacity_bytes=CAP) as tier:
        tier.put(*b0)
        outs = tier.put_many([b1, b2, b3, b0])   # b3 evicts b0, then b0 comes back
        assert [(o.stored, o.existed, [m.key for m in o.evicted]) for o in outs] == [
            (True, False, []), (True, False, []), (True, False, [b0[0]]),
            (True, False, [b1[0]])]
        assert bytes(tier.get(b0[0]).payload) == b0[1]  # type: ignore[union-attr]
        assert _g3_files(tmp_path)[1] == []


def test_g3_put_many_equals_a_put_loop(tmp_path: Path) -> None:
    """Random batches with repeats, refusals and evictions: put_many and put on
    two directories give the same outcomes, contents and counters."""
    rng = random.Random(7)
    pool = [make(n=rng.choice([900, 2000, 3000, 12_000]), seed=600 + i) for i in range(10)]
    with DiskTier(str(tmp_path / "a"), name="a", capacity_bytes=CAP, fsync=False) as a, \
            DiskTier(str(tmp_path / "b"), name="b", capacity_bytes=CAP, fsync=False) as b:
        for _ in range(25):
            batch = [rng.choice(pool) for _ in range(rng.randint(1, 7))]
            got = [(o.stored, o.existed, [m.key for m in o.evicted]) for o in a.put_many(batch)]
            want = [(o.stored, o.existed, [m.key for m in o.evicted])
                    for o in (b.put(*item) for item in batch)]
            assert got == want
            if rng.random() < 0.3:
                key = rng.choice(pool)[0]
                assert (a.get(key) is None) == (b.get(key) is None)
        sa, sb = a.stats(), b.stats()
        assert sorted(a.keys()) == sorted(b.keys())
        assert (sa.used_bytes, sa.blocks, sa.evictions) == (sb.used_bytes, sb.blocks, sb.evictions)
        assert sa.evictions > 0
        assert _g3_files(tmp_path / "a")[1] == []


def test_g3_put_many_bad_item_stores_nothing(tmp_path: Path) -> None:
    good = [make(seed=540 + i) for i in range(3)]
    key, payload, _ = make(seed=543)
    lying = (key, payload, BlockMeta(key, "fp", "x", 64, "chat", 0.0, checksum=bytes(16)))
    with DiskTier(str(tmp_path), name="g3", capacity_bytes=CAP) as tier:
        with pytest.raises(BlockCorruptError):
            tier.put_many([good[0], good[1], lying, good[2]])
        assert tier.stats().blocks == 0 and _g3_files(tmp_path) == ([], [])
        with pytest.raises(TierError, match=r"meta\.key"):
            tier.put_many([good[0], (bytes(16), payload, good[1][2])])
        assert tier.stats().blocks == 0
    with pytest.raises(TierError, match="writers"):
        open_tier(str(tmp_path), name="g3", capacity_bytes=CAP, writers=0)


def test_g3_put_many_from_threads_stores_each_key_once(tmp_path: Path) -> None:
    blocks = [make(n=1000, seed=560 + i) for i in range(6)]
    firsts: list[bytes] = []
    with DiskTier(str(tmp_path), name="g3", capacity_bytes=1 << 20, writers=4) as tier:

        def worker(seed: int) -> None:
            batch = random.Random(seed).sample(blocks, len(blocks))
            for (k, _, _), out in zip(batch, tier.put_many(batch), strict=True):
                assert out.stored
                if not out.existed:
                    firsts.append(k)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(firsts) == sorted(b[0] for b in blocks)      # one writer per key won
        assert _g3_files(tmp_path) == (sorted(f"{b[0].hex()}.kvb" for b in blocks), [])


_CRASH_CHILD = """
import hashlib, sys
from kvstore.blockfile import BlockMeta
from kvstore.tiers.disk import DiskTier
tier = DiskTier(sys.argv[1], name="crash", capacity_bytes=1 << 40)
n = int(sys.argv[2])
while True:
    batch = []
    for _ in range(8):
        key = hashlib.blake2b(str(n).encode(), digest_size=16).digest()
        n += 1
        batch.append((key, key * 16384, BlockMeta(key, "fp", "raw", 1, "chat", 1e9)))
    outs = tier.put_many(batch)
    print(" ".join(k.hex() for (k, _, _), o in zip(batch, outs) if o.stored), flush=True)
"""


def test_g3_put_many_survives_kill_9_mid_batch(tmp_path: Path) -> None:
    """SIGKILL a writer at random moments: after reopening, every block it reported
    is there, every visible block verifies, and the interrupted batch left no temp
    file (a process kill, not a power cut: the page cache survives it)."""
    rng = random.Random(11)
    reported: set[bytes] = set()
    interrupted = 0
    for round_ in range(8):
        proc = subprocess.Popen([sys.executable, "-c", _CRASH_CHILD, str(tmp_path),
                                 str(round_ * 100_000)], stdout=subprocess.PIPE, cwd=ROOT)
        assert proc.stdout is not None
        first = proc.stdout.readline()        # the writer is up and committing batches
        time.sleep(rng.uniform(0.0, 0.15))
        proc.kill()
        rest = proc.stdout.read()
        proc.wait()
        assert first.endswith(b"\n"), "the writer died before its first batch"
        for line in (first + rest).splitlines(keepends=True):
            if line.endswith(b"\n"):
                reported.update(bytes.fromhex(h.decode()) for h in line.split())
        interrupted += bool(_g3_files(tmp_path)[1])
        with DiskTier(str(tmp_path), name="crash", capacity_bytes=1 << 40) as tier:
            assert _g3_files(tmp_path)[1] == []
            visible = set(tier.keys())
            assert reported <= visible
            for key in visible:
                hit = tier.get(key)
                assert hit is not None and bytes(hit.payload) == key * 16384  # 256 KiB
            assert tier.stats().checksum_failures == 0
    assert interrupted > 0, "no kill landed inside a batch; the test proved nothing"
