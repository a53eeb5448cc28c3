"""Issue 10, item 6: client input never ends a gRPC call as INTERNAL or UNKNOWN.

Every method of every service (kvstore, prefill, decode, router; unary and
streaming) gets raw garbage bytes, then messages built from its own descriptor
with each field in turn — and all at once — set to an oversized or odd value
(100 kB strings, NULs, invalid UTF-8 on the wire, integer extremes, NaN/inf,
10,000-element repeats). Unparsable bytes must give INVALID_ARGUMENT; no input
may give INTERNAL or UNKNOWN. Real servers, real sockets.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor as pbd
from google.protobuf.message import Message

from proto import decode_pb2, kvstore_pb2, prefill_pb2, router_pb2
from tests.security.tlsenv import aio_channel, tls_env  # noqa: F401 - a fixture

BAD_CODES = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
GARBAGE = (b"\xff" * 7, b"\x0a\xff\xff\xff\xff\x0f", b"\x08", b"\x12\x05ab",
           bytes(range(256)), b"\x0a\x02\xff\xfe")   # the last: bad UTF-8 in field 1 (a string)
BIG = 100_000
CALL_TIMEOUT_S = 15.0

_INT_EXTREMES = {
    pbd.FieldDescriptor.TYPE_INT32: (-2**31, 2**31 - 1), pbd.FieldDescriptor.TYPE_SINT32:
    (-2**31, 2**31 - 1), pbd.FieldDescriptor.TYPE_SFIXED32: (-2**31, 2**31 - 1),
    pbd.FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1), pbd.FieldDescriptor.TYPE_FIXED32:
    (0, 2**32 - 1), pbd.FieldDescriptor.TYPE_INT64: (-2**63, 2**63 - 1),
    pbd.FieldDescriptor.TYPE_SINT64: (-2**63, 2**63 - 1), pbd.FieldDescriptor.TYPE_SFIXED64:
    (-2**63, 2**63 - 1), pbd.FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    pbd.FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def odd_values(f: pbd.FieldDescriptor) -> list[Any]:
    """Oversized and odd values of one scalar field's type."""
    t = f.type
    if t == pbd.FieldDescriptor.TYPE_STRING:
        return ["x" * BIG, "9" * 5000, "\x00", "../" * 50, "\u202e\U0001f600", " "]
    if t == pbd.FieldDescriptor.TYPE_BYTES:
        return [b"\x00" * BIG, b"\xff", os.urandom(17)]
    if t in _INT_EXTREMES:
        return list(_INT_EXTREMES[t])
    if t in (pbd.FieldDescriptor.TYPE_FLOAT, pbd.FieldDescriptor.TYPE_DOUBLE):
        return [math.nan, math.inf, -math.inf, -1.0, 1e300 if t == 1 else 3e38]
    if t == pbd.FieldDescriptor.TYPE_BOOL:
        return [True]
    if t == pbd.FieldDescriptor.TYPE_ENUM:
        return [2**31 - 1, -1]
    return []


def _repeated(f: pbd.FieldDescriptor) -> bool:
    rep = getattr(f, "is_repeated", None)     # protobuf >= 5.29; ``label`` is gone in 6
    return bool(rep) if rep is not None else f.label == pbd.FieldDescriptor.LABEL_REPEATED


def _set(msg: Message, f: pbd.FieldDescriptor, value: Any) -> None:
    if _repeated(f):
        field = getattr(msg, f.name)
        n = 10_000 if not isinstance(value, str | bytes) or len(value) < 100 else 3
        field.extend([value] * n)
    else:
        setattr(msg, f.name, value)


def variants(cls: type[Message], depth: int = 0) -> Iterator[Message]:
    """One message per (field, odd value), nested messages one level deep, then
    one message with every field odd at once."""
    desc = cls.DESCRIPTOR
    everything = cls()
    for f in desc.fields:
        if f.type == pbd.FieldDescriptor.TYPE_MESSAGE:
            if depth > 0 or f.message_type.GetOptions().map_entry:
                continue
            holder = getattr(cls(), f.name)
            inner_cls = type(holder.add() if _repeated(f) else holder)
            for inner in variants(inner_cls, depth + 1):
                m = cls()
                if _repeated(f):
                    getattr(m, f.name).extend([inner] * 200)
                else:
                    getattr(m, f.name).CopyFrom(inner)
                yield m
            continue
        vals = odd_values(f)
        for v in vals:
            m = cls()
            _set(m, f, v)
            yield m
        if vals and f.containing_oneof is None:
            _set(everything, f, vals[0])
    yield everything


