"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` on the OpenAI front.

``vllm bench serve`` asks the server's tokenizer, through these two, whether the
prompts it built (from its local copy of the tokenizer) come back with the length
it meant, and cuts those that come back longer (its ``random`` and
``prefix_repetition`` datasets). Without them it printed "/tokenize unavailable,
skipping alignment" and sent the unaligned prompts (issue 18's client sweep).
The server's tokenizer is the router's own: the one that counts a request's
prompt tokens, with the same neutralised control strings (a prompt's text never
becomes a special token here either).

Request and response fields follow vLLM's server: ``{"prompt": str}`` or
``{"messages": [...]}`` (the chat template applied, ``add_generation_prompt``
default true) -> ``{"count", "max_model_len", "tokens"}``; ``{"tokens": [int]}``
-> ``{"prompt": str}``. ``model``, when given, must be the served model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from engine.tokenizer import Tokenizer
from router.body import parse_json_body
from router.errors import InvalidRequestError
from router.openai_schema import (
    messages_as_dicts,
    parse_messages,
    parse_model,
    require_object,
)
from router.tokenize import off_loop


@dataclass(frozen=True, slots=True)
class TokenizeInput:
    text: str = ""
    messages: tuple[dict[str, str], ...] = ()
    add_generation_prompt: bool = True


def parse_tokenize(body: object, *, served_model: str) -> TokenizeInput:
    b = require_object(body)
    if b.get("model") is not None:
        parse_model(b, served_model)
    if b.get("messages") is not None:
        agp = b.get("add_generation_prompt", True)
        if not isinstance(agp, bool):
            raise InvalidRequestError("add_generation_prompt must be a boolean",
                                      param="add_generation_prompt")
        msgs = tuple(messages_as_dicts(parse_messages(b["messages"])))
        return TokenizeInput(messages=msgs, add_generation_prompt=agp)
    prompt = b.get("prompt")
    if not isinstance(prompt, str):
        raise InvalidRequestError("give 'prompt' (a string) or 'messages'", param="prompt")
    return TokenizeInput(text=prompt)


def parse_detokenize(body: object, *, served_model: str, vocab_size: int,
                     max_tokens: int) -> tuple[int, ...]:
    b = require_object(body)
    if b.get("model") is not None:
        parse_model(b, served_model)
    tokens = b.get("tokens")
    if not isinstance(tokens, list) or len(tokens) > max_tokens or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size
            for t in tokens):
        raise InvalidRequestError(f"'tokens' must be a list of at most {max_tokens} token ids "
                                  f"in [0, {vocab_size})", param="tokens")
    return tuple(tokens)


@dataclass(frozen=True, slots=True)
class TokenizeEndpoints:
    tokenizer: Tokenizer
    model_name: str
    max_context: int
    vocab_size: int

    def install(self, app: web.Application, authorize: Any) -> None:
        """``authorize(request)``: the front's caller check (401 without a valid key)."""
        async def tokenize(request: web.Request) -> web.Response:
            authorize(request)
            inp = await parse_json_body(request, parse_tokenize, served_model=self.model_name)
            ids = await off_loop(self._encode, inp)
            return web.json_response({"count": len(ids), "max_model_len": self.max_context,
                                      "tokens": ids, "token_strs": None})

        async def detokenize(request: web.Request) -> web.Response:
            authorize(request)
            ids = await parse_json_body(request, parse_detokenize, served_model=self.model_name,
                                        vocab_size=self.vocab_size, max_tokens=self.max_context)
            text = await off_loop(self.tokenizer.decode, ids)
            return web.json_response({"prompt": text})

        app.router.add_post("/tokenize", tokenize)
        app.router.add_post("/detokenize", detokenize)

    def _encode(self, inp: TokenizeInput) -> list[int]:
        if inp.messages:
            msgs: list[Mapping[str, str]] = list(inp.messages)
            return self.tokenizer.apply_chat_template(
                msgs, add_generation_prompt=inp.add_generation_prompt)  # type: ignore[arg-type]
        return self.tokenizer.encode(inp.text)
