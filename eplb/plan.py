"""EPLB-style expert placement with redundant experts, planned robustly.

Setting: ``ranks`` expert-parallel ranks with ``slots_per_rank`` expert slots
each; ``ranks * slots_per_rank = experts + redundant``. Every expert gets at
least one replica; the ``redundant`` extra replicas go to the hottest experts.

Why the plan is shaped as it is: the runtime dispatcher (eplb.evaluate)
can move an expert's tokens only between that expert's replicas, so ranks
linked by shared experts form groups that balance among themselves, and
nothing balances across groups. Each redundant replica can join at most one
more rank to a group, so there are always at least ``ranks - redundant``
groups (72 - 32 = 40 here): a plan is good out of sample when every group's
total load stays near its share. The planner therefore

1. *predicts* each expert's load share per layer as the mean of the planning
   recordings' shares (each recording normalised per layer), with an
   uncertainty ``sd_e`` = sqrt(spread across recordings^2 + (rel_sigma *
   share)^2): measured drift plus a prior for drift to workloads not seen;
2. *replicates* by repeatedly giving one more replica to the expert with the
   largest robust load per replica ``(share + kappa * sd) / replicas``;
3. gives each replicated expert a *group of its own ranks* (one replica per
   rank; the groups are disjoint, so the dispatcher balances each group
   exactly), the remaining ranks being single-rank groups;
4. *packs* the single-replica experts into the groups' free slots so as to
   minimise the largest robust group level ``(mean + kappa * sd) / ranks``:
   largest first into the lowest level, then pairwise swaps out of the worst
   group while that lowers the worst level;
5. spreads each group's experts over its ranks, largest first onto the
   least-loaded rank (which also balances the static equal split).

When the replicated experts need more ranks than exist (tiny settings), it
falls back to plain balanced packing: replicas largest first onto the
least-loaded rank with a free slot that does not hold the expert yet. That
packing on the mean loads is also the ``method="greedy"`` baseline that
``kvserve eplb`` reports side by side.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eplb.evaluate import ExpertLoadError, LayerPlacement, moe_layers

METHODS = ("robust", "greedy")


@dataclass(frozen=True, slots=True)
class EplbConfig:
    ranks: int = 72
    redundant: int = 32
    kappa: float = 1.0          # weight of the uncertainty in "robust load"
    rel_sigma: float = 0.25     # prior relative drift of an expert's share between workloads
    swap_rounds: int = 400      # local-search budget per layer
    method: str = "robust"      # or "greedy": the plain baseline (mean loads, balanced packing)

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {self.ranks}")
        if self.redundant < 0:
            raise ValueError(f"redundant must be >= 0, got {self.redundant}")
        if self.kappa < 0 or self.rel_sigma < 0:
            raise ValueError("kappa and rel_sigma must be >= 0")
        if self.swap_rounds < 0:
            raise ValueError(f"swap_rounds must be >= 0, got {self.swap_rounds}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")

    def slots_per_rank(self, experts: int) -> int:
        slots = experts + self.redundant
        if slots % self.ranks:
            raise ValueError(f"{experts} experts + {self.redundant} redundant = {slots} slots do "
                             f"not divide evenly over {self.ranks} ranks")
        if self.redundant > 0 and slots // self.ranks > experts:
            raise ValueError("more slots per rank than experts: a rank would hold an expert twice")
        return slots // self.ranks


@dataclass(frozen=True, slots=True)
class ExpertPlan:
    """Placements of the MoE layers (dense layers have none)."""

    n_ranks: int
    slots_per_rank: int
    n_layers: int
    n_experts: int
    layers: dict[int, LayerPlacement]

    def __post_init__(self) -> None:
        for li, place in self.layers.items():
            used = place.slots_used()
            if used.max(initial=0) > self.slots_per_rank:
                raise ExpertLoadError(f"layer {li}: a rank holds {used.max()} replicas, "
                                      f"capacity is {self.slots_per_rank}")

    def to_json(self) -> dict[str, object]:
        """decode_svc's placement format; dense layers get contiguous placement."""
        dense = LayerPlacement.contiguous(self.n_experts, self.n_ranks)
        return {"n_ranks": self.n_ranks, "slots_per_rank": self.slots_per_rank,
                "replicas": [[list(r) for r in self.layers.get(li, dense).replicas]
                             for li in range(self.n_layers)]}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))


