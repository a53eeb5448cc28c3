"""The ways a request can go wrong: bad input,
a stale or released handle (rebuilt, never an error), a client that goes
away, a decode process killed mid-stream or asked to drain."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import grpc
import pytest

from proto import decode_pb2, prefill_pb2
from tests.decode_svc.stack import (
    TIMEOUT,
    Stack,
    decode,
    generate,
    keys_of,
    prefill,
    prompt,
    reference,
    sampling,
    wait_stored,
)
from tests.prefill_svc import procs

B = 16


def _code(fn: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        fn()  # type: ignore[operator]
    return info.value.code(), info.value.details()


def test_bad_input_is_rejected_with_a_message_and_services_keep_serving(stack: Stack) -> None:
    pre, dec = stack.prefill_stub(), stack.decode_stub()
    code, msg = _code(lambda: prefill(pre, []))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "empty" in msg
    code, msg = _code(lambda: pre.Prefill(prefill_pb2.PrefillRequest(
        ctx={"model_fingerprint": "00" * 16}, token_ids=[1, 2, 3]), timeout=TIMEOUT))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "fingerprint" in msg
    code, msg = _code(lambda: prefill(pre, prompt(1, 1500)))      # tiny-dense context: 1024
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "at most 1023" in msg
    code, msg = _code(lambda: prefill(pre, [1, 2, 999_999]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "vocabulary" in msg
    code, msg = _code(lambda: pre.Prefill(prefill_pb2.PrefillRequest(
        ctx={"traffic_class": "bulk"}, token_ids=[1, 2, 3]), timeout=TIMEOUT))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "traffic class" in msg
    code, msg = _code(lambda: pre.Prefill(prefill_pb2.PrefillRequest(
        token_ids=[1, 2], prompt="both"), timeout=TIMEOUT))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "exactly one" in msg
    code, msg = _code(lambda: list(pre.PullKV(prefill_pb2.PullKVRequest(request_id="nope"),
                                              timeout=TIMEOUT)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "nope" in msg

    h = prefill(pre, prompt(2, 20))
    code, msg = _code(lambda: decode(dec, h, max_tokens=0))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in msg
    alien = prefill_pb2.KVHandle()
    alien.CopyFrom(h)
    alien.ctx.model_fingerprint = "ab" * 16
    code, msg = _code(lambda: decode(dec, alien))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "fingerprint" in msg
    empty = prefill_pb2.KVHandle()
    empty.CopyFrom(h)
    del empty.prompt_ids[:]
    code, msg = _code(lambda: decode(dec, empty))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "empty" in msg

    # Both services still serve, and the original handle is still good.
    assert decode(dec, h, max_tokens=6).tokens == reference(stack.ref, prompt(2, 20), 6)
    assert procs.healthy(stack.prefill.address) and procs.healthy(stack.decode.address)


def test_decode_rebuilds_from_the_warehouse_when_the_buffer_is_gone(stack: Stack) -> None:
    p = prompt(3, 75)
    want = reference(stack.ref, p, 9)
    generate(stack, p, max_tokens=9)
    wait_stored(stack.store.address, keys_of(stack.ref, p), len(p) // B, len(p))
    h = prefill(stack.prefill_stub(), p, max_tokens=9)
    released = stack.prefill_stub().Release(prefill_pb2.ReleaseRequest(
        request_id=h.ctx.request_id), timeout=TIMEOUT)
    assert released.released
    before = stack.decode.metrics().get("kvserve_decode_decode_kv_sources_total{kind=warehouse}",
                                        0.0)
    assert decode(stack.decode_stub(), h, max_tokens=9).tokens == want
    after = stack.decode.metrics()["kvserve_decode_decode_kv_sources_total{kind=warehouse}"]
    assert after == before + 1


def test_client_going_away_frees_the_sequence_at_once(stack: Stack) -> None:
    h = prefill(stack.prefill_stub(), prompt(4, 20))
    cancelled = stack.decode.metrics().get("kvserve_decode_batch_cancelled_total", 0.0)
    call = stack.decode_stub().Decode(decode_pb2.DecodeRequest(
        handle=h, sampling=sampling(900, ignore_eos=True)), timeout=TIMEOUT)
    for _, _ in zip(range(3), call, strict=False):
        pass
    call.cancel()
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        m = stack.decode.metrics()
        if m["kvserve_decode_batch_active"] == 0 and \
                m["kvserve_decode_batch_cancelled_total"] == cancelled + 1:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"sequence not freed after the client left: {m}")
    assert m["kvserve_decode_batch_tokens_total"] < 900 + 100


@pytest.fixture()
def spare_decode(stack: Stack) -> Iterator[procs.Proc]:
    """A decode process of its own (the test kills or drains it)."""
    p = procs.engine_service("decode", stack.config, stack.redis_url, stack.log_dir,
                             store_address=stack.store.address)
    procs.start_all(p)
    try:
        yield p
    finally:
        p.kill()


def test_decode_killed_mid_stream_fails_fast_and_prefill_is_unaffected(
        stack: Stack, spare_decode: procs.Proc) -> None:
    h = prefill(stack.prefill_stub(), prompt(5, 30))
    call = stack.decode_stub(spare_decode.address).Decode(decode_pb2.DecodeRequest(
        handle=h, sampling=sampling(900, ignore_eos=True)), timeout=TIMEOUT)
    got = 0
    t_kill = 0.0
    with pytest.raises(grpc.RpcError) as info:
        for _ in call:
            got += 1
            if got == 3:
                spare_decode.popen.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
                t_kill = time.monotonic()
    assert time.monotonic() - t_kill < 5.0, "the client hung after the decode process died"
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert got >= 3
    # The prefill side never noticed: it answers, and its handles decode elsewhere.
    _, out = generate(stack, prompt(5, 30), max_tokens=5)
    assert out.tokens == reference(stack.ref, prompt(5, 30), 5)
    assert procs.healthy(stack.prefill.address)


def test_sigterm_drains_in_flight_streams_and_leaves_the_registry(
        stack: Stack, spare_decode: procs.Proc) -> None:
    from tests.decode_svc.stack import instances

    assert spare_decode.address in [i.address for i in instances(stack.redis_url)]
    p = prompt(6, 25)
    h = prefill(stack.prefill_stub(), p, max_tokens=120, ignore_eos=True)
    call = stack.decode_stub(spare_decode.address).Decode(decode_pb2.DecodeRequest(
        handle=h, sampling=sampling(120, ignore_eos=True)), timeout=TIMEOUT)
    events = [next(call)]
    spare_decode.popen.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    events += list(call)                          # the stream is finished, not cut
    assert events[-1].finished and events[-1].finish_reason == "length"
    toks = [t for ev in events for t in ev.token_ids]
    assert toks == reference(stack.ref, p, 120, ignore_eos=True)
    assert spare_decode.popen.wait(timeout=20) == 0  # type: ignore[union-attr]
    assert spare_decode.address not in [i.address for i in instances(stack.redis_url)]
    assert not procs.healthy(spare_decode.address)
