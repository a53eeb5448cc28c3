"""Where a decode step's time goes, measured on every step at no extra sync.

The forward's share is device time on CUDA (an event pair around each forward,
read once the step's tokens are on the host, by then complete), host time
elsewhere; the rest of ``Engine.decode_step`` (inputs, sampling, the tokens'
copy back, the sequences' bookkeeping) is its wall time less that. A decode
step of the whole stack once took 398 ms where the engine's forward took 6.3
(issue 18, run 6), and nothing said which part: the services export these.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StepTimes:
    rows: int                       # sequences stepped
    forward_s: float                # the forwards (device time on CUDA)
    total_s: float                  # decode_step's wall time

    @property
    def other_s(self) -> float:
        """Inputs, sampling, the tokens to the host, bookkeeping."""
        return max(0.0, self.total_s - self.forward_s)


class StepClock:
    """One decode step's clock: ``forward`` wraps each forward, ``stop`` reads it."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._t0 = time.perf_counter()
        self._host_s = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def forward(self, fn: Callable[[], T]) -> T:
        if not self._cuda:
            t = time.perf_counter()
            out = fn()
            self._host_s += time.perf_counter() - t
            return out
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = fn()
        b.record()
        self._events.append((a, b))
        return out

    def stop(self, rows: int) -> StepTimes:
        """After the step's tokens reached the host (so its events are complete)."""
        total = time.perf_counter() - self._t0
        if not self._cuda:
            return StepTimes(rows, self._host_s, total)
        for _, b in self._events:
            b.synchronize()                 # already done: the tokens' copy waited for it
        fwd = sum(a.elapsed_time(b) for a, b in self._events) / 1e3
        return StepTimes(rows, fwd, total)