def predicted_shares(recordings: Sequence[np.ndarray], layer: int,
                     rel_sigma: float) -> tuple[np.ndarray, np.ndarray]:
    """Mean per-layer share of each expert over the recordings, and its uncertainty."""
    rows = []
    for rec in recordings:
        total = rec[layer].sum()
        if total > 0:
            rows.append(rec[layer] / total)
    if not rows:
        raise ExpertLoadError(f"layer {layer} has no routed tokens in any planning recording")
    shares = np.array(rows)                                        # [files, E]
    p = shares.mean(axis=0)
    spread = shares.var(axis=0) if len(rows) > 1 else np.zeros_like(p)
    return p, np.sqrt(spread + (rel_sigma * p) ** 2)


def replica_counts(robust: np.ndarray, redundant: int, max_count: int) -> np.ndarray:
    counts = np.ones(robust.shape[0], dtype=np.int64)
    for _ in range(redundant):
        per = np.where(counts < max_count, robust / counts, -np.inf)
        counts[int(np.argmax(per))] += 1
    return counts


class _Groups:
    """Disjoint groups of ranks: one per replicated expert, plus single ranks."""

    def __init__(self, p: np.ndarray, sd: np.ndarray, counts: np.ndarray, spr: int,
                 n_ranks: int, kappa: float) -> None:
        rep = np.flatnonzero(counts > 1)
        n_single = n_ranks - int(counts[rep].sum())
        self.owner = np.concatenate([rep, np.full(n_single, -1)])   # [G] replicated expert
        self.size = np.concatenate([counts[rep], np.ones(n_single, dtype=np.int64)])
        self.cap = np.where(self.owner >= 0, (spr - 1) * self.size, spr)   # free slots
        self.mu = np.where(self.owner >= 0, p[np.maximum(self.owner, 0)], 0.0)
        self.var = np.where(self.owner >= 0, sd[np.maximum(self.owner, 0)] ** 2, 0.0)
        self.kappa = kappa
        self.members: list[list[int]] = [[] for _ in range(len(self.size))]

    def level(self, mu: np.ndarray, var: np.ndarray, size: np.ndarray) -> np.ndarray:
        return (mu + self.kappa * np.sqrt(np.maximum(var, 0.0))) / size

    def pack(self, singles: np.ndarray, p: np.ndarray, sd: np.ndarray, rounds: int) -> None:
        robust = p + self.kappa * sd
        free = self.cap.astype(np.int64).copy()
        for e in singles[np.argsort(-robust[singles], kind="stable")]:
            lv = self.level(self.mu + p[e], self.var + sd[e] ** 2, self.size)
            lv[free == 0] = np.inf
            g = int(np.argmin(lv))
            self._add(g, int(e), p, sd)
            free[g] -= 1
        for _ in range(rounds):
            if not self._swap_out_of_worst(p, sd):
                break

    def _add(self, g: int, e: int, p: np.ndarray, sd: np.ndarray) -> None:
        self.members[g].append(e)
        self.mu[g] += p[e]
        self.var[g] += sd[e] ** 2

    def _swap_out_of_worst(self, p: np.ndarray, sd: np.ndarray) -> bool:
        levels = self.level(self.mu, self.var, self.size)
        w = int(np.argmax(levels))
        if not self.members[w]:
            return False
        a = np.array(self.members[w])                                    # [A] in the worst group
        others = [(g, e) for g, mem in enumerate(self.members) if g != w for e in mem]
        if not others:
            return False
        og = np.array([g for g, _ in others])
        b = np.array([e for _, e in others])                             # [B] elsewhere
        dmu = p[b][None, :] - p[a][:, None]                              # [A, B] change in w
        dvar = sd[b][None, :] ** 2 - sd[a][:, None] ** 2
        new_w = self.level(self.mu[w] + dmu, self.var[w] + dvar, self.size[w])
        new_o = self.level(self.mu[og][None, :] - dmu, self.var[og][None, :] - dvar,
                           self.size[og][None, :])
        worst = np.maximum(new_w, new_o)
        i, j = np.unravel_index(int(np.argmin(worst)), worst.shape)
        if worst[i, j] >= levels[w] - 1e-12:
            return False
        g, ea, eb = int(og[j]), int(a[i]), int(b[j])
        self.members[w].remove(ea)
        self.members[g].remove(eb)
        self.members[w].append(eb)
        self.members[g].append(ea)
        self.mu[w] += p[eb] - p[ea]
        self.mu[g] += p[ea] - p[eb]
        self.var[w] += sd[eb] ** 2 - sd[ea] ** 2
        self.var[g] += sd[ea] ** 2 - sd[eb] ** 2
        return True

    def placement(self, p: np.ndarray, n_experts: int, spr: int) -> list[list[int]]:
        """replicas[e] -> ranks, ranks numbered group by group."""
        replicas: list[list[int]] = [[] for _ in range(n_experts)]
        first = 0
        for g, size in enumerate(self.size.tolist()):
            owner = int(self.owner[g])
            per_rank = spr - 1 if owner >= 0 else spr
            if owner >= 0:
                replicas[owner] = list(range(first, first + size))
            load = np.zeros(size)
            used = np.zeros(size, dtype=np.int64)
            for e in sorted(self.members[g], key=lambda e: -p[e]):
                open_ = np.flatnonzero(used < per_rank)
                r = int(open_[np.argmin(load[open_])])
                load[r] += p[e]
                used[r] += 1
                replicas[e].append(first + r)
            first += size
        return replicas


