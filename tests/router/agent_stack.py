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

from kvstore.redis_server import EmbeddedRedis
from tests.prefill_svc.procs import engine_service, start_all, store, write_config
from tests.router.front_stack import RouterProc, http, live_counts, router_proc, wait_until

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
    config = write_config(d / "kvserve.toml", model=MODEL, block_tokens=64)
    with EmbeddedRedis() as redis:
        st = store(config, redis.url, d)
        engines = [engine_service(role, config, redis.url, d, store_address=st.address)
                   for role in ("prefill", "decode")]
        router = router_proc(config, redis.url, d)
        procs = [st, *engines, router.proc]
        try:
            start_all(*procs)
            wait_until(lambda: live_counts(router.http) == {"prefill": 1, "decode": 1}, 60,
                       "router sees prefill and decode")
            # Ready means answering: right after start the front has dropped the first
            # connections without a response (under investigation; see NOTES).
            wait_until(lambda: _answers(router.http), 90, "router answers a chat", 1.0)
            yield router
        finally:
            for p in procs:
                p.kill()