@asynccontextmanager
async def kvstore_server(redis_url: str) -> AsyncIterator[str]:
    from kvstore.service import start_server
    from kvstore.warehouse import Warehouse
    from tests.kvstore.storeproc import wh_config

    wh = await Warehouse(wh_config(redis_url)).start()
    srv = await start_server(wh)
    try:
        yield f"127.0.0.1:{srv.port}"
    finally:
        await srv.drain(0)
        await wh.close()


@asynccontextmanager
async def engine_server(role: str, store_address: str) -> AsyncIterator[str]:
    from decode_svc.config import DecodeConfig
    from decode_svc.server import SERVICE_NAME as DECODE
    from decode_svc.server import DecodeService
    from engine import Engine
    from prefill_svc.config import PrefillConfig
    from prefill_svc.server import SERVICE_NAME as PREFILL
    from prefill_svc.server import PrefillService
    from proto import decode_pb2_grpc, prefill_pb2_grpc
    from service.config import Endpoint, EngineSpec
    from service.hosting import ServiceSpec, run_service

    spec = EngineSpec(model="tiny-dense", block_tokens=16, num_blocks=128)
    endpoint = Endpoint(port=0, store_address=store_address, call_timeout_s=3.0)
    engine = Engine(spec.engine_config())
    if role == "prefill":
        pcfg = PrefillConfig(engine=spec, endpoint=endpoint, warmup_tokens=0)
        sspec = ServiceSpec("prefill", PREFILL,
                            lambda a: PrefillService(pcfg, engine, address=a),
                            prefill_pb2_grpc.add_PrefillServicer_to_server,
                            engine.fingerprint_hex, 128)
    else:
        dcfg = DecodeConfig(engine=spec, endpoint=endpoint, warmup_tokens=0,
                            pull_timeout_s=3.0, canonical_wait_s=0)
        sspec = ServiceSpec("decode", DECODE, lambda a: DecodeService(dcfg, engine, address=a),
                            decode_pb2_grpc.add_DecodeServicer_to_server,
                            engine.fingerprint_hex, 128)
    stop = asyncio.Event()
    ready: list[str] = []
    task = asyncio.create_task(run_service(endpoint, sspec, stop=stop,
                                           on_ready=lambda r: ready.append(r.address)))
    try:
        while not ready:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        yield ready[0]
    finally:
        stop.set()
        await task


@asynccontextmanager
async def router_server(redis_url: str) -> AsyncIterator[str]:
    from router.serve import RouterConfig, start_router

    r = await start_router(RouterConfig(model="tiny-dense", grpc_port=0, http_port=0,
                                        redis_url=redis_url))
    try:
        yield f"127.0.0.1:{r.grpc_port}"
    finally:
        await r.stop(0)


def channel(address: str, peer_role: str) -> grpc.aio.Channel:
    return aio_channel(address, peer_role, [("grpc.max_send_message_length", 256 * 2**20),
                                            ("grpc.max_receive_message_length", 256 * 2**20)])


async def call_raw(ch: grpc.aio.Channel, path: str, method: pbd.MethodDescriptor,
                   payload: bytes) -> grpc.StatusCode:
    """Send ``payload`` as the request (the only message of a request stream)."""
    ident: Callable[[bytes], bytes] = lambda b: b  # noqa: E731 - raw bytes both ways
    if method.client_streaming and method.server_streaming:
        call = ch.stream_stream(path, request_serializer=ident, response_deserializer=ident)
    elif method.client_streaming:
        call = ch.stream_unary(path, request_serializer=ident, response_deserializer=ident)
    elif method.server_streaming:
        call = ch.unary_stream(path, request_serializer=ident, response_deserializer=ident)
    else:
        call = ch.unary_unary(path, request_serializer=ident, response_deserializer=ident)
    req: Any = iter([payload]) if method.client_streaming else payload
    try:
        res = call(req, timeout=CALL_TIMEOUT_S)
        if method.server_streaming:
            async for _ in res:
                pass
        else:
            await res
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


SERVICES = {  # service -> (proto module, peer role for the certificate name)
    "KVStore": (kvstore_pb2, "kvstore"),
    "Prefill": (prefill_pb2, "prefill"),
    "Decode": (decode_pb2, "decode"),
    "Router": (router_pb2, "router"),
}


