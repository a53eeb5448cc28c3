"""Constrained decoding: a grammar turned into a per-sequence token mask (llguidance).

A ``GrammarSpec`` (JSON schema, regex, or a Lark/EBNF grammar) is compiled
against the engine's tokenizer into one ``Constraint`` per sequence. Before a
row is sampled, ``mask_`` sets every token the grammar forbids to -inf; after
it, ``accept`` advances the matcher. The mask depends only on that sequence's
own tokens and is applied to its own logits row after the forward pass, so
batch invariance holds: co-tenants never change which tokens a row may take.

llguidance is used because it installs from PyPI with no dependencies (no torch,
no triton, unlike xgrammar) and computes masks on the CPU; the mask is moved to
the logits' device, so the same code serves CPU and GPU engines.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from engine.errors import EngineInputError

# The spec and its checks live in engine/grammar.py (no torch there, for the router).
from engine.grammar import _COMPILERS, GRAMMAR_KINDS, GrammarSpec, _llg, available, validate

__all__ = ["GRAMMAR_KINDS", "Constraint", "GrammarCompiler", "GrammarSpec", "available",
           "validate"]


class GrammarCompiler:
    """Compiles specs against one tokenizer. Building llguidance's tokenizer view
    takes ~0.3 s for a 49k vocabulary, so one compiler lives per engine/router."""

    def __init__(self, tokenizer_json: str, *, vocab_size: int,
                 eos_token_ids: frozenset[int]) -> None:
        if _llg is None:
            raise EngineInputError("constrained decoding needs the llguidance package")
        if not eos_token_ids:
            raise EngineInputError("constrained decoding needs a tokenizer with an EOS token")
        self._tok = _llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                     eos_token=sorted(eos_token_ids))
        self.vocab_size = vocab_size
        self._eos = torch.tensor(sorted(eos_token_ids), dtype=torch.int64)

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: int) -> GrammarCompiler:
        """From an ``engine.tokenizer`` tokenizer that exposes its HF JSON."""
        to_json = getattr(tokenizer, "tokenizer_json", None)
        if to_json is None:
            raise EngineInputError("constrained decoding needs a model with an HF tokenizer "
                                   f"(this one has {type(tokenizer).__name__})")
        return cls(to_json(), vocab_size=vocab_size, eos_token_ids=tokenizer.eos_token_ids)

    def grammar(self, spec: GrammarSpec) -> str:
        """llguidance's grammar text, checked; a bad grammar raises EngineInputError."""
        try:
            text = _COMPILERS[spec.kind](spec.source)
        except ValueError as exc:
            raise EngineInputError(f"bad {spec.kind} grammar: {exc}") from exc
        error = _llg.LLMatcher.validate_grammar(text, self._tok)
        if error and not error.startswith("WARNING"):
            raise EngineInputError(f"bad {spec.kind} grammar: {error.strip()}")
        return text

    def check(self, spec: GrammarSpec) -> None:
        self.grammar(spec)

    def constraint(self, spec: GrammarSpec) -> Constraint:
        matcher = _llg.LLMatcher(self._tok, self.grammar(spec), log_level=0)
        if matcher.is_error():
            raise EngineInputError(f"bad {spec.kind} grammar: {matcher.get_error()}")
        return Constraint(matcher, self.vocab_size, self._eos)


class Constraint:
    """One sequence's matcher: the tokens it may take next, advanced token by token."""

    __slots__ = ("_eos", "_matcher", "_vocab")

    def __init__(self, matcher: Any, vocab_size: int, eos: torch.Tensor) -> None:
        self._matcher = matcher
        self._vocab = vocab_size
        self._eos = eos

    def allowed(self) -> torch.Tensor:
        """[V] bool on the CPU: the tokens the grammar allows now."""
        # One bit per token, little-endian within 32-bit words: byte k holds tokens 8k..8k+7.
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        allowed = torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self._vocab]
                                   .astype(np.bool_))
        if not bool(allowed.any()):
            # A finished (or failed) matcher allows nothing more: end the sequence.
            allowed[self._eos] = True
        return allowed

    def mask_(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [V] of this sequence only; forbidden tokens become -inf in place."""
        allowed = self.allowed().to(logits.device, non_blocking=True)
        return logits.masked_fill_(~allowed, float("-inf"))

    def accept(self, token: int) -> None:
        if self._matcher.is_stopped():
            return                      # the EOS (or tokens ignore_eos lets through) after it
        if not self._matcher.consume_token(token):
            raise EngineInputError(f"token {token} breaks the sequence's grammar: "
                                   f"{self._matcher.get_error()}")

    @property
    def finished(self) -> bool:
        return bool(self._matcher.is_stopped() or self._matcher.is_accepting())
