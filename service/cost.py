"""The cost-aware fetch rule (docs/architecture.md#tiers-ttls-and-eviction).

The hit rule says which leading blocks *may* be restored; this decides which
of them are *worth* fetching. Restores must be a prefix, so the choice is a
cut point ``k``: fetch blocks ``[start, k)``, recompute ``[k, end)``. The
plan takes the ``k`` with the smallest predicted time

    fetch(start..k) * margin + (end - k) * block_tokens / prefill_tokens_per_s

where fetching ``n`` blocks from a tier costs ``latency + n * block_bytes /
bandwidth``. A tier is therefore used only when its measured speed beats
recomputing: a cheap G2 prefix followed by a slow G3 tail is cut where G3
starts. Bandwidth, latency and prefill speed start from configured priors
and follow measurements (exponentially weighted), so the rule adapts to the
machine it runs on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from service.config import CostConfig

log = logging.getLogger(__name__)

# A fetch of at most this many blocks measures latency rather than bandwidth.
_LATENCY_PROBE_BLOCKS = 1
_MIN_BW_Bps = 1e6


@dataclass(frozen=True, slots=True)
class FetchPlan:
    start_block: int                # first block not already in the engine (G1)
    end_block: int                  # the hit rule's limit
    fetch_blocks: int               # fetch [start_block, start_block + fetch_blocks)
    tier_blocks: dict[str, int]     # fetched blocks per tier
    fetch_s: float                  # predicted time to fetch them
    recompute_s: float              # predicted time to recompute all candidates instead
    kind: str                       # "none" | "fetch" | "partial" | "recompute"
    fetch_all_s: float = 0.0        # predicted time to fetch every candidate (the alternative)

    @property
    def candidates(self) -> int:
        return self.end_block - self.start_block

    @property
    def decision(self) -> str:
        """Human-readable choice, as the KV handle reports it."""
        tiers = "+".join(sorted(self.tier_blocks))
        if self.kind == "fetch":
            return f"fetch {tiers}"
        if self.kind == "partial":
            rest = self.candidates - self.fetch_blocks
            return f"fetch {tiers} ({self.fetch_blocks} blocks), recompute {rest} blocks"
        return self.kind


@dataclass(frozen=True, slots=True)
class CostSnapshot:
    bandwidth_Bps: dict[str, float]
    latency_s: dict[str, float]
    prefill_tokens_per_s: float


class CostModel:
    def __init__(self, cfg: CostConfig, *, block_nbytes: int, block_tokens: int) -> None:
        self._cfg = cfg
        self._block_nbytes = block_nbytes
        self._block_tokens = block_tokens
        self._bw = dict(cfg.tier_bandwidth_Bps)
        self._lat = dict(cfg.tier_latency_s)
        self._tps = cfg.prefill_tokens_per_s
        # Tiers the priors do not name are treated as the slowest known one.
        self._slowest = min(self._bw, key=lambda t: self._bw[t])

    def _tier(self, name: str) -> str:
        return name if name in self._bw else self._slowest

    def fetch_time(self, tier_blocks: dict[str, int]) -> float:
        return sum(self._lat[self._tier(t)] + n * self._block_nbytes / self._bw[self._tier(t)]
                   for t, n in tier_blocks.items() if n > 0)

    def recompute_time(self, n_blocks: int) -> float:
        return n_blocks * self._block_tokens / self._tps

    def plan(self, block_tiers: Sequence[str], start_block: int, end_block: int) -> FetchPlan:
        """Choose how many of blocks ``[start_block, end_block)`` to fetch;
        ``block_tiers[i]`` is the best tier holding block i."""
        end_block = min(end_block, len(block_tiers))
        start_block = min(start_block, end_block)
        candidates = block_tiers[start_block:end_block]
        n = len(candidates)
        fetch_s = [0.0]                  # fetch_s[k]: predicted time to fetch the first k
        counts: dict[str, int] = {}
        for tier in candidates:
            counts[tier] = counts.get(tier, 0) + 1
            fetch_s.append(self.fetch_time(counts))
        k = _POLICIES[self._cfg.fetch_policy](self, fetch_s, n)
        if n == 0:
            kind = "none"
        elif k == 0:
            kind = "recompute"
        else:
            kind = "fetch" if k == n else "partial"
        plan = FetchPlan(start_block, end_block, k, tier_counts(candidates[:k]), fetch_s[k],
                         self.recompute_time(n), kind, fetch_s[n])
        if n:
            log.info("fetch rule (%s): %s | candidates %d blocks %s, fetch %.4fs vs recompute "
                     "%.4fs (prefill %.0f tok/s, bw %s)", self._cfg.fetch_policy, plan.decision,
                     n, tier_counts(candidates), fetch_s[n], plan.recompute_s, self._tps,
                     {t: f"{b / 1e9:.2f}GB/s" for t, b in self._bw.items()})
        return plan

    def _cheapest(self, fetch_s: list[float], n: int) -> int:
        """The cut point with the smallest predicted fetch + recompute time."""
        return min(range(n + 1), key=lambda k: (fetch_s[k] * self._cfg.fetch_margin
                                               + self.recompute_time(n - k), k))

    def observe_fetch(self, tier_blocks: dict[str, int], nbytes: int, seconds: float) -> None:
        """A fetch of ``tier_blocks`` moved ``nbytes`` in ``seconds``: share the
        observed time among its tiers in proportion to their predicted times."""
        if nbytes <= 0 or seconds <= 0 or not tier_blocks:
            return
        predicted = {t: self.fetch_time({t: n}) for t, n in tier_blocks.items() if n > 0}
        total = sum(predicted.values()) or 1.0
        a = self._cfg.ewma_alpha
        for tier, n in tier_blocks.items():
            if n <= 0:
                continue
            t = self._tier(tier)
            share = seconds * predicted[tier] / total
            nb = nbytes * n / sum(tier_blocks.values())
            if n <= _LATENCY_PROBE_BLOCKS:
                lat = max(0.0, share - nb / self._bw[t])
                self._lat[t] = (1 - a) * self._lat[t] + a * lat
            transfer = max(share - self._lat[t], share * 0.1)
            bw = max(_MIN_BW_Bps, nb / transfer)
            self._bw[t] = (1 - a) * self._bw[t] + a * bw

    def observe_prefill(self, tokens: int, seconds: float, *, calibrate: bool = False) -> None:
        """``tokens`` were computed in ``seconds``; small computes are mostly
        fixed overhead and would underrate the speed, so they are ignored.
        ``calibrate`` (the start-up measurement) replaces the prior outright."""
        if tokens < self._block_tokens or seconds <= 0:
            return
        a = 1.0 if calibrate else self._cfg.ewma_alpha
        self._tps = (1 - a) * self._tps + a * (tokens / seconds)

    def snapshot(self) -> CostSnapshot:
        return CostSnapshot(dict(self._bw), dict(self._lat), self._tps)


# How many candidate blocks to fetch, given the predicted fetch times of each prefix.
_POLICIES: dict[str, Callable[[CostModel, list[float], int], int]] = {
    "cost": CostModel._cheapest,
    "always": lambda model, fetch_s, n: n,      # benchmarks of the restore path, tests
    "never": lambda model, fetch_s, n: 0,       # warehouse reads off (debugging)
}
FETCH_POLICIES = tuple(_POLICIES)


def tier_counts(tiers: Sequence[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in tiers:
        out[t] = out.get(t, 0) + 1
    return out
