"""Tokenizing a request off the event loop, after a cheap too-long check.

Rendering a chat template and encoding run on a small thread pool: the
``tokenizers`` call used releases the GIL (engine.tokenizer), so the loop
keeps answering ``/health`` and streaming while a 12 MB prompt is encoded.
Before any of that, a prompt that cannot fit is refused from its length
alone: every token of plain text stands for at most ``max_token_bytes``
bytes, so ``len(text) // max_token_bytes`` tokens is a lower bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from engine.tokenizer import Tokenizer
from router.errors import ContextLengthError
from router.generation import RouteRequest

T = TypeVar("T")


def _behind_the_loop() -> None:
    """Tokenizer threads yield the CPU to the event loop (Linux: nice is per thread)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), HELPER_NICE)


HELPER_NICE = 5
# Each encode is CPU-bound: leave one core to the event loop.
_POOL = ThreadPoolExecutor(max_workers=max(1, min(4, (os.cpu_count() or 2) - 1)),
                           thread_name_prefix="tokenize", initializer=_behind_the_loop)


def refuse_if_surely_too_long(tok: Tokenizer, req: RouteRequest, max_context: int) -> None:
    chars = (sum(len(m.content) for m in req.messages) if req.messages
             else len(req.prompt) if req.prompt else 0)
    at_least = max(tok.min_tokens(chars), len(req.token_ids))
    if at_least >= max_context:
        param = "messages" if req.messages else "prompt"
        raise ContextLengthError(
            f"this model's maximum context length is {max_context} tokens; the prompt has at "
            f"least {at_least}, leaving no room to generate", param=param)


async def off_loop(fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` on the tokenizer threads: encodes and decodes are CPU-bound and
    would stall every other request's stream on the event loop."""
    return await asyncio.get_running_loop().run_in_executor(_POOL, fn, *args)


async def tokenize_off_loop(tokenize: Callable[[RouteRequest], list[int]], tok: Tokenizer,
                            req: RouteRequest, max_context: int) -> list[int]:
    refuse_if_surely_too_long(tok, req, max_context)
    return await off_loop(tokenize, req)
