"""Batch-invariant CUDA kernels (``kernels = "triton_bi"``; GPU tests skip without
CUDA): a row's bits never depend on the rows sharing its call, so restores
start at any block boundary and decode in any batch gives a cold run's tokens."""

from __future__ import annotations

import random

import pytest
import torch

from engine import SamplingParams
from engine.errors import ModelConfigError
from tests.engine.conftest import make_engine, random_prompts

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_triton_bi_without_cuda_is_a_clear_config_error() -> None:
    with pytest.raises(ModelConfigError, match="'triton_bi' requested but they run on CUDA only"):
        make_engine("tiny-dense", kernels="triton_bi")


def test_auto_takes_triton_bi_on_cuda_only_once_measured_within_ten_percent() -> None:
    from engine.kernels import TRITON_BI_COST, cuda_auto

    assert cuda_auto(None) == "triton"                 # not measured for this version
    assert cuda_auto(0.10) == cuda_auto(0.03) == "triton_bi"
    assert cuda_auto(0.11) == "triton"
    assert cuda_auto() == cuda_auto(TRITON_BI_COST)


# ------------------------------------------------------------------ (a) GEMM
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [200, 9_000, 20_000])       # one per decode block-N choice
def test_gemm_rows_do_not_depend_on_m(dtype: torch.dtype, n: int) -> None:
    """Rows of M = 1..64 (the decode plan), 65, 512 (128 x 128 tiles), 513 and
    2,048 (128 x 256 tiles) are the rows of one 2,048-row call, bit for bit."""
    from engine.triton_invariant import linear

    g = torch.Generator(device="cuda").manual_seed(n)
    k = 576
    w_t = torch.randn(n, k, device="cuda", generator=g, dtype=dtype).t()   # as weights.py
    bias = torch.randn(n, device="cuda", generator=g, dtype=dtype)
    x = torch.randn(2100, k, device="cuda", generator=g, dtype=dtype)
    full = linear(x[:2048], w_t, bias)
    ref = x[:2048].double() @ w_t.double() + bias.double()
    assert ((full.double() - ref).norm() / ref.norm()).item() < 1e-2
    for m in [*range(1, 66), 512, 513]:
        assert torch.equal(linear(x[:m], w_t, bias), full[:m]), m
        lo = 2048 - m                              # rows from another tile offset
        assert torch.equal(linear(x[lo:2048], w_t, bias), full[lo:2048]), m
    assert torch.equal(linear(x, w_t, bias)[:2048], full)


# qkv, o, gate_up, down and the LM head of llama-8b: (K, N)
LLAMA_8B_WEIGHTS = ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (4096, 128256))

@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("k", "n", "splits", "layout"), [
    *((k, n, None, layout) for k, n in LLAMA_8B_WEIGHTS for layout in ("kn", "nk")),
    # K in two sums: the option applies to narrow weights, timed on the [N, K] layout
    *((k, n, 2, "nk") for k, n in LLAMA_8B_WEIGHTS if n < 16384),
])
def test_gemm_rows_on_llama_8b_weights(k: int, n: int, splits: int | None, layout: str) -> None:
    """The same across every plan on the real shapes (long K, wide N; the decode
    plans by shape of engine/triton_gemm_table.py among them, TMA ones too), with
    the shipped K-split rule and with K in two sums (engine/triton_gemm.py
    ``k_splits``' option: a program a split at M <= 64, both in one past it),
    for weights stored as weights.py does ([K, N] rows) and as [N, K]."""
    from engine.triton_invariant import linear

    g = torch.Generator(device="cuda").manual_seed(k + n)
    shape = (n, k) if layout == "nk" else (k, n)
    w = torch.randn(*shape, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    w_t = w.t() if layout == "nk" else w
    x = torch.randn(2048, k, device="cuda", generator=g, dtype=torch.bfloat16)
    full = linear(x, w_t, splits=splits)
    for m in (1, 2, 8, 17, 32, 33, 48, 64, 65, 200, 512, 513, 1000):
        assert torch.equal(linear(x[:m], w_t, splits=splits), full[:m]), m
        assert torch.equal(linear(x[2048 - m:], w_t, splits=splits), full[2048 - m:]), m


# ------------------------------------------------------------- (b) attention
def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    # q: [T, H, D]; k, v: [T, Hkv, D] -> causal attention [T, H * D] in fp64
    t, h, d = q.shape
    g = h // k.shape[1]
    kk = k.double().repeat_interleave(g, 1).transpose(0, 1)       # [H, T, D]
    vv = v.double().repeat_interleave(g, 1).transpose(0, 1)
    s = q.double().transpose(0, 1) @ kk.transpose(1, 2) / d ** 0.5    # [H, T, T]
    i = torch.arange(t, device=q.device)
    see = i[None, :] <= i[:, None]
    if window:
        see &= i[None, :] > i[:, None] - window
    o = s.masked_fill(~see, float("-inf")).softmax(-1) @ vv          # [H, T, D]
    return o.transpose(0, 1).reshape(t, h * d)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (32, 8, 128)])
