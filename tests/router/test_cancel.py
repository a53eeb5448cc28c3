"""A client that hangs up stops its work: against real processes (router,
prefill, decode on the smollm2-shape config, whose prefill of a long prompt
takes seconds on CPU), an abandoned long request stops consuming prefill
within one chunk, measured by the prefill service's own counters, and the
next request does not wait behind it."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvstore.redis_server import EmbeddedRedis
from tests.prefill_svc.procs import Proc, engine_service, write_config
from tests.router.front_stack import RouterProc, http, live_counts, router_proc, wait_until

MODEL = "smollm2-shape"        # SmolLM2-135M's shape, random weights, byte tokenizer
BLOCK = 32                     # one prefill chunk = one block = 32 tokens
CHUNKS = "kvserve_prefill_prefill_chunks_total"
STOPPED = "kvserve_prefill_prefill_stopped_total"
N_TOKENS = 2048                # 64 chunks: many seconds of CPU prefill


@dataclass(slots=True)
class Stack:
    router: RouterProc
    prefill: Proc


def _live(r: RouterProc) -> dict[str, int]:
    try:
        return live_counts(r.http)
    except OSError:
        return {}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    d = tmp_path_factory.mktemp("cancel")
    config = write_config(d / "kvserve.toml", model=MODEL, block_tokens=BLOCK)
    with EmbeddedRedis() as redis:
        # Prefill steps of one block (--step-tokens): one step = one chunk here.
        engines = [engine_service(role, config, redis.url, d, store_address="",
                                  extra=("--num-blocks", "160", *(
                                      ("--step-tokens", str(BLOCK), "--solo-step-tokens", "0")
                                      if role == "prefill" else ())))
                   for role in ("prefill", "decode")]
        r = router_proc(config, redis.url, d)
        procs = [*engines, r.proc]
        try:
            for p in procs:       # a 135M-shape model starts slowly on a loaded machine
                p.start()
            for p in procs:
                p.wait_ready(300)
            wait_until(lambda: _live(r) == {"prefill": 1, "decode": 1}, 60, "instances")
            yield Stack(r, engines[0])
        finally:
            for p in procs:
                p.kill()


def test_abandoned_long_request_stops_prefill_within_one_chunk(stack: Stack) -> None:
    m0 = stack.prefill.metrics()
    prompt = "".join(chr(97 + i % 26) for i in range(N_TOKENS))
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode()
    host, port = stack.router.http.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    # Let the prefill get going (and time its chunks: the machine may be loaded),
    # then hang up.
    wait_until(lambda: stack.prefill.metrics()[CHUNKS] >= m0[CHUNKS] + 1, 120,
               "the long prefill to start")
    t1, c1 = time.monotonic(), stack.prefill.metrics()[CHUNKS]
    wait_until(lambda: stack.prefill.metrics()[CHUNKS] >= c1 + 2, 120, "two more chunks")
    chunk_s = (time.monotonic() - t1) / max(1.0, stack.prefill.metrics()[CHUNKS] - c1)
    s.close()
    at_close = stack.prefill.metrics()[CHUNKS]
    wait_until(lambda: stack.prefill.metrics()[STOPPED] > m0[STOPPED], 10 + 4 * chunk_s,
               f"the prefill to stop (a chunk takes ~{chunk_s:.2f} s here)")
    stopped_at = stack.prefill.metrics()[CHUNKS]
    time.sleep(1.0)
    after = stack.prefill.metrics()
    # Nothing more computed after the stop, and the stop came within one chunk of the
    # hang-up: the chunk in flight when the cancel arrived (a counter read just before
    # the close may miss one more that was starting).
    print(f"\nprefill chunks: {at_close - m0[CHUNKS]:.0f} before the hang-up, "
          f"{stopped_at - at_close:.0f} after it, then stopped ({N_TOKENS // BLOCK} in all)")
    assert after[CHUNKS] == stopped_at
    assert stopped_at - at_close <= 2, (at_close, stopped_at)
    assert stopped_at - m0[CHUNKS] < N_TOKENS // BLOCK // 2      # far from the whole prompt
    # The next request runs at once, not behind the rest of the abandoned prefill.
    left_s = (N_TOKENS // BLOCK - (stopped_at - m0[CHUNKS])) * chunk_s
    t0 = time.monotonic()
    r = http("POST", stack.router.http + "/v1/completions",
             {"model": MODEL, "prompt": "short one", "max_tokens": 2, "ignore_eos": True})
    assert r.status == 200, r.body
    assert time.monotonic() - t0 < max(10.0, left_s / 2), (time.monotonic() - t0, left_s)
