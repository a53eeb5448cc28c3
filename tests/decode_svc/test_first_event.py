"""The first token's event goes out before the prompt's KV is pulled: it must
say exactly what the engine says once the sequence is live."""

from __future__ import annotations

import time

import grpc
import torch

from decode_svc.first_event import early_first
from engine import SamplingParams
from proto import prefill_pb2
from tests.decode_svc.stack import TIMEOUT, Stack, decode, prefill, prompt, reference


def test_early_first_agrees_with_the_engine_for_every_token(stack: Stack) -> None:
    """For each first token and sampling, the early event exists exactly when the
    engine would go on after that token, and its text is the engine's."""
    eng = stack.ref
    toks = prompt(5, 20)
    L, _, H, _, D = eng.layout.block_shape
    kv = torch.zeros((L, 2, H, len(toks), D), dtype=eng.dtype)
    eos = min(eng.tokenizer.eos_token_ids)
    cases = [SamplingParams(max_tokens=4), SamplingParams(max_tokens=1),
             SamplingParams(max_tokens=4, ignore_eos=True),
             SamplingParams(max_tokens=4, stop=("a", "e", " "))]
    ended = went_on = 0
    for sp in cases:
        for first in sorted({eos, *range(1, eng.model_config.vocab_size, 3)}):
            eng.adopt("probe", toks, kv, first, sp)
            try:
                reason, text = eng.finish_reason("probe"), eng.completion_text("probe")
            finally:
                eng.free("probe")
            got = early_first(eng, len(toks), first, sp)
            if reason is None:
                assert got is not None and (got.token, got.text) == (first, text), (first, sp)
                went_on += 1
            else:
                assert got is None, (first, sp, reason)
                ended += 1
    assert ended and went_on


def test_first_event_does_not_wait_for_the_kv(stack: Stack) -> None:
    """A handle whose buffer is gone forces a rebuild from the warehouse; the
    first event is still the handle's token, sent before it, and the stream is
    the engine's."""
    p = prompt(91, 45)
    want = reference(stack.ref, p, 7)
    before = stack.decode.metrics().get("kvserve_decode_decode_early_first_total", 0.0)
    h = prefill(stack.prefill_stub(), p, max_tokens=7)
    stack.prefill_stub().Release(prefill_pb2.ReleaseRequest(request_id=h.ctx.request_id),
                                 timeout=TIMEOUT)
    out = decode(stack.decode_stub(), h, max_tokens=7)
    assert out.tokens == want and len(out.events) == len(want)
    assert list(out.events[0].token_ids) == [h.first_token]
    assert stack.decode.metrics()["kvserve_decode_decode_early_first_total"] == before + 1


def test_client_gone_after_the_first_event_frees_the_prefill_buffer(stack: Stack) -> None:
    from proto import decode_pb2
    from tests.decode_svc.stack import sampling

    h = prefill(stack.prefill_stub(), prompt(92, 40), max_tokens=50)
    call = stack.decode_stub().Decode(decode_pb2.DecodeRequest(handle=h, sampling=sampling(50)),
                                      timeout=TIMEOUT)
    first = next(call)
    assert list(first.token_ids) == [h.first_token]
    call.cancel()
    deadline = time.monotonic() + 10
    pull = prefill_pb2.PullKVRequest(request_id=h.ctx.request_id, use_shm=False)
    while True:
        try:
            list(stack.prefill_stub().PullKV(pull, timeout=TIMEOUT))    # still buffered
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "released" in (exc.details() or "")
            break
        assert time.monotonic() < deadline, "decode never released the prefill buffer"
        time.sleep(0.05)
