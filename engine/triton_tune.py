"""The batch-invariant kernels against their fast non-invariant peers, on the
device, in one process (for one planned device call):

- ``gemm``: llama-8b-shape weights, bf16. Every candidate plan's rows are
  compared bit for bit with the shipped plan table's at M = 2,048 (which rows a
  plan may be used for is decided here: only identical plans qualify), then
  each plan and ``torch.mm`` (cuBLAS) are timed at M = 1, 8, 64, 512, 2,048,
  8,192.
- ``attn``: prefill attention of one 4k / 16k / 32k sequence against SDPA's
  flash kernel (causal, GQA, same FLOPs), with the shipped key split and
  others (the fold's cost); decode rows at batch 1 / 8 / 64 and context 256 /
  4k / 32k against the ``triton`` family's paged kernel, each in the decode
  pipeline variants of ``VARIANTS`` with ``--variants`` (their bits compared;
  one of them hit an illegal address on the H200, 2026-12-02, so they are
  opt-in); ``attn_decode``: the decode rows alone.

- ``decode``: the decode-sized plans (M = 1, 8, 64) on the llama-8b-shape
  layer weights: each candidate's rows against the shipped 2,048-row call bit
  for bit (at two row offsets), then its weight-streaming rate in GB/s beside
  cuBLAS and the shipped table, and the table under other K-split rules.

``python3 -m engine.triton_tune gemm attn decode --json OUT.json``: a table on stdout,
everything in the JSON. Times are medians of ``triton.testing.do_bench``.
``--smoke`` runs the same code on the CPU under ``TRITON_INTERPRET=1`` with tiny
shapes in fp16 (one untimed-quality run each), to check it before device time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch
import triton
from triton.testing import do_bench

from engine import triton_attention as ta
from engine import triton_gemm as tg

LLAMA = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
         "down": (14336, 4096), "lm_head": (4096, 128256)}
CANDIDATES = (
    tg.GemmPlan(64, 32, 4, 4), tg.GemmPlan(64, 32, 4, 6), tg.GemmPlan(64, 32, 4, 8),
    tg.GemmPlan(64, 64, 4, 6), tg.GemmPlan(64, 128, 4, 4),
    tg.GemmPlan(128, 128, 8, 3), tg.GemmPlan(128, 128, 8, 4),
    tg.GemmPlan(128, 256, 8, 3), tg.GemmPlan(128, 256, 8, 4, group_m=16),
    tg.GemmPlan(128, 256, 8, 3, persistent=True), tg.GemmPlan(128, 128, 8, 4, persistent=True),
)

# decode-sized M (<= 64): the shipped picks and their neighbours (narrow column
# tiles, weight-major tiles, 128-deep K stages, TMA)
DECODE_CANDIDATES = (
    tg.GemmPlan(64, 32, 4, 8), tg.GemmPlan(64, 32, 4, 6, bk=128), tg.GemmPlan(64, 32, 4, 8, bk=128),
    tg.GemmPlan(64, 16, 4, 8, bk=128), tg.GemmPlan(64, 64, 4, 6, bk=128),
    *(tg.GemmPlan(64, 64, 4, st, swap=True) for st in (8, 10, 12)),
    *(tg.GemmPlan(64, 64, 4, st, swap=True, bk=128) for st in (4, 6, 8)),
    tg.GemmPlan(64, 64, 4, 4, swap=True, bk=256),
    *(tg.GemmPlan(64, 128, 4, st, swap=True) for st in (4, 6)),
    *(tg.GemmPlan(64, 128, 4, st, swap=True, bk=128) for st in (3, 4)),
    *(tg.GemmPlan(64, 64, 4, st, swap=True, persistent=True, bk=128) for st in (4, 6)),
    tg.GemmPlan(64, 128, 4, 4, swap=True, persistent=True),
    # two K splits (k_splits) double the programs of the narrow outputs: pipelines
    # of <= ~100 KB of shared memory let two programs share an SM
    *(tg.GemmPlan(64, 64, 4, st, bk=128) for st in (2, 3, 4)),
    *(tg.GemmPlan(64, 64, 4, st, swap=True) for st in (4, 6)),
    tg.GemmPlan(64, 64, 4, 3, swap=True, bk=128),
)


def at_m(p: tg.GemmPlan, m: int) -> tg.GemmPlan:
    return replace(p, bm=tg.x_tile(m)) if p.swap else p


@dataclass(frozen=True, slots=True)
class Setup:
    dev: torch.device
    dtype: torch.dtype
    shrink: int                       # weight and context sizes divided by this
    m_timed: tuple[int, ...]
    m_canon: int
    lengths: tuple[int, ...]
    contexts: tuple[int, ...]
    heads: tuple[int, int, int, int]  # heads, kv heads, head dim, block tokens

    def ms(self, fn: Callable[[], object]) -> float:
        if self.dev.type == "cuda":
            return float(do_bench(fn, warmup=10, rep=40, return_mode="median"))
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


DEVICE = Setup(torch.device("cuda"), torch.bfloat16, 1, (1, 8, 64, 512, 2048, 8192), 2048,
               (4096, 16384, 32768), (256, 4096, 32768), (32, 8, 128, 64))
SMOKE = Setup(torch.device("cpu"), torch.float16, 64, (1, 8, 70), 130, (300,), (100, 300),
              (8, 2, 16, 16))


def _log(line: str) -> None:
    print(line, flush=True)


def tune_gemm(su: Setup) -> dict[str, object]:
    dev, M_TIMED, _ms = su.dev, su.m_timed, su.ms
    g = torch.Generator(device=dev).manual_seed(0)
    out: dict[str, object] = {}
    _log(f"{'weight':<8} {'plan':<22} {'same bits':>9} " +
         " ".join(f"{'M=' + str(m):>9}" for m in M_TIMED))
    for name, (k, n) in LLAMA.items():
        k, n = k // su.shrink, n // su.shrink
        w_t = (torch.randn(n, k, device=dev, generator=g) * 0.02).to(su.dtype).t()
        x = torch.randn(max(M_TIMED), k, device=dev, generator=g).to(su.dtype)
        canon = tg.linear(x[:su.m_canon], w_t)
        rows: dict[str, object] = {}
        cublas = {m: _ms(partial(torch.mm, x[:m], w_t)) for m in M_TIMED}
        _log(f"{name:<8} {'cuBLAS':<22} {'-':>9} " +
             " ".join(f"{cublas[m] * 1e3:>8.1f}u" for m in M_TIMED))
        rows["cublas_ms"] = cublas
        for p in CANDIDATES:
            try:
                same = all(torch.equal(tg.linear(x[:m], w_t, plan=p), canon[:m])
                           for m in (1, 7, 64, 65, 512, 2048) if m <= su.m_canon)
                t = {m: _ms(partial(tg.linear, x[:m], w_t, plan=p)) for m in M_TIMED}
            except Exception as e:           # a plan the compiler refuses: say so, go on
                _log(f"{name:<8} {p!s:<22} failed: {type(e).__name__}: {e}"[:200])
                continue
            label = f"{p.bm}x{p.bn} w{p.warps} s{p.stages} g{p.group_m}" + \
                (" tma" if p.persistent else "")
            rows[label] = {"same_bits": same, "ms": t}
            _log(f"{name:<8} {label:<22} {same!s:>9} " +
                 " ".join(f"{cublas[m] / t[m]:>8.2f}x" for m in M_TIMED))
        shipped = {m: _ms(partial(tg.linear, x[:m], w_t)) for m in M_TIMED}
        rows["shipped_ms"] = shipped
        _log(f"{name:<8} {'shipped table':<22} {'True':>9} " +
             " ".join(f"{cublas[m] / shipped[m]:>8.2f}x" for m in M_TIMED))
        out[name] = rows
    return out


def tune_decode(su: Setup) -> dict[str, object]:
    """Decode-sized M (1, 8, 64): each candidate's rows against the shipped
    2,048-row call bit for bit, then its weight-streaming rate (GB/s)."""
    dev, _ms = su.dev, su.ms
    g = torch.Generator(device=dev).manual_seed(1)
    ms_ = (1, 8, 64)
    out: dict[str, object] = {}
    for name, (k, n) in LLAMA.items():
        if name == "lm_head":
            continue
        k, n = k // su.shrink, n // su.shrink
        w_t = (torch.randn(n, k, device=dev, generator=g) * 0.02).to(su.dtype).t()
        x = torch.randn(su.m_canon, k, device=dev, generator=g).to(su.dtype)
        canon = tg.linear(x, w_t)
        gb = n * k * 2 / 1e6                      # weight bytes / 1e6: GB/s from ms
        rows: dict[str, object] = {}
        cublas = {m: _ms(partial(torch.mm, x[:m], w_t)) for m in ms_}
        shipped = {m: _ms(partial(tg.linear, x[:m], w_t)) for m in ms_}
        rows["cublas_ms"], rows["shipped_ms"] = cublas, shipped
        for label, t in (("cuBLAS", cublas), ("shipped", shipped)):
            _log(f"{name:<8} {label:<28} {'-':>5} " + " ".join(f"{gb / t[m]:>7.0f}" for m in ms_))
        for p in DECODE_CANDIDATES:
            label = (f"{'swap ' if p.swap else ''}{p.bm}x{p.bn} w{p.warps} s{p.stages} k{p.bk}"
                     + (" tma" if p.persistent else ""))
            try:
                same = all(torch.equal(tg.linear(x[a:a + m], w_t, plan=at_m(p, m)),
                                       canon[a:a + m])
                           for m in (1, 3, 8, 16, 17, 33, 64) for a in (0, 100))
                t = {m: _ms(partial(tg.linear, x[:m], w_t, plan=at_m(p, m))) for m in ms_}
            except Exception as e:           # a plan the compiler refuses: say so, go on
                _log(f"{name:<8} {label:<28} failed: {type(e).__name__}: {e}"[:200])
                continue
            rows[label] = {"same_bits": same, "ms": t}
            _log(f"{name:<8} {label:<28} {same!s:>5} "
                 + " ".join(f"{gb / t[m]:>7.0f}" for m in ms_))
        # other K-split rules (each its own arithmetic: rows against a 2,048-row
        # call with the same split), the shipped plan table
        for sp in (1, 2, 4):
            if k % (sp * 256):
                continue
            label = f"table, {sp} K split{'s' if sp > 1 else ''}"
            ref = tg.linear(x, w_t, splits=sp)
            same = all(torch.equal(tg.linear(x[a:a + m], w_t, splits=sp), ref[a:a + m])
                       for m in (1, 8, 33, 64) for a in (0, 100))
            t = {m: _ms(partial(tg.linear, x[:m], w_t, splits=sp)) for m in ms_}
            rows[label] = {"same_bits": same, "ms": t}
            _log(f"{name:<8} {label:<28} {same!s:>5} "
                 + " ".join(f"{gb / t[m]:>7.0f}" for m in ms_))
        out[name] = rows
    return out


# decode attention schedules timed beside the shipped one
# (one stage capped at 128 registers met an illegal address on the H200 on
# 2026-12-02 and again on 2026-12-03: not among them)
VARIANTS = (ta.AHEAD_DECODE, ta.DecodeSchedule(2, 2), ta.DecodeSchedule(1, 2))


def _pool(su: Setup, t: int, batch: int = 1) -> tuple[torch.Tensor, list[torch.Tensor]]:
    _, kv_heads, dim, bt = su.heads
    per = -(-t // bt)
    pool = torch.randn(1, 2, kv_heads, per * batch + 1, bt, dim, device=su.dev).to(su.dtype)
    perm = torch.randperm(per * batch, device=su.dev)
    return pool, [perm[i * per:(i + 1) * per] for i in range(batch)]


def tune_attention(su: Setup, prefill: bool = True,
                   variants: tuple[ta.DecodeSchedule, ...] = ()) -> dict[str, object]:
    import torch.nn.functional as F

    from engine.paged_decode import paged_decode, splits_for

    dev, _ms = su.dev, su.ms
    heads, kv_heads, dim, _ = su.heads
    res: dict[str, object] = {}
    for t in su.lengths if prefill else ():
        pool, (table,) = _pool(su, t)
        q = torch.randn(t, heads, dim, device=dev).to(su.dtype)
        out = torch.empty(t, heads * dim, device=dev, dtype=su.dtype)
        flops = 2 * t * t * heads * dim                      # causal: half of 4 t^2 H D
        kk = pool[0, 0, :, table].reshape(kv_heads, -1, dim)[:, :t].unsqueeze(0)
        vv = pool[0, 1, :, table].reshape(kv_heads, -1, dim)[:, :t].unsqueeze(0)
        qh = q.transpose(0, 1).unsqueeze(0)
        sdpa = _ms(lambda qh=qh, kk=kk, vv=vv: F.scaled_dot_product_attention(
            qh, kk, vv, is_causal=True, enable_gqa=True))
        row = {"sdpa_ms": sdpa, "sdpa_tflops": flops / sdpa / 1e9}
        for split in (ta.KEY_SPLIT, 4096 // su.shrink, 32768 // su.shrink):
            plan = ta.InvariantAttention(pool, [ta.AttnSegment(0, t, 0, table)], heads,
                                         split=split)
            ms = _ms(lambda plan=plan, q=q, out=out: plan(0, q, 0, out))
            row[f"split{split}_ms"] = ms
            _log(f"prefill attn t={t:>6} split={split:>6}: {ms:8.3f} ms "
                 f"{flops / ms / 1e9:6.0f} TFLOP/s, SDPA flash {sdpa:8.3f} ms "
                 f"({sdpa / ms:.2f}x)")
        res[f"prefill_{t}"] = row
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if su.dev.type == "cuda" \
        else 132
    for ctx in su.contexts:
        for b in (1, 8, 64):
            if b * ctx > 64 * 4096 * 2:
                continue
            pool, tables = _pool(su, ctx, b)
            q = torch.randn(b, heads, dim, device=dev).to(su.dtype)
            parts = splits_for(b, kv_heads, sms)
            acc, ml = ta.decode_scratch(b, ctx, heads, dim, dev)
            out = torch.empty(b, heads * dim, device=dev, dtype=su.dtype)
            segs = [ta.AttnSegment(i, 1, ctx - 1, tb) for i, tb in enumerate(tables)]
            # a decode schedule (loop, stages, warps, register cap) does not
            # change the bits: which is fastest at this batch
            by_var: dict[str, float] = {}
            same = True
            first: torch.Tensor | None = None
            for sch in (ta.DECODE, *variants):
                inv = ta.InvariantAttention(pool, segs, heads, parts, schedule=sch)
                inv(0, q, 0, out, acc, ml)
                first = out.clone() if first is None else first
                same &= torch.equal(out, first)
                by_var[str(sch)] = _ms(lambda inv=inv, q=q, out=out, acc=acc, ml=ml:
                                       inv(0, q, 0, out, acc, ml))
            ms = by_var[str(ta.DECODE)]
            tbl = torch.stack(tables).to(torch.int32)
            lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
            pacc = torch.empty(b, parts, heads, dim, device=dev)
            pml = torch.empty(b, parts, heads, 2, device=dev)
            base = _ms(partial(paged_decode, q, pool[0, 0], pool[0, 1], tbl, lens, 0, parts,
                               pacc, pml))
            kv_bytes = 2 * b * ctx * kv_heads * dim * 2
            res[f"decode_b{b}_ctx{ctx}"] = {"invariant_ms": ms, "paged_ms": base, "parts": parts,
                                            "variants_ms": by_var, "variants_same_bits": same}
            _log(f"decode attn b={b:>2} ctx={ctx:>5} parts={parts:>2}: {ms * 1e3:7.1f} us "
                 f"({kv_bytes / ms / 1e6:5.0f} GB/s) vs triton paged {base * 1e3:7.1f} us "
                 f"({base / ms:.2f}x); same bits {same}: "
                 + " ".join(f"{k} {v * 1e3:.1f}" for k, v in by_var.items()))
    return res


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("what", nargs="+", choices=["gemm", "attn", "attn_decode", "decode"])
    p.add_argument("--json", default="")
    p.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny shapes")
    p.add_argument("--variants", action="store_true",
                   help="attn: also time the decode variants of VARIANTS")
    a = p.parse_args(argv)
    su = SMOKE if a.smoke else DEVICE
    res: dict[str, object] = {"device": torch.cuda.get_device_name() if not a.smoke else "cpu",
                              "triton": triton.__version__, "torch": torch.__version__}
    for what in a.what:
        variants = VARIANTS if a.variants else ()
        res[what] = {"gemm": tune_gemm, "decode": tune_decode,
                     "attn": partial(tune_attention, variants=variants),
                     "attn_decode": partial(tune_attention, prefill=False,
                                            variants=variants)}[what](su)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
