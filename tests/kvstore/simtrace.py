"""Hand-built and random prefix traces for the simulator, policy and what-if tests."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from common.traces import Trace, TraceRequest
from tests.shared_data import shared_dir

MOONCAKE_CONV = str(shared_dir() / "traces/mooncake-fast25/conversation_trace.jsonl")


def make_trace(reqs: Sequence[tuple[float, Sequence[int]]], *, block_tokens: int = 4,
               cls: str = "chat", tail: int = 0) -> Trace:
    """Requests of full blocks; with ``tail`` > 0 the last id is a partial block
    of ``tail`` tokens (as in Mooncake, where len(hash_ids) = ceil(input/512))."""
    out = tuple(TraceRequest(t=float(t), session="s", hash_ids=tuple(ids),
                             input_length=(len(ids) - (tail > 0)) * block_tokens + tail,
                             output_length=1,
                             traffic_class=cls) for t, ids in reqs)
    return Trace(name="hand", block_tokens=block_tokens, requests=out, arrival_note="hand-built")


def random_prefix_trace(seed: int, *, sessions: int = 12, turns: int = 6, shared: int = 2,
                        rate_s: float = 0.5, think_s: float = 30.0, block_tokens: int = 4,
                        classes: Sequence[str] = ("chat",)) -> Trace:
    """Multi-turn sessions: every request starts with a shared system prefix,
    then extends its session's previous request by a few new blocks, so ids are
    prefix-consistent (an id fixes its whole prefix) as in the real traces."""
    rng = np.random.default_rng(seed)
    next_id = shared
    reqs: list[TraceRequest] = []
    start = 0.0
    for s in range(sessions):
        start += float(rng.exponential(1.0 / rate_s))
        ids: list[int] = list(range(shared))
        t = start
        cls = classes[s % len(classes)]
        for _ in range(int(rng.integers(1, turns + 1))):
            grow = int(rng.integers(1, 5))
            ids = ids + list(range(next_id, next_id + grow))
            next_id += grow
            reqs.append(TraceRequest(t=t, session=f"s{s}", hash_ids=tuple(ids),
                                     input_length=len(ids) * block_tokens, output_length=1,
                                     traffic_class=cls))
            t += float(rng.exponential(think_s))
    reqs.sort(key=lambda r: r.t)
    return Trace(name=f"random{seed}", block_tokens=block_tokens, requests=tuple(reqs),
                 arrival_note="random prefix sessions")
