"""Prefill cost model of the simulated cluster (``kvserve replay``).

Compute time of a prompt of ``L`` tokens whose first ``h`` tokens are restored:

    compute(L, h) = a + b * (L - h) + c * (L**2 - h**2)

the linear-plus-quadratic shape of a transformer prefill (per-token MLP and
projections, attention over everything before each token), with the tokens
after the restore point still attending to the restored prefix. The default
coefficients fit the measured Llama-8B-shaped prefill on one H200 (4k / 16k /
32k tokens: 0.087 / 0.43 / 1.09 s; docs/architecture.md#reference-figures).
Restoring ``n`` tokens from a tier takes ``n * kv_bytes_per_token / bandwidth``
(pinned host -> GPU 55 GB/s for G2, local disk 1.25 GB/s for G3, same page); a
tier slower than recomputing is not used (the cost-aware fetch rule,
docs/architecture.md#tiers-ttls-and-eviction).

``CostModel.from_json`` accepts the coefficients themselves, a list of
measured ``points`` ``[[tokens, seconds], ...]``, or any JSON (such as the
output of ``kvserve bench engine --json``) holding objects with a prompt
length and a cold prefill time, which are then fitted.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# docs/architecture.md#reference-figures: Llama-8B-shaped prefill on one H200 (bf16, SDPA).
DESIGN_POINTS: tuple[tuple[int, float], ...] = ((4096, 0.087), (16384, 0.43), (32768, 1.09))
# Llama-3-8B: 32 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes.
LLAMA3_8B_KV_BYTES_PER_TOKEN = 131_072
TIER_GBPS: tuple[float, ...] = (55.0, 1.25)        # G2 pinned host, G3 local disk
_TOKEN_KEYS = ("prompt_tokens", "tokens", "n_tokens", "input_tokens", "prompt_len")
_TIME_KEYS = ("cold_ttft_s", "prefill_s", "compute_s", "ttft_s", "seconds", "time_s")


class CostModelError(ValueError):
    """A cost-model file cannot be used; the message says why."""


def fit_points(points: Sequence[tuple[float, float]]) -> tuple[float, float, float]:
    """Least-squares (a, b, c) >= 0 for t = a + b n + c n^2; terms whose
    coefficient would be negative are dropped and the rest refitted."""
    pts = np.array(points, dtype=np.float64).reshape(-1, 2)
    if len(pts) == 0 or (pts[:, 0] <= 0).any() or (pts[:, 1] <= 0).any():
        raise CostModelError("cost points must be (tokens > 0, seconds > 0) pairs")
    n, t = pts[:, 0], pts[:, 1]
    basis = np.stack([np.ones_like(n), n, n * n], axis=1)
    # Richest model the points support first; b alone always fits (t, n > 0).
    for active in ([0, 1, 2], [1, 2], [1]):
        if len(active) > len(pts):
            continue
        coef, *_ = np.linalg.lstsq(basis[:, active], t, rcond=None)
        if (coef >= 0).all():
            out = [0.0, 0.0, 0.0]
            for k, v in zip(active, coef, strict=True):
                out[k] = float(v)
            return out[0], out[1], out[2]
    raise CostModelError("could not fit the cost points")  # unreachable: b > 0 fits


@dataclass(frozen=True, slots=True)
class CostModel:
    a_s: float
    b_s_per_token: float
    c_s_per_token2: float
    kv_bytes_per_token: int = LLAMA3_8B_KV_BYTES_PER_TOKEN
    tier_gbps: tuple[float, ...] = TIER_GBPS
    source: str = "docs/architecture.md#reference-figures (Llama-8B shape, H200)"

    def __post_init__(self) -> None:
        if min(self.a_s, self.b_s_per_token, self.c_s_per_token2) < 0:
            raise CostModelError("cost coefficients must be >= 0")
        if self.b_s_per_token <= 0 and self.c_s_per_token2 <= 0:
            raise CostModelError("cost model must charge something per token")
        if self.kv_bytes_per_token < 1 or any(g <= 0 for g in self.tier_gbps):
            raise CostModelError("kv_bytes_per_token and tier bandwidths must be > 0")

    @classmethod
    def default(cls) -> CostModel:
        return cls(*fit_points(DESIGN_POINTS))

    def compute_s(self, total: int, cached: int) -> float:
        """Prefill compute of ``total`` tokens of which the first ``cached`` are restored."""
        return (self.a_s + self.b_s_per_token * (total - cached)
                + self.c_s_per_token2 * (total * total - cached * cached))

    def fetch_s_per_token(self, tier: int) -> float:
        gbps = self.tier_gbps[min(tier, len(self.tier_gbps) - 1)]
        return self.kv_bytes_per_token / (gbps * 1e9)

    def tier_usable(self, tier: int) -> bool:
        """Cost-aware fetch: restore from a tier only if it beats recomputing
        (compared with the linear per-token compute, the cheapest case)."""
        return self.fetch_s_per_token(tier) < self.b_s_per_token

    def token_equivalents(self, seconds: float) -> float:
        """Work in tokens of linear prefill (the unit placement scores use)."""
        return seconds / self.b_s_per_token if self.b_s_per_token > 0 else seconds

    @classmethod
    def from_json(cls, path: str | Path) -> CostModel:
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CostModelError(f"{p}: cannot read cost model ({exc})") from None
        extra: dict[str, Any] = {}
        if isinstance(data, dict):
            if "kv_bytes_per_token" in data:
                extra["kv_bytes_per_token"] = int(data["kv_bytes_per_token"])
            if "tier_gbps" in data:
                extra["tier_gbps"] = tuple(float(g) for g in data["tier_gbps"])
            if {"a_s", "b_s_per_token", "c_s_per_token2"} <= data.keys():
                return cls(float(data["a_s"]), float(data["b_s_per_token"]),
                           float(data["c_s_per_token2"]), source=str(p), **extra)
            if "points" in data:
                return cls(*fit_points(data["points"]), source=f"{p} (points)", **extra)
        points = list(_find_points(data))
        if not points:
            raise CostModelError(
                f"{p}: no cost model found: give a_s/b_s_per_token/c_s_per_token2, "
                f"'points' [[tokens, seconds], ...], or objects with one of {_TOKEN_KEYS} "
                f"and one of {_TIME_KEYS}")
        return cls(*fit_points(points), source=f"{p} ({len(points)} measured points)", **extra)


def _find_points(data: Any) -> Iterator[tuple[float, float]]:
    if isinstance(data, dict):
        n = next((data[k] for k in _TOKEN_KEYS if isinstance(data.get(k), int | float)), None)
        t = next((data[k] for k in _TIME_KEYS if isinstance(data.get(k), int | float)), None)
        if n is not None and t is not None and n > 0 and t > 0:
            yield float(n), float(t)
        for v in data.values():
            yield from _find_points(v)
    elif isinstance(data, list):
        for v in data:
            yield from _find_points(v)


__all__ = ["DESIGN_POINTS", "LLAMA3_8B_KV_BYTES_PER_TOKEN", "TIER_GBPS", "CostModel",
           "CostModelError", "fit_points"]
