"""The prefill service's scheduler: a bounded waiting queue and a plan per
step (vLLM v1's scheduler is the model: one loop, a token budget per step,
nothing fails that was admitted).

Pure bookkeeping, no engine and no asyncio: ``prefill_svc/steps.py`` feeds it
requests and step results and runs its plans on the engine thread.

- A request is *waiting* from submission until it is admitted into the
  engine, *running* until its prompt is computed. Waiting requests are bounded
  by count (``max_waiting``) and by the tokens they still have to compute
  (``max_waiting_tokens``); a request that does not fit is refused before any
  work with an estimate of when there is room (``Busy.retry_after_ms``).
- A waiting request becomes *ready* once its warehouse lookup and fetch are
  done (they run while it waits); only ready ones are admitted.
- Each step: running and ready requests in policy order (prefill_svc/policy.py)
  take the step's token budget in turn, each up to what it has left, so a
  long prompt goes in chunks and short ones finish beside it. A waiting
  request is admitted only while fewer than ``max_running`` run and the KV
  pool has its blocks; the first one that does not fit stops admissions for
  this step (no small request overtakes it into the pool for ever).
- Aging (prefill_svc/policy.py has the rules): requests that have waited
  ``max_delay_s`` take their part of the step first, oldest first, and the
  policy order takes the rest: all of it with ``strict`` (the default); with
  ``share``, one share per aged request and one for all the others together,
  a request held for a running prompt (below) lending that prompt its share.
- A ready request whose prompt shares at least ``HOLD_MIN_TOKENS`` of
  uncached prefix with blocks a running prompt is computing right now waits
  for that prompt instead of computing the same blocks beside it (an agent
  resends a long context while its previous turn is still in prefill): once
  the running one is done its blocks are in G1 and the waiting one is
  admitted as a hit. The wait is bounded by the running prompt's own compute.

Every plan also says why each waiting request was not admitted
(``StepPlan.blocked``, one of ``WAIT_REASONS``), so the service can split a
request's queue time into its causes (``Entry.charge``): on the H200 stack
prefill's queue held each request 0.8 s while its GPU idled three quarters of
the time, and the one figure did not say for what.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from common.config import PrefillSection
from prefill_svc.policy import AGING, policy

MIN_RETRY_MS = 10
MAX_RETRY_MS = 60_000
HOLD_MIN_TOKENS = 256       # shared uncached prefix worth waiting for (four 64-token blocks)

# Why a waiting request is not in the engine yet:
#   warm     its warehouse lookup and fetch are not done
#   pool     the KV pool lacks its blocks (or an earlier request's stopped admissions)
#   held     a running prompt computes its prefix: admitted as a hit once it is done
#   running  max_running prompts are already being computed
#   budget   the step's tokens went to requests ahead of it (policy order, aging)
#   engine   ready and planned (or not yet planned): waits for the engine thread
#            (the step in flight, resident demotions, the hop)
WAIT_REASONS = ("warm", "pool", "held", "running", "budget", "engine")


@dataclass(slots=True, eq=False)
class Entry:
    request_id: str
    prompt_tokens: int
    arrival: float              # monotonic seconds
    remaining: int              # tokens still to compute (an estimate until admitted)
    blocks: int                 # KV blocks its admission takes (estimate)
    payload: Any = None         # the service's request state
    ready: bool = False         # warehouse lookup/fetch done: may be admitted
    running: bool = False       # admitted into the engine
    cancelled: bool = False     # its caller went away
    keys: tuple[bytes, ...] = ()   # chain keys of its full blocks (equal key: equal prefix)
    block_tokens: int = 0
    computing_from: int = 0     # running: its first block not taken from a cache
    idle_g1: tuple[int, ...] = ()   # G1 blocks it reuses that no one holds (in ``blocks``' pool
                                    # count once per step, however many waiting ones reuse them)
    why: str = "warm"               # why it waits now (WAIT_REASONS)
    since: float = -1.0             # monotonic: when ``why`` last changed (-1: at arrival)
    waits: dict[str, float] = field(default_factory=dict)   # seconds waited, by reason

    def charge(self, now: float, why: str) -> None:
        """The time since the last change goes to the old reason; ``why`` from now."""
        start = self.arrival if self.since < 0 else self.since
        if now > start:
            self.waits[self.why] = self.waits.get(self.why, 0.0) + (now - start)
        self.since = max(now, start)
        self.why = why


@dataclass(frozen=True, slots=True)
class StepPlan:
    admit: tuple[Entry, ...]            # admit into the engine first, in this order
    budgets: dict[str, int]             # request id -> tokens to compute in this step
    stop: tuple[Entry, ...]             # running but cancelled: free before the step
    starved: bool = False               # a ready request did not fit in the free blocks
    blocked: dict[str, str] = field(default_factory=dict)   # ready, not admitted: id -> why


@dataclass(frozen=True, slots=True)
class Busy:
    reason: str
    retry_after_ms: int


class Scheduler:
    __slots__ = ("_aged_take", "_key", "cfg", "running", "tokens_per_s", "waiting")

    def __init__(self, cfg: PrefillSection, tokens_per_s: float) -> None:
        self.cfg = cfg
        self.tokens_per_s = tokens_per_s            # updated from measured steps
        self.waiting: dict[str, Entry] = {}         # arrival order
        self.running: dict[str, Entry] = {}
        self._key = policy(cfg.policy)
        self._aged_take = AGING[cfg.aging]

    # -- admission to the queue ---------------------------------------------

    def check_count(self) -> Busy | None:
        """Room for one more request? Checked before any work on it."""
        if len(self.waiting) < self.cfg.max_waiting:
            return None
        # Room comes when a waiting request is admitted, i.e. about when the
        # running prompt closest to its end completes.
        head = min((e.remaining for e in self.running.values()), default=self.cfg.step_tokens)
        return Busy(f"prefill queue full: {len(self.waiting)} requests waiting "
                    f"(max_waiting {self.cfg.max_waiting})", self._ms(head))

    def check_tokens(self, tokens: int) -> Busy | None:
        """Room for a request with ``tokens`` to compute? (before any work on it)"""
        queued = self.waiting_tokens
        if queued + tokens <= self.cfg.max_waiting_tokens or not self.waiting:
            return None     # an empty queue takes any prompt: it would never fit otherwise
        return Busy(f"prefill queue full: {queued} tokens to compute waiting "
                    f"(max_waiting_tokens {self.cfg.max_waiting_tokens})",
                    self._ms(queued + tokens - self.cfg.max_waiting_tokens))

    def add(self, e: Entry) -> None:
        self.waiting[e.request_id] = e

    def mark_ready(self, e: Entry, remaining: int, blocks: int,
                   idle_g1: tuple[int, ...] = ()) -> None:
        """Ready to admit: ``blocks`` fresh ones plus the idle G1 blocks it reuses."""
        e.remaining, e.blocks, e.idle_g1, e.ready = max(1, remaining), blocks, idle_g1, True

    def unready(self, e: Entry) -> None:
        """Its restore plan went stale: not admitted until it is warmed again."""
        e.ready = False

    def drop(self, e: Entry) -> None:
        """Out of the queue (finished, failed or cancelled)."""
        self.waiting.pop(e.request_id, None)
        self.running.pop(e.request_id, None)

    # -- steps ------------------------------------------------------------------

    def plan(self, free_blocks: int, now: float) -> StepPlan:
        stop = tuple(e for e in self.running.values() if e.cancelled)
        cands = [e for e in self.running.values() if not e.cancelled]
        cands += [e for e in self.waiting.values() if e.ready and not e.cancelled]
        cands.sort(key=self._key)
        computing = {k: e for e in self.running.values() if not e.cancelled
                     for k in e.keys[e.computing_from:]}
        step = _Step(self.cfg.max_running, free_blocks,
                     len(cands) - sum(not e.running for e in cands), computing)
        budget = self.cfg.step_tokens
        if len(cands) == 1 and len(self.waiting) + len(self.running) == 1:
            # Alone, a prompt takes a larger step: each step streams every weight once
            # (a cold 1,493-token prompt 9 % faster in one step than in 512-token ones),
            # and nothing waits behind it; whatever arrives waits at most this one step.
            budget = max(budget, self.cfg.solo_step_tokens)
        # Aged requests: each has one share of the step, the others one share
        # together. A request held for a prompt computing its prefix lends its
        # share (and its age) to that prompt: it can only go once that one is done.
        lent: dict[str, tuple[float, int, Entry]] = {}      # id -> (oldest age, shares, whom)
        for e in cands:
            if now - e.arrival < self.cfg.max_delay_s:
                continue
            to = e if e.running else (_holder(e, computing) or e)
            arrival, shares, _ = lent.get(to.request_id, (to.arrival, 0, to))
            lent[to.request_id] = (min(arrival, e.arrival), shares + 1, to)
        shares = sum(n for _, n, _ in lent.values())
        share = self._aged_take(budget, shares)
        for _, _, e in sorted(lent.values(), key=lambda t: t[0]):
            if share <= 0:
                break
            took = step.give(e, share)
            share, budget = share - took, budget - took
        for e in cands:
            if budget <= 0:
                break
            budget -= step.give(e, budget)
        blocked = {e.request_id: step.why.get(e.request_id) or step.reason(e)
                   for e in cands if not e.running and e.request_id not in step.budgets}
        return StepPlan(tuple(step.admit), step.budgets, stop, starved=not step.admitting,
                        blocked=blocked)

    def admitted(self, e: Entry, remaining: int) -> None:
        self.waiting.pop(e.request_id, None)
        e.running, e.remaining = True, remaining
        if e.block_tokens:
            e.computing_from = max(0, e.prompt_tokens - remaining) // e.block_tokens
        self.running[e.request_id] = e

    def progressed(self, e: Entry, remaining: int) -> None:
        e.remaining = remaining

    @property
    def has_work(self) -> bool:
        return bool(self.running) or any(e.ready for e in self.waiting.values())

    # -- load ---------------------------------------------------------------------

    @property
    def queue(self) -> int:
        return len(self.waiting)

    @property
    def waiting_tokens(self) -> int:
        return sum(e.remaining for e in self.waiting.values())

    @property
    def tokens_in_flight(self) -> int:
        """Tokens still to compute, queued and running, cached ones excluded."""
        return self.waiting_tokens + sum(e.remaining for e in self.running.values())

    def _ms(self, tokens: int) -> int:
        ms = 1000.0 * max(0, tokens) / max(1e-9, self.tokens_per_s)
        return int(min(MAX_RETRY_MS, max(MIN_RETRY_MS, ms)))


@dataclass(slots=True)
class _Step:
    """One plan being built: what is still free and who got what."""

    max_running: int
    free_blocks: int
    n_running: int
    computing: dict[bytes, Entry]           # blocks running prompts compute now -> which
    admitting: bool = True
    pinned: set[int] = field(default_factory=set)      # idle G1 blocks admissions take
    admit: list[Entry] = field(default_factory=list)
    budgets: dict[str, int] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)  # refused admission: id -> why (last)

    def reason(self, e: Entry) -> str:
        """Why ``e``, never offered a share of this step, waits: what would
        have stopped it had the step's tokens reached it."""
        if self.computing and _holder(e, self.computing) is not None:
            return "held"
        if self.n_running >= self.max_running:
            return "running"
        return "budget" if self.admitting else "pool"

    def give(self, e: Entry, most: int) -> int:
        """Up to ``most`` tokens of this step to ``e`` (admitting it if it
        waits and may go in now); returns how many it took."""
        left = e.remaining - self.budgets.get(e.request_id, 0)
        if left <= 0 or most <= 0:
            return 0
        if not e.running and e.request_id not in self.budgets:
            if not self.admitting:
                self.why[e.request_id] = "pool"
                return 0
            if self.n_running >= self.max_running:
                self.why[e.request_id] = "running"
                return 0
            if self.computing and _holder(e, self.computing) is not None:
                self.why[e.request_id] = "held"
                return 0                     # admitted as a G1 hit once that one is done
            pins = [b for b in e.idle_g1 if b not in self.pinned]
            if e.blocks + len(pins) > self.free_blocks:
                self.why[e.request_id] = "pool"
                self.admitting = False       # the pool frees as running prompts finish
                return 0
            self.free_blocks -= e.blocks + len(pins)
            self.pinned.update(pins)
            self.n_running += 1
            self.admit.append(e)
        take = min(left, most)
        self.budgets[e.request_id] = self.budgets.get(e.request_id, 0) + take
        return take


def _holder(e: Entry, computing: dict[bytes, Entry]) -> Entry | None:
    """The running prompt ``e`` waits for: the one computing ``e``'s longest
    prefix among the blocks being computed, when that prefix covers at least
    HOLD_MIN_TOKENS ``e`` does not already have cached."""
    if not e.keys or not e.block_tokens:
        return None
    cached = max(0, e.prompt_tokens - e.remaining) // e.block_tokens
    for i in range(len(e.keys) - 1, cached - 1, -1):   # chain keys: the last match
        if (owner := computing.get(e.keys[i])) is not None:
            return owner if (i + 1 - cached) * e.block_tokens >= HOLD_MIN_TOKENS else None
    return None
