"""Decode-sized ``triton_bi`` GEMM plans swept per weight shape (issue 21): which
tile streams each llama-8b-shape weight fastest at M = 32 / 48 / 64 while
keeping every row's bits.

For each weight (qkv, o, gate_up, down, LM head), each row count and each
candidate plan (``CANDIDATES``: tile, operand side, K per stage, stages, warps,
TMA loads): the candidate's rows at the bucket's row counts (two offsets) are
compared bit for bit with the shipped 2,048-row call, then its calls are timed
in a CUDA graph with dependent launches (as the decode graphs run them) over
copies of the weight that together outgrow the L2 many times, so every call
streams its weight from HBM. A call's time is set against the bytes' bound:
the weight's bytes over the same run's copy bandwidth (a 2 GiB device copy,
bytes read plus written). Only candidates whose rows all matched may be
picked; the fastest per weight and bucket goes into ``table`` (the shape of
``engine.triton_gemm.DECODE_PLANS``) when it beats the shipped plan by
``--margin``.

``python3 -m benchmarks.gemm_sweep --model llama-8b-shape --m 32 48 64 --json OUT.json``
(CUDA). ``benchmarks.decode_profile --gemm-table OUT.json`` runs the table in
the engine (mode part ``gsweep``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, replace

import torch

from benchmarks.engine import mem_copy_gbps
from benchmarks.harness import save_json
from engine import triton_gemm as tg
from engine import triton_pdl
from security.secret_files import write_private

# (K, N) by weight, the narrow outputs first (the b64 step's lever)
SHAPES = {"llama-8b-shape": {"down": (14336, 4096), "qkv": (4096, 6144), "o": (4096, 4096),
                             "gate_up": (4096, 28672), "lm_head": (4096, 128256)}}


def _p(bm: int, bn: int, stages: int, bk: int = 64, warps: int = 4, swap: bool = False,
       tma: bool = False) -> tg.GemmPlan:
    return tg.GemmPlan(bm, bn, warps, stages, swap=swap, bk=bk, persistent=tma)


# Each keeps the 16-deep K steps from K = 0 in one accumulator per output (one
# split); they differ in what a program covers and how its loads are issued.
# Pipelines stay within the H200's 227 KB of shared memory a program.
CANDIDATES: tuple[tg.GemmPlan, ...] = (
    # 64-row tiles, the input rows on the instruction's 64-row side
    *(_p(64, 64, st, bk) for st, bk in ((4, 128), (6, 128), (3, 256), (8, 64))),
    _p(64, 32, 8, 128),
    *(_p(64, 128, st, bk) for st, bk in ((4, 128), (2, 256))),
    # weight-major: the weight's columns on the 64-row side (warps along them)
    *(_p(64, 64, st, bk, swap=True) for st, bk in ((4, 128), (6, 128), (3, 256))),
    *(_p(64, 128, st, bk, w, swap=True) for st, bk, w in ((4, 64, 4), (4, 128, 4), (3, 128, 8),
                                                         (4, 128, 8))),
    _p(64, 256, 3, 64, 8, swap=True),
    # the tensor-copy engine loading both operands
    *(_p(64, 64, st, bk, swap=True, tma=True) for st, bk in ((4, 128), (6, 128), (3, 256))),
    *(_p(64, 128, st, bk, w, swap=True, tma=True) for st, bk, w in ((3, 128, 4), (4, 128, 8),
                                                                   (2, 256, 8))),
    *(_p(64, bn, st, bk, tma=True) for bn, st, bk in ((64, 6, 128), (128, 4, 128))),
)


def label(p: tg.GemmPlan) -> str:
    """``64x64 ...``: rows x columns a program; ``swap W128 ...``: a weight-major
    tile of 128 weight columns (its input side follows M)."""
    tile = f"swap W{p.bn}" if p.swap else f"{p.bm}x{p.bn}"
    return f"{tile} w{p.warps} s{p.stages} k{p.bk}" + (" tma" if p.persistent else "")


def at_m(p: tg.GemmPlan, m: int) -> tg.GemmPlan:
    """A weight-major plan's input side follows the row count (as the table's)."""
    return replace(p, bm=tg.x_tile(m)) if p.swap else p


def bucket_rows(bucket: int) -> tuple[int, ...]:
    """Row counts a plan of this bucket serves, checked bit for bit."""
    lo = bucket // 2 + 1 if bucket > 16 else 1
    return tuple(sorted({lo, (lo + bucket) // 2, bucket}))


@dataclass(frozen=True, slots=True)
class Timing:
    us: float            # one call, mean over the graph's calls and replays
    gbps: float          # weight bytes over that time
    of_copy: float       # gbps over the same run's copy bandwidth


def _graph_us(calls: list, replays: int) -> float:
    """Mean time of one of ``calls`` in a PDL graph of all of them."""
    with triton_pdl.dependent_launches(True):
        for c in calls:                # compiles, and any allocator growth, before capture
            c()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for c in calls:
                c()
    for _ in range(2):
        graph.replay()
    t0 = torch.cuda.Event(enable_timing=True)
    t1 = torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(replays):
        graph.replay()
    t1.record()
    torch.cuda.synchronize()
    del graph
    return 1e3 * t0.elapsed_time(t1) / (replays * len(calls))


def sweep_shape(name: str, k: int, n: int, ms: list[int], copy_gbps: float,
                cands: tuple[tg.GemmPlan, ...], stream_bytes: float, replays: int,
                layout: str = "kn", log=print) -> list[dict]:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(k * 7 + n)
    # weights.py keeps [K, N] rows (``nk``: an [N, K] matrix's transposed view, as
    # the GPU tests and engine/triton_tune.py build them)
    w0 = (torch.randn(*((n, k) if layout == "nk" else (k, n)), device=dev, generator=g)
          * 0.02).to(torch.bfloat16)
    wbytes = w0.numel() * 2
    copies = [w0] + [w0.clone() for _ in range(max(1, math.ceil(stream_bytes / wbytes)) - 1)]
    wts = [w.t() if layout == "nk" else w for w in copies]          # each [K, N]
    x = torch.randn(2048, k, device=dev, generator=g).to(torch.bfloat16)
    canon = tg.linear(x, wts[0])                        # the shipped 2,048-row plan
    rows: list[dict] = []

    def timing(m: int, plan: tg.GemmPlan | None) -> Timing:
        xs = x[:m]
        us = _graph_us([lambda w=w: tg.linear(xs, w, plan=plan) for w in wts], replays)
        gbps = wbytes / us / 1e3
        return Timing(us, gbps, gbps / copy_gbps)

    for m in ms:
        bucket = tg.x_tile(m)
        shipped = tg.PLANS[torch.bfloat16](m, n, tg.k_splits(torch.bfloat16, n, k), k=k)
        t = timing(m, None)
        rows.append({"shape": name, "m": m, "plan": "shipped: " + label(shipped),
                     "same_bits": True, **asdict(t), "shipped": True,
                     "spec": asdict(shipped)})
        log(f"{name:<8} M={m:<3} {'shipped: ' + label(shipped):<36} {'-':>5} "
            f"{t.us:8.1f} us {t.gbps:7.0f} GB/s {t.of_copy:6.3f}")
        for p in cands:
            try:
                same = all(torch.equal(tg.linear(x[a:a + r], wts[0], plan=at_m(p, r)),
                                       canon[a:a + r])
                           for r in bucket_rows(bucket) for a in (0, 2048 - r))
                t = timing(m, at_m(p, m))
            except Exception as e:      # a plan the compiler or the launch refuses: go on
                rows.append({"shape": name, "m": m, "plan": label(p),
                             "error": f"{type(e).__name__}: {e}"[:200]})
                log(f"{name:<8} M={m:<3} {label(p):<36} failed: {type(e).__name__}: {e}"[:160])
                continue
            rows.append({"shape": name, "m": m, "plan": label(p), "same_bits": same,
                         **asdict(t), "spec": asdict(p)})
            log(f"{name:<8} M={m:<3} {label(p):<36} {same!s:>5} {t.us:8.1f} us "
                f"{t.gbps:7.0f} GB/s {t.of_copy:6.3f}")
    return rows


def pick(rows: list[dict], shapes: dict[str, tuple[int, int]], margin: float) -> dict:
    """Per weight and bucket, the fastest candidate whose rows all matched, at the
    bucket's own row count (the decode graphs run 32 or 64 rows), and the table
    entry when it beats the shipped plan by ``margin``."""
    best: dict[str, dict] = {}
    table: list[dict] = []
    for r in rows:
        if "us" not in r or r["m"] != tg.x_tile(r["m"]):
            continue
        key = f"{r['shape']}@{r['m']}"
        slot = best.setdefault(key, {})
        if r.get("shipped"):
            slot["shipped"] = r
        elif r["same_bits"] and ("best" not in slot or r["us"] < slot["best"]["us"]):
            slot["best"] = r
    for key, slot in best.items():
        name, m = key.split("@")
        if "best" not in slot or "shipped" not in slot:
            continue
        gain = slot["shipped"]["us"] / slot["best"]["us"] - 1
        slot["gain"] = gain
        if gain >= margin:
            k, n = shapes[name]
            table.append({"k": k, "n": n, "bucket": int(m), "plan": slot["best"]["spec"],
                          "label": slot["best"]["plan"]})
    return {"best": best, "table": table}


def load_table(path: str) -> dict[tuple[int, int, int], tg.GemmPlan]:
    """A sweep's ``table`` as ``engine.triton_gemm.DECODE_PLANS``."""
    with open(path) as f:
        data = json.load(f)
    return {(e["k"], e["n"], e["bucket"]): tg.GemmPlan(**e["plan"]) for e in data["table"]}


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="llama-8b-shape", choices=sorted(SHAPES))
    p.add_argument("--m", type=int, nargs="+", default=[32, 48, 64])
    p.add_argument("--shapes", nargs="+", default=None, help="default: every weight")
    p.add_argument("--only", type=int, nargs="*", default=None, help="candidate indices")
    p.add_argument("--stream-gb", type=float, default=1.5,
                   help="bytes of weight copies a timed graph streams (L2 is 50-60 MB)")
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--margin", type=float, default=0.02,
                   help="a plan enters the table when this much faster than the shipped one")
    p.add_argument("--layout", default="kn", choices=["kn", "nk"],
                   help="weights stored [K, N] (the engine's) or [N, K]")
    p.add_argument("--write-table", default="",
                   help="write the table as a module (engine/triton_gemm_table.py)")
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    if bad := [m for m in a.m if not 1 <= m <= 64]:
        p.error(f"--m: decode row counts are 1..64, not {bad}")
    shapes = {s: SHAPES[a.model][s] for s in (a.shapes or SHAPES[a.model])}
    cands = tuple(CANDIDATES[i] for i in a.only) if a.only else CANDIDATES
    dev = torch.device("cuda")
    mem_copy_gbps(dev)                  # the first copy of a process reads low
    copy = mem_copy_gbps(dev)
    _log(f"copy {copy:.0f} GB/s; {len(cands)} candidates; shapes {list(shapes)}; M {a.m}")
    _log(f"layout {a.layout}")
    _log(f"{'weight':<8} {'M':<5} {'plan':<36} {'same':>5} {'time':>11} {'rate':>12} "
         f"{'of copy':>6}")
    rows: list[dict] = []
    res: dict[str, object] = {}
    # every call with dependent launches, checked and timed alike: one build a plan
    with triton_pdl.dependent_launches(True):
        for name, (k, n) in shapes.items():
            rows += sweep_shape(name, k, n, a.m, copy, cands, a.stream_gb * 1e9, a.replays,
                                a.layout, _log)
            torch.cuda.empty_cache()        # this weight's copies before the next's
            # saved after each weight: a run cut short keeps what it measured
            res = {"model": a.model, "layout": a.layout, "copy_gbps": copy, "rows": rows,
                   **pick(rows, shapes, a.margin)}
            save_json(res, a.json)
    copy_after = mem_copy_gbps(dev)
    res["copy_gbps_after"] = copy_after
    _log(f"copy after: {copy_after:.0f} GB/s")
    _log("best invariant plan per weight and bucket (us, of copy) against the shipped:")
    best = res.get("best", {})
    assert isinstance(best, dict)
    for key, slot in best.items():
        if "best" in slot and "shipped" in slot:
            b, s = slot["best"], slot["shipped"]
            _log(f"  {key:<12} {b['plan']:<32} {b['us']:7.1f} us {b['of_copy']:.3f}  "
                 f"{s['plan']:<36} {s['us']:7.1f} us {s['of_copy']:.3f}  "
                 f"{100 * slot['gain']:+.1f} %")
    table = res.get("table", [])
    assert isinstance(table, list)
    _log(f"table: {[(e['k'], e['n'], e['bucket'], e['label']) for e in table]}")
    save_json(res, a.json)
    if a.write_table:
        write_private(a.write_table, table_module(res))


