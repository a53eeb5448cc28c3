"""The Anthropic Messages API (``POST /v1/messages``) over the chat flow.

Only the wire format is Anthropic's: the body is parsed into the same
messages/sampling/tools the OpenAI front builds (system -> a system turn,
``tool_use`` blocks -> assistant tool calls, ``tool_result`` blocks -> tool
turns), planned by ``router.chat_plan.plan_chat`` and run by the same
``RouterCore.generate``; the answer comes back as content blocks (``text``,
``tool_use``), ``stop_reason`` and ``usage`` with ``cache_read_input_tokens``
(the prompt tokens restored from the cache; ``input_tokens`` counts the rest,
as Anthropic does). Streaming sends Anthropic's named SSE events. Errors use
Anthropic's shape ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from aiohttp import web
from multidict import CIMultiDict

from router.auth import identify
from router.body import read_json_body
from router.chat_plan import plan_chat
from router.errors import (
    InvalidRequestError,
    ModelNotFoundError,
    RouterError,
    http_error,
    retry_headers,
)
from router.front_config import FrontConfig, Generator
from router.generation import GenEvent, RouteRequest, Usage
from router.metrics import RouterMetrics
from router.openai_schema import MAX_STOP, Message, Sampling
from router.tools import (
    Piece,
    ToolCall,
    ToolSpec,
    ToolStream,
    checked_spec,
    make_tool,
)

log = logging.getLogger(__name__)


class FrontPlumbing(Protocol):
    """What the Messages API takes from the OpenAI front that mounts it
    (``router.front.Front``): settings, the request flow, metrics, request ids
    and the usage accounting of a finished stream."""

    cfg: FrontConfig
    core: Generator
    metrics: RouterMetrics

    def request_id(self, request: web.Request) -> str: ...

    def finish(self, last: GenEvent) -> Usage: ...

JsonObj = dict[str, Any]
# HTTP status -> Anthropic error type.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}
# Fields that would change the answer and that this server does not implement.
_REFUSED = ("top_k", "thinking", "container", "mcp_servers")


@dataclass(frozen=True, slots=True)
class MessagesRequest:
    messages: tuple[Message, ...]
    sampling: Sampling
    stream: bool
    tools: ToolSpec | None


def _bad(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def _number(body: Mapping[str, Any], name: str, lo: float, hi: float) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
        raise _bad(f"{name} must be a number in [{lo:g}, {hi:g}], got {v!r}", name)
    return float(v)


def _text_blocks(value: object, param: str) -> str:
    """A string, or a list of text blocks, as one text."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _bad(f"{param} must be a string or a list of content blocks", param)
    parts = []
    for j, b in enumerate(value):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(
                b.get("text"), str):
            raise _bad(f"{param}[{j}] must be a text block; this model reads text only",
                       f"{param}[{j}]")
        parts.append(b["text"])
    return "".join(parts)


def _turns(role: str, content: object, param: str) -> list[Message]:
    if isinstance(content, str):
        return [Message(role, content)]
    if not isinstance(content, list):
        raise _bad(f"{param} must be a string or a list of content blocks", param)
    out: list[Message] = []
    text: list[str] = []
    calls: list[ToolCall] = []
    for j, b in enumerate(content):
        p = f"{param}[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(b.get("input"), dict):
                raise _bad(f"{p}.input must be an object", f"{p}.input")
            calls.append(ToolCall(str(b.get("id") or ToolCall.new_id("toolu_")),
                                  str(b.get("name")), json.dumps(b["input"])))
        elif kind == "tool_result" and role == "user":
            if text:
                out.append(Message("user", "".join(text)))
                text = []
            result = b.get("content", "")
            body = _text_blocks(result, f"{p}.content")
            if b.get("is_error"):
                body = f"Error: {body}"
            out.append(Message("tool", body, tool_call_id=str(b.get("tool_use_id", ""))))
        else:
            raise _bad(f"{p}.type {kind!r} is not supported here (text, and tool_use in "
                       "assistant turns / tool_result in user turns)", f"{p}.type")
    if text or calls or not out:
        out.append(Message(role, "".join(text), tool_calls=tuple(calls)))
    return out


def _tools(body: Mapping[str, Any]) -> ToolSpec | None:
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw is None:
        kind = choice.get("type") if isinstance(choice, dict) else choice
        if kind not in (None, "auto", "none"):
            raise _bad("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(raw, list) or not raw:
        raise _bad("tools must be a non-empty list", "tools")
    tools = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict) or t.get("type") not in (None, "custom"):
            raise _bad(f"tools[{i}] must be a custom tool (name, description, input_schema)",
                       f"tools[{i}]")
        tools.append(make_tool(t.get("name"), t.get("description"), t.get("input_schema"),
                               f"tools[{i}]"))
    choice = {"type": "auto"} if choice is None else choice
    if not isinstance(choice, dict):
        raise _bad("tool_choice must be an object", "tool_choice")
    kind = choice.get("type")
    mapped = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}.get(
        kind if isinstance(kind, str) else "")
    if mapped is None:
        raise _bad(f"tool_choice.type {kind!r} is not one of auto, any, tool, none",
                   "tool_choice.type")
    name = str(choice.get("name", "")) if mapped == "function" else ""
    return checked_spec(tuple(tools), mapped, name,
                        not choice.get("disable_parallel_tool_use", False), "tool_choice.name")


