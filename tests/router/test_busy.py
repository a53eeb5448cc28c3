"""A busy decode instance is waited for, not failed: the router keeps the
prefilled handle, retries when decode said it would have room, and the
request completes exactly (real processes: prefill, a one-slot decode with no
waiting room, a router; tiny-dense)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import Engine, EngineConfig, SamplingParams
from kvstore.redis_server import EmbeddedRedis
from tests.prefill_svc.procs import BLOCK, Proc, engine_service, start_all, write_config
from tests.router.front_stack import (
    Reply,
    RouterProc,
    http,
    live_counts,
    metric_sum,
    router_proc,
    wait_until,
)

MODEL = "tiny-dense"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RouterProc, Proc, Proc]]:
    d: Path = tmp_path_factory.mktemp("busy")
    # The hand-off path is what this exercises: every prompt through prefill.
    config = write_config(d / "kvserve.toml", model=MODEL, local_cold_tokens=0)
    with EmbeddedRedis() as redis:
        pre = engine_service("prefill", config, redis.url, d, store_address="")
        dec = engine_service("decode", config, redis.url, d, store_address="",
                             extra=("--max-seqs", "1", "--max-waiting", "0"))
        router = router_proc(config, redis.url, d)
        procs = [pre, dec, router.proc]
        try:
            start_all(*procs)
            wait_until(lambda: live_counts(router.http) == {"prefill": 1, "decode": 1}, 60,
                       "router sees prefill and decode")
            yield router, pre, dec
        finally:
            for p in procs:
                p.kill()


def test_a_busy_decode_is_retried_with_the_same_handle(
        stack: tuple[RouterProc, Proc, Proc]) -> None:
    router, pre, dec = stack
    long_prompt = [(i * 7) % 250 + 1 for i in range(40)]
    short_prompt = [(i * 11) % 250 + 1 for i in range(50)]
    replies: dict[str, Reply] = {}

    def send(name: str, prompt: list[int], n: int) -> None:
        replies[name] = http("POST", router.http + "/v1/completions",
                             {"model": MODEL, "prompt": prompt, "max_tokens": n,
                              "temperature": 0, "ignore_eos": True, "stream": True}, timeout=120)

    ok_before = pre.metrics().get("kvserve_prefill_prefill_requests_total{kind=ok}", 0.0)
    first = threading.Thread(target=send, args=("long", long_prompt, 900))
    first.start()
    wait_until(lambda: dec.metrics().get("kvserve_decode_batch_active", 0.0) == 1, 30,
               "the long request holds decode's only slot")
    send("short", short_prompt, 6)               # decode is full: busy, then room
    first.join(120)
    assert replies["long"].status == 200 and replies["short"].status == 200
    assert replies["short"].events()[-1] == "[DONE]"
    assert dec.metrics()["kvserve_decode_decode_busy_rejections_total"] >= 1
    assert metric_sum(router.http, "kvserve_router_retries_total", role="decode",
                      reason="busy") >= 1
    # Prefilled once each: the busy wait kept the handle, nothing was redone.
    assert pre.metrics()["kvserve_prefill_prefill_requests_total{kind=ok}"] == ok_before + 2
    ref = Engine(EngineConfig(model=MODEL, block_tokens=BLOCK, num_blocks=64))
    want = ref.generate(short_prompt, SamplingParams(max_tokens=6, ignore_eos=True)).tokens
    text = "".join(json.loads(e)["choices"][0]["text"] for e in replies["short"].events()[:-1])
    assert text == ref.tokenizer.decode(want)
