"""Expert loads, placements and how balanced a placement keeps the ranks.

Imbalance of one MoE layer = max rank load / mean rank load (a step waits for
the slowest rank); a recording's figure is the mean over its MoE layers
(layers with no routed tokens, such as DeepSeek-V3's first three dense
layers, are skipped).

How an expert's tokens reach its replicas:

* ``static``: split equally over the replicas.
* ``dispatch`` (the runtime rule, documented in docs/router.md): for each step
  the dispatcher knows every expert's token count (the gate's output, which
  the all-to-all needs anyway). Ranks first carry their single-replica
  experts; then the experts with several replicas are visited heaviest first
  and each one's tokens are poured into its replicas' ranks lowest first, so
  those ranks rise to a common level (water-filling). The pass is repeated
  ``sweeps`` times, each time lifting an expert's own tokens out before
  pouring them again; this is coordinate descent on the sum of squared rank
  loads, whose minimum is also the min-max split. For the planner's layouts
  (each replicated expert owns its group of ranks) the first pass is exact.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DISPATCH_SWEEPS = 8


class ExpertLoadError(ValueError):
    """An expert-load recording or a placement is malformed."""


def load_expert_loads(path: str | Path) -> np.ndarray:
    """``{"logical_count": [[count per expert] per layer]}`` -> [layers, experts] float64."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ExpertLoadError(f"{p}: cannot read expert loads ({exc})") from None
    rows = data.get("logical_count") if isinstance(data, dict) else None
    if not isinstance(rows, list) or not rows:
        raise ExpertLoadError(f"{p}: expected a JSON object with a non-empty 'logical_count' "
                              "list of per-layer expert counts")
    try:
        arr = np.asarray(rows, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ExpertLoadError(f"{p}: logical_count must be a [layers][experts] table of "
                              f"numbers ({exc})") from None
    if arr.ndim != 2 or arr.shape[1] < 1:
        raise ExpertLoadError(f"{p}: logical_count must be rectangular [layers][experts], "
                              f"got shape {arr.shape}")
    if not np.isfinite(arr).all() or (arr < 0).any():
        raise ExpertLoadError(f"{p}: counts must be finite and >= 0")
    return arr


def moe_layers(loads: np.ndarray) -> np.ndarray:
    """Indices of layers that routed any token (dense layers record zeros)."""
    return np.flatnonzero(loads.sum(axis=1) > 0)


@dataclass(frozen=True, slots=True)
class LayerPlacement:
    """Where one layer's experts live: ``replicas[e]`` = ranks holding expert e."""

    n_ranks: int
    replicas: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        for e, ranks in enumerate(self.replicas):
            if not ranks:
                raise ExpertLoadError(f"expert {e} has no replica")
            if len(set(ranks)) != len(ranks) or not all(0 <= r < self.n_ranks for r in ranks):
                raise ExpertLoadError(f"expert {e}: replica ranks {ranks} must be distinct and "
                                      f"in 0..{self.n_ranks - 1}")

    @property
    def counts(self) -> np.ndarray:
        return np.array([len(r) for r in self.replicas])

    def slots_used(self) -> np.ndarray:
        """[R] replicas held by each rank."""
        used = np.zeros(self.n_ranks, dtype=np.int64)
        for ranks in self.replicas:
            used[list(ranks)] += 1
        return used

    @classmethod
    def contiguous(cls, n_experts: int, n_ranks: int) -> LayerPlacement:
        """Experts in index order, as evenly as possible over the ranks, no replicas."""
        return cls(n_ranks, tuple((e * n_ranks // n_experts,) for e in range(n_experts)))


def static_rank_loads(place: LayerPlacement, x: np.ndarray) -> np.ndarray:
    """[R] rank loads when each expert's tokens split equally over its replicas."""
    loads = np.zeros(place.n_ranks)
    for e, ranks in enumerate(place.replicas):
        if len(ranks) == 1:
            loads[ranks[0]] += x[e]
        else:
            loads[list(ranks)] += x[e] / len(ranks)
    return loads


def _water_fill(base: np.ndarray, amount: float) -> np.ndarray:
    """Shares of ``amount`` that raise the lowest of ``base`` to a common level."""
    order = np.argsort(base)
    b = base[order]
    csum = np.cumsum(b)
    k = len(b)
    level = (amount + csum[-1]) / k
    for j in range(1, len(b) + 1):
        lv = (amount + csum[j - 1]) / j
        if j == len(b) or lv <= b[j]:
            k, level = j, lv
            break
    share = np.zeros_like(base)
    share[order[:k]] = level - b[:k]
    return share


def dispatch_rank_loads(place: LayerPlacement, x: np.ndarray,
                        sweeps: int = DISPATCH_SWEEPS) -> np.ndarray:
    """[R] rank loads under the runtime dispatch rule (module doc)."""
    loads = np.zeros(place.n_ranks)
    multi: list[tuple[int, np.ndarray]] = []
    for e, ranks in enumerate(place.replicas):
        if len(ranks) == 1:
            loads[ranks[0]] += x[e]
        else:
            multi.append((e, np.array(ranks)))
    if not multi:
        return loads
    multi.sort(key=lambda item: -x[item[0]])
    shares = [np.zeros(len(r)) for _, r in multi]
    for _ in range(max(1, sweeps)):
        for k, (e, ranks) in enumerate(multi):
            loads[ranks] -= shares[k]
            shares[k] = _water_fill(loads[ranks], float(x[e]))
            loads[ranks] += shares[k]
    return loads


def layer_imbalance(rank_loads: np.ndarray) -> float:
    mean = rank_loads.mean()
    return float(rank_loads.max() / mean) if mean > 0 else 1.0


@dataclass(frozen=True, slots=True)
class LayerScore:
    layer: int
    contiguous: float
    static: float
    dispatch: float


@dataclass(frozen=True, slots=True)
class PlanScore:
    """Imbalance of a plan (and of contiguous placement) on one recording."""

    contiguous: float
    static: float
    dispatch: float
    layers: tuple[LayerScore, ...]


def score_plan(placements: dict[int, LayerPlacement], loads: np.ndarray, *,
               sweeps: int = DISPATCH_SWEEPS) -> PlanScore:
    """Mean over the recording's MoE layers; the plan must cover each of them."""
    layers = moe_layers(loads)
    if layers.size == 0:
        raise ExpertLoadError("the evaluation recording has no routed tokens in any layer")
    rows: list[LayerScore] = []
    for li in layers:
        place = placements.get(int(li))
        if place is None:
            raise ExpertLoadError(f"layer {li} routes tokens in the evaluation recording but "
                                  "the plan has no placement for it (a dense layer when planned)")
        x = loads[li]
        if len(place.replicas) != x.shape[0]:
            raise ExpertLoadError(f"layer {li}: plan has {len(place.replicas)} experts, "
                                  f"recording has {x.shape[0]}")
        contiguous = LayerPlacement.contiguous(x.shape[0], place.n_ranks)
        rows.append(LayerScore(
            int(li),
            layer_imbalance(static_rank_loads(contiguous, x)),
            layer_imbalance(static_rank_loads(place, x)),
            layer_imbalance(dispatch_rank_loads(place, x, sweeps))))
    return PlanScore(float(np.mean([r.contiguous for r in rows])),
                     float(np.mean([r.static for r in rows])),
                     float(np.mean([r.dispatch for r in rows])), tuple(rows))


__all__ = ["DISPATCH_SWEEPS", "ExpertLoadError", "LayerPlacement", "LayerScore", "PlanScore",
           "dispatch_rank_loads", "layer_imbalance", "load_expert_loads", "moe_layers",
           "score_plan", "static_rank_loads"]
