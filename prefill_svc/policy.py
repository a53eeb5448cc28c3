"""Orderings of the prefill queue, by name (``[prefill].policy``).

A policy maps a request to a sort key; the scheduler serves keys in
ascending order, running and waiting requests alike, within each step's
token budget.

- ``fcfs``: arrival order.
- ``src``: shortest remaining compute first (prompt tokens minus those found
  cached, in G1 or the warehouse): SGLang's cache-aware ordering in the form
  that also ranks cold prompts by length, so a returning agent turn with a
  few new tokens passes cold prompts, and a short chat passes a long
  document.

Starvation is bounded by the scheduler, not the key: requests that have
waited ``max_delay_s`` take part of every step first (prefill_svc/scheduler.py),
how much by the aging rule (``[prefill].aging``):

- ``strict`` (default): the aged take the whole step, oldest first; the tail
  is bounded tightest, and everything younger waits for them.
- ``share``: each aged request one share, all the others one share together;
  an old prompt advances at least at half speed and never holds a whole step,
  so turns arriving behind a cold long context still go, at the old prompt's
  (and the turns held for it) expense. On the agent replay of
  docs/BENCHMARKS.md it lost to ``strict`` at p50, p90 and p99 alike: the
  turns held for the long prompt outnumbered the ones it delayed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from common.config import PREFILL_AGING, PREFILL_POLICIES, ConfigError


class Ranked(Protocol):
    arrival: float              # monotonic seconds
    remaining: int              # prompt tokens still to compute


PolicyKey = Callable[[Ranked], tuple[float, ...]]


def fcfs(r: Ranked) -> tuple[float, ...]:
    return (r.arrival,)


def src(r: Ranked) -> tuple[float, ...]:
    return (float(r.remaining), r.arrival)


POLICIES: dict[str, PolicyKey] = {"fcfs": fcfs, "src": src}
assert set(POLICIES) == set(PREFILL_POLICIES), "common.config.PREFILL_POLICIES is stale"


def policy(name: str) -> PolicyKey:
    try:
        return POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown prefill policy {name!r}; known: {sorted(POLICIES)}") from None


# Tokens of a step (``budget``) the aged requests take first, given their shares.
AgingRule = Callable[[int, int], int]
AGING: dict[str, AgingRule] = {
    "share": lambda budget, shares: budget * shares // (shares + 1),
    "strict": lambda budget, shares: budget if shares else 0,
}
assert set(AGING) == set(PREFILL_AGING), "common.config.PREFILL_AGING is stale"
