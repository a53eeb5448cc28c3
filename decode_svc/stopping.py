"""When a sequence stops, and what text it has shown so far.

One ``StopState`` per sequence turns sampled tokens into text deltas:
end-of-sequence tokens (unless ignored), ``max_tokens``, and stop strings.
Text that could still turn out to be the start of a stop string, or that ends
in half a UTF-8 character, is held back until it is decided, so a client
never sees a stop string or a broken character.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

_REPLACEMENT = "\ufffd"


@dataclass(frozen=True, slots=True)
class StopRule:
    max_tokens: int
    stop: tuple[str, ...] = ()
    eos_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")


@dataclass(frozen=True, slots=True)
class Step:
    """What one accepted token produced."""

    text: str               # newly visible text
    finished: bool
    finish_reason: str      # "stop" | "length" | ""


@dataclass(slots=True)
class StopState:
    rule: StopRule
    decode: Callable[[Sequence[int]], str]
    tokens: list[int] = field(default_factory=list)
    _shown: int = 0                         # characters of the text already emitted
    _text_tokens: int = 0                   # tokens whose text counts (an EOS does not)

    def accept(self, token: int) -> Step:
        self.tokens.append(token)
        reason = ""
        if token in self.rule.eos_ids and not self.rule.ignore_eos:
            reason = "stop"
        else:
            self._text_tokens = len(self.tokens)
            if len(self.tokens) >= self.rule.max_tokens:
                reason = "length"
        text = self.decode(self.tokens[:self._text_tokens])
        cut = self._find_stop(text)
        if cut >= 0:
            text, reason = text[:cut], "stop"
        visible = len(text) if reason else self._safe_length(text)
        delta = text[self._shown:visible] if visible > self._shown else ""
        self._shown = max(self._shown, visible)
        return Step(delta, bool(reason), reason)

    def _find_stop(self, text: str) -> int:
        # Only text not yet shown (plus a stop string's length back) can hold a new match.
        longest = max((len(s) for s in self.rule.stop), default=0)
        start = max(0, self._shown - longest)
        hits = [i for i in (text.find(s, start) for s in self.rule.stop) if i >= 0]
        return min(hits) if hits else -1

    def _safe_length(self, text: str) -> int:
        n = len(text)
        while n and text[n - 1] == _REPLACEMENT:
            n -= 1
        hold = 0
        for s in self.rule.stop:
            # Hold back the longest tail that is a proper prefix of a stop string.
            for k in range(min(len(s) - 1, n), hold, -1):
                if text[n - k:n] == s[:k]:
                    hold = k
                    break
        return n - hold