def parse_messages_request(body: object, *, served_model: str,
                           max_context: int) -> MessagesRequest:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", "body")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model is required", "model")
    if model != served_model:
        raise ModelNotFoundError(model, served_model)
    for name in _REFUSED:
        if body.get(name) is not None and body.get(name) != {"type": "disabled"}:
            raise _bad(f"{name} is not supported by this server", name)
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise _bad("max_tokens is required and must be an integer >= 1", "max_tokens")
    if max_tokens > max_context:
        raise InvalidRequestError(f"max_tokens is {max_tokens}, but this model's maximum "
                                  f"context length is {max_context} tokens", param="max_tokens",
                                  code="context_length_exceeded")
    turns: list[Message] = []
    if body.get("system") is not None:
        turns.append(Message("system", _text_blocks(body["system"], "system")))
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise _bad("messages must be a non-empty list", "messages")
    for i, m in enumerate(raw):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise _bad(f"messages[{i}].role must be 'user' or 'assistant'", f"messages[{i}].role")
        turns += _turns(role, m.get("content"), f"messages[{i}].content")
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(
            isinstance(s, str) and s for s in stops):
        raise _bad(f"stop_sequences takes at most {MAX_STOP} non-empty strings",
                   "stop_sequences")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream must be a boolean", "stream")
    sampling = Sampling(max_tokens=max_tokens, stop=tuple(stops))
    temperature = _number(body, "temperature", 0.0, 1.0)
    if temperature is not None:
        sampling = replace(sampling, temperature=temperature)
    top_p = _number(body, "top_p", 0.0, 1.0)
    if top_p is not None:
        if top_p == 0.0:
            raise _bad("top_p must be in (0, 1]", "top_p")
        sampling = replace(sampling, top_p=top_p)
    return MessagesRequest(tuple(turns), sampling, stream, _tools(body))


# -- answers ---------------------------------------------------------------------------

def usage_body(usage: Usage) -> JsonObj:
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": usage.cached_tokens,
            "cache_creation_input_tokens": 0}


def error_response(exc: BaseException) -> web.Response:
    """The Anthropic-shaped error answer (with Retry-After on a 429)."""
    status, body = error_body(exc)
    return web.json_response(body, status=status, headers=retry_headers(exc))


def error_body(exc: BaseException) -> tuple[int, JsonObj]:
    err = http_error(exc)
    kind = _ERROR_TYPES.get(err.status, "api_error" if err.status >= 500
                            else "invalid_request_error")
    return err.status, {"type": "error", "error": {"type": kind,
                                                   "message": err.body["error"]["message"]}}


def event(name: str, data: JsonObj) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def tool_block(call: ToolCall) -> JsonObj:
    return {"type": "tool_use", "id": call.id, "name": call.name,
            "input": json.loads(call.arguments)}


@dataclass(slots=True)
class _Ending:
    """Why the answer stopped, as Anthropic names it."""

    eos_ids: frozenset[int]
    stops: tuple[str, ...]
    decode: Any

    def reason(self, finish: str, tokens: Sequence[int], called: bool) -> tuple[str, str | None]:
        if called and finish == "stop":
            return "tool_use", None
        if finish == "length":
            return "max_tokens", None
        if self.stops and tokens and tokens[-1] not in self.eos_ids and self.decode is not None:
            text = self.decode(list(tokens))
            hits = [(text.find(s), s) for s in self.stops if s in text]
            if hits:
                return "stop_sequence", min(hits)[1]
        return "end_turn", None


def _anthropic_headers(request: web.Request) -> Mapping[str, str]:
    """Anthropic clients send their key as ``x-api-key``; the front's auth reads a
    bearer token, so the key is offered as one when no Authorization header came."""
    key = request.headers.get("x-api-key")
    if not key or "Authorization" in request.headers:
        return request.headers
    headers = CIMultiDict(request.headers)
    headers["Authorization"] = f"Bearer {key}"
    return headers


