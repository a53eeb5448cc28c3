"""Cluster replay: a request trace through the placement policies and the
simulated warehouse, with no tensors (``kvserve replay``).

Model (a discrete-event simulation, documented in docs/router.md):

* ``instances`` prefill instances, each a single FIFO server with its own
  ``studies.sim.SimWarehouse`` (tier capacities per instance, eviction policy
  and TTL as configured);
* a request arrives at ``t0 + (t - t0) / load`` (``load`` multiplies the
  trace's arrival rate); the router scores every instance with the same
  ``router.placement`` policy code the live router runs: pending work of each
  instance (its queued seconds in token-equivalents of linear prefill) and,
  for cache-aware policies, the tokens each instance's store can restore now
  (``SimWarehouse.match``) under the hit rule;
* the request starts when its instance is free; its store is accessed then
  (hit = leading resident blocks; then its blocks are stored or touched);
  service = fetch of the restored tokens at the tier's bandwidth + compute of
  the rest (``studies.replay_cost.CostModel``);
* TTFT = finish - arrival (queue wait + fetch + compute); decode is not
  modelled.

With ``load=None`` the load is calibrated first: the load at which
``round_robin`` keeps the instances ``target_busy`` (70%) busy, found by a
few fixed-point steps ``load *= target / utilisation`` on round_robin runs.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
from tqdm import tqdm

from common.config import HitRule
from common.traces import Trace
from kvstore.eviction import policy_names
from router.placement import (
    PlacementRequest,
    PolicyConfig,
    UnknownPolicyError,
    make_router_policy,
    restorable_tokens,
    router_policy_names,
)
from router.view import N_TIERS, CandidateSet
from studies.replay_cost import CostModel
from studies.sim import SimWarehouse, replay_cache

# Simulated store tier k is view tier G(k+2): tier 0 = G2 host DRAM, 1 = G3 disk, 2 = G4.
_VIEW_TIER_OFFSET = 1


ARRIVAL_MODES = ("auto", "scale", "sessions")


def arrival_mode(trace: Trace, mode: str) -> str:
    """"auto": "sessions" when the loader synthesised the session start times
    (agent archives: a seeded Poisson process, see common.traces), else "scale"."""
    if mode != "auto":
        return mode
    return "sessions" if "agent sessions placed" in trace.arrival_note else "scale"


def arrival_times(trace: Trace, load: float, mode: str = "auto") -> np.ndarray:
    """Arrival time of each request at ``load`` times the trace's rate.

    "scale" divides every time by ``load`` (real timestamps, as Mooncake's).
    "sessions" divides only the session start times by ``load`` and keeps each
    session's own timing (think time, tool time): scaling the points of a
    Poisson process by 1/load gives a Poisson process ``load`` times as fast,
    so ``load`` multiplies the session arrival rate, i.e. the number of
    sessions running at once, without making any agent think faster.
    """
    t = np.fromiter((r.t for r in trace.requests), dtype=np.float64, count=len(trace.requests))
    t0 = float(t.min())
    if arrival_mode(trace, mode) == "scale":
        return t0 + (t - t0) / load
    top = _top_sessions(trace)
    start: dict[str, float] = {}
    for s, ti in zip(top, t.tolist(), strict=True):
        if ti < start.get(s, math.inf):
            start[s] = ti
    s0 = np.array([start[s] for s in top])
    return t0 + (s0 - t0) / load + (t - s0)


def _top_sessions(trace: Trace) -> list[str]:
    # Sub-agent requests ("trace_0001/agent-3") belong to their parent's session.
    return [r.session.split("/", 1)[0] for r in trace.requests]


def measure_window(trace: Trace, arrivals: np.ndarray, mode: str = "auto"
                   ) -> tuple[float, float]:
    """The interval over which utilisation is measured.

    "scale": the middle 90% of arrivals. "sessions": the time during which at
    least half the peak number of sessions are running (a session runs from
    its first to its last request), i.e. the plateau between the ramp-up and
    the drain of a finite set of sessions, whose long tails would otherwise
    dilute the figure."""
    if arrival_mode(trace, mode) == "scale":
        lo, hi = np.quantile(arrivals, [0.05, 0.95])
        return float(lo), float(hi)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    for s, a in zip(_top_sessions(trace), arrivals.tolist(), strict=True):
        first[s] = min(first.get(s, math.inf), a)
        last[s] = max(last.get(s, -math.inf), a)
    times = np.array(list(first.values()) + list(last.values()))
    steps = np.array([1] * len(first) + [-1] * len(last))
    order = np.lexsort((-steps, times))          # at a tie, starts before ends
    active = np.cumsum(steps[order])
    busy = np.flatnonzero(active >= max(1, active.max() / 2))
    return float(times[order][busy[0]]), float(times[order][min(busy[-1] + 1, len(times) - 1)])


def policy_kind(name: str) -> str:
    """"router" or "eviction"; an unknown name lists both sets."""
    if name in router_policy_names():
        return "router"
    if name in policy_names():
        return "eviction"
    raise UnknownPolicyError(f"unknown policy {name!r}: routing policies "
                             f"{router_policy_names()}, eviction policies {policy_names()}")


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    instances: int = 8
    load: float | None = None                 # arrival-rate multiplier; None: calibrate
    target_busy: float = 0.7
    capacity_tokens: tuple[int | None, ...] = (3_000_000,)    # per instance, per tier
    ttl_s: float = math.inf
    eviction: str = "lru"
    calibration_rounds: int = 6
    arrival: str = "auto"                     # "scale", "sessions" or "auto" (see arrival_times)
    progress: bool = False

    def __post_init__(self) -> None:
        if self.instances < 1:
            raise ValueError(f"instances must be >= 1, got {self.instances}")
        if self.load is not None and not (self.load > 0 and math.isfinite(self.load)):
            raise ValueError(f"load must be a positive number, got {self.load}")
        if not 0 < self.target_busy < 1:
            raise ValueError(f"target_busy must be in (0, 1), got {self.target_busy}")
        if not self.capacity_tokens or len(self.capacity_tokens) > N_TIERS - _VIEW_TIER_OFFSET:
            raise ValueError("capacity_tokens needs 1 to 3 tiers (G2[, G3[, G4]])")
        if any(c is not None and c < 0 for c in self.capacity_tokens):
            raise ValueError(f"capacity_tokens must be >= 0, got {self.capacity_tokens}")
        if not self.ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {self.ttl_s}")
        if self.eviction not in policy_names():
            raise ValueError(f"unknown eviction policy {self.eviction!r}; choose one of "
                             f"{policy_names()}")
        if self.calibration_rounds < 1:
            raise ValueError("calibration_rounds must be >= 1")
        if self.arrival not in ARRIVAL_MODES:
            raise ValueError(f"arrival must be one of {ARRIVAL_MODES}, got {self.arrival!r}")


@dataclass(frozen=True, slots=True)
class InstanceResult:
    instance: str
    requests: int
    hit_rate: float
    token_hit_rate: float
    busy_s: float
    utilization: float


@dataclass(frozen=True, slots=True)
class ClusterResult:
    policy: str
    instances: int
    load: float
    requests: int
    hit_rate: float
    token_hit_rate: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    imbalance: float                 # max / mean instance busy time
    utilization: float               # busy share of the measure_window
    per_instance: tuple[InstanceResult, ...]
    ttft_s: np.ndarray = field(repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class Calibration:
    load: float
    utilization: float               # round_robin's, at ``load``
    steps: tuple[tuple[float, float], ...]   # (load tried, utilisation measured)
    reached: bool                    # False: the trace cannot load round_robin that much
                                     #   (too few sessions); ``load`` is the best found


@dataclass(slots=True)
class _Tally:
    requests: int = 0
    blocks: int = 0
    hit_blocks: int = 0
    tokens: int = 0
    hit_tokens: int = 0


def _sim_candidates(n: int) -> CandidateSet:
    ids = tuple(f"inst-{i:03d}" for i in range(n))
    return CandidateSet(ids=ids, nodes=ids, infos=(), load=np.zeros(n), queue=np.zeros(n),
                        pending_tokens=np.zeros(n), imbalance=np.ones(n))


def simulate(trace: Trace, policy: str, cfg: ReplayConfig, load: float,
             cost: CostModel | None = None, policy_cfg: PolicyConfig | None = None
             ) -> ClusterResult:
    """One replay of ``trace`` at ``load`` (module doc)."""
    cost = cost or CostModel.default()
    pol = make_router_policy(policy, policy_cfg)
    n = cfg.instances
    bt = trace.block_tokens
    rule = HitRule(block_tokens=bt)
    stores = [SimWarehouse(list(cfg.capacity_tokens), policy=cfg.eviction, ttl_s=cfg.ttl_s,
                           block_tokens=bt) for _ in range(n)]
    n_tiers = len(cfg.capacity_tokens)
    usable = [cost.tier_usable(k) for k in range(n_tiers)]
    fetch_per_token = [cost.fetch_s_per_token(k) for k in range(n_tiers)]
    cands = _sim_candidates(n)
    free_at = np.zeros(n)
    busy = np.zeros(n)
    tallies = [_Tally() for _ in range(n)]
    reqs = trace.requests
    ttft = np.empty(len(reqs))
    arrivals = arrival_times(trace, load, cfg.arrival)
    order = np.argsort(arrivals, kind="stable")
    w0, w1 = measure_window(trace, arrivals, cfg.arrival)
    window = max(w1 - w0, 1e-9)
    busy_in_window = np.zeros(n)
    hits = np.zeros((n, N_TIERS), dtype=np.int64)
    match_tiers = getattr(stores[0], "match_tiers", None) is not None
    for k in tqdm(order.tolist(), desc=f"replay {policy}", file=sys.stderr,
                  disable=not cfg.progress, mininterval=1.0):
        r = reqs[k]
        now = float(arrivals[k])
        pending = cands.pending_tokens            # updated in place (the set is frozen)
        np.maximum(free_at - now, 0.0, out=pending)
        np.multiply(pending, 1.0 / cost.b_s_per_token, out=pending)
        n_store = min(len(r.hash_ids), r.input_length // bt)
        if pol.uses_cache and n_store:
            ids = r.hash_ids[:n_store]
            hits[:] = 0
            for i, store in enumerate(stores):
                if match_tiers:
                    for tier, m in enumerate(store.match_tiers(ids, now)):  # type: ignore[attr-defined]
                        hits[i, tier + _VIEW_TIER_OFFSET] = m
                else:
                    hits[i, _VIEW_TIER_OFFSET] = store.match(ids, now)
            req = PlacementRequest(r.input_length,
                                   restorable_tokens(hits, bt, r.input_length, rule))
        else:
            req = PlacementRequest(r.input_length)
        i = pol.choose_prefill(cands, req).index
        start = max(now, free_at[i])
        res = stores[i].access(replace(r, t=start))
        # Restore only from tiers that beat recomputing (cost-aware fetch).
        restored_blocks = sum(h for h, ok in zip(res.tier_hits, usable, strict=True) if ok)
        cached = rule.usable_tokens(min(restored_blocks * bt, r.input_length), r.input_length)
        fetch = 0.0
        if cached and restored_blocks:
            per_block = cached / restored_blocks
            fetch = sum(h * per_block * f for h, f, ok
                        in zip(res.tier_hits, fetch_per_token, usable, strict=True) if ok)
        service = fetch + cost.compute_s(r.input_length, cached)
        free_at[i] = start + service
        busy[i] += service
        busy_in_window[i] += max(0.0, min(free_at[i], w1) - max(start, w0))
        ttft[k] = free_at[i] - now
        t = tallies[i]
        t.requests += 1
        t.blocks += res.total_blocks
        t.hit_blocks += res.hit_blocks
        t.tokens += res.input_tokens
        t.hit_tokens += res.hit_tokens
    per = tuple(InstanceResult(cands.ids[i], t.requests,
                               t.hit_blocks / t.blocks if t.blocks else 0.0,
                               t.hit_tokens / t.tokens if t.tokens else 0.0,
                               float(busy[i]), float(busy_in_window[i] / window))
                for i, t in enumerate(tallies))
    blocks = sum(t.blocks for t in tallies)
    tokens = sum(t.tokens for t in tallies)
    p50, p90, p99 = np.percentile(ttft, [50, 90, 99])
    return ClusterResult(
        policy=policy, instances=n, load=load, requests=len(reqs),
        hit_rate=sum(t.hit_blocks for t in tallies) / blocks if blocks else 0.0,
        token_hit_rate=sum(t.hit_tokens for t in tallies) / tokens if tokens else 0.0,
        ttft_p50_s=float(p50), ttft_p90_s=float(p90), ttft_p99_s=float(p99),
        ttft_mean_s=float(ttft.mean()),
        imbalance=float(busy.max() / busy.mean()) if busy.mean() > 0 else 1.0,
        utilization=float(busy_in_window.sum() / (n * window)), per_instance=per, ttft_s=ttft)


def calibrate_load(trace: Trace, cfg: ReplayConfig, cost: CostModel | None = None
                   ) -> Calibration:
    """The load at which round_robin keeps the instances ``target_busy`` busy."""
    quiet = replace(cfg, progress=False)
    load = 1.0
    steps: list[tuple[float, float]] = []
    for _ in range(cfg.calibration_rounds):
        util = simulate(trace, "round_robin", quiet, load, cost).utilization
        steps.append((load, util))
        if util <= 0:
            raise ValueError("the trace generates no prefill work to calibrate a load on")
        if abs(util - cfg.target_busy) <= 0.02 * cfg.target_busy:
            return Calibration(load, util, tuple(steps), True)
        if len(steps) > 1:
            (l0, u0), (l1, u1) = steps[-2], steps[-1]
            if l1 > 2 * l0 and u1 < 1.1 * u0:
                # More load no longer adds work (every session already overlaps).
                return Calibration(l1, u1, tuple(steps), False)
        load *= cfg.target_busy / util
    util = simulate(trace, "round_robin", quiet, load, cost).utilization
    steps.append((load, util))
    return Calibration(load, util, tuple(steps),
                       abs(util - cfg.target_busy) <= 0.05 * cfg.target_busy)


def replay_cluster(trace: Trace, policies: Sequence[str], cfg: ReplayConfig,
                   cost: CostModel | None = None, policy_cfg: PolicyConfig | None = None
                   ) -> tuple[list[ClusterResult], Calibration | None]:
    """Every policy at the same load (calibrated once when ``cfg.load`` is None)."""
    for p in policies:
        if policy_kind(p) != "router":
            raise UnknownPolicyError(f"{p!r} is an eviction policy; a cluster replay needs "
                                     f"routing policies {router_policy_names()}")
    calib = None if cfg.load is not None else calibrate_load(trace, cfg, cost)
    load = cfg.load if calib is None else calib.load
    return [simulate(trace, p, cfg, load, cost, policy_cfg) for p in policies], calib


@dataclass(frozen=True, slots=True)
class CacheResult:
    """Single-store replay of an eviction policy (``studies.sim.replay_cache``)."""

    policy: str
    requests: int
    hit_rate: float
    token_hit_rate: float
    evictions: int
    expirations: int
    capacity_tokens: tuple[int | None, ...]


def replay_eviction(trace: Trace, policy: str, cfg: ReplayConfig) -> CacheResult:
    stats = replay_cache(trace, policy=policy, capacity_tokens=list(cfg.capacity_tokens),
                         ttl_s=cfg.ttl_s)
    return CacheResult(policy, stats.requests, stats.hit_rate, stats.token_hit_rate,
                       stats.evictions, stats.expirations, cfg.capacity_tokens)


__all__ = [
    "CacheResult",
    "Calibration",
    "ClusterResult",
    "InstanceResult",
    "ReplayConfig",
    "calibrate_load",
    "policy_kind",
    "replay_cluster",
    "replay_eviction",
    "simulate",
]
