"""Per-tenant fair queues: deficit round robin over prompt tokens.

Each tenant has a FIFO of waiting requests. Tenants with waiters take turns;
a tenant's turn adds ``quantum`` tokens to its deficit and serves its oldest
eligible requests while the deficit covers their cost (prompt tokens), so over
any stretch of backlog every tenant gets about the same prompt tokens through,
whatever its request sizes or rate (Shreedhar and Varghese's DRR). A tenant
whose queue empties leaves the rotation and loses its deficit: credit is not
saved up while idle.

``eligible`` lets the caller hold back a request without losing its place
(its API key is at its concurrency limit): the tenant's next eligible request
goes instead, and a tenant with none is passed over without credit.

Invariants: every waiter is in exactly one tenant FIFO; a tenant is in
``_order`` iff its FIFO is non-empty.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class Waiter:
    """One request waiting for room. ``admitted`` resolves when it may go."""

    key: str
    tenant: str
    cost: int                       # prompt tokens (>= 1)
    arrived: float                  # admission clock
    admitted: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())


class FairQueue:
    def __init__(self, quantum: int) -> None:
        if quantum < 1:
            raise ValueError(f"quantum must be >= 1, got {quantum}")
        self._quantum = quantum
        self._fifo: dict[str, deque[Waiter]] = {}
        self._deficit: dict[str, int] = {}
        self._order: deque[str] = deque()      # tenants with waiters; [0] has the turn
        self._turn_started = False             # [0] got its quantum for this turn
        self._cost: dict[str, int] = {}        # queued tokens per tenant
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[Waiter]:
        for fifo in self._fifo.values():
            yield from fifo

    def depth(self, tenant: str) -> int:
        fifo = self._fifo.get(tenant)
        return len(fifo) if fifo else 0

    def depths(self) -> dict[str, int]:
        return {t: len(q) for t, q in self._fifo.items()}

    def push(self, w: Waiter) -> None:
        fifo = self._fifo.get(w.tenant)
        if fifo is None:
            fifo = self._fifo[w.tenant] = deque()
            self._deficit[w.tenant] = 0
            self._order.append(w.tenant)
        fifo.append(w)
        self._cost[w.tenant] = self._cost.get(w.tenant, 0) + w.cost
        self._n += 1

    def remove(self, w: Waiter) -> bool:
        """Take ``w`` out (it gave up: timed out or its client left)."""
        fifo = self._fifo.get(w.tenant)
        if fifo is None or w not in fifo:
            return False
        fifo.remove(w)
        self._taken(w)
        return True

    def pop(self, eligible: Callable[[Waiter], bool]) -> Waiter | None:
        """The next request in fair order among the eligible ones, or None (and
        then the rotation is as it was: finding no room takes nobody's turn)."""
        if not self._order:
            return None
        head, started = self._order[0], self._turn_started
        passed = 0                              # tenants in a row with nothing eligible
        while passed < len(self._order):
            tenant = self._order[0]
            w = next((x for x in self._fifo[tenant] if eligible(x)), None)
            if w is None:
                passed += 1
                self._next_turn()
                continue
            passed = 0
            if not self._turn_started:          # a turn begins with one quantum of credit
                self._deficit[tenant] += self._quantum
                self._turn_started = True
            if self._deficit[tenant] >= w.cost:
                self._deficit[tenant] -= w.cost
                self._fifo[tenant].remove(w)
                self._taken(w)
                return w
            # Credit exhausted: the turn ends. A request of k quanta goes on the
            # tenant's k-th turn, with the other tenants' turns between.
            self._next_turn()
        # Nothing eligible anywhere, so no credit moved: undo the rotation.
        while self._order[0] != head:
            self._order.rotate(-1)
        self._turn_started = started
        return None

    def cost_ahead(self, tenant: str, cost: int) -> int:
        """Prompt tokens served before a new request of ``tenant`` under DRR:
        the tenant's own queue and its cost, plus as much of each other
        tenant's queue (no more than what it has waiting)."""
        mine = self._cost.get(tenant, 0) + cost
        return mine + sum(min(c, mine) for t, c in self._cost.items() if t != tenant)

    def _next_turn(self) -> None:
        self._order.rotate(-1)
        self._turn_started = False

    def _taken(self, w: Waiter) -> None:
        self._n -= 1
        self._cost[w.tenant] -= w.cost
        if not self._fifo[w.tenant]:
            del self._fifo[w.tenant], self._deficit[w.tenant], self._cost[w.tenant]
            if self._order[0] == w.tenant:
                self._turn_started = False
            self._order.remove(w.tenant)