def table_module(res: dict) -> str:
    """``engine/triton_gemm_table.py``: the table as plain literals (the engine
    builds its plans from them), each entry with what the sweep measured."""
    best = res.get("best", {})
    lines = [
        '"""Decode GEMM plans by weight shape, as benchmarks/gemm_sweep.py measured them',
        f"({torch.cuda.get_device_name()}, copy {res['copy_gbps']:.0f} GB/s, weights "
        f"{res.get('layout', 'kn')}):",
        "{(K, N, rows bucket): GemmPlan fields}, each faster than the 64-row rule's",
        "plan at the bucket's own row count with every row's bits kept (checked",
        "against a 2,048-row call there). Written by ``python3 -m",
        "benchmarks.gemm_sweep --write-table``; docs/BENCHMARKS.md, issue 21.",
        '"""', "", "TABLE: dict[tuple[int, int, int], dict[str, object]] = {"]
    for e in res.get("table", []):
        slot = best.get(next((f"{s}@{e['bucket']}" for s in SHAPES[res["model"]]
                              if SHAPES[res["model"]][s] == (e["k"], e["n"])), ""), {})
        b, sh = slot.get("best", {}), slot.get("shipped", {})
        lines.append(f"    # {b.get('us', 0):.1f} us ({b.get('of_copy', 0):.3f} of the copy) "
                     f"against {sh.get('us', 0):.1f} ({sh.get('plan', '?')})")
        items = [f'"{key}": {val!r}' for key, val in e["plan"].items()
                 if key != "group_m"]               # one row tile: no grouping
        lines += [f"    ({e['k']}, {e['n']}, {e['bucket']}):",
                  "        {" + ", ".join(items[:4]) + ",",
                  "         " + ", ".join(items[4:]) + "},"]
    lines.append("}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
