"""Where a CUDA decode step's time goes, and what dependent launches
(engine/triton_pdl.py) and other decode choices change, in one process.

For each kernel family and batch: decode tok/s and its fraction of the HBM
roofline (a copy timed in the same process, as ``benchmarks.kernels``), the
step split into the graph's device time and the rest (inputs, sampling, the
tokens' copy back: ``Engine.last_step``), the graph's replays alone, and each
launch mode's logits and greedy tokens against the plain mode's, bit for bit.
Then a ``torch.profiler`` trace of graph replays at the chosen batches: time
per kernel, and the gaps between kernels inside the graph.

``python3 -m benchmarks.decode_profile --model llama-8b-shape --json OUT.json``.
A mode is ``plain`` or ``+``-joined parts: ``pdl`` (dependent launches),
``nBMxBNsSkK`` (``triton_gemm.NARROW_64``, the 33-64-row plan of narrow
outputs: tile, stages, K per stage), ``asN`` (decode attention pipeline
stages), ``l2s3w4`` (a decode attention schedule,
``triton_attention.DecodeSchedule``), ``host0`` (the host work between
replays as before issue 21: every input rebuilt and sent, the unfused draw;
``DecodeRunner.staged``, ``draw.FUSED``), ``gsweep`` (the decode GEMM plans
by weight shape of ``--gemm-table``, a ``benchmarks.gemm_sweep`` JSON, in
``triton_gemm.DECODE_PLANS``), ``g0`` (none: the 64-row rule alone, the plans
before that table); ``@B`` at the end runs it at batch B
only. A mode given twice is run twice (its second row's key ends in ``'``), so
``host0`` and the shipped path can alternate in one process. Plans, stages,
schedules and ``host0`` only schedule the same arithmetic: the bit
checks say whether that held. Issue 21, docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import replace

import torch

from benchmarks.engine import _prompt, decode_limit_tok_s, mem_copy_gbps
from benchmarks.harness import save_json
from engine import draw, triton_attention, triton_gemm
from engine.config import EngineConfig
from engine.runner import Engine


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


SHIPPED_N64 = triton_gemm.NARROW_64
SHIPPED_DECODE = triton_attention.DECODE
SHIPPED_TABLE = dict(triton_gemm.DECODE_PLANS)
SWEPT_TABLE: dict[tuple[int, int, int], triton_gemm.GemmPlan] = {}   # --gemm-table


def parse_plan(spec: str) -> triton_gemm.GemmPlan:
    """``64x32s6k128`` -> GemmPlan(64, 32, 4 warps, 6 stages, bk=128)."""
    tile, rest = spec.split("s")
    stages, bk = rest.split("k")
    bm, bn = tile.split("x")
    return triton_gemm.GemmPlan(int(bm), int(bn), 4, int(stages), bk=int(bk))


def set_mode(eng: Engine, mode: str) -> None:
    runner = eng._paged
    assert runner is not None
    parts = mode.split("@")[0].split("+")
    runner.pdl = "pdl" in parts
    runner.staged = draw.FUSED = "host0" not in parts
    triton_gemm.NARROW_64 = SHIPPED_N64
    triton_attention.DECODE = SHIPPED_DECODE
    triton_gemm.DECODE_PLANS = dict(SHIPPED_TABLE)
    for part in parts:
        if part == "gsweep":
            triton_gemm.DECODE_PLANS = dict(SWEPT_TABLE)
        elif part == "g0":
            triton_gemm.DECODE_PLANS = {}
        elif part.startswith("n"):
            triton_gemm.NARROW_64 = parse_plan(part[1:])
        elif part.startswith("as"):
            triton_attention.DECODE = replace(triton_attention.DECODE, stages=int(part[2:]))
        elif part.startswith("l"):
            triton_attention.DECODE = triton_attention.DecodeSchedule.parse(part)
    runner.reset_graphs()


def mode_batches(mode: str, batches: list[int]) -> list[int]:
    return [int(mode.split("@")[1])] if "@" in mode else batches


def _short(name: str) -> str:
    for key in ("_gemm_swap_kernel", "_gemm_kernel", "_decode_kernel", "_fold_splits",
                "_add_rms_norm_kernel", "_rms_norm_kernel", "_silu_mul_kernel", "_rope_kernel",
                "_write_kv_kernel", "_paged_decode_kernel", "_merge_splits_kernel"):
        if key in name:
            return key
    if "gemm" in name or "gemv" in name or "nvjet" in name or "xmma" in name:
        return "cublas:" + name[:48]
    return name[:60]


def profile_replays(eng: Engine, b: int, replays: int, out_dir: str, tag: str) -> dict:
    """Kernel time per name and the gaps between kernels, one graph replay's mean."""
    runner = eng._paged
    assert runner is not None
    graph, _ = runner._graph(b)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    path = os.path.join(out_dir, f"trace_{tag}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    kern = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    if not kern:
        return {"kernels": 0}
    per = len(kern) // replays
    by: dict[str, list[float]] = defaultdict(list)
    gaps_before: dict[str, float] = defaultdict(float)
    spans, busy, gaps = [], [], []
    for r in range(replays):
        ks = kern[r * per:(r + 1) * per]
        spans.append(ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"])
        busy.append(sum(k["dur"] for k in ks))
        g = 0.0
        for prev, k in itertools.pairwise(ks):
            gap = max(0.0, k["ts"] - (prev["ts"] + prev["dur"]))
            g += gap
            gaps_before[_short(k["name"])] += gap / replays
        gaps.append(g)
        for k in ks:
            by[_short(k["name"])].append(k["dur"])
    table = sorted(((n, len(d) / replays, sum(d) / replays) for n, d in by.items()),
                   key=lambda x: -x[2])
    return {"kernels_per_replay": per, "span_us": statistics.median(spans),
            "busy_us": statistics.median(busy), "gaps_us": statistics.median(gaps),
            "by_kernel": [{"name": n, "count": c, "us": us,
                           "gap_before_us": gaps_before[n]} for n, c, us in table]}


IDLE_STEPS = 8      # decode steps profiled for the device's idle time between them


def device_idle(eng: Engine, sids: list[str], steps: int) -> dict:
    """Per decode step (``Engine.decode_step`` as a server calls it): the device's
    span, its busy time (the union of kernels and copies) and the rest, idle: the
    gaps inside the graph plus the wait for the host between steps."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.decode_step(sids)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "steps.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    if not spans:
        return {}
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    span = end - spans[0][0]
    return {"device_step_us": span / steps, "device_busy_us": busy / steps,
            "device_idle_us": (span - busy) / steps}


def run_batch(eng: Engine, b: int, steps: int, ctx: int, bw: float, mode: str,
              ref: dict[int, dict]) -> dict:
    set_mode(eng, mode)
    sids = [f"d{i}" for i in range(b)]
    try:
        for i, s in enumerate(sids):
            eng.prefill(s, _prompt(ctx, eng.model_config.vocab_size, 1000 + i))
        return _run_batch(eng, sids, b, steps, ctx, bw, mode, ref)
    finally:
        for s in sids:
            if s in eng.live_sequences:
                eng.free(s)


def _run_batch(eng: Engine, sids: list[str], b: int, steps: int, ctx: int, bw: float,
               mode: str, ref: dict[int, dict]) -> dict:
    runner = eng._paged
    assert runner is not None
    seqs = [eng._seq(s) for s in sids]
    eng._grow(seqs)
    args = ([s.pending for s in seqs], [s.kv_len for s in seqs], [list(s.blocks) for s in seqs])
    logits = runner.step(*args).clone()         # captures this mode's graph
    eng.decode_step(sids)                       # warm-up (the same token again: same K/V)
    totals, fwds = [], []
    torch.cuda.synchronize()
    t0 = torch.cuda.Event(enable_timing=True)
    t1 = torch.cuda.Event(enable_timing=True)
    w0 = time.perf_counter()
    for _ in range(steps):
        eng.decode_step(sids)
        st = eng.last_step
        assert st is not None
        totals.append(st.total_s)
        fwds.append(st.forward_s)
    wall = time.perf_counter() - w0
    toks = [eng.seq_tokens(s)[ctx:] for s in sids]
    graph, _ = runner._graph(runner.bucket(b))
    t0.record()
    for _ in range(20):
        graph.replay()
    t1.record()
    torch.cuda.synchronize()
    replay_ms = t0.elapsed_time(t1) / 20
    tok_s = b * steps / wall
    limit = decode_limit_tok_s(eng, b, ctx, steps, bw)
    res = {"tok_s": tok_s, "vs_roofline": tok_s / limit,
           "step_ms": 1e3 * statistics.median(totals), "forward_ms": 1e3 * statistics.median(fwds),
           "other_ms": 1e3 * (statistics.median(totals) - statistics.median(fwds)),
           "replay_ms": replay_ms, "replay_vs_roofline": (b / (replay_ms / 1e3)) / limit,
           **device_idle(eng, sids, IDLE_STEPS)}
    if mode == "plain" or b not in ref:
        ref[b] = {"logits": logits, "tokens": toks}
    else:
        res["logits_equal"] = bool(torch.equal(logits, ref[b]["logits"]))
        res["tokens_equal"] = toks == ref[b]["tokens"]
    return res


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="llama-8b-shape")
    p.add_argument("--kernels", nargs="+", default=["triton_bi", "triton"])
    p.add_argument("--modes", nargs="+", default=["plain", "pdl"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--ctx", type=int, nargs="+", default=[256],
                   help="prompt lengths (several: each row and profile per context)")
    p.add_argument("--profile", type=int, nargs="*", default=[1, 64],
                   help="batches whose graph replays are profiled in --profile-modes")
    p.add_argument("--profile-modes", nargs="*", default=["plain", "pdl"])
    p.add_argument("--out", default=os.environ.get("OUT", tempfile.gettempdir()))
    p.add_argument("--gemm-table", default="",
                   help="a benchmarks.gemm_sweep JSON whose table the mode part gsweep runs")
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    if a.gemm_table:
        from benchmarks.gemm_sweep import load_table
        SWEPT_TABLE.update(load_table(a.gemm_table))
        _log(f"swept GEMM table: {SWEPT_TABLE}")
    from engine import triton_pdl
    _log(f"PDL supported: {triton_pdl.supported()} (gdc in Triton: {triton_pdl.HAVE_GDC})")
    res: dict[str, object] = {"model": a.model, "ctx": a.ctx, "steps": a.steps}
    # the largest batch at the longest context, its steps (timed and profiled),
    # the warm-up and a spare block a row, and the engine's scratch
    blocks = max(a.batches) * (-(-(max(a.ctx) + a.steps + IDLE_STEPS + 2) // 64) + 1) + 64
    for fam in a.kernels:
        eng = Engine(EngineConfig(model=a.model, dtype="bfloat16", device="cuda", kernels=fam,
                                  block_tokens=64, num_blocks=max(1024, blocks),
                                  prefill_chunk=2048, decode_bucket=max(a.batches)))
        # the first copy of a process reads low (3.76 against 4.1-4.2 TB/s on the
        # H200, 2026-12-02: benchmarks.kernels times it after its prefills)
        mem_copy_gbps(eng.device)
        bw = mem_copy_gbps(eng.device) * 1e9
        fr: dict[str, object] = {"hbm_copy_gbps": bw / 1e9}
        # plan and attention variants are triton_bi's kernels
        modes = a.modes if fam == "triton_bi" else [
            m for m in a.modes if all(p in ("plain", "pdl") for p in m.split("@")[0].split("+"))]
        for ctx in a.ctx:
            tag = f"c{ctx}_" if len(a.ctx) > 1 else ""
            ref: dict[int, dict] = {}
            for b in a.batches:
                for mode in modes:
                    if b not in mode_batches(mode, a.batches):
                        continue
                    try:
                        r = run_batch(eng, b, a.steps, ctx, bw, mode, ref)
                    except Exception as e:          # one mode failing leaves the others
                        r = {"error": repr(e)[:300]}
                    key = f"{tag}b{b}_{mode}"
                    while key in fr:
                        key += "'"
                    fr[key] = r
                    _log(f"{fam} ctx {ctx} b{b} {mode}: " + ", ".join(
                        f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                        for k, v in r.items()))
            for b in a.profile:
                for mode in a.profile_modes:
                    if mode not in modes:
                        continue
                    try:
                        set_mode(eng, mode)
                        prof = profile_replays(eng, b, 5, a.out, f"{fam}_{tag}b{b}_{mode}")
                    except Exception as e:
                        prof = {"error": repr(e)[:300]}
                    fr[f"profile_{tag}b{b}_{mode}"] = prof
                    _log(f"{fam} profile ctx {ctx} b{b} {mode}: " + json.dumps(
                        {k: v for k, v in prof.items() if k != "by_kernel"}))
                    for row in prof.get("by_kernel", [])[:14]:
                        _log(f"    {row['name']:<58} x{row['count']:<5.0f} {row['us']:9.1f} us"
                             f"  gaps before {row['gap_before_us']:7.1f} us")
        res[fam] = fr
        draw.FUSED = True               # the shipped draw for whatever runs next
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    save_json(res, a.json)


if __name__ == "__main__":
    main()
