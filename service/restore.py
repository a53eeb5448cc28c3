"""Finding and fetching a prompt's stored blocks: warehouse lookup, hit rule,
cost-aware choice, fetch. Used by prefill, and by decode when it must rebuild
a request's KV from the warehouse.

The result is always safe to hand to ``Engine.prefill``: a prefix of whole
blocks right after the engine's own G1 hit, never more than the hit rule
allows; a block that is missing or fails its checksum cuts the prefix there
(the rest is recomputed).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.config import HitRule
from kvstore.types import RequestCtx
from service.cost import CostModel, FetchPlan, tier_counts
from service.store_link import StoreLink


@dataclass(frozen=True, slots=True)
class Restore:
    blocks: torch.Tensor | None     # [n, layers, 2, kv_heads, block_tokens, head_dim], host
    start_block: int                # blocks[0] is this block of the prompt (= the G1 hit)
    stored_blocks: int | None       # leading blocks the warehouse holds; None: it did not answer
    usable_tokens: int              # the hit rule's cap on G1 + restored tokens
    plan: FetchPlan | None
    lookup_s: float
    fetch_s: float
    short_blocks: int               # planned but missing / corrupt at fetch time

    @property
    def n_blocks(self) -> int:
        return 0 if self.blocks is None else int(self.blocks.shape[0])

    @property
    def degraded(self) -> bool:
        return self.stored_blocks is None

    @property
    def decision(self) -> str:
        if self.degraded:
            return "warehouse unavailable: recompute"
        if self.plan is None:
            return "none"
        if self.short_blocks:
            return f"{self.plan.decision} ({self.short_blocks} blocks missing at fetch)"
        return self.plan.decision


class Restorer:
    def __init__(self, store: StoreLink, cost: CostModel, hit_rule: HitRule, layout: object,
                 *, pin: bool = False) -> None:
        self._store = store
        self._cost = cost
        self._hit_rule = hit_rule
        self._layout = layout
        self._pin = pin

    async def restore(self, keys: Sequence[bytes], *, prompt_tokens: int, g1_blocks: int,
                      ctx: RequestCtx) -> Restore:
        B = self._hit_rule.block_tokens
        t0 = time.perf_counter()
        lookup = await self._store.lookup(keys, prompt_tokens=prompt_tokens, ctx=ctx)
        lookup_s = time.perf_counter() - t0
        stored = None if lookup is None else lookup.matched_blocks
        matched = max(g1_blocks, stored or 0)
        usable = self._hit_rule.usable_tokens(matched * B, prompt_tokens)
        if lookup is None:
            # No warehouse configured: nothing stored. Configured but down: degraded.
            stored_none = 0 if not self._store.enabled else None
            return Restore(None, g1_blocks, stored_none, usable, None, lookup_s, 0.0, 0)
        plan = self._cost.plan(lookup.block_tiers, g1_blocks, usable // B)
        if plan.fetch_blocks == 0:
            return Restore(None, g1_blocks, stored, usable, plan, lookup_s, 0.0, 0)
        want = keys[g1_blocks:g1_blocks + plan.fetch_blocks]
        layout = self._layout
        # [n, layers, 2, kv_heads, B, head_dim]: the client writes each block into its row.
        out = torch.empty((len(want), *layout.block_shape),  # type: ignore[attr-defined]
                          dtype=layout.torch_dtype, pin_memory=self._pin)  # type: ignore[attr-defined]
        t1 = time.perf_counter()
        got = await self._store.get(want, ctx=ctx, out=out)
        fetch_s = time.perf_counter() - t1
        if got is None:
            return Restore(None, g1_blocks, None, usable, plan, lookup_s, fetch_s, len(want))
        n = got.hit_prefix
        blocks = out[:n] if n else None
        fetched_tiers = plan.tier_blocks if n == len(want) else tier_counts(
            lookup.block_tiers[g1_blocks:g1_blocks + n])
        self._cost.observe_fetch(fetched_tiers, n * self._layout.block_nbytes, fetch_s)  # type: ignore[attr-defined]
        return Restore(blocks, g1_blocks, stored, usable, plan, lookup_s, fetch_s, len(want) - n)

