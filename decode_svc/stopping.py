"""What a streaming client may see of a sequence's text so far.

When a sequence stops and what its text is are the engine's rules
(``Engine.finish_reason``: EOS unless ignored, stop strings, max_tokens, the
context; ``Engine.completion_text``: EOS dropped, cut before a stop string),
so a disaggregated stream ends exactly where ``Engine.generate`` would.
This module only decides how much of that text is safe to show before the
end: a tail that could still become a stop string, or that ends in half a
UTF-8 character, is held back until it is decided.
"""

from __future__ import annotations

from dataclasses import dataclass

_REPLACEMENT = "\ufffd"


@dataclass(slots=True)
class TextStream:
    stop: tuple[str, ...] = ()
    _shown: int = 0                 # characters already emitted

    def delta(self, text: str, finished: bool) -> str:
        """The newly visible part of ``text`` (the whole completion so far)."""
        visible = len(text) if finished else self._safe_length(text)
        out = text[self._shown:visible] if visible > self._shown else ""
        self._shown = max(self._shown, visible)
        return out

    def _safe_length(self, text: str) -> int:
        n = len(text)
        while n and text[n - 1] == _REPLACEMENT:
            n -= 1
        hold = 0
        for s in self.stop:
            # Hold back the longest tail that is a proper prefix of a stop string.
            for k in range(min(len(s) - 1, n), hold, -1):
                if text[n - k:n] == s[:k]:
                    hold = k
                    break
        return n - hold
