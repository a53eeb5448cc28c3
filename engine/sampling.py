"""Sampling: greedy, temperature, top-p, per-sequence seed, penalties, logit bias,
and grammar constraints.

The i-th token of a sequence is drawn from its logits with noise keyed by
(seed, i) alone (engine/draw.py: Gumbel-max over a counter-based hash), so a
sequence draws the same tokens whether it runs alone or batched, cold or
restored, or with its prefill and decode on different machines. A step's rows
are drawn together: one launch and one copy of the tokens to the host on CUDA,
never a sync or a host-side draw per row (issue 18: those took 398 ms of a
decode step at batch 46 on the H200).

Logit processing (logit bias, presence/frequency penalties over the tokens the
sequence generated, the grammar mask) is per row, before the draw, and reads
only the row's own state (``RowSampler``): batch invariance holds for
constrained and penalised sequences too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.constrained import Constraint, GrammarSpec
from engine.draw import draw_rows
from engine.errors import EngineInputError

MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0        # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0   # subtracted once from every token generated so far
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias added to its logit)
    grammar: GrammarSpec | None = None

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
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and -2.0 <= v <= 2.0):
                raise EngineInputError(f"{name} must be in [-2, 2], got {v}")
        bias = tuple(sorted((int(t), float(b)) for t, b in self.logit_bias))
        object.__setattr__(self, "logit_bias", bias)
        for t, b in bias:
            if t < 0 or not (math.isfinite(b) and abs(b) <= MAX_LOGIT_BIAS):
                raise EngineInputError(f"logit_bias[{t}] = {b}: token ids must be >= 0 and "
                                       f"biases in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if len({t for t, _ in bias}) != len(bias):
            raise EngineInputError("logit_bias names a token twice")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processed(self) -> bool:
        """Whether the logits change before sampling (else the plain fast path)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.grammar is not None)

    def key(self, step: int) -> int:
        """The draw's key for the sequence's ``step``-th sampled token (< 2**63)."""
        return (self.seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9) % (2**63 - 1)


def sample_row(logits: torch.Tensor, params: SamplingParams, step: int) -> int:
    """Stateless sampling of one row (no penalties or grammar: those need a RowSampler)."""
    return draw_rows(logits[None], [params.temperature], [params.top_p], [params.key(step)])[0]


# Builds a sequence's grammar constraint (the engine's compiler, made on first use).
ConstraintFactory = Callable[[GrammarSpec], Constraint]


@dataclass(slots=True)
class RowSampler:
    """One sequence's sampling state: its parameters, the counts of the tokens it
    generated (for penalties) and its grammar matcher."""

    params: SamplingParams
    constraint: Constraint | None = None
    counts: dict[int, int] = field(default_factory=dict)
    step: int = 0                   # tokens accepted so far

    @classmethod
    def create(cls, params: SamplingParams, vocab_size: int,
               constraints: ConstraintFactory | None = None) -> RowSampler:
        bad = [t for t, _ in params.logit_bias if t >= vocab_size]
        if bad:
            raise EngineInputError(f"logit_bias token id {bad[0]} is outside the vocabulary "
                                   f"[0, {vocab_size})")
        constraint = None
        if params.grammar is not None:
            if constraints is None:
                raise EngineInputError("this engine cannot apply grammars")
            constraint = constraints(params.grammar)
        return cls(params, constraint)

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [V] of this sequence -> a processed fp32 copy."""
        p = self.params
        out = logits.float().clone()
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], device=out.device)
            out[ids] += torch.tensor([b for _, b in p.logit_bias], device=out.device)
        if self.counts and (p.presence_penalty or p.frequency_penalty):
            ids = torch.tensor(list(self.counts), device=out.device)
            n = torch.tensor(list(self.counts.values()), dtype=out.dtype, device=out.device)
            out[ids] -= p.frequency_penalty * n + p.presence_penalty
        if self.constraint is not None:
            self.constraint.mask_(out)
        return out

    def sample(self, logits: torch.Tensor) -> int:
        """logits: [V] -> the next token, accepted into the state."""
        return sample_rows(logits[None], [self])[0]

    def accept(self, token: int) -> None:
        """Record a token the sequence took (sampled here or, on decode, by prefill)."""
        self.step += 1
        if self.params.presence_penalty or self.params.frequency_penalty:
            self.counts[token] = self.counts.get(token, 0) + 1
        if self.constraint is not None:
            self.constraint.accept(token)


def sample_rows(logits: torch.Tensor, samplers: list[RowSampler]) -> list[int]:
    """logits: [N, V] for N sequences (rows beyond N are ignored); each token is
    accepted into its sampler's state."""
    n = len(samplers)
    rows = logits[:n]
    if any(s.params.processed for s in samplers):
        rows = rows.float().clone()
        for i, s in enumerate(samplers):
            if s.params.processed:
                rows[i] = s.process(rows[i])
    tokens = draw_rows(rows, [s.params.temperature for s in samplers],
                       [s.params.top_p for s in samplers],
                       [s.params.key(s.step) for s in samplers])
    for s, t in zip(samplers, tokens, strict=True):
        s.accept(t)
    return tokens
