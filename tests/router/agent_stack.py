"""One real stack (Redis, kvstore, prefill, decode, router processes serving
SmolLM2-135M with 64-token blocks) for the agent-API tests: tools and
structured outputs (test_tools_client.py), the Messages API
(test_messages_client.py) and the openai client (test_openai_client.py).
Started once per test package by the ``agent_stack`` fixture
(tests/router/conftest.py) and killed at the end."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from tests.router.front_stack import RouterProc, http, split_stack, wait_until

MODEL = "smollm2"


def _answers(base: str) -> bool:
    try:
        r = http("POST", f"{base}/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
            timeout=30)
    except OSError:
        return False
    return r.status == 200


@contextlib.contextmanager
def agent_stack(d: Path) -> Iterator[RouterProc]:
    with split_stack(d, model=MODEL, block_tokens=64, live_s=60) as s:
        # Ready means answering: right after start the front has dropped the first
        # connections without a response.
        wait_until(lambda: _answers(s.router.http), 90, "router answers a chat", 1.0)
        yield s.router