class MessagesApi:
    """The /v1/messages handler; the front's plumbing (caller, body, ids, metrics)."""

    def __init__(self, front: FrontPlumbing) -> None:
        self.front = front

    def _ending(self, stops: tuple[str, ...]) -> _Ending:
        tok = getattr(getattr(self.front.core, "meta", None), "tokenizer", None)
        return _Ending(frozenset(getattr(tok, "eos_token_ids", ())), stops,
                       getattr(tok, "decode", None))

    async def handle(self, request: web.Request) -> web.StreamResponse:
        front = self.front
        try:
            caller = identify(_anthropic_headers(request), front.cfg.api_keys, front.cfg.classes)
            parsed = parse_messages_request(await read_json_body(request),
                                            served_model=front.cfg.model_name,
                                            max_context=front.cfg.max_context)
            plan = plan_chat(parsed.messages, parsed.sampling, parsed.tools, None)
            route = RouteRequest(request_id=front.request_id(request), tenant=caller.tenant,
                                 traffic_class=caller.traffic_class, api_key_id=caller.key_id,
                                 sampling=plan.sampling,
                                 messages=plan.messages)
        except Exception as exc:
            return error_response(exc)
        t0 = time.perf_counter()
        events = front.core.generate(route)
        answer = _Answer(route, ToolStream(plan.tools, "toolu_"), self._ending(
            parsed.sampling.stop), front.cfg.model_name)
        try:
            try:
                first = await anext(events)
            except StopAsyncIteration:
                raise RouterError("the generation ended without any event") from None
            except Exception as exc:
                return error_response(exc)
            front.metrics.ttft_seconds.observe(time.perf_counter() - t0)
            if parsed.stream:
                return await self._stream(request, events, first, answer)
            return await self._whole(events, first, answer)
        finally:
            await events.aclose()

    async def _whole(self, events: AsyncGenerator[GenEvent, None], first: GenEvent,
                     answer: _Answer) -> web.Response:
        last = first
        pieces = answer.feed(first)
        try:
            async for ev in events:
                pieces += answer.feed(ev)
                last = ev
        except Exception as exc:
            return error_response(exc)
        pieces += answer.stream.finish()
        usage = self.front.finish(last)
        content: list[JsonObj] = []
        for p in pieces:
            if isinstance(p, ToolCall):
                content.append(tool_block(p))
            elif content and content[-1]["type"] == "text":
                content[-1]["text"] += p
            else:
                content.append({"type": "text", "text": p})
        reason, seq = answer.reason(last)
        body = {**answer.head(), "content": content, "stop_reason": reason,
                "stop_sequence": seq, "usage": usage_body(usage)}
        return web.json_response(body)

    async def _stream(self, request: web.Request, events: AsyncGenerator[GenEvent, None],
                      first: GenEvent, answer: _Answer) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        blocks = _Blocks(resp)
        try:
            start = {**answer.head(), "content": [], "stop_reason": None,
                     "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}
            await resp.write(event("message_start", {"type": "message_start",
                                                     "message": start}))
            last = first
            await blocks.send(answer.feed(first))
            if not first.finished:
                async for ev in events:
                    last = ev
                    await blocks.send(answer.feed(ev))
                    if ev.finished:
                        break
            if not last.finished:
                raise RouterError("the generation stream ended before it finished")
            await blocks.send(answer.stream.finish())
            await blocks.close()
            usage = self.front.finish(last)
            reason, seq = answer.reason(last)
            await resp.write(event("message_delta", {
                "type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                "usage": usage_body(usage)}))
            await resp.write(event("message_stop", {"type": "message_stop"}))
        except ConnectionError:
            log.info("client of %s disconnected mid-stream", answer.route.request_id)
            return resp
        except Exception as exc:  # headers are sent: report in-stream
            _, body = error_body(exc)
            self.front.metrics.stream_errors.inc()
            with contextlib.suppress(ConnectionError):
                await resp.write(event("error", body))
        with contextlib.suppress(ConnectionError):
            await resp.write_eof()
        return resp


@dataclass(slots=True)
class _Answer:
    route: RouteRequest
    stream: ToolStream
    ending: _Ending
    model: str
    id: str = field(default_factory=lambda: "msg_" + uuid.uuid4().hex[:24])
    tokens: list[int] = field(default_factory=list)

    def head(self) -> JsonObj:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model}

    def feed(self, ev: GenEvent) -> list[Piece]:
        self.tokens += ev.token_ids
        return self.stream.feed(ev.text)

    def reason(self, last: GenEvent) -> tuple[str, str | None]:
        return self.ending.reason(last.finish_reason or "stop", self.tokens,
                                  self.stream.calls > 0)


@dataclass(slots=True)
class _Blocks:
    """Content blocks as stream events: a text block stays open across text pieces."""

    resp: web.StreamResponse
    index: int = 0
    text_open: bool = False

    async def send(self, pieces: list[Piece]) -> None:
        for p in pieces:
            if isinstance(p, ToolCall):
                await self.close()
                await self._write("content_block_start", content_block={
                    "type": "tool_use", "id": p.id, "name": p.name, "input": {}})
                await self._write("content_block_delta", delta={
                    "type": "input_json_delta", "partial_json": p.arguments})
                await self._write("content_block_stop")
                self.index += 1
                continue
            if not self.text_open:
                await self._write("content_block_start", content_block={"type": "text",
                                                                        "text": ""})
                self.text_open = True
            await self._write("content_block_delta", delta={"type": "text_delta", "text": p})

    async def close(self) -> None:
        if self.text_open:
            await self._write("content_block_stop")
            self.text_open = False
            self.index += 1

    async def _write(self, name: str, **fields: object) -> None:
        await self.resp.write(event(name, {"type": name, "index": self.index, **fields}))
