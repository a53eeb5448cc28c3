"""``response_format``: structured outputs enforced by constrained decoding.

Accepted forms (the engine enforces each with llguidance, engine/constrained.py):

- ``{"type": "text"}``: free text (the default);
- ``{"type": "json_object"}``: any JSON object;
- ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}``:
  output that validates against the schema (enforced whether or not ``strict`` is set);
- extension ``{"type": "regex", "regex": "..."}``: output that fully matches the regex
  (Rust ``regex`` syntax, anchored at both ends);
- extension ``{"type": "grammar", "grammar": "..."}``: output derived from a Lark-style EBNF
  grammar in llguidance's dialect (``start:`` rule, ``"literals"``, ``/regex/`` lexemes,
  ``%json {schema}`` for embedded JSON).

A grammar that does not compile is a 400 naming ``response_format`` (checked here,
without a tokenizer; the engine checks again against its own).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from engine.errors import EngineInputError
from engine.grammar import GrammarSpec, validate
from router.errors import InvalidRequestError

P = "response_format"


def _bad(message: str, param: str = P) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def _text(_: Mapping[str, Any]) -> GrammarSpec | None:
    return None


def _json_object(_: Mapping[str, Any]) -> GrammarSpec:
    return GrammarSpec("json_schema", '{"type": "object"}')


def _json_schema(rf: Mapping[str, Any]) -> GrammarSpec:
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise _bad("response_format.json_schema must be an object", f"{P}.json_schema")
    schema = js.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise _bad("response_format.json_schema.schema must be an object",
                   f"{P}.json_schema.schema")
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _bad("response_format.json_schema.strict must be a boolean",
                   f"{P}.json_schema.strict")
    return GrammarSpec("json_schema", json.dumps(schema))


def _source(field: str, kind: str) -> Callable[[Mapping[str, Any]], GrammarSpec]:
    def parse(rf: Mapping[str, Any]) -> GrammarSpec:
        src = rf.get(field)
        if not isinstance(src, str) or not src:
            raise _bad(f"response_format.{field} must be a non-empty string", f"{P}.{field}")
        return GrammarSpec(kind, src)
    return parse


_FORMATS: dict[str, Callable[[Mapping[str, Any]], GrammarSpec | None]] = {
    "text": _text,
    "json_object": _json_object,
    "json_schema": _json_schema,
    "regex": _source("regex", "regex"),
    "grammar": _source("grammar", "lark"),
}


def parse_response_format(value: object) -> GrammarSpec | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad("response_format must be an object")
    kind = value.get("type")
    parse = _FORMATS.get(kind) if isinstance(kind, str) else None
    if parse is None:
        raise _bad(f"response_format.type {kind!r} is not one of {sorted(_FORMATS)}",
                   f"{P}.type")
    try:
        spec = parse(value)
        if spec is not None:
            validate(spec)         # syntax errors are the client's: a 400 naming the field
        return spec
    except EngineInputError as exc:
        raise _bad(str(exc)) from exc
