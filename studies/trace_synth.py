"""A seeded synthetic prefix trace of any size, written as a compact trace.

Sessions arrive by a Poisson process; each opens with one of ``prompts``
shared system prompts (Zipf-popular) and grows by a few blocks per turn, so
every request's blocks are the shared prompt then its session's history
(prefix-consistent ids, as in the real traces). A fraction of sessions are
agent sessions (short think times, large growth), the rest chat. Requests are
emitted in time order from a heap of sessions and written straight into the
output arrays, so a 100 M-block-use trace needs ~0.5 GB and about a minute.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.trace_arrays import CompactTrace


@dataclass(frozen=True, slots=True)
class SynthConfig:
    uses: int = 100_000_000          # block uses to generate (stops at the first request past)
    seed: int = 0
    block_tokens: int = 64
    prompts: int = 50                # shared system prompts
    prompt_blocks: int = 48          # mean blocks per system prompt
    agent_fraction: float = 0.3
    overlap_sessions: float = 200.0  # sessions live at once on average (Little's law)
    chat_turns: float = 6.0          # mean turns per session (geometric)
    agent_turns: float = 40.0
    chat_growth: float = 12.0        # mean new blocks per turn
    agent_growth: float = 6.0
    chat_think_s: float = 60.0       # mean gap between a session's turns
    agent_think_s: float = 8.0

    def __post_init__(self) -> None:
        if self.uses < 1 or self.prompts < 1 or self.prompt_blocks < 1 or self.block_tokens < 1:
            raise ValueError("uses, prompts, prompt_blocks and block_tokens must be >= 1")
        if not 0.0 <= self.agent_fraction <= 1.0:
            raise ValueError(f"agent_fraction must be in [0, 1], got {self.agent_fraction}")
        for name in ("overlap_sessions", "chat_turns", "agent_turns", "chat_growth",
                     "agent_growth", "chat_think_s", "agent_think_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")


def synth(cfg: SynthConfig, out: str | Path | None = None) -> CompactTrace:
    """Generate the trace (and save it to ``out`` when given)."""
    rng = np.random.default_rng(cfg.seed)
    plen = np.maximum(1, rng.poisson(cfg.prompt_blocks, cfg.prompts)).astype(np.int64)
    pstart = np.concatenate([[0], np.cumsum(plen)[:-1]])
    next_id = int(plen.sum())
    zipf = 1.0 / np.arange(1, cfg.prompts + 1)
    zipf /= zipf.sum()
    mean_dur = (1 - cfg.agent_fraction) * cfg.chat_turns * cfg.chat_think_s + \
        cfg.agent_fraction * cfg.agent_turns * cfg.agent_think_s
    rate = cfg.overlap_sessions / mean_dur
    cap = cfg.uses + 1_000_000
    ids = np.empty(cap, dtype=np.uint32)
    offsets = [0]
    times: list[float] = []
    lens: list[int] = []
    classes: list[int] = []
    sessions: list[int] = []
    heap: list[tuple[float, int]] = []
    state: dict[int, tuple[int, int, int, int, int]] = {}  # sid -> prompt, base, len, turns, agent
    t_next_session = 0.0
    n_sessions = 0
    pos = 0
    while pos < cfg.uses:
        if not heap or t_next_session <= heap[0][0]:
            agent = int(rng.random() < cfg.agent_fraction)
            turns = int(rng.geometric(1.0 / (cfg.agent_turns if agent else cfg.chat_turns)))
            growth = cfg.agent_growth if agent else cfg.chat_growth
            total = int(sum(rng.geometric(1.0 / growth, turns)))
            state[n_sessions] = (int(rng.choice(cfg.prompts, p=zipf)), next_id, 0, turns, agent)
            next_id += total + turns
            heapq.heappush(heap, (t_next_session, n_sessions))
            n_sessions += 1
            t_next_session += float(rng.exponential(1.0 / rate))
            continue
        t, sid = heapq.heappop(heap)
        prompt, base, n, turns, agent = state[sid]
        n += int(rng.geometric(1.0 / (cfg.agent_growth if agent else cfg.chat_growth)))
        p0, pl = int(pstart[prompt]), int(plen[prompt])
        m = pl + n
        if pos + m > cap:
            break
        ids[pos:pos + pl] = np.arange(p0, p0 + pl, dtype=np.uint32)
        ids[pos + pl:pos + m] = np.arange(base, base + n, dtype=np.uint32)
        pos += m
        offsets.append(pos)
        times.append(t)
        lens.append(m * cfg.block_tokens - int(rng.integers(0, cfg.block_tokens)))
        classes.append(agent)
        sessions.append(sid)
        if turns > 1:
            state[sid] = (prompt, base, n, turns - 1, agent)
            think = cfg.agent_think_s if agent else cfg.chat_think_s
            heapq.heappush(heap, (t + float(rng.exponential(think)), sid))
        else:
            del state[sid]
    if next_id >= 2**32:
        raise ValueError("more than 2**32 distinct blocks; lower uses")
    ct = CompactTrace(
        name=f"synth-{cfg.uses}-seed{cfg.seed}", block_tokens=cfg.block_tokens,
        ids=ids[:pos].copy() if pos < cap // 2 else ids[:pos],
        offsets=np.asarray(offsets, dtype=np.int64), times=np.asarray(times, dtype=np.float64),
        input_length=np.asarray(lens, dtype=np.int64), classes=np.asarray(classes, np.uint8),
        sessions=np.asarray(sessions, dtype=np.uint32), class_names=("chat", "agent"),
        n_keys=next_id,
        arrival_note=(f"synthetic: {n_sessions} sessions, Poisson arrivals at {rate:.3g}/s "
                      f"(seed {cfg.seed}, {cfg.overlap_sessions:g} overlapping), "
                      f"{cfg.agent_fraction:g} agent"))
    if out is not None:
        ct.save(out)
    return ct


__all__ = ["SynthConfig", "synth"]
