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


# ------------------------------------------------------------------ (a) GEMM
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [200, 9_000, 20_000])       # one per block-N choice
def test_gemm_rows_do_not_depend_on_m(dtype: torch.dtype, n: int) -> None:
    from engine.triton_invariant import linear

    g = torch.Generator(device="cuda").manual_seed(n)
    k = 576
    w_t = torch.randn(n, k, device="cuda", generator=g, dtype=dtype).t()   # as weights.py
    bias = torch.randn(n, device="cuda", generator=g, dtype=dtype)
    x = torch.randn(600, k, device="cuda", generator=g, dtype=dtype)
    full = linear(x[:512], w_t, bias)
    ref = x[:512].double() @ w_t.double() + bias.double()
    assert ((full.double() - ref).norm() / ref.norm()).item() < 1e-2
    for m in range(1, 65):
        assert torch.equal(linear(x[:m], w_t, bias), full[:m]), m
        lo = 512 - m                               # rows from another tile offset
        assert torch.equal(linear(x[lo:512], w_t, bias), full[lo:512]), m
    assert torch.equal(linear(x, w_t, bias)[:512], full)


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
@pytest.mark.parametrize("window", [0, 100])
def test_attention_row_is_the_same_in_any_chunk_and_as_decode(
        heads: int, kv_heads: int, dim: int, window: int) -> None:
    from engine.triton_invariant import AttnSegment, InvariantAttention

    g = torch.Generator(device="cuda").manual_seed(dim + window)
    T, B, nb = 700, 16, 128
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

    whole = chunked([512, 188])
    ref = _reference(q, k, v, window)
    assert ((whole.double() - ref).norm() / ref.norm()).item() < 1e-2
    for sizes in ([7] * 100, [1, 63, 64, 572], [T]):
        assert torch.equal(chunked(sizes), whole), sizes
    # decode: one row per sequence, up to 64 sequences in one call, any positions
    rng = random.Random(window)
    for n in (1, 5, 64):
        at = rng.sample(range(T), n)
        out = torch.empty(n, heads * dim, device="cuda", dtype=torch.bfloat16)
        InvariantAttention(pool, [AttnSegment(i, 1, p, table) for i, p in enumerate(at)],
                           heads)(0, q[at], window, out)
        assert torch.equal(out, whole[at]), n


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
