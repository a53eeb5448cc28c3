"""The router's live view against real processes: affinity from KV events,
and instances dying under it (SIGKILL).

One cluster per module: Redis and two nodes, each with a kvstore, a prefill
and a decode instance (tiny-dense), and a router, with heartbeats every 0.3 s
and a 2 s instance expiry. The tests run in order; the first checks that

* a prompt whose blocks one node's store holds (known to the router only
  through the KV event stream) is prefilled on that node's instance;

then they kill instances in turn (and start one more decode instance) and
check that

* a request whose instance is dead before the first token is retried on
  another and succeeds (the dead one is quarantined at once);
* with no request touching it, a killed instance leaves the router's view
  within the heartbeat expiry;
* a decode instance killed mid-stream ends the stream with a clear in-stream
  error event naming it, then ``data: [DONE]``;
* a new instance joins the view within a registry poll or two.
"""

from __future__ import annotations

import json
import signal
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvstore.redis_server import EmbeddedRedis, free_port
from proto import common_pb2, prefill_pb2, prefill_pb2_grpc
from tests.prefill_svc.procs import Proc, engine_service, start_all, write_config
from tests.redis_args import redis_args
from tests.router.front_stack import (
    RouterProc,
    http,
    live_counts,
    metric_sum,
    router_proc,
    wait_until,
)
from tests.tls import channel

MODEL = "tiny-dense"
NODES = ("node-a", "node-b")
EXPIRY_S = 2.0          # [router].instance_ttl_s in write_config
POLL_S = 0.3            # the router polls the registry at min(0.5, heartbeat)


@dataclass(slots=True)
class Cluster:
    router: RouterProc
    prefill: dict[str, Proc]      # instance id -> process
    decode: dict[str, Proc]

    @property
    def http(self) -> str:
        return self.router.http


def _instance_id(p: Proc) -> str:
    return f"{p.role}-{p.address}"


def _store(config: Path, redis_url: str, log_dir: Path, node: str) -> Proc:
    port = free_port()
    argv = [sys.executable, "-m", "kvserve.cli", "store", "serve", "--config", str(config),
            "--host", "127.0.0.1", "--port", str(port), *redis_args(redis_url),
            "--metrics-port", "-1", "--grace", "1", "--node", node]
    return Proc("kvstore", argv, port, log_dir / f"kvstore-{node}.log")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    d = tmp_path_factory.mktemp("failover")
    # Prefill placement and failover are what these tests watch: a repeated prompt
    # would otherwise go to decode alone (router.dispatch; test_front covers that).
    config = write_config(d / "kvserve.toml", model=MODEL, local_tail_tokens=0,
                          local_cold_tokens=0)
    with EmbeddedRedis() as redis:
        stores = {node: _store(config, redis.url, d, node) for node in NODES}
        start_all(*stores.values())
        engines = [engine_service(role, config, redis.url, d,
                                  store_address=stores[node].address, extra=("--node", node))
                   for node in NODES for role in ("prefill", "decode")]
        router = router_proc(config, redis.url, d)
        c = Cluster(router, {_instance_id(p): p for p in engines if p.role == "prefill"},
                    {_instance_id(p): p for p in engines if p.role == "decode"})
        try:
            start_all(*engines, router.proc)
            wait_until(lambda: live_counts(router.http) == {"prefill": 2, "decode": 2}, 30,
                       "router sees every instance")
            yield c
        finally:
            # Tests add instances to the cluster's tables; stop whatever is there.
            for p in [router.proc, *c.prefill.values(), *c.decode.values(),
                      *stores.values()]:
                p.kill()


