"""The cost of keyed integrity at rest, for ``kvserve bench store`` (kvstore/bench.py):
the header tag before it (an unkeyed xxh3-64, format v1) as a baseline tier can
use, and one header tag timed both ways."""

from __future__ import annotations

import os
import time

import xxhash

from kvstore.blockfile import BlockMac, BlockMeta, encode_parts


class Xxh3Tag(BlockMac):
    """The header tag before keyed integrity: an unkeyed xxh3 (128 bits here, to fill
    the tag's 32 hex digits; xxh3-64 in format v1 costs the same). Baseline rows only."""

    def __init__(self) -> None:
        super().__init__(b"")

    def tag(self, data: bytes) -> str:
        return xxhash.xxh3_128_hexdigest(data)

    def verify(self, data: bytes, tag: bytes) -> bool:
        return self.tag(data).encode() == tag


def mac_tag_us(n: int = 20_000) -> dict[str, float]:
    """Microseconds per header tag: keyed BLAKE2b-128 (now) and xxh3-64 (before)."""
    head = encode_parts(b"\0" * 4096, BlockMeta(b"k" * 16, "ab" * 16, "L30xH3xT64xD64:float32",
                                                 64, "chat", time.time(), tenant="t")).header
    out = {}
    for name, tagger in (("mac_tag_us", BlockMac(os.urandom(32))), ("xxh3_tag_us", Xxh3Tag())):
        t0 = time.perf_counter()
        for _ in range(n):
            tagger.tag(head)
        out[name] = (time.perf_counter() - t0) / n * 1e6
    return out


def mac_rows(res: dict[str, float]) -> dict[str, float]:
    """The MAC's cost from the interleaved G3 rows, and one tag timed both ways."""
    return {"mac_write_ratio": res["g3_write_gbps"] / res["g3_xxh3tag_write_gbps"],
            "mac_read_ratio": res["g3_read_gbps"] / res["g3_xxh3tag_read_gbps"],
            **mac_tag_us()}
