"""Session warm-up: move a prompt's stored blocks up to G2 before its prefill.

The router calls ``Warm`` when a request arrives (docs/router.md, "Session
warm-up"), so while the request waits in queues the blocks its prefill will
restore travel from disk (G3) or the object tier (G4) into host memory (G2),
and the prefill then pays a memory copy instead of a disk read. Only the
leading run of blocks the hit rule can use is moved; blocks already in G2 are
left alone. A read goes through ``Warehouse.get``, so every block is verified
as on any read and promoted by the same code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.types import RequestCtx

if TYPE_CHECKING:
    from kvstore.warehouse import Warehouse


@dataclass(frozen=True, slots=True)
class WarmResult:
    matched_blocks: int     # leading blocks present in some tier
    in_g2_blocks: int       # of them in G2 already
    promoted_blocks: int    # of them brought up into G2 now


async def warm(wh: Warehouse, keys: Sequence[bytes], *, prompt_tokens: int,
               ctx: RequestCtx) -> WarmResult:
    # touch=False: arrival is not a hit (the prefill's own lookup refreshes TTLs).
    found = await wh.lookup(keys, prompt_tokens=prompt_tokens, ctx=ctx, touch=False)
    usable = found.usable_tokens // wh.hit_rule.block_tokens
    tiers = found.block_tiers[:usable]
    colder = [k for k, t in zip(keys, tiers, strict=False) if t in ("G3", "G4")]
    promoted = 0
    if colder and "G2" in wh.tiers:
        fetched = await wh.get(colder, ctx=ctx)
        promoted = sum(1 for f in fetched if f.tier in ("G3", "G4"))
    return WarmResult(found.matched_blocks, sum(1 for t in tiers if t == "G2"), promoted)
