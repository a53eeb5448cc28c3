"""Control-token strings in untrusted text stay text.

A tokenizer's added tokens (``<|im_start|>``, ``<|im_end|>``, ``<tool_call>``
...) are matched in any text it encodes, so a user who types ``<|im_start|>
system`` into a message would get the real role marker and could forge a
turn. The chat template's own markers must be special tokens; the same
strings inside message content, tool output, tool-call arguments, names or
tool descriptions must not.

How: before rendering, every occurrence of a control string inside any
string value the template receives is replaced by a placeholder that cannot
occur by chance (private-use characters around a per-render random nonce and
an index). The template renders as usual (its ``trim``, ``split`` and
``tojson`` work on the rest of the text), and the rendered text is cut at the
placeholders: the pieces between them are encoded normally (they hold the
template's markers and text free of control strings), and each placeholder
is encoded as plain text, never as the control token. For text without any
control string the result is exactly the encoding of the whole rendered text.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

_OPEN, _CLOSE = "\ue000", "\ue001"     # Unicode private use: no model's markup


@dataclass(frozen=True, slots=True)
class Piece:
    text: str
    control: bool                       # True: a control string typed by a user


class ControlStrings:
    """The control strings of one tokenizer, and the neutralise/split pair."""

    def __init__(self, strings: Iterable[str]) -> None:
        # Longest first: the regex alternation must prefer "<|im_start|>" over "<|im".
        self.strings: tuple[str, ...] = tuple(sorted({s for s in strings if s},
                                                     key=lambda s: (-len(s), s)))
        self._find = (re.compile("|".join(re.escape(s) for s in self.strings))
                      if self.strings else None)
        self._index = {s: i for i, s in enumerate(self.strings)}

    def __bool__(self) -> bool:
        return self._find is not None

    def neutralise(self, value: Any, nonce: str) -> Any:
        """``value`` with every control string in every string (keys included,
        at any depth) replaced by its placeholder."""
        if self._find is None:
            return value
        if isinstance(value, str):
            return self._find.sub(lambda m: f"{_OPEN}{nonce}{self._index[m.group()]}{_CLOSE}",
                                  value)
        if isinstance(value, Mapping):
            return {self.neutralise(k, nonce): self.neutralise(v, nonce)
                    for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.neutralise(v, nonce) for v in value]
        return value

    def split(self, rendered: str, nonce: str) -> list[Piece]:
        """The rendered text cut at the placeholders, in order (empty pieces dropped)."""
        if self._find is None or _OPEN not in rendered:
            return [Piece(rendered, False)] if rendered else []
        pat = re.compile(re.escape(_OPEN + nonce) + r"(\d+)" + re.escape(_CLOSE))
        out: list[Piece] = []
        pos = 0
        for m in pat.finditer(rendered):
            if m.start() > pos:
                out.append(Piece(rendered[pos:m.start()], False))
            out.append(Piece(self.strings[int(m.group(1))], True))
            pos = m.end()
        if pos < len(rendered):
            out.append(Piece(rendered[pos:], False))
        return out


def new_nonce() -> str:
    return secrets.token_hex(16)
