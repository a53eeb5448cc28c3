"""Issue 20: KV events in vLLM's own schema, kvserve -> the vLLM ecosystem: the
warehouse's stored/evicted events, republished by ``kvstore.vllm_events``, are
decoded by a ZMQ subscriber that uses vLLM's own classes
(``vllm.distributed.kv_events``), with media CPU/DISK, the tenant's tag in the
extra keys, and replay of missed batches. The other way (plain vLLM servers'
own events placing requests) is test_vllm_attach.py.
"""

from __future__ import annotations

import asyncio
import os

import msgspec
import pytest
import zmq

from kvstore.types import RequestCtx
from kvstore.vllm_events import PublisherConfig, VLLMEventPublisher
from security.vllm_trust import tenant_tag
from tests.connectors.stack import (
    BLOCK,
    deployment_secret,
    store_client,
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
