"""OpenAI request bodies parsed into typed, validated dataclasses.

The parser is the only place that looks at raw JSON: everything after it sees
``ChatRequest``/``CompletionRequest``. Unknown fields are accepted and
ignored (clients and SDKs send many); a known field of the wrong type or out
of range raises ``InvalidRequestError`` naming the field as ``param``, so a
bad request is always a 4xx, never a 500. Features that would silently change
the answer if ignored (n > 1, logprobs, echo, best_of, suffix, images) are
refused with a message rather than dropped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.grammar import GrammarSpec
from router.errors import InvalidRequestError, ModelNotFoundError
from router.structured import parse_response_format
from router.tools import ToolCall, ToolSpec, parse_message_tool_calls, parse_openai_tools

# Roles a chat template understands; "developer" is OpenAI's newer name for system.
_ROLE_ALIASES = {"system": "system", "developer": "system", "user": "user",
                 "assistant": "assistant", "tool": "tool"}
MAX_STOP = 4
MAX_STOP_CHARS = 256
# A hard ceiling before any model is consulted: beyond it a number is nonsense for
# any context length, and it keeps the proto's uint32 field from overflowing.
MAX_TOKENS_CEILING = 2**31 - 1
SEED_RANGE = (-(2**63), 2**64 - 1)


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()     # an assistant turn's calls (router/tools.py)
    tool_call_id: str = ""                    # a tool turn's answer to that call


@dataclass(frozen=True, slots=True)
class Sampling:
    """What the client asked for; ``max_tokens`` None means "as many as fit"."""

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: GrammarSpec | None = None      # response_format or a forced tool call


@dataclass(frozen=True, slots=True)
class StreamSpec:
    enabled: bool = False
    include_usage: bool = False


@dataclass(frozen=True, slots=True)
class ChatRequest:
    model: str
    messages: tuple[Message, ...]
    sampling: Sampling
    stream: StreamSpec
    tools: ToolSpec | None = None
    response_format: GrammarSpec | None = None


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    model: str
    prompt: str | tuple[int, ...]
    sampling: Sampling
    stream: StreamSpec


def _bad(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _as_int(value: object, param: str) -> int:
    # bool is an int subclass in Python but never a count in JSON.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(f"{param} must be an integer, got {_type_name(value)}", param)
    if isinstance(value, float):
        if not value.is_integer():
            raise _bad(f"{param} must be an integer, got {value}", param)
        value = int(value)
    return value


def _as_number(value: object, param: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(f"{param} must be a number, got {_type_name(value)}", param)
    f = float(value)
    if not math.isfinite(f):
        raise _bad(f"{param} must be finite, got {value}", param)
    return f


def _as_bool(value: object, param: str) -> bool:
    if not isinstance(value, bool):
        raise _bad(f"{param} must be a boolean, got {_type_name(value)}", param)
    return value


def _as_str(value: object, param: str) -> str:
    if not isinstance(value, str):
        raise _bad(f"{param} must be a string, got {_type_name(value)}", param)
    return value


def _opt(body: Mapping[str, Any], name: str) -> Any:
    """A field's value, with JSON null meaning "not given" as the OpenAI API treats it."""
    return body.get(name)


def parse_model(body: Mapping[str, Any], served_model: str) -> str:
    if "model" not in body or body["model"] is None:
        raise _bad("you must provide a model parameter", "model")
    model = _as_str(body["model"], "model")
    if model != served_model:
        raise ModelNotFoundError(model, served_model)
    return model


def _parse_stop(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list):
        raise _bad(f"stop must be a string or a list of strings, got {_type_name(value)}", "stop")
    if len(stops) > MAX_STOP:
        raise _bad(f"stop may hold at most {MAX_STOP} sequences, got {len(stops)}", "stop")
    out: list[str] = []
    for i, s in enumerate(stops):
        s = _as_str(s, f"stop[{i}]")
        if not s or len(s) > MAX_STOP_CHARS:
            raise _bad(f"stop[{i}] must have 1..{MAX_STOP_CHARS} characters", f"stop[{i}]")
        out.append(s)
    return tuple(out)


