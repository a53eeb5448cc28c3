"""Orderings of the prefill queue, by name (``[prefill].policy``).

A policy maps a request to a sort key; the scheduler serves keys in
ascending order, running and waiting requests alike, within each step's
token budget.

- ``fcfs``: arrival order.
- ``src``: shortest remaining compute first (prompt tokens minus those found
  cached, in G1 or the warehouse): SGLang's cache-aware ordering in the form
  that also ranks cold prompts by length, so a returning agent turn with a
  few new tokens passes cold prompts, and a short chat passes a long
  document. Aging bounds the cost: a request that has waited ``max_delay_s``
  since its arrival goes before every request that has not, in arrival order
  among such, so no prompt is passed for longer than that.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from common.config import PREFILL_POLICIES, ConfigError


class Ranked(Protocol):
    arrival: float              # monotonic seconds
    remaining: int              # prompt tokens still to compute


@dataclass(frozen=True, slots=True)
class PolicyContext:
    now: float                  # monotonic seconds
    max_delay_s: float


PolicyKey = Callable[[Ranked, PolicyContext], tuple[float, ...]]


def fcfs(r: Ranked, ctx: PolicyContext) -> tuple[float, ...]:
    return (r.arrival,)


def src(r: Ranked, ctx: PolicyContext) -> tuple[float, ...]:
    if ctx.now - r.arrival >= ctx.max_delay_s:
        return (0.0, r.arrival)             # waited long enough: in arrival order, first
    return (1.0, float(r.remaining), r.arrival)


POLICIES: dict[str, PolicyKey] = {"fcfs": fcfs, "src": src}
assert set(POLICIES) == set(PREFILL_POLICIES), "common.config.PREFILL_POLICIES is stale"


def policy(name: str) -> PolicyKey:
    try:
        return POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown prefill policy {name!r}; known: {sorted(POLICIES)}") from None