def _body(max_tokens: int = 4, **extra: object) -> dict:  # type: ignore[type-arg]
    # A fresh prompt each time: no prefix affinity, so placement spreads by load.
    return {"model": MODEL, "messages": [{"role": "user", "content": uuid.uuid4().hex * 2}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


def _live(procs: dict[str, Proc]) -> list[str]:
    return [i for i, p in procs.items() if p.popen is not None and p.popen.poll() is None]


def test_prefix_holder_is_chosen_from_kv_events(cluster: Cluster) -> None:
    # Ties between idle instances go to the first in id order; put the prefix on the
    # *other* one, by prefilling it there directly (the router is not involved, so
    # it can only learn where the blocks are from the KV event stream).
    holder = sorted(cluster.prefill)[1]
    tokens = [ord(c) for c in uuid.uuid4().hex * 3]            # 96 tokens = 6 blocks
    stored_before = metric_sum(cluster.http, "kvserve_router_kv_events_total", kind="stored")
    with channel(cluster.prefill[holder].address) as ch:
        handle = prefill_pb2_grpc.PrefillStub(ch).Prefill(prefill_pb2.PrefillRequest(
            ctx=common_pb2.RequestContext(request_id="seed-" + uuid.uuid4().hex),
            token_ids=tokens, sampling=common_pb2.SamplingParams(max_tokens=1)), timeout=30)
        prefill_pb2_grpc.PrefillStub(ch).Release(
            prefill_pb2.ReleaseRequest(request_id=handle.ctx.request_id), timeout=5)
    wait_until(lambda: metric_sum(cluster.http, "kvserve_router_kv_events_total",
                                  kind="stored") > stored_before, 10, "the stored event")
    for i in range(3):
        # Unrelated prompts in between move the tie-break's rotation along.
        http("POST", cluster.http + "/v1/completions",
             {"model": MODEL, "prompt": uuid.uuid4().hex, "max_tokens": 1})
        # The work the router sent since an instance's last heartbeat counts as its
        # load (more than the affinity of the same prompt is worth); let it reset.
        time.sleep(3 * POLL_S)
        r = http("POST", cluster.http + "/v1/completions",
                 {"model": MODEL, "prompt": tokens, "max_tokens": 2, "temperature": 0})
        assert r.status == 200, r.body
        assert r.headers["X-KV-Prefill-Instance"] == holder, i
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == len(tokens) - 16                    # all blocks but the last
    assert metric_sum(cluster.http, "kvserve_router_placements_total", role="prefill",
                      instance=holder, reason="prefix_affinity") >= 3


def test_mid_stream_decode_kill_fails_clearly(cluster: Cluster) -> None:
    host, port = cluster.http.removeprefix("http://").split(":")
    body = json.dumps(_body(max_tokens=900, stream=True)).encode()
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Type: application/json\r\nConnection: close\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        buf = b""
        while b"\r\n\r\n" not in buf or b"data: " not in buf.split(b"\r\n\r\n", 1)[1]:
            buf += s.recv(65536)
        head = buf.split(b"\r\n\r\n", 1)[0].decode()
        assert head.startswith("HTTP/1.1 200")
        victim = next(line.split(":", 1)[1].strip() for line in head.split("\r\n")
                      if line.lower().startswith("x-kv-decode-instance"))
        cluster.decode[victim].popen.send_signal(signal.SIGKILL)   # type: ignore[union-attr]
        while chunk := s.recv(65536):
            buf += chunk
    text = buf.decode(errors="replace")
    events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert victim in error["message"] and "after the first token" in error["message"]
    assert error["type"] == "server_error"
    # Part of an answer had gone out before the failure; no finish_reason was sent.
    chunks = [json.loads(e) for e in events[:-2]]
    assert chunks and all(c["choices"][0]["finish_reason"] is None for c in chunks)
    assert len(chunks) < 900
    cluster.decode[victim].popen.wait()  # type: ignore[union-attr]


def test_dead_prefill_is_retried_before_the_first_token(cluster: Cluster) -> None:
    live = _live(cluster.prefill)
    assert len(live) == 2
    victim = live[1]
    time.sleep(2 * POLL_S)
    cluster.prefill[victim].kill()
    retried_before = metric_sum(cluster.http, "kvserve_router_retries_total", role="prefill")
    for _ in range(8):
        r = http("POST", cluster.http + "/v1/completions",
                 {"model": MODEL, "prompt": uuid.uuid4().hex, "max_tokens": 3,
                  "stream": True})
        assert r.status == 200 and r.events()[-1] == "[DONE]", r.body
        assert r.headers["X-KV-Prefill-Instance"] != victim
        if metric_sum(cluster.http, "kvserve_router_retries_total",
                      role="prefill") > retried_before:
            break
    else:
        pytest.fail("no request was placed on the killed prefill instance")


def test_restarted_instance_rejoins(cluster: Cluster, tmp_path: Path) -> None:
    assert len(_live(cluster.decode)) == 1
    p = next(iter(cluster.prefill.values()))
    config = Path(p.argv[p.argv.index("--config") + 1])
    redis_url = Path(p.argv[p.argv.index("--redis-url-file") + 1]).read_text().strip()
    store_address = p.argv[p.argv.index("--store") + 1]
    fresh = engine_service("decode", config, redis_url, tmp_path, store_address=store_address)
    start_all(fresh)
    cluster.decode[_instance_id(fresh)] = fresh
    wait_until(lambda: live_counts(cluster.http)["decode"] == 2, 5 * POLL_S + 1.0,
               "the new decode instance to join")
    used = {http("POST", cluster.http + "/v1/chat/completions",
                 _body()).headers["X-KV-Decode-Instance"] for _ in range(4)}
    assert _instance_id(fresh) in used


def test_dead_decode_is_retried_before_the_first_token(cluster: Cluster) -> None:
    live = _live(cluster.decode)
    assert len(live) == 2
    victim = live[0]
    time.sleep(2 * POLL_S)          # let heartbeats reset the router's pending-work estimates
    cluster.decode[victim].kill()
    retried_before = metric_sum(cluster.http, "kvserve_router_retries_total", role="decode")
    for _ in range(8):
        r = http("POST", cluster.http + "/v1/chat/completions", _body())
        assert r.status == 200, r.body
        assert r.headers["X-KV-Decode-Instance"] != victim
        if metric_sum(cluster.http, "kvserve_router_retries_total",
                      role="decode") > retried_before:
            break
    else:
        pytest.fail("no request was placed on the killed decode instance")
    # Quarantined at its first failure, without waiting for the registry.
    assert live_counts(cluster.http)["decode"] == len(live) - 1


def test_killed_instance_leaves_the_view_within_the_expiry(cluster: Cluster) -> None:
    live = _live(cluster.decode)
    assert len(live) == 1
    victim = cluster.decode[live[0]]
    victim.kill()
    killed_at = time.monotonic()
    # No request touches it: only the missing heartbeats can take it out.
    wait_until(lambda: live_counts(cluster.http)["decode"] == 0, EXPIRY_S + 2 * POLL_S + 1.0,
               "the killed decode instance to leave the view")
    assert time.monotonic() - killed_at <= EXPIRY_S + 2 * POLL_S + 1.0
    # With no decode instance left the router answers 503 at once, in the OpenAI shape.
    r = http("POST", cluster.http + "/v1/chat/completions", _body())
    assert r.status == 503, r.body
    err = r.json()["error"]
    assert err["type"] == "service_unavailable" and "decode" in err["message"]
    assert http("GET", cluster.http + "/health").status == 503
