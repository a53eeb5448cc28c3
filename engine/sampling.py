"""Sampling: greedy, temperature, top-p, per-sequence seed.

The i-th token of a sequence is drawn with its own ``torch.Generator`` seeded
from (seed, i), and rows are sampled one at a time, so a sequence draws the
same tokens whether it runs alone or batched, cold or restored, or with its
prefill and decode on different machines.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import EngineInputError


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0        # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise EngineInputError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise EngineInputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise EngineInputError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.seed < 2**63:
            raise EngineInputError(f"seed must be in [0, 2**63), got {self.seed}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        if any(not s for s in self.stop):
            raise EngineInputError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self, step: int) -> torch.Generator:
        """The generator for the sequence's ``step``-th sampled token."""
        mixed = (self.seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9) % (2**63 - 1)
        return torch.Generator(device="cpu").manual_seed(mixed)


def sample_row(logits: torch.Tensor, params: SamplingParams, step: int) -> int:
    """logits: [V] fp32 (any device) -> a token id; ``step`` = tokens sampled so far."""
    if params.greedy:
        return int(torch.argmax(logits))
    generator = params.generator(step)
    probs = torch.softmax(logits.float().cpu() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (at least one token).
        drop = (torch.cumsum(sorted_p, dim=-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        choice = torch.multinomial(sorted_p, 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                steps: list[int]) -> list[int]:
    """logits: [N, V] for N sequences (rows beyond N are ignored)."""
    if all(p.greedy for p in params):
        return torch.argmax(logits[: len(params)], dim=-1).tolist()
    return [sample_row(logits[i], p, st) for i, (p, st) in enumerate(zip(params, steps,
                                                                          strict=True))]
