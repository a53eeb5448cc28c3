"""From a parsed chat request to what the flow runs and how its answer is shaped.

``plan_chat`` is the one step both chat fronts (OpenAI ``/v1/chat/completions``
and Anthropic ``/v1/messages``) share between parsing and ``RouterCore.generate``:
it renders tools and tool turns into plain messages for the chat template
(router/tools.py) and puts the grammar the engine must enforce (a forced tool
call or a ``response_format``) into the sampling parameters.
``ToolChatShapes`` turns the model's ``<tool_call>`` blocks back into OpenAI
``tool_calls`` (whole, or as ``delta.tool_calls`` when streaming).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.errors import EngineInputError
from engine.grammar import GrammarSpec, validate
from router.errors import InvalidRequestError
from router.generation import Usage
from router.openai_responses import ChatShapes, JsonObj
from router.openai_schema import Message, Sampling
from router.tools import ToolCall, ToolSpec, ToolStream, render, split_output, with_grammar


@dataclass(frozen=True, slots=True)
class ChatPlan:
    messages: tuple[Message, ...]   # plain role/content turns, tools rendered in
    sampling: Sampling              # grammar set when the output is constrained
    tools: ToolSpec | None          # parse tool calls out of the output when it parses


def plan_chat(messages: Sequence[Message], sampling: Sampling, tools: ToolSpec | None,
              response_format: GrammarSpec | None) -> ChatPlan:
    rendered = tuple(Message(role, content) for role, content in render(messages, tools))
    sampling = with_grammar(sampling, tools, response_format)
    if tools is not None and sampling.grammar is not None and sampling.grammar is not (
            response_format):
        try:                        # the tools' parameter schemas are the client's
            validate(sampling.grammar)
        except EngineInputError as exc:
            raise InvalidRequestError(f"tools: {exc}", param="tools") from exc
    return ChatPlan(rendered, sampling, tools)


def openai_call(call: ToolCall, index: int | None = None) -> JsonObj:
    out: JsonObj = {"id": call.id, "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments}}
    if index is not None:
        out = {"index": index, **out}
    return out


@dataclass(slots=True)
class ToolChatShapes:
    """ChatShapes with tool calls parsed out of the text (router.openai_responses.Shapes)."""

    inner: ChatShapes
    stream: ToolStream

    @property
    def include_usage(self) -> bool:
        return self.inner.include_usage

    def whole(self, text: str, finish_reason: str, usage: Usage) -> JsonObj:
        content, calls = split_output(text, self.stream.spec)
        body = self.inner.whole(content, finish_reason, usage)
        if calls:
            choice = body["choices"][0]
            choice["message"]["content"] = content or None
            choice["message"]["tool_calls"] = [openai_call(c) for c in calls]
            if finish_reason == "stop":
                choice["finish_reason"] = "tool_calls"
        return body

    def chunk(self, text: str, finish_reason: str | None = None) -> JsonObj:
        before = self.stream.calls
        pieces = self.stream.feed(text)
        if finish_reason is not None:
            pieces += self.stream.finish()
        if finish_reason == "stop" and self.stream.calls:
            finish_reason = "tool_calls"
        body = self.inner.chunk("".join(p for p in pieces if isinstance(p, str)), finish_reason)
        calls = [p for p in pieces if isinstance(p, ToolCall)]
        if calls:
            body["choices"][0]["delta"]["tool_calls"] = [
                openai_call(c, before + i) for i, c in enumerate(calls)]
        return body

    def usage_chunk(self, usage: Usage) -> JsonObj:
        return self.inner.usage_chunk(usage)


def chat_shapes(inner: ChatShapes, tools: ToolSpec | None) -> Any:
    """The shapes for a chat answer: plain, or with tool calls parsed out."""
    if tools is None or not tools.parses:
        return inner
    return ToolChatShapes(inner, ToolStream(tools))
