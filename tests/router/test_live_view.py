"""LiveView against a real Redis: registry heartbeats in and out, quarantine,
the fingerprint the block keys need, and KV events (written by the real
BlockIndex) moving the prefix view."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from common.config import TrafficClasses
from kvstore.events import KIND_DELETED, KIND_STORED, KVEvent
from kvstore.index import BlockIndex, IndexRecord
from kvstore.registry import InstanceInfo, InstanceRegistry
from router.errors import InvalidRequestError, NoInstanceError
from router.live_view import LiveView, ViewConfig
from router.metrics import RouterMetrics

FP = "ab" * 16
CFG = ViewConfig(heartbeat_s=0.1, instance_ttl_s=0.5, poll_s=0.05, events_block_ms=50)


def _info(iid: str, role: str, node: str = "n0", fp: str = FP) -> InstanceInfo:
    return InstanceInfo(instance_id=iid, role=role, address=f"127.0.0.1:{hash(iid) % 60000}",
                        node=node, model_fingerprint=fp)


async def _until(cond: object, timeout_s: float) -> float:
    t0 = time.monotonic()
    while not cond():  # type: ignore[operator]
        assert time.monotonic() - t0 < timeout_s, "condition not met in time"
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


def test_registry_membership_expiry_and_quarantine(redis_url: str) -> None:
    async def main() -> None:
        reg = InstanceRegistry(redis_url, ttl_s=CFG.instance_ttl_s)
        view = LiveView(redis_url, CFG, RouterMetrics())
        for i in (_info("p1", "prefill"), _info("d1", "decode"), _info("d2", "decode"),
                  _info("s1", "kvstore")):
            await reg.register(i)
        await view.start()
        try:
            assert view.live_counts() == {"prefill": 1, "decode": 2}
            assert view.fingerprint() == FP
            # d2 keeps beating, d1 stops: d1 leaves within the expiry (+ a poll).
            stop = asyncio.Event()

            async def beat() -> None:
                while not stop.is_set():
                    for iid in ("p1", "d2", "s1"):
                        await reg.heartbeat(iid)
                    await asyncio.sleep(CFG.heartbeat_s)

            beater = asyncio.create_task(beat())
            took = await _until(lambda: view.live_counts()["decode"] == 1, 3.0)
            assert took <= CFG.instance_ttl_s + 3 * CFG.poll_s + 0.3
            assert view.choose_decode(10, exclude=set()).instance.instance_id == "d2"
            # A failure seen by the router quarantines at once, and not forever.
            view.mark_failed("d2")
            with pytest.raises(NoInstanceError, match="decode"):
                view.choose_decode(10, exclude=set())
            await _until(lambda: view.live_counts()["decode"] == 1, 3.0)
            with pytest.raises(NoInstanceError, match=r"abandoned after failures: \['p1'\]"):
                view.choose_prefill([], 10, exclude={"p1"})
        finally:
            stop.set()
            beater.cancel()
            await view.stop()
            await reg.close()

    asyncio.run(main())


def test_decode_goes_where_the_sequence_fits_in_unreserved_kv(redis_url: str) -> None:
    """Decode instances report their unreserved KV (kv_free_tokens); the one
    without room for prompt + max_tokens is passed over while another has it,
    even when it is the less loaded; when none has room, load decides. A
    sequence no decode pool could ever hold is refused before any work."""
    from kvstore.registry import LoadReport

    async def main() -> None:
        reg = InstanceRegistry(redis_url, ttl_s=5)
        view = LiveView(redis_url, CFG, RouterMetrics())
        for i in (_info("p1", "prefill"), _info("d1", "decode"), _info("d2", "decode")):
            await reg.register(i)
        await reg.heartbeat("d1", LoadReport(tokens_in_flight=10, kv_free_tokens=256,
                                             kv_capacity_tokens=512))
        await reg.heartbeat("d2", LoadReport(tokens_in_flight=900, kv_free_tokens=4096,
                                             kv_capacity_tokens=4096))
        await view.start()
        try:
            pick = view.choose_decode
            assert pick(100, exclude=set()).instance.instance_id == "d1"       # no size given
            assert pick(100, exclude=set(), kv_tokens=200).instance.instance_id == "d1"
            assert pick(100, exclude=set(), kv_tokens=300).instance.instance_id == "d2"
            assert pick(100, exclude={"d2"}, kv_tokens=300).instance.instance_id == "d1"
            assert pick(100, exclude=set(), kv_tokens=9000).instance.instance_id == "d1"
            view.check_decode_room(4097)            # KV for 4096 tokens: fits d2's pool
            with pytest.raises(InvalidRequestError, match="largest decode KV pool holds 4096"):
                view.check_decode_room(4098)
            await reg.register(_info("d3", "decode"))      # reports no pool size: may fit
            await view.refresh()
            view.check_decode_room(10**6)
        finally:
            await view.stop()
            await reg.close()

    asyncio.run(main())


def test_mixed_fingerprints_are_refused(redis_url: str) -> None:
    async def main() -> None:
        reg = InstanceRegistry(redis_url, ttl_s=5)
        view = LiveView(redis_url, CFG, RouterMetrics())
        await view.start()
        try:
            with pytest.raises(NoInstanceError, match="no live prefill"):
                view.fingerprint()
            await reg.register(_info("p1", "prefill"))
            await reg.register(_info("p2", "prefill", fp="cd" * 16))
            await view.refresh()
            with pytest.raises(NoInstanceError, match="disagree"):
                view.fingerprint()
        finally:
            await view.stop()
            await reg.close()

    asyncio.run(main())


def test_kv_events_from_the_index_move_affinity(redis_url: str,
                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="router.live_view")   # decisions carry scores
    keys = [bytes([i]) * 16 for i in range(6)]

    async def main() -> None:
        # A view expiry long enough that nobody needs to heartbeat here.
        cfg = ViewConfig(heartbeat_s=1.0, instance_ttl_s=30.0, poll_s=0.05, events_block_ms=50)
        reg = InstanceRegistry(redis_url, ttl_s=30)
        for i in (_info("pa", "prefill", node="node-a"), _info("pb", "prefill", node="node-b"),
                  _info("sa", "kvstore", node="node-a"), _info("d", "decode")):
            await reg.register(i)
        index = await BlockIndex(redis_url, node="node-a", classes=TrafficClasses()).start()
        # Stored before the router starts: it must replay the stream's history.
        await index.add([IndexRecord(key=k, size=100, traffic_class="chat") for k in keys],
                        tier="G2")
        view = LiveView(redis_url, cfg, RouterMetrics())
        await view.start()
        try:
            tokens = 6 * 64 + 10
            await _until(lambda: view.choose_prefill(keys, tokens, exclude=set()).reason
                         == "prefix_affinity", 3.0)
            choice = view.choose_prefill(keys, tokens, exclude=set())
            assert choice.instance.instance_id == "pa"
            assert "restorable 384 tokens" in choice.detail
            assert "scores: pa=" in choice.detail and ", pb=" in choice.detail
            # Deleted outright (tier-less event): the affinity is gone.
            await index.delete(keys[:1])
            await _until(lambda: view.choose_prefill(keys, tokens, exclude=set()).reason
                         != "prefix_affinity", 3.0)
        finally:
            await view.stop()
            await index.close()
            await reg.close()

    asyncio.run(main())


def test_tierless_delete_event_clears_every_location() -> None:
    view = LiveView("redis://127.0.0.1:1/0", CFG, RouterMetrics())
    keys = (b"k" * 16, b"j" * 16)
    view._apply(KVEvent("1-0", KIND_STORED, "node-a", "G2", "s", keys))
    view._apply(KVEvent("2-0", KIND_STORED, "node-b", "G3", "s", keys))
    assert set(view.prefixes.match(keys)) == {"node-a", "node-b"}
    view._apply(KVEvent("3-0", KIND_DELETED, "node-a", "", "s", keys[:1]))
    assert view.prefixes.match(keys) == {}
    view._apply(KVEvent("4-0", KIND_STORED, "node-a", "G9", "s", keys))   # skipped, logged
    assert view.prefixes.match(keys) == {}


def test_a_returning_prompt_goes_to_the_decode_instance_holding_its_prefix(
        redis_url: str) -> None:
    """Decode keeps a finished turn's blocks and pulls only what follows them:
    with a cache-aware policy the next turn (a longer prompt with the same
    prefix) goes back to that decode instance while its load is within the
    slack, whatever the load order says; round robin ignores it."""
    from dataclasses import replace

    from kvstore.registry import LoadReport

    async def main(policy: str) -> list[str]:
        reg = InstanceRegistry(redis_url, ttl_s=5)
        view = LiveView(redis_url, replace(CFG, policy=policy), RouterMetrics())
        for i in (_info("p1", "prefill"), _info("d1", "decode"), _info("d2", "decode"),
                  _info("d3", "decode")):
            await reg.register(i)
        await view.start()
        picks = []
        try:
            turn1 = [bytes([i]) * 16 for i in range(4)]
            turn2 = [*turn1, bytes([9]) * 16, bytes([10]) * 16]
            other = [bytes([20 + i]) * 16 for i in range(6)]
            for keys in (turn1, other, turn2):
                pick = view.choose_decode(100, exclude=set(), keys=keys)
                picks.append(pick.instance.instance_id)
                await reg.heartbeat(picks[-1], LoadReport(tokens_in_flight=0))
            # Overloaded beyond the slack: load wins over the held prefix.
            await reg.heartbeat(picks[0], LoadReport(
                tokens_in_flight=CFG.sessions.slack_tokens + 500))
            await view.refresh()
            picks.append(view.choose_decode(100, exclude=set(),
                                            keys=[*turn2, bytes([11]) * 16]).instance.instance_id)
        finally:
            await view.stop()
            await reg.close()
        return picks

    aware = asyncio.run(main("cache_aware"))
    assert aware[0] != aware[1], "an idle cluster fills round-robin"
    assert aware[2] == aware[0], "the next turn returns to the decode holding its prefix"
    assert aware[3] != aware[0], "unless that instance is overloaded"
    rr = asyncio.run(main("round_robin"))
    assert len(set(rr[:3])) == 3, "round robin places by turn, not by prefix"
