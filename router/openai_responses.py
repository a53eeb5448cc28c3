"""OpenAI response bodies: whole completions, stream chunks, usage, models.

Shapes follow the OpenAI API so the official SDK parses them unchanged:
chat chunks carry ``delta``s (the first one the role), the last content
chunk carries ``finish_reason``, and with ``stream_options.include_usage``
every chunk has ``"usage": null`` and one extra chunk with empty ``choices``
carries the usage before ``data: [DONE]``.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from router.generation import Usage

JsonObj = dict[str, Any]


def usage_body(usage: Usage) -> JsonObj:
    return {"prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def sse(obj: JsonObj) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


@dataclass(slots=True)
class ResponseIds:
    """The id/created/model triple every body and chunk of one response repeats."""

    model: str
    chat: bool
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.id:
            self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex

    def _base(self, obj: str) -> JsonObj:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


@dataclass(slots=True)
class ChatShapes:
    ids: ResponseIds
    include_usage: bool = False
    _sent_role: bool = False

    def whole(self, text: str, finish_reason: str, usage: Usage) -> JsonObj:
        body = self.ids._base("chat.completion")
        body["choices"] = [{"index": 0, "message": {"role": "assistant", "content": text},
                            "logprobs": None, "finish_reason": finish_reason}]
        body["usage"] = usage_body(usage)
        return body

    def chunk(self, text: str, finish_reason: str | None = None) -> JsonObj:
        delta: JsonObj = {"content": text}
        if not self._sent_role:
            delta = {"role": "assistant", "content": text}
            self._sent_role = True
        body = self.ids._base("chat.completion.chunk")
        body["choices"] = [{"index": 0, "delta": delta, "logprobs": None,
                            "finish_reason": finish_reason}]
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: Usage) -> JsonObj:
        body = self.ids._base("chat.completion.chunk")
        body["choices"] = []
        body["usage"] = usage_body(usage)
        return body


@dataclass(slots=True)
class CompletionShapes:
    ids: ResponseIds
    include_usage: bool = False

    def whole(self, text: str, finish_reason: str, usage: Usage) -> JsonObj:
        body = self.ids._base("text_completion")
        body["choices"] = [{"index": 0, "text": text, "logprobs": None,
                            "finish_reason": finish_reason}]
        body["usage"] = usage_body(usage)
        return body

    def chunk(self, text: str, finish_reason: str | None = None) -> JsonObj:
        body = self.ids._base("text_completion")
        body["choices"] = [{"index": 0, "text": text, "logprobs": None,
                            "finish_reason": finish_reason}]
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: Usage) -> JsonObj:
        body = self.ids._base("text_completion")
        body["choices"] = []
        body["usage"] = usage_body(usage)
        return body


Shapes = ChatShapes | CompletionShapes


def models_body(model: str, created: int, owned_by: str = "kvserve") -> JsonObj:
    return {"object": "list",
            "data": [{"id": model, "object": "model", "created": created, "owned_by": owned_by}]}