def _parse_max_tokens(body: Mapping[str, Any], max_context: int) -> int | None:
    # max_completion_tokens is the newer name; it wins when both are given.
    for name in ("max_completion_tokens", "max_tokens"):
        value = _opt(body, name)
        if value is None:
            continue
        n = _as_int(value, name)
        if n < 1:
            raise _bad(f"{name} must be at least 1, got {n}", name)
        if n > min(max_context, MAX_TOKENS_CEILING):
            raise InvalidRequestError(
                f"{name} is {n}, but this model's maximum context length is {max_context} "
                f"tokens", param=name, code="context_length_exceeded")
        return n
    return None


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    n = _opt(body, "n")
    if n is not None and _as_int(n, "n") != 1:
        raise _bad(f"n must be 1 (one choice per request is supported), got {n}", "n")
    best_of = _opt(body, "best_of")
    if best_of is not None and _as_int(best_of, "best_of") != 1:
        raise _bad(f"best_of must be 1, got {best_of}", "best_of")
    logprobs = _opt(body, "logprobs")
    if logprobs not in (None, False, 0):
        raise _bad("logprobs are not supported by this server", "logprobs")
    if _opt(body, "top_logprobs") not in (None, 0):
        raise _bad("top_logprobs is not supported by this server", "top_logprobs")
    if _opt(body, "echo") not in (None, False):
        raise _bad("echo is not supported by this server", "echo")
    if _opt(body, "suffix") not in (None, ""):
        raise _bad("suffix is not supported by this server", "suffix")


def _parse_penalty(body: Mapping[str, Any], name: str) -> float:
    value = _opt(body, name)
    if value is None:
        return 0.0
    f = _as_number(value, name)
    if not -2.0 <= f <= 2.0:
        raise _bad(f"{name} must be in [-2, 2], got {value}", name)
    return f


def _parse_logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} map; ids are checked against the vocabulary by the engine."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise _bad(f"logit_bias must be an object, got {_type_name(value)}", "logit_bias")
    if len(value) > 300:
        raise _bad(f"logit_bias may hold at most 300 tokens, got {len(value)}", "logit_bias")
    out: list[tuple[int, float]] = []
    for key, bias in value.items():
        param = f"logit_bias.{key}"
        if not (isinstance(key, str) and key.isdigit() and len(key) < 10):
            raise _bad(f"logit_bias keys must be token ids, got {key!r}", param)
        b = _as_number(bias, param)
        if not -100.0 <= b <= 100.0:
            raise _bad(f"{param} must be in [-100, 100], got {bias}", param)
        out.append((int(key), b))
    return tuple(sorted(out))


def _parse_sampling(body: Mapping[str, Any], max_context: int) -> Sampling:
    _refuse_unsupported(body)
    temperature = 1.0
    if _opt(body, "temperature") is not None:
        temperature = _as_number(body["temperature"], "temperature")
        if not 0.0 <= temperature <= 2.0:
            raise _bad(f"temperature must be in [0, 2], got {temperature}", "temperature")
    top_p = 1.0
    if _opt(body, "top_p") is not None:
        top_p = _as_number(body["top_p"], "top_p")
        if not 0.0 < top_p <= 1.0:
            raise _bad(f"top_p must be in (0, 1], got {top_p}", "top_p")
    seed: int | None = None
    if _opt(body, "seed") is not None:
        seed = _as_int(body["seed"], "seed")
        if not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
            raise _bad(f"seed out of range: {seed}", "seed")
    ignore_eos = False
    if _opt(body, "ignore_eos") is not None:
        ignore_eos = _as_bool(body["ignore_eos"], "ignore_eos")
    return Sampling(temperature=temperature, top_p=top_p, seed=seed,
                    max_tokens=_parse_max_tokens(body, max_context),
                    stop=_parse_stop(_opt(body, "stop")), ignore_eos=ignore_eos,
                    presence_penalty=_parse_penalty(body, "presence_penalty"),
                    frequency_penalty=_parse_penalty(body, "frequency_penalty"),
                    logit_bias=_parse_logit_bias(_opt(body, "logit_bias")))


def _parse_stream(body: Mapping[str, Any]) -> StreamSpec:
    stream = False
    if _opt(body, "stream") is not None:
        stream = _as_bool(body["stream"], "stream")
    options = _opt(body, "stream_options")
    if options is None:
        return StreamSpec(enabled=stream)
    if not isinstance(options, dict):
        raise _bad(f"stream_options must be an object, got {_type_name(options)}",
                   "stream_options")
    if not stream:
        raise _bad("stream_options is only allowed when stream is true", "stream_options")
    include = options.get("include_usage")
    include_usage = False if include is None else _as_bool(include, "stream_options.include_usage")
    return StreamSpec(enabled=True, include_usage=include_usage)


