"""Issue 20: KV events in vLLM's own schema, both ways.

* kvserve -> the vLLM ecosystem: the warehouse's stored/evicted events,
  republished by ``kvstore.vllm_events``, are decoded by a ZMQ subscriber that
  uses vLLM's own classes (``vllm.distributed.kv_events``), with media
  CPU/DISK, the tenant's tag in the extra keys, and replay of missed batches.
* the vLLM ecosystem -> kvserve: two plain vLLM servers (no connector)
  registered by ``kvserve vllm-attach``; kvserve's router learns where a prompt's
  prefix is from the servers' own KV events and sends the repeat there.
"""

from __future__ import annotations

import asyncio
import json
import os

import aiohttp
import msgspec
import pytest
import zmq

from kvstore.types import RequestCtx
from kvstore.vllm_events import PublisherConfig, VLLMEventPublisher
from router.serve import RouterConfig, start_router
from security.config import SecurityConfig
from security.vllm_trust import tenant_tag
from tests.connectors.conftest import two_servers_fit
from tests.connectors.stack import (
    BLOCK,
    deployment_secret,
    router_keys,
    security,
    store_client,
    until_router_places,
)

pytestmark = pytest.mark.timeout(1500)


def test_a_subscriber_with_vllms_own_classes_decodes_the_warehouses_events(vllm_stack,
                                                                            tmp_path):
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    decoder = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
    tenant = f"pub-{vllm_stack.run}"
    keys = [os.urandom(16) for _ in range(3)]
    ctx = RequestCtx(request_id="pub", tenant=tenant, model_fingerprint="cd" * 16)
    blocks = [bytes([i]) * 4096 for i in range(3)]
    endpoint = f"ipc://{tmp_path}/pub.ev"
    replay_endpoint = f"ipc://{tmp_path}/pub.replay"

    async def body() -> list[object]:
        pub = VLLMEventPublisher(PublisherConfig(redis_url=vllm_stack.redis_url,
                                                 endpoint=endpoint,
                                                 replay_endpoint=replay_endpoint,
                                                 block_ms=100), deployment_secret()).bind()
        ctxz = zmq.asyncio.Context()
        sub = ctxz.socket(zmq.SUB)
        sub.connect(endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        stop = asyncio.Event()
        task = asyncio.get_running_loop().create_task(pub.run(stop))
        seen: list[object] = []
        try:
            await asyncio.sleep(0.5)                  # the SUB joined; the reader pinned
            async with store_client(vllm_stack.store.address) as c:
                await c.put(keys, blocks, layout="L1xH1xT64xD8:float32", token_count=BLOCK,
                            ctx=ctx)
                await asyncio.sleep(0.3)
                assert await c.delete(keys[:1], ctx=ctx) == 1
            while not any(isinstance(e, kv_events.BlockRemoved) for e in seen):
                topic, seq, payload = await asyncio.wait_for(sub.recv_multipart(), 30)
                assert topic == b"kvserve" and len(seq) == 8
                seen.extend(decoder.decode(payload).events)
            # A subscriber that missed batches asks the replay socket for everything
            # from a sequence number on, as vLLM's consumers do.
            dealer = ctxz.socket(zmq.DEALER)
            dealer.connect(replay_endpoint)
            await dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            replayed = 0
            while True:
                _, topic, seq, payload = await asyncio.wait_for(dealer.recv_multipart(), 10)
                if int.from_bytes(seq, "big", signed=True) == -1:
                    break
                assert int.from_bytes(seq, "big") == replayed and topic == b"kvserve"
                decoder.decode(payload)
                replayed += 1
            dealer.close(linger=0)
            assert 2 <= replayed <= pub.published
        finally:
            stop.set()
            await task
            sub.close(linger=0)
            ctxz.term()
            pub.close()
        return seen

    seen = asyncio.run(body())
    stored = [e for e in seen if isinstance(e, kv_events.BlockStored)]
    cpu = [e for e in stored if e.medium == "CPU"]
    assert cpu and set(keys) <= {h for e in cpu for h in e.block_hashes}
    tag = tenant_tag(tenant, deployment_secret())
    assert all(x == (tag,) for e in cpu for h, x in zip(e.block_hashes, e.extra_keys,
                                                        strict=True) if h in keys)
    assert all(e.token_ids == [] and e.block_size == BLOCK for e in stored)
    removed = [e for e in seen if isinstance(e, kv_events.BlockRemoved)]
    assert keys[0] in {h for e in removed for h in e.block_hashes}


def _messages(run: str, i: int) -> list[dict[str, str]]:
    words = " ".join(f"native{i}-{k}" for k in range(150))
    return [{"role": "user", "content": f"Plain fleet {run}, note {i}: {words}"}]


def test_router_places_a_repeat_on_a_plain_vllm_from_its_own_events(vllm_stack, vllm_servers,
                                                                    tmp_path):
    if not two_servers_fit():
        pytest.skip("less than 5 GiB of memory available: two vLLM servers do not fit")
    from connectors.vllm_identity import vllm_fingerprint
    from kvserve.launch_vllm import VLLMProcess
    from kvserve.launch_vllm_attach import AttachConfig, run_attach

    vllm_servers.stop_all()
    tls, insecure = security()
    names = ["plain-0", "plain-1"]
    specs = [vllm_stack.spec(n, connector=False, kv_events=f"ipc://{tmp_path}/{n}.ev")
             for n in names]
    procs = [VLLMProcess(s, vllm_stack.root / f"{s.instance_id}.log").start() for s in specs]
    fp = vllm_fingerprint(vllm_stack.model_dir).hex()
    sec = SecurityConfig(insecure=True) if insecure else SecurityConfig(cert_dir=tls,
                                                                        role="router")

    async def body() -> None:
        stop = asyncio.Event()
        attach = [asyncio.get_running_loop().create_task(run_attach(
            AttachConfig(url=s.base_url, instance_id=s.instance_id,
                         redis_url=vllm_stack.redis_url, model_fingerprint=fp,
                         kv_events=s.kv_events), s.security(), stop)) for s in specs]
        r = await start_router(RouterConfig(model="smollm2", grpc_port=0, http_port=0,
                                            redis_url=vllm_stack.redis_url, backend="vllm",
                                            security=sec))
        base = f"http://127.0.0.1:{r.http_port}"
        try:
            async with aiohttp.ClientSession() as http:
                for _ in range(600):
                    async with http.get(base + "/health") as resp:
                        if (await resp.json())["instances"].get("prefill") == 2:
                            break
                    await asyncio.sleep(0.2)
                first = []
                for i in range(4):
                    first.append(await _ask(http, base, _messages(vllm_stack.run, i)))
                assert {w for w, _ in first} == set(names), first   # cold ones spread
                for i, (w, out) in enumerate(first):
                    keys = router_keys(r, _messages(vllm_stack.run, i))
                    # Nothing but the server's own events can tell the router this:
                    # no connector, no warehouse.
                    await until_router_places(r, keys, w, 30.0)
                    assert r.view.prefixes.match(keys)[w].by_tier[0] >= len(keys) - 1
                    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
                for i, (w, out) in enumerate(first):
                    again, out2 = await _ask(http, base, _messages(vllm_stack.run, i))
                    assert again == w, f"repeat {i} went to {again}, prefix is on {w}"
                    assert out2["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
                    assert out2["choices"][0]["message"] == out["choices"][0]["message"]
        finally:
            await r.stop(1.0)
            stop.set()
            await asyncio.gather(*attach)

    try:
        for p in procs:
            p.wait_ready()
        asyncio.run(body())
    finally:
        for p in procs:
            p.stop()


async def _ask(http: aiohttp.ClientSession, base: str,
               messages: list[dict[str, str]]) -> tuple[str, dict]:  # type: ignore[type-arg]
    body = {"model": "smollm2", "temperature": 0, "max_tokens": 8, "messages": messages}
    async with http.post(base + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers["X-KV-Prefill-Instance"], json.loads(await resp.text())