@pytest.mark.parametrize("window", [0, 100, 1500])
def test_attention_row_is_the_same_in_any_chunk_batch_and_as_decode(
        heads: int, kv_heads: int, dim: int, window: int) -> None:
    """2,600 tokens (three key splits of 1,024): one call, any chunking, several
    sequences in one call (batched prefill), and one-token decode rows in calls of
    1 to 64 rows whose splits are dealt over 1, 4 or 32 programs: the same bits."""
    from engine.triton_attention import decode_scratch
    from engine.triton_invariant import AttnSegment, InvariantAttention

    g = torch.Generator(device="cuda").manual_seed(dim + window)
    T, B, nb = 2600, 16, 256
    pool = torch.full((1, 2, kv_heads, nb, B, dim), float("nan"), device="cuda",
                      dtype=torch.bfloat16)                        # unwritten slots: NaN
    table = torch.randperm(nb, device="cuda", generator=g)[: -(-T // B)]
    k = torch.randn(T, kv_heads, dim, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(T, kv_heads, dim, device="cuda", generator=g, dtype=torch.bfloat16)
    pos = torch.arange(T, device="cuda")
    slots = table[pos // B] * B + pos % B
    pool.view(1, 2, kv_heads, nb * B, dim)[0, 0, :, slots] = k.transpose(0, 1)
    pool.view(1, 2, kv_heads, nb * B, dim)[0, 1, :, slots] = v.transpose(0, 1)
    q = torch.randn(T, heads, dim, device="cuda", generator=g, dtype=torch.bfloat16)

    def chunked(sizes: list[int]) -> torch.Tensor:
        out = torch.empty(T, heads * dim, device="cuda", dtype=torch.bfloat16)
        s = 0
        for c in sizes:
            InvariantAttention(pool, [AttnSegment(0, c, s, table)], heads)(
                0, q[s:s + c], window, out[s:s + c])
            s += c
        assert s == T
        return out

    whole = chunked([T])
    ref = _reference(q, k, v, window)
    assert ((whole.double() - ref).norm() / ref.norm()).item() < 1e-2
    for sizes in ([7] * 371 + [3], [1, 63, 64, 1000, 1472], [512] * 5 + [40], [2048, 552]):
        assert torch.equal(chunked(sizes), whole), sizes
    rng = random.Random(window)
    # batched prefill: 2..6 sequences' chunks in one call, any order and lengths
    for n in (2, 6):
        cuts = sorted(rng.sample(range(1, T), n - 1))
        spans = list(zip([0, *cuts], [*cuts, T], strict=True))
        rng.shuffle(spans)
        rows = torch.cat([torch.arange(a, b, device="cuda") for a, b in spans])
        segs, r0 = [], 0
        for a, b in spans:
            segs.append(AttnSegment(r0, b - a, a, table))
            r0 += b - a
        out = torch.empty(T, heads * dim, device="cuda", dtype=torch.bfloat16)
        InvariantAttention(pool, segs, heads)(0, q[rows], window, out)
        assert torch.equal(out, whole[rows]), n
    # decode: one row per sequence, up to 64 sequences in one call, any positions
    for n, parts in ((1, 32), (1, 1), (5, 4), (64, 1), (64, 4)):
        at = rng.sample(range(T), n)
        out = torch.empty(n, heads * dim, device="cuda", dtype=torch.bfloat16)
        acc, ml = (x.fill_(float("nan")) for x in decode_scratch(n, T, heads, dim, pool.device))
        InvariantAttention(pool, [AttnSegment(i, 1, p, table) for i, p in enumerate(at)],
                           heads, parts=parts)(0, q[at], window, out, acc, ml)
        assert torch.equal(out, whole[at]), (n, parts)
    # rows of one split (finished by their first program alone) beside rows of
    # two and three (dealt, stored and folded by _fold_splits) in one call
    at = [0, 255, 1023, 1024, 2047, 2599]
    for parts in (4, 32):
        out = torch.empty(len(at), heads * dim, device="cuda", dtype=torch.bfloat16)
        acc, ml = (x.fill_(float("nan"))
                   for x in decode_scratch(len(at), T, heads, dim, pool.device))
        InvariantAttention(pool, [AttnSegment(i, 1, p, table) for i, p in enumerate(at)],
                           heads, parts=parts)(0, q[at], window, out, acc, ml)
        assert torch.equal(out, whole[at]), ("one split and several", parts)
    # more splits than programs (21 splits of 128 keys, 3 to 11 a program; the
    # fold pass's rounds of 4 splits crossed)
    fine = torch.empty(T, heads * dim, device="cuda", dtype=torch.bfloat16)
    InvariantAttention(pool, [AttnSegment(0, T, 0, table)], heads, split=128)(
        0, q, window, fine)
    at = list(range(T - 64, T))
    for parts in (2, 4, 8):
        out = torch.empty(len(at), heads * dim, device="cuda", dtype=torch.bfloat16)
        acc, ml = (x.fill_(float("nan"))
                   for x in decode_scratch(len(at), T, heads, dim, pool.device, 128))
        InvariantAttention(pool, [AttnSegment(i, 1, p, table) for i, p in enumerate(at)],
                           heads, parts=parts, split=128)(0, q[at], window, out, acc, ml)
        assert torch.equal(out, fine[at]), ("splits > programs", parts)


# ------------------------------------------------- (c) the engine, end to end
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("model", "decode"), [
    ("smollm2-shape", {}),                           # paged decode in CUDA graphs
    ("tiny-hybrid", {"cuda_graphs": False}),         # paged runner, eager
    ("tiny-dense", {"paged_decode": False}),         # the prefill path's BatchAttention
])
def test_restores_at_any_block_and_decode_in_any_batch_match_cold_runs(
        model: str, decode: dict[str, bool]) -> None:
    """20 prompts, greedy 64 tokens: cold single runs (decode in graphs, bucket 1),
    against restores from blocks exported by a cold run (cut at any block boundary,
    on an engine with another prefill chunk and decode path) decoded in batches of
    1 to 64 that change every step."""
    kw = {"device": "cuda", "dtype": "bfloat16", "kernels": "triton_bi",
          "block_tokens": 16, "num_blocks": 4096}
    a = make_engine(model, **kw)
    b = make_engine(model, prefill_chunk=48, **kw, **decode)
    assert a.invariant and a._paged is not None and a.fingerprint == b.fingerprint
    assert (b._paged is None) == (decode.get("paged_decode") is False)
    sp = SamplingParams(max_tokens=64, ignore_eos=True)
    prompts = random_prompts(20, 20, 300, 256, seed=7)
    cold = [a.generate(p, sp).tokens for p in prompts]
    exported = []
    for i, p in enumerate(prompts):
        a.prefill(f"x{i}", p, sampling=sp)
        exported.append(a.export_blocks(f"x{i}"))
        a.free(f"x{i}")
    rng = random.Random(11)
    ids, want, prompt_of = [], {}, {}
    for j in range(64):                              # every prompt about 3 times
        i = j % len(prompts)
        cut = rng.randint(0, exported[i].shape[0])   # any block boundary, 0 = none
        sid = f"s{j}"
        b.prefill(sid, prompts[i], sampling=sp, restored=exported[i][:cut])
        ids.append(sid)
        want[sid], prompt_of[sid] = cold[i], prompts[i]
    live = list(ids)
    while live:
        step = rng.sample(live, rng.randint(1, len(live)))
        b.decode_step(step)
        for sid in step:
            if b.finish_reason(sid) is not None:
                live.remove(sid)
    got = {sid: b.seq_tokens(sid)[len(prompt_of[sid]):] for sid in ids}
    assert got == want
    # decode KV is prefill KV: blocks written by decode equal a cold prefill's
    for sid in ids[:3]:
        toks = b.seq_tokens(sid)[:-1]                # the last token has no KV yet
        a.prefill("k", toks)
        assert torch.equal(b.export_blocks(sid), a.export_blocks("k"))
        a.free("k")


@pytest.mark.gpu
@needs_cuda
def test_long_contexts_decoded_over_key_splits_match_cold_runs() -> None:
    """Prompts of 1.1k-3k tokens (decode rows span up to three 1,024-key splits,
    shared by up to 32 programs at batch 1): restored at any block boundary and
    decoded in changing batches, the tokens of cold single runs."""
    kw = {"device": "cuda", "dtype": "bfloat16", "kernels": "triton_bi",
          "block_tokens": 16, "num_blocks": 4096}
    a = make_engine("smollm2-shape", **kw)
    b = make_engine("smollm2-shape", prefill_chunk=400, **kw)
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = random_prompts(6, 1100, 3000, 49_152, seed=5)
    cold = [a.generate(p, sp).tokens for p in prompts]
    rng = random.Random(3)
    ids = []
    for i, p in enumerate(prompts):
        a.prefill("x", p, sampling=sp)
        blocks = a.export_blocks("x")
        a.free("x")
        b.prefill(f"s{i}", p, sampling=sp, restored=blocks[:rng.randint(0, blocks.shape[0])])
        ids.append(f"s{i}")
    live = list(ids)
    while live:
        step = rng.sample(live, rng.randint(1, len(live)))
        b.decode_step(step)
        live = [s for s in live if b.finish_reason(s) is None]
    assert [b.seq_tokens(s)[len(p):] for s, p in zip(ids, prompts, strict=True)] == cold
