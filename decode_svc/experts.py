"""Per-expert token counts of a MoE decode instance and its expert imbalance.

A decode step waits for the slowest expert-parallel rank, so the figure that
matters is, per MoE layer, max rank load / mean rank load under the
instance's expert placement, averaged over the layers that routed tokens
(docs/architecture.md#router; the same definition and runtime dispatch rule as the router's
planner, eplb.evaluate, which this module uses). Counts are kept over a
sliding window of recent steps (the "current" imbalance) and in total.

Placement: a plan file (``eplb.plan.ExpertPlan.save`` JSON), "auto" (plan
with eplb.plan from this instance's own counts, re-planned every
``replan_steps`` steps, as an EPLB rebalancer would), or contiguous.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from eplb.evaluate import LayerPlacement, dispatch_rank_loads, layer_imbalance


@dataclass(frozen=True, slots=True)
class ExpertPlacement:
    layers: tuple[LayerPlacement, ...]
    source: str                     # "contiguous" | "auto" | the plan file

    @classmethod
    def contiguous(cls, n_layers: int, n_experts: int, n_ranks: int) -> ExpertPlacement:
        layer = LayerPlacement.contiguous(n_experts, max(1, min(n_ranks, n_experts)))
        return cls((layer,) * n_layers, "contiguous")

    @classmethod
    def load(cls, path: str | Path, n_layers: int, n_experts: int) -> ExpertPlacement:
        """``{"n_ranks": R, "replicas": [[[rank, ...] per expert] per layer]}``;
        one layer's list stands for every layer."""
        data = json.loads(Path(path).read_text())
        layers = data["replicas"]
        if len(layers) == 1:
            layers = layers * n_layers
        if len(layers) != n_layers or any(len(layer) != n_experts for layer in layers):
            raise ValueError(f"{path}: placement must cover {n_layers} layers x "
                             f"{n_experts} experts")
        n_ranks = int(data["n_ranks"])
        return cls(tuple(LayerPlacement(n_ranks, tuple(tuple(int(r) for r in ranks)
                                                       for ranks in layer))
                         for layer in layers), str(path))

    @classmethod
    def planned(cls, counts: np.ndarray, n_ranks: int, redundant: int) -> ExpertPlacement:
        """EPLB plan from recorded counts [layers, experts]; idle layers stay contiguous."""
        from eplb.plan import EplbConfig, plan

        n_layers, n_experts = counts.shape
        p = plan([counts.astype(np.float64)], EplbConfig(ranks=n_ranks, redundant=redundant))
        dense = LayerPlacement.contiguous(n_experts, n_ranks)
        return cls(tuple(p.layers.get(li, dense) for li in range(n_layers)), "auto")


def imbalance(counts: np.ndarray, placement: ExpertPlacement) -> float:
    """Mean over layers with traffic of max rank load / mean rank load; 1.0 = balanced."""
    per_layer = [layer_imbalance(dispatch_rank_loads(placement.layers[li], counts[li]))
                 for li in range(counts.shape[0]) if counts[li].sum() > 0]
    return float(np.mean(per_layer)) if per_layer else 1.0


class ExpertLoad:
    def __init__(self, n_layers: int, n_experts: int, placement: ExpertPlacement, *,
                 window_steps: int = 64, replan_steps: int = 0, redundant: int = 0) -> None:
        self.placement = placement
        self.total = np.zeros((n_layers, n_experts), dtype=np.int64)
        self._window: deque[np.ndarray] = deque(maxlen=window_steps)
        self._replan_steps = replan_steps
        self._redundant = redundant
        self._steps = 0
        self._current = 1.0

    def add(self, counts: torch.Tensor | None) -> None:
        """Counts of one step ([layers, experts], from ``Engine.expert_counts``)."""
        if counts is None:
            return
        arr = counts.numpy().astype(np.int64)
        self.total += arr
        self._window.append(arr)
        self._steps += 1
        if self._replan_steps and self._steps % self._replan_steps == 0:
            n_ranks = self.placement.layers[0].n_ranks
            self.placement = ExpertPlacement.planned(self.total, n_ranks, self._redundant)
        self._current = imbalance(np.sum(self._window, axis=0), self.placement)

    @property
    def current(self) -> float:
        return self._current

    def per_expert(self) -> list[list[int]]:
        return self.total.tolist()
