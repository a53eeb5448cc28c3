"""Disaggregated generation (prefill process -> decode
process over real gRPC, warehouse in a third) is token-identical to the
engine's monolithic greedy generation, cold and warm, alone and batched; and
the agent pattern hits the whole previous context from turn 2 on."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from proto import common_pb2, decode_pb2, prefill_pb2
from tests.decode_svc.stack import (
    TIMEOUT,
    Decoded,
    Stack,
    generate,
    keys_of,
    prompt,
    reference,
    sampling,
    stored_blocks,
    wait_stored,
)

B = 16
G1_TOKENS = "kvserve_decode_decode_g1_prefix_tokens_total"
CANONICAL = "kvserve_decode_decode_canonical_blocks_total"
# Lengths around block boundaries: shorter than a block, exact multiples, partial tails.
LENGTHS = [5, 16, 17, 31, 32, 33, 47, 64, 70, 100, 129]


def test_token_identity_cold_then_warm_and_batched(stack: Stack) -> None:
    prompts = [prompt(100 + i, n) for i, n in enumerate(LENGTHS)]
    want = [reference(stack.ref, p, max_tokens=10) for p in prompts]
    hit_rule = stack.ref.hit_rule

    # Cold: nothing stored for these prompts yet.
    for p, w in zip(prompts, want, strict=True):
        h, out = generate(stack, p, max_tokens=10)
        assert h.cached_tokens == 0
        assert out.tokens == w, f"prompt of {len(p)} tokens"
        assert out.events[-1].usage.prompt_tokens == len(p)
        assert out.events[-1].usage.completion_tokens == len(w)

    # Warm: the prompt blocks were written through, and the canonical blocks of
    # prompt + output after decode. Wait until the warehouse holds them.
    for p, w in zip(prompts, want, strict=True):
        kv_len = len(p) + len(w) - 1
        wait_stored(stack.store.address, keys_of(stack.ref, p + w), kv_len // B, len(p) + len(w))

    # Warm, all at once: the decode instance batches them; batch invariance
    # keeps every sequence's tokens identical to running it alone.
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: generate(stack, p, max_tokens=10), prompts))
    for p, w, (h, out) in zip(prompts, want, results, strict=True):
        stored = stored_blocks(stack.store.address, keys_of(stack.ref, p), len(p))
        assert h.cached_tokens == hit_rule.usable_tokens(stored * B, len(p))
        if len(p) > 2 * B:
            assert h.cached_tokens > 0 and h.fetch_decision.startswith("fetch")
        assert out.tokens == w, f"warm prompt of {len(p)} tokens"


def test_agent_conversation_hits_the_whole_previous_context(stack: Stack) -> None:
    """Six turns: each resends the whole context (previous prompt + answer + a
    new user message) the moment the previous answer's final event arrives.
    Decode stores the canonical blocks after the prompt (the answer's) before
    that event and leaves the prompt's to prefill's write-through (it puts no
    block twice); so the answer's blocks are in the warehouse with no waiting,
    and once the write-through landed (a deployed prefill serves those from its
    G1 meanwhile: tests/prefill_svc/test_past_g1.py; this one keeps none)
    cached_tokens is floor_to_block(min(previous context, L - reserve))."""
    tenant = "agent-test"
    hit_rule = stack.ref.hit_rule
    context = prompt(7, 40)
    prev_kv = prev_prompt = 0                    # tokens of the previous turn with KV, prompt
    for turn in range(6):
        L = len(context)
        keys = keys_of(stack.ref, context, tenant)
        if turn:
            answer = keys[prev_prompt // B:prev_kv // B]
            held = stored_blocks(stack.store.address, answer, L, tenant)   # no waiting
            assert held == len(answer), f"turn {turn}: warehouse holds {held} answer blocks"
            held = wait_stored(stack.store.address, keys, prev_kv // B, L, tenant)
            assert held == prev_kv // B, f"turn {turn}: warehouse holds {held} blocks"
        g1_before = stack.decode.metrics().get(G1_TOKENS, 0.0)
        put_before = stack.decode.metrics().get(CANONICAL, 0.0)
        h, out = generate(stack, context, max_tokens=12, tenant=tenant, ignore_eos=True)
        put = stack.decode.metrics().get(CANONICAL, 0.0) - put_before
        assert put == (L + len(out.tokens) - 1) // B - L // B, f"turn {turn}: {put} blocks"
        want = reference(stack.ref, context, max_tokens=12, ignore_eos=True)
        assert out.tokens == want, f"turn {turn}: output differs from a cache-less run"
        # Decode kept the previous turn's blocks: only the tail was pulled.
        held = min(prev_kv // B, (L - 1) // B) * B
        assert stack.decode.metrics().get(G1_TOKENS, 0.0) - g1_before == held, f"turn {turn}"
        if turn == 0:
            assert h.cached_tokens == 0
        else:
            expect = hit_rule.usable_tokens(prev_kv, L)
            assert expect == (min(prev_kv, L - hit_rule.reserve) // B) * B
            assert h.cached_tokens == expect, f"turn {turn}"
        prev_kv, prev_prompt = L + len(out.tokens) - 1, L
        context = context + out.tokens + prompt(50 + turn, 9)


def _local(stack: Stack, tokens: list[int], tail: int, *, tenant: str,
           max_tokens: int = 12) -> Decoded:
    """A Decode call with no prefill (what the router sends for a short tail)."""
    handle = prefill_pb2.KVHandle(ctx=common_pb2.RequestContext(tenant=tenant),
                                  prompt_ids=tokens)
    events = list(stack.decode_stub().Decode(decode_pb2.DecodeRequest(
        handle=handle, sampling=sampling(max_tokens, ignore_eos=True), local_tail_tokens=tail),
        timeout=TIMEOUT))
    toks = [t for ev in events for t in ev.token_ids]
    return Decoded(toks, "".join(ev.text for ev in events), events[-1].finish_reason, events)


def test_a_short_tail_is_computed_on_decode_alone_and_exact(stack: Stack) -> None:
    """A returning turn sent to decode with no prefill: its previous turn's
    blocks come from decode's G1, only the new tokens are computed there, the
    tokens equal a cache-less run, and the new prompt blocks reach the
    warehouse (no prefill wrote them through). A tail longer than allowed, or a
    prompt decode never saw, is declined before any work."""
    tenant = "local-tail"
    dm = stack.decode.metrics
    context = prompt(11, 45)
    _, out = generate(stack, context, max_tokens=12, tenant=tenant, ignore_eos=True)
    for turn in range(2):
        prev_kv = len(context) + len(out.tokens) - 1
        context = context + out.tokens + prompt(60 + turn, 13)
        before = {k: dm().get(f"kvserve_decode_decode_{k}", 0.0)
                  for k in ("local_tails_total", "local_tail_tokens_total", "pull_bytes_total",
                            "canonical_blocks_total")}
        out = _local(stack, context, 64, tenant=tenant)
        assert out.tokens == reference(stack.ref, context, max_tokens=12, ignore_eos=True), turn
        reused = stack.ref.hit_rule.usable_tokens(prev_kv // B * B, len(context))
        assert reused > 0 and out.events[-1].usage.cached_tokens == reused, turn
        after = {k: dm().get(f"kvserve_decode_decode_{k}", 0.0) for k in before}
        assert after["local_tails_total"] == before["local_tails_total"] + 1
        assert (after["local_tail_tokens_total"] - before["local_tail_tokens_total"]
                == len(context) - reused)
        assert after["pull_bytes_total"] == before["pull_bytes_total"]      # nothing pulled
        # The blocks G1 supplied have a writer already: only what was computed here is put.
        put = after["canonical_blocks_total"] - before["canonical_blocks_total"]
        assert 0 < put <= (len(context) + len(out.tokens) - 1) // B - reused // B, turn
    kv_len = len(context) + len(out.tokens) - 1
    keys = keys_of(stack.ref, context + out.tokens, tenant)
    assert wait_stored(stack.store.address, keys, kv_len // B, kv_len, tenant) >= kv_len // B

    declined = dm().get("kvserve_decode_decode_local_declined_total", 0.0)
    longer = context + out.tokens + prompt(70, 40)
    for tokens, tail in ((longer, 32), (prompt(12, 100), 64)):
        with pytest.raises(grpc.RpcError) as err:
            _local(stack, tokens, tail, tenant=tenant)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "without a prefill" in (err.value.details() or "")
    assert dm().get("kvserve_decode_decode_local_declined_total", 0.0) == declined + 2
    # Declined before any work: the longer prompt is still answered exactly by the usual path.
    _, out = generate(stack, longer, max_tokens=12, tenant=tenant, ignore_eos=True)
    assert out.tokens == reference(stack.ref, longer, max_tokens=12, ignore_eos=True)


def test_a_short_cold_prompt_is_computed_on_decode_alone_and_exact(stack: Stack) -> None:
    """A prompt no instance holds, short enough (``local_cold_max_tokens``,
    256): computed on decode with no prefill, token-identical to a cache-less
    run, nothing pulled, its blocks written to the warehouse after the answer.
    A longer one is declined before any work (prefill restores what the
    warehouse has), whatever the router asked."""
    tenant = "local-cold"
    dm = stack.decode.metrics
    names = ("local_colds_total", "local_tails_total", "pull_bytes_total",
             "local_declined_total")
    before = {k: dm().get(f"kvserve_decode_decode_{k}", 0.0) for k in names}
    short = prompt(13, 150)
    out = _local(stack, short, 512, tenant=tenant)
    assert out.tokens == reference(stack.ref, short, max_tokens=12, ignore_eos=True)
    assert out.events[-1].usage.cached_tokens == 0
    after = {k: dm().get(f"kvserve_decode_decode_{k}", 0.0) for k in names}
    assert after["local_colds_total"] == before["local_colds_total"] + 1
    assert after["local_tails_total"] == before["local_tails_total"] + 1
    assert after["pull_bytes_total"] == before["pull_bytes_total"]
    kv_len = len(short) + len(out.tokens) - 1
    keys = keys_of(stack.ref, short + out.tokens, tenant)
    assert wait_stored(stack.store.address, keys, kv_len // B, kv_len, tenant) >= kv_len // B

    with pytest.raises(grpc.RpcError) as err:
        _local(stack, prompt(14, 300), 512, tenant=tenant)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "at most 256 tokens" in (err.value.details() or "")
    assert dm().get("kvserve_decode_decode_local_declined_total", 0.0) == (
        before["local_declined_total"] + 1)
    assert dm().get("kvserve_decode_decode_local_colds_total", 0.0) == (
        after["local_colds_total"])


def test_stop_strings_and_eos_end_where_the_engine_does(stack: Stack) -> None:
    from engine import SamplingParams

    p = prompt(77, 30)
    free = stack.ref.generate(p, SamplingParams(max_tokens=40, ignore_eos=True))
    clean = [i for i in range(3, len(free.text) - 2)
             if "\ufffd" not in free.text[i:i + 2] and free.text[i:i + 2].strip()]
    stop = free.text[clean[0]:clean[0] + 2]
    want = stack.ref.generate(p, SamplingParams(max_tokens=40, stop=(stop,), ignore_eos=True))
    assert want.finish_reason == "stop" and len(want.tokens) < 40
    _, out = generate(stack, p, max_tokens=40, stop=[stop], ignore_eos=True)
    assert (out.tokens, out.text, out.finish_reason) == (want.tokens, want.text, "stop")
    assert stop not in "".join(ev.text for ev in out.events)
    # Per-token events with rising times.
    assert [len(ev.token_ids) for ev in out.events] == [1] * len(want.tokens)
    times = [ev.t_s for ev in out.events]
    assert times == sorted(times) and times[0] > 0
