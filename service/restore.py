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
from dataclasses import dataclass, field

import torch

from common.config import HitRule
from kvstore.types import RequestCtx
from service.cost import CostModel, FetchPlan, tier_counts
from service.store_link import StoreLink
from telemetry import tracing


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


@dataclass(slots=True)
class RestoreStats:
    """Restore bandwidth = rate(bytes_total) / rate(seconds_total) (docs/operators.md)."""

    blocks_total: dict[str, int] = field(default_factory=dict)     # by source tier
    bytes_total: dict[str, int] = field(default_factory=dict)      # by source tier
    seconds_total: float = 0.0                                     # fetch time, all tiers
    past_g1_blocks_total: int = 0   # found past a G1 hit the warehouse's chain had not reached


class Restorer:
    def __init__(self, store: StoreLink, cost: CostModel, hit_rule: HitRule, layout: object,
                 *, pin: bool = False) -> None:
        self._store = store
        self._cost = cost
        self._hit_rule = hit_rule
        self._layout = layout
        self._pin = pin
        self.stats = RestoreStats()

    async def restore(self, keys: Sequence[bytes], *, prompt_tokens: int, g1_blocks: int,
                      ctx: RequestCtx) -> Restore:
        with tracing.span("restore", prompt_tokens=prompt_tokens, g1_blocks=g1_blocks,
                          traffic_class=ctx.traffic_class) as s:
            r = await self._restore(keys, prompt_tokens=prompt_tokens, g1_blocks=g1_blocks,
                                    ctx=ctx)
            s.set(restored_blocks=r.n_blocks, usable_tokens=r.usable_tokens,
                  stored_blocks=-1 if r.stored_blocks is None else r.stored_blocks,
                  decision=r.decision, short_blocks=r.short_blocks)
            return r

    async def _restore(self, keys: Sequence[bytes], *, prompt_tokens: int, g1_blocks: int,
                       ctx: RequestCtx) -> Restore:
        B = self._hit_rule.block_tokens
        t0 = time.perf_counter()
        with tracing.span("lookup", blocks=len(keys)) as s:
            lookup = await self._store.lookup(keys, prompt_tokens=prompt_tokens, ctx=ctx)
            if lookup is not None:
                s.set(matched_blocks=lookup.matched_blocks, usable_tokens=lookup.usable_tokens)
        if lookup is None:
            # No warehouse configured: nothing stored. Configured but down: degraded.
            stored_none = 0 if not self._store.enabled else None
            usable = self._hit_rule.usable_tokens(g1_blocks * B, prompt_tokens)
            return Restore(None, g1_blocks, stored_none, usable, None,
                           time.perf_counter() - t0, 0.0, 0)
        stored, tiers = lookup.matched_blocks, lookup.block_tiers
        if stored < g1_blocks < len(keys):
            tiers = await self._past_g1(keys, g1_blocks, ctx, tiers)
        lookup_s = time.perf_counter() - t0
        usable = self._hit_rule.usable_tokens(max(g1_blocks, len(tiers)) * B, prompt_tokens)
        plan = self._cost.plan(tiers, g1_blocks, usable // B)
        if plan.fetch_blocks == 0:
            return Restore(None, g1_blocks, stored, usable, plan, lookup_s, 0.0, 0)
        want = keys[g1_blocks:g1_blocks + plan.fetch_blocks]
        layout = self._layout
        # [n, layers, 2, kv_heads, B, head_dim]: the client writes each block into its row.
        out = torch.empty((len(want), *layout.block_shape),  # type: ignore[attr-defined]
                          dtype=layout.torch_dtype, pin_memory=self._pin)  # type: ignore[attr-defined]
        t1 = time.perf_counter()
        with tracing.span("fetch", blocks=len(want)) as s:
            got = await self._store.get(want, ctx=ctx, out=out)
            fetch_s = time.perf_counter() - t1
            if got is None:
                s.fail("StoreUnavailable")
                return Restore(None, g1_blocks, None, usable, plan, lookup_s, fetch_s, len(want))
            n = got.hit_prefix
            blocks = out[:n] if n else None
            fetched_tiers = plan.tier_blocks if n == len(want) else tier_counts(
                tiers[g1_blocks:g1_blocks + n])
            nbytes = n * self._layout.block_nbytes  # type: ignore[attr-defined]
            s.set(fetched_blocks=n, bytes=nbytes,
                  **{f"tier.{t}": c for t, c in fetched_tiers.items()})
        self._cost.observe_fetch(fetched_tiers, nbytes, fetch_s)
        self._count(fetched_tiers, fetch_s)
        return Restore(blocks, g1_blocks, stored, usable, plan, lookup_s, fetch_s, len(want) - n)

    async def _past_g1(self, keys: Sequence[bytes], g1_blocks: int, ctx: RequestCtx,
                       tiers: list[str]) -> list[str]:
        """The warehouse's chain stops inside this engine's G1 hit: the blocks
        G1 holds are still on their way there (another request's write-through
        runs behind its reply), while the ones after them may already be stored
        (decode's canonical blocks of a session's last answer). A chain key
        names its whole prefix, so a match of ``keys[g1_blocks:]`` continues
        the G1 hit. Best tiers for blocks ``[0, g1_blocks + matched)``; the G1
        entries are placeholders the plan never reads. ``touch=False``: the
        request's own lookup already counted it."""
        B = self._hit_rule.block_tokens
        rest = keys[g1_blocks:]
        more = await self._store.lookup(rest, prompt_tokens=len(rest) * B, ctx=ctx, touch=False)
        if more is None or not more.matched_blocks:
            return tiers
        self.stats.past_g1_blocks_total += more.matched_blocks
        return ["G1"] * g1_blocks + list(more.block_tiers)

    def _count(self, tiers: dict[str, int], fetch_s: float) -> None:
        st, block = self.stats, self._layout.block_nbytes  # type: ignore[attr-defined]
        for tier, n in tiers.items():
            st.blocks_total[tier] = st.blocks_total.get(tier, 0) + n
            st.bytes_total[tier] = st.bytes_total.get(tier, 0) + n * block
        st.seconds_total += fetch_s