def _balanced_packing(robust: np.ndarray, counts: np.ndarray, n_ranks: int,
                      spr: int) -> list[list[int]]:
    """Fallback: replicas largest first onto the least-loaded rank with room."""
    items = sorted(((robust[e] / counts[e], e) for e in range(len(counts))
                    for _ in range(counts[e])), key=lambda it: -it[0])
    load = np.zeros(n_ranks)
    used = np.zeros(n_ranks, dtype=np.int64)
    replicas: list[list[int]] = [[] for _ in range(len(counts))]
    for w, e in items:
        ok = np.flatnonzero(used < spr)
        ok = ok[~np.isin(ok, replicas[e])]
        if ok.size == 0:
            raise ExpertLoadError("cannot place all replicas: no rank has room for "
                                  f"another copy of expert {e}")
        r = int(ok[np.argmin(load[ok])])
        load[r] += w
        used[r] += 1
        replicas[e].append(r)
    return replicas


def plan_layer(recordings: Sequence[np.ndarray], layer: int, cfg: EplbConfig) -> LayerPlacement:
    n_experts = recordings[0].shape[1]
    spr = cfg.slots_per_rank(n_experts)
    p, sd = predicted_shares(recordings, layer, cfg.rel_sigma)
    if cfg.method == "greedy":
        # The plain baseline: hottest experts replicated by mean load per
        # replica, replicas packed largest first onto the least-loaded rank.
        counts = replica_counts(p, cfg.redundant, max_count=cfg.ranks)
        replicas = _balanced_packing(p, counts, cfg.ranks, spr)
        return LayerPlacement(cfg.ranks, tuple(tuple(sorted(r)) for r in replicas))
    robust = p + cfg.kappa * sd
    counts = replica_counts(robust, cfg.redundant, max_count=cfg.ranks)
    if int(counts[counts > 1].sum()) <= cfg.ranks:
        groups = _Groups(p, sd, counts, spr, cfg.ranks, cfg.kappa)
        groups.pack(np.flatnonzero(counts == 1), p, sd, cfg.swap_rounds)
        replicas = groups.placement(p, n_experts, spr)
    else:
        replicas = _balanced_packing(robust, counts, cfg.ranks, spr)
    return LayerPlacement(cfg.ranks, tuple(tuple(sorted(r)) for r in replicas))


def plan(recordings: Sequence[np.ndarray], cfg: EplbConfig) -> ExpertPlan:
    """A placement for every layer that routes tokens in any planning recording."""
    if not recordings:
        raise ExpertLoadError("planning needs at least one expert-load recording")
    shape = recordings[0].shape
    for rec in recordings[1:]:
        if rec.shape != shape:
            raise ExpertLoadError(f"planning recordings disagree in shape: {shape} vs {rec.shape}")
    spr = cfg.slots_per_rank(shape[1])
    layers = np.unique(np.concatenate([moe_layers(r) for r in recordings]))
    if layers.size == 0:
        raise ExpertLoadError("no planning recording routes any token")
    placements = {int(li): plan_layer(recordings, int(li), cfg) for li in layers}
    return ExpertPlan(cfg.ranks, spr, shape[0], shape[1], placements)


__all__ = ["METHODS", "EplbConfig", "ExpertPlan", "plan", "plan_layer", "predicted_shares",
           "replica_counts"]
