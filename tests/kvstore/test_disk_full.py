"""Issue 10, item 8: a full disk under G3. A real, small filesystem (a 4 MiB tmpfs
mounted for the test, unmounted after; needs root) is filled for real: one
rate-limited warning with the numbers, the tier's target shrinks to the space it
finds, nothing is corrupt, writes go on (the oldest blocks make room), and the
target grows back when space returns."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.config import HitRule, TierConfig
from kvstore.blockfile import BlockMeta, decode_block
from kvstore.tiers.base import key_relpath
from kvstore.tiers.disk import DiskTier
from kvstore.types import TIER_BITS, RequestCtx
from kvstore.warehouse import Warehouse, WarehouseConfig
from tests.kvstore.storeproc import TEST_CLASSES, blocks, keys

DISK = 4 * 2**20
BLOCK = 64 * 2**10
LAYOUT = "L1xH1xT2048xD8:float32"          # 2*2048*8*4 = 64 KiB per block


@pytest.fixture()
def small_fs(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK},mode=0700", "tmpfs",
                          str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _meta(k: bytes) -> BlockMeta:
    return BlockMeta(k, "", "", 1, "chat", time.time() + 3600)


def test_g3_on_a_full_disk(small_fs: Path, caplog: pytest.LogCaptureFixture) -> None:
    filler = small_fs / "filler"
    filler.write_bytes(b"\0" * (DISK // 2))           # someone else's 2 MiB
    tier = DiskTier(str(small_fs / "g3"), name="G3", capacity_bytes=1 << 30, writers=4)
    tier.regrow_check_s = 0.0
    written: dict[bytes, bytes] = {}
    caplog.set_level(logging.INFO, logger="kvstore.tiers.disk")
    last: list[bool] = []
    for b in range(12):                                # 96 x 64 KiB = 6 MiB into ~2 MiB
        ks, data = keys(8, seed=b), blocks(8, seed=b, nbytes=BLOCK)
        outs = tier.put_many([(k, d, _meta(k)) for k, d in zip(ks, data, strict=True)])
        last = [o.stored for o in outs]
        written.update({k: bytes(d) for k, d, o in zip(ks, data, outs, strict=True)
                        if o.stored})
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]      # rate-limited
    msg = warnings[0].getMessage()
    assert "disk full" in msg and "bytes free" in msg and "target shrunk" in msg
    assert str(tier.capacity_bytes) in msg                               # the numbers
    assert tier.disk_full_events >= 1
    assert tier.capacity_bytes < DISK // 2 < tier.configured_bytes     # shrank to the space
    assert all(last), "writes stopped instead of making room"
    # Nothing corrupt: every block the tier holds decodes and verifies, no temp files.
    held = tier.keys()
    assert held and set(held) <= set(written)
    for k in held:
        assert bytes(decode_block((tier.root / key_relpath(k)).read_bytes(),
                                  expect_key=k).payload) == written[k]
        hit = tier.get(k)
        assert hit is not None and bytes(hit.payload) == written[k]
    assert not list(tier.root.rglob("*.tmp"))
    shrunk = tier.capacity_bytes
    # Space returns: the target grows back and writes land without evicting.
    filler.unlink()
    ks, data = keys(8, seed=100), blocks(8, seed=100, nbytes=BLOCK)
    outs = tier.put_many([(k, d, _meta(k)) for k, d in zip(ks, data, strict=True)])
    assert all(o.stored for o in outs) and not any(o.evicted for o in outs)
    assert tier.capacity_bytes > shrunk + DISK // 4
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    tier.close()


def test_the_warehouse_keeps_serving_on_a_full_disk(small_fs: Path, redis_url: str,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Through the store: no traceback per batch, every G3 bit names an intact file."""
    async def body() -> None:
        node = f"full-{uuid.uuid4().hex[:6]}"
        cfg = WarehouseConfig(redis_url=redis_url, classes=TEST_CLASSES,
                              tiers=TierConfig(g2_bytes=1 << 20, g3_path=str(small_fs / "g3"),
                                               g3_bytes=1 << 30, node=node),
                              hit_rule=HitRule(block_tokens=2048), sweep_interval_s=0)
        ctx = RequestCtx(tenant="full")
        async with Warehouse(cfg) as wh:
            for b in range(12):
                ks, data = keys(8, seed=200 + b), blocks(8, seed=b, nbytes=BLOCK)
                await wh.put(ks, data, layout=LAYOUT, token_counts=[2048] * 8, ctx=ctx)
                await wh.flush()
            g3 = wh.tiers["G3"]
            assert isinstance(g3, DiskTier) and g3.disk_full_events >= 1
            on_disk = 0
            for b in range(12):
                ks = keys(8, seed=200 + b)
                for k, e in zip(ks, await wh.index.entries(ks), strict=True):
                    if e is not None and e.tiers & TIER_BITS["G3"]:
                        decode_block((g3.root / key_relpath(k)).read_bytes(), expect_key=k)
                        on_disk += 1
            assert on_disk > 0
            assert wh.writeback.failed_batches == 0
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors, [r.getMessage() for r in errors]
    asyncio.run(body())
