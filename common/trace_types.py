"""The one typed form every trace loader produces (``common.traces``) and the
compact arrays convert to and from (``common.trace_arrays``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TraceRequest:
    t: float                    # seconds from trace start (after time_scale)
    session: str
    hash_ids: tuple[int, ...]   # namespaced prefix block ids
    input_length: int
    output_length: int
    traffic_class: str          # "agent" for agent sessions, "chat" otherwise (or --class-of)


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    block_tokens: int
    requests: tuple[TraceRequest, ...]   # sorted by t
    arrival_note: str                    # how arrival times were placed, for reports

    @property
    def span_s(self) -> float:
        return self.requests[-1].t - self.requests[0].t if self.requests else 0.0


__all__ = ["Trace", "TraceRequest"]
