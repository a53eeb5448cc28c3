"""What a sequence's output must match (``GrammarSpec``) and the checks a router
makes before any engine sees it, with no torch: the router and other processes
that never compute import this module alone (a torch import is seconds of a
start on a 2-core machine). The per-sequence token masks are
engine/constrained.py's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from engine.errors import EngineInputError

try:
    import llguidance as _llg
except ImportError:  # pragma: no cover - llguidance is a core dependency
    _llg = None


def _json_schema(source: str) -> str:
    # Compact, fixed separators: a small model given free whitespace can loop on
    # blanks forever; ", " / ": " are what models see in training text.
    return _llg.LLMatcher.grammar_from_json_schema(
        source, overrides={"whitespace_flexible": False, "item_separator": ", ",
                           "key_separator": ": "})


# kind -> llguidance grammar text. "lark" takes llguidance's Lark dialect (an EBNF
# with regex lexemes and %json{...} for embedded JSON schemas).
_COMPILERS: dict[str, Callable[[str], str]] = {
    "json_schema": _json_schema,
    "regex": lambda s: _llg.LLMatcher.grammar_from_regex(s),
    "lark": lambda s: _llg.LLMatcher.grammar_from_lark(s),
}
GRAMMAR_KINDS = tuple(_COMPILERS)


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What a sequence's output must match; ``source`` is the schema (JSON text),
    the regex, or the grammar."""

    kind: str
    source: str

    def __post_init__(self) -> None:
        if self.kind not in _COMPILERS:
            raise EngineInputError(f"grammar kind {self.kind!r} is not one of "
                                   f"{list(GRAMMAR_KINDS)}")
        if not self.source:
            raise EngineInputError("grammar source must not be empty")
        if self.kind == "json_schema":
            try:
                json.loads(self.source)
            except ValueError as exc:
                raise EngineInputError(f"json_schema grammar is not valid JSON: {exc}") from exc


def available() -> bool:
    return _llg is not None


def validate(spec: GrammarSpec) -> None:
    """Check a grammar without a tokenizer (syntax, schema keywords): what a router
    can refuse before any engine sees the request. Raises EngineInputError."""
    if _llg is None:
        raise EngineInputError("constrained decoding needs the llguidance package")
    try:
        text = _COMPILERS[spec.kind](spec.source)
    except ValueError as exc:
        raise EngineInputError(f"bad {spec.kind} grammar: {exc}") from exc
    error = _llg.LLMatcher.validate_grammar(text)
    if error and not error.startswith("WARNING"):
        raise EngineInputError(f"bad {spec.kind} grammar: {error.strip()}")
