"""MoE decode: per-expert counts and expert imbalance, reported in every
DecodeEvent and in the registry (in-process services, real gRPC sockets,
real Redis)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from decode_svc.config import DecodeConfig
from decode_svc.experts import ExpertPlacement, imbalance
from decode_svc.server import SERVICE_NAME as DECODE
from decode_svc.server import DecodeService
from engine import Engine
from kvstore.registry import InstanceRegistry
from prefill_svc.config import PrefillConfig
from prefill_svc.server import SERVICE_NAME as PREFILL
from prefill_svc.server import PrefillService
from proto import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from service.config import Endpoint, EngineSpec
from service.hosting import ServiceSpec, run_service
from tests.tls import aio_channel


def test_imbalance_is_max_over_mean_rank_load_under_the_placement() -> None:
    # One MoE layer, 8 experts on 4 ranks (2 each, contiguous): rank loads 8, 0, 8, 0.
    counts = np.array([[8, 0, 0, 0, 4, 4, 0, 0], [0] * 8], dtype=np.float64)
    contiguous = ExpertPlacement.contiguous(2, 8, 4)
    assert imbalance(counts, contiguous) == pytest.approx(8 / 4)     # the idle layer is skipped
    # The router's EPLB planner with one redundant slot per rank replicates the hot
    # experts and spreads the load: 16 tokens over 4 ranks, exactly 4 each.
    planned = ExpertPlacement.planned(counts, 4, 4)
    assert planned.source == "auto"
    assert imbalance(counts, planned) == pytest.approx(1.0)


def test_moe_decode_reports_expert_counts_and_imbalance(redis_url: str) -> None:
    asyncio.run(_moe(redis_url))


async def _moe(redis_url: str) -> None:
    spec = EngineSpec(model="tiny-moe", block_tokens=16, num_blocks=256)
    ep = Endpoint(port=0, redis_url=redis_url, heartbeat_s=0.1, instance_ttl_s=2.0)
    stop = asyncio.Event()
    made: dict[str, object] = {}
    ready: dict[str, str] = {}

    def serve(role: str, cls: type, cfg: object, name: str, add: object) -> asyncio.Task[None]:
        engine = Engine(spec.engine_config())

        def make(address: str) -> object:
            made[role] = cls(cfg, engine, address=address)
            return made[role]

        return asyncio.create_task(run_service(
            ep, ServiceSpec(role, name, make, add, engine.fingerprint_hex, 256),  # type: ignore[arg-type]
            stop=stop, on_ready=lambda r: ready.__setitem__(role, r.address)))

    tasks = [serve("prefill", PrefillService, PrefillConfig(engine=spec, endpoint=ep), PREFILL,
                   prefill_pb2_grpc.add_PrefillServicer_to_server),
             serve("decode", DecodeService, DecodeConfig(engine=spec, endpoint=ep, ep_ranks=4),
                   DECODE, decode_pb2_grpc.add_DecodeServicer_to_server)]
    try:
        while len(ready) < 2:
            await asyncio.sleep(0.02)
        async with asyncio.timeout(60):
            await _check(ready, made["decode"], redis_url)  # type: ignore[arg-type]
    finally:
        stop.set()
        await asyncio.gather(*tasks)


async def _check(ready: dict[str, str], dec: DecodeService, redis_url: str) -> None:
    async with aio_channel(ready["prefill"]) as pch, \
            aio_channel(ready["decode"]) as dch:
        sampling = {"max_tokens": 20, "ignore_eos": True}
        h = await prefill_pb2_grpc.PrefillStub(pch).Prefill(
            prefill_pb2.PrefillRequest(token_ids=list(range(1, 40)), sampling=sampling),
            timeout=30)
        events = [ev async for ev in decode_pb2_grpc.DecodeStub(dch).Decode(
            decode_pb2.DecodeRequest(handle=h, sampling=sampling), timeout=30)]
    assert len(events) == 20 and events[-1].finished
    assert all(ev.expert_imbalance >= 1.0 for ev in events)
    experts = dec.experts
    assert experts is not None
    # 19 decode steps (the first token came from prefill), top-2 routing, every layer.
    assert experts.total.sum(axis=1).tolist() == [2 * 19] * 4
    want = imbalance(experts.total, ExpertPlacement.contiguous(4, 8, 4))
    assert events[-1].expert_imbalance == pytest.approx(want)
    assert want > 1.0                            # random routing is never perfectly even
    async with InstanceRegistry(redis_url) as reg:
        for _ in range(50):
            (info,) = await reg.list_instances("decode")
            if info.expert_imbalance == pytest.approx(want):
                break
            await asyncio.sleep(0.05)
    assert info.expert_imbalance == pytest.approx(want)
    assert info.model_fingerprint == dec.engine.fingerprint_hex
