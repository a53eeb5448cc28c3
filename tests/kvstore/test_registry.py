"""Instance registry: heartbeats keep instances listed, silence expires them."""

from __future__ import annotations

import asyncio

import pytest

from kvstore.registry import InstanceInfo, InstanceRegistry, LoadReport


def test_register_heartbeat_and_expiry(redis_url: str) -> None:
    async def body() -> None:
        reg = InstanceRegistry(redis_url, ttl_s=0.6)
        await reg.register(InstanceInfo("prefill-0", "prefill", "127.0.0.1:1", node="n1",
                                        model_fingerprint="ab" * 16, capacity=100))
        await reg.register(InstanceInfo("decode-0", "decode", "127.0.0.1:2", node="n1"))
        listed = await reg.list_instances()
        assert [i.instance_id for i in listed] == ["decode-0", "prefill-0"]
        assert [i.instance_id for i in await reg.list_instances("prefill")] == ["prefill-0"]
        for _ in range(3):                       # prefill keeps beating, decode goes silent
            await asyncio.sleep(0.3)
            assert await reg.heartbeat("prefill-0", LoadReport(load=0.5, queue=3,
                                                               expert_imbalance=1.07))
        listed = await reg.list_instances()
        assert [i.instance_id for i in listed] == ["prefill-0"]
        p = listed[0]
        assert (p.load, p.queue, p.expert_imbalance, p.capacity) == (0.5, 3, 1.07, 100.0)
        assert p.model_fingerprint == "ab" * 16 and p.last_heartbeat > 0
        assert not await reg.heartbeat("decode-0")   # expired: must register again
        await reg.deregister("prefill-0")
        assert await reg.list_instances() == []
        await reg.close()
    asyncio.run(body())


def test_bad_instances_are_rejected() -> None:
    with pytest.raises(ValueError, match="role"):
        InstanceInfo("x", "scheduler", "a:1")
    with pytest.raises(ValueError, match="instance_id"):
        InstanceInfo("has space", "decode", "a:1")