def _content_text(content: object, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{param} must be a string or a list of content parts, got "
                   f"{_type_name(content)}", param)
    parts: list[str] = []
    for j, part in enumerate(content):
        p = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise _bad(f"{p} must be an object, got {_type_name(part)}", p)
        kind = part.get("type")
        if kind != "text":
            raise _bad(f"{p}.type {kind!r} is not supported; this model reads text parts only",
                       f"{p}.type")
        parts.append(_as_str(part.get("text"), f"{p}.text"))
    return "".join(parts)


def parse_messages(value: object) -> tuple[Message, ...]:
    if value is None:
        raise _bad("messages is required", "messages")
    if not isinstance(value, list):
        raise _bad(f"messages must be a list, got {_type_name(value)}", "messages")
    if not value:
        raise _bad("messages must hold at least one message", "messages")
    out: list[Message] = []
    for i, m in enumerate(value):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"{param} must be an object, got {_type_name(m)}", param)
        role_raw = _as_str(m.get("role"), f"{param}.role")
        role = _ROLE_ALIASES.get(role_raw)
        if role is None:
            raise _bad(f"{param}.role {role_raw!r} is not one of {sorted(_ROLE_ALIASES)}",
                       f"{param}.role")
        content = m.get("content")
        # An assistant turn that only called tools carries null content.
        text = "" if content is None and role == "assistant" else _content_text(
            content, f"{param}.content")
        calls = (parse_message_tool_calls(m.get("tool_calls"), f"{param}.tool_calls")
                 if role == "assistant" else ())
        call_id = m.get("tool_call_id") if role == "tool" else None
        out.append(Message(role=role, content=text, tool_calls=calls,
                           tool_call_id=call_id if isinstance(call_id, str) else ""))
    return tuple(out)


def _parse_prompt(value: object, vocab_size: int) -> str | tuple[int, ...]:
    if value is None:
        raise _bad("prompt is required", "prompt")
    if isinstance(value, str):
        if not value:
            raise _bad("prompt must not be empty", "prompt")
        return value
    if not isinstance(value, list) or not value:
        raise _bad("prompt must be a string, a list of token ids, or a one-element list of "
                   f"either, got {_type_name(value)}", "prompt")
    if len(value) == 1 and isinstance(value[0], str | list):
        # The batch forms with a single entry; real batches need n/index fan-out.
        return _parse_prompt(value[0], vocab_size)
    if all(isinstance(t, str) for t in value) or all(isinstance(t, list) for t in value):
        raise _bad(f"batched prompts are not supported (got {len(value)}); send one request "
                   "per prompt", "prompt")
    tokens: list[int] = []
    for i, t in enumerate(value):
        tok = _as_int(t, f"prompt[{i}]")
        if not 0 <= tok < vocab_size:
            raise _bad(f"prompt[{i}] token id {tok} is outside the vocabulary [0, {vocab_size})",
                       f"prompt[{i}]")
        tokens.append(tok)
    return tuple(tokens)


def require_object(body: object) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, got {_type_name(body)}", "body")
    return body


def parse_chat_request(body: object, *, served_model: str, max_context: int) -> ChatRequest:
    b = require_object(body)
    model = parse_model(b, served_model)
    messages = parse_messages(b.get("messages"))
    return ChatRequest(model=model, messages=messages,
                       sampling=_parse_sampling(b, max_context), stream=_parse_stream(b),
                       tools=parse_openai_tools(b),
                       response_format=parse_response_format(_opt(b, "response_format")))


def parse_completion_request(body: object, *, served_model: str, max_context: int,
                             vocab_size: int) -> CompletionRequest:
    b = require_object(body)
    model = parse_model(b, served_model)
    prompt = _parse_prompt(b.get("prompt"), vocab_size)
    return CompletionRequest(model=model, prompt=prompt,
                             sampling=_parse_sampling(b, max_context), stream=_parse_stream(b))


def messages_as_dicts(messages: Sequence[Message]) -> list[dict[str, str]]:
    """The form chat templates take."""
    return [{"role": m.role, "content": m.content} for m in messages]