async def fuzz_service(address: str, service: str) -> dict[str, list[str]]:
    """Failures: method -> what gave INTERNAL/UNKNOWN (or garbage not INVALID_ARGUMENT)."""
    module, role = SERVICES[service]
    sd = module.DESCRIPTOR.services_by_name[service]
    failures: dict[str, list[str]] = {}
    async with channel(address, role) as ch:
        for method in sd.methods:
            path = f"/{sd.full_name}/{method.name}"
            bad = failures.setdefault(method.name, [])
            cls = getattr(module, method.input_type.name, None)
            if cls is None:   # a type from another file (common.proto)
                from proto import common_pb2

                cls = getattr(common_pb2, method.input_type.name)
            for raw in GARBAGE:
                try:
                    cls.FromString(raw)
                    want = None                  # parses (as unknown fields): any client code
                except Exception:
                    want = grpc.StatusCode.INVALID_ARGUMENT
                code = await call_raw(ch, path, method, raw)
                if code in BAD_CODES or (want is not None and code != want):
                    bad.append(f"garbage {raw[:12]!r} -> {code.name}")
            seen = 0
            for msg in variants(cls):
                seen += 1
                code = await call_raw(ch, path, method, msg.SerializeToString())
                if code in BAD_CODES:
                    bad.append(f"{str(msg)[:160]!r} -> {code.name}")
            assert seen >= 1 + len(cls.DESCRIPTOR.fields), f"{path}: too few variants"
            if not bad:
                del failures[method.name]
    return failures


@pytest.mark.usefixtures("tls_env")
def test_every_service_maps_bad_input_to_a_client_status(redis_url: str) -> None:
    async def body() -> dict[str, dict[str, list[str]]]:
        async with AsyncExitStack() as stack:
            store = await stack.enter_async_context(kvstore_server(redis_url))
            prefill = await stack.enter_async_context(engine_server("prefill", store))
            decode = await stack.enter_async_context(engine_server("decode", store))
            router = await stack.enter_async_context(router_server(redis_url))
            addresses = {"KVStore": store, "Prefill": prefill, "Decode": decode,
                         "Router": router}
            return {s: await fuzz_service(a, s) for s, a in addresses.items()}

    failures = asyncio.run(asyncio.wait_for(body(), 300))
    failures = {s: f for s, f in failures.items() if f}
    assert not failures, "\n".join(f"{s}.{m}: {x}" for s, ms in failures.items()
                                   for m, xs in ms.items() for x in xs[:5])


@pytest.mark.usefixtures("tls_env")
def test_an_over_long_layout_is_invalid_argument(redis_url: str) -> None:
    """The case the issue found (INTERNAL before): a kvstore Put with a 100 kB layout."""
    async def body() -> None:
        async with kvstore_server(redis_url) as address, channel(address, "kvstore") as ch:
            hdr = kvstore_pb2.PutHeader(layout="L" + "9" * BIG + "xH1xT4xD8:float32",
                                        blocks=[kvstore_pb2.BlockHeader(key=b"k" * 16, size=8,
                                                                        token_count=1)])
            put = ch.stream_unary("/kvserve.v1.KVStore/Put",
                                  request_serializer=kvstore_pb2.PutChunk.SerializeToString,
                                  response_deserializer=kvstore_pb2.PutResponse.FromString)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await put(iter([kvstore_pb2.PutChunk(header=hdr)]), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "layout" in (err.value.details() or "")
    asyncio.run(body())


@pytest.mark.usefixtures("tls_env")
def test_the_plain_health_port_answers_garbage_with_invalid_argument(redis_url: str) -> None:
    from grpc_health.v1 import health_pb2

    from kvstore.service import start_server
    from kvstore.warehouse import Warehouse
    from tests.kvstore.storeproc import wh_config

    async def body() -> None:
        wh = await Warehouse(wh_config(redis_url)).start()
        srv = await start_server(wh, health_port=0)
        try:
            method = health_pb2.DESCRIPTOR.services_by_name["Health"].methods_by_name["Check"]
            async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.health_port}") as ch:
                for raw in GARBAGE[:4]:
                    code = await call_raw(ch, "/grpc.health.v1.Health/Check", method, raw)
                    assert code == grpc.StatusCode.INVALID_ARGUMENT, (raw, code)
                ok = await call_raw(ch, "/grpc.health.v1.Health/Check", method, b"")
                assert ok == grpc.StatusCode.OK
        finally:
            await srv.drain(0)
            await wh.close()
    asyncio.run(body())
