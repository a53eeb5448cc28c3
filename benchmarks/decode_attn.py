"""The batch-invariant decode attention alone (llama-8b-shape heads: 32 query
heads, 8 KV heads, dim 128, bf16, 64-token blocks; CUDA), each decode schedule
(``engine.triton_attention.DecodeSchedule``: loop form, pipeline stages, warps,
register cap) at batch 1 / 8 / 64 and each context: time a layer, the KV
bytes it reads over that time, and its rows bit for bit against main's
schedule (``DecodeSchedule()``). Each timed call walks several layers of one pool
(``--layers``), so no layer's KV is still in L2 from the layer before; the
HBM copy is timed in the same process.

Below b64 a layer's eager launch from Python outlasts its kernel, so those
rows time the host (tens of us a layer on the H200); the decode graphs'
kernel times are ``benchmarks.decode_profile``'s.

``python3 -m benchmarks.decode_attn --json OUT.json``; ``--best FILE`` writes
the fastest schedule at batch 64 (first context) whose rows were equal at
every batch and context (issue 21, docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch

from benchmarks.engine import mem_copy_gbps
from benchmarks.harness import save_json
from engine import triton_attention as ta
from engine.paged_decode import splits_for

HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 64
SHIPPED = ta.DecodeSchedule()                 # every row is compared with its rows
SCHEDULES = ("l0s2w4", "l0s3w4", "l1s2w4", "l2s2w4", "l2s3w4", "l2s3w8")
# last: a variant of this kind (one stage) met an illegal address on the H200
# once (2026-12-02), which would end every measurement after it
RISKY = ("l0s1w4r128",)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _ms(fn: Callable[[], None], dev: torch.device) -> float:
    if dev.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=20, rep=100, return_mode="median"))
    t0 = time.perf_counter()                     # --smoke: the interpreter, once
    fn()
    return (time.perf_counter() - t0) * 1e3


def bench_case(b: int, ctx: int, layers: int, schedules: list[ta.DecodeSchedule],
               parts: list[int], dev: torch.device,
               more_parts: tuple[str, ...] = ()) -> dict[str, dict[str, float | bool]]:
    """One batch and context: every schedule at ``parts[0]`` programs a row,
    those named in ``more_parts`` at the other counts too, against the first."""
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float16   # no bf16 interpreted
    g = torch.Generator(device=dev).manual_seed(b * 100_003 + ctx)
    per = -(-ctx // BLOCK)
    pool = torch.randn(layers, 2, KV_HEADS, b * per + 1, BLOCK, DIM, device=dev,
                       generator=g).to(dtype)
    perm = torch.randperm(b * per, device=dev, generator=g)
    segs = [ta.AttnSegment(i, 1, ctx - 1, perm[i * per:(i + 1) * per]) for i in range(b)]
    q = torch.randn(b, HEADS, DIM, device=dev, generator=g).to(dtype)
    acc, ml = ta.decode_scratch(b, ctx, HEADS, DIM, dev)
    kv_bytes = 2 * b * ctx * KV_HEADS * DIM * 2
    first: torch.Tensor | None = None
    res: dict[str, dict[str, float | bool]] = {}
    for sch in schedules:
        for n in parts if str(sch) in more_parts else parts[:1]:
            inv = ta.InvariantAttention(pool, segs, HEADS, parts=n, schedule=sch)
            out = torch.full((b, HEADS * DIM), float("nan"), device=dev, dtype=dtype)
            inv(0, q, 0, out, acc, ml)
            first = out.clone() if first is None else first
            same = bool(torch.equal(out, first))

            def run(inv: ta.InvariantAttention = inv, out: torch.Tensor = out) -> None:
                for layer in range(layers):
                    inv(layer, q, 0, out, acc, ml)

            us = 1e3 * _ms(run, dev) / layers
            key = f"{sch}p{n}"
            res[key] = {"us": us, "gbps": kv_bytes / us / 1e3, "same_bits": same}
            _log(f"b{b:<3} ctx {ctx:>6} {key:<14} {us:8.1f} us a layer "
                 f"{kv_bytes / us / 1e3:7.0f} GB/s  same bits {same}")
    del pool
    torch.cuda.empty_cache()
    return res


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batches", type=int, nargs="+", default=[64, 8, 1])
    p.add_argument("--ctx", type=int, nargs="+", default=[272, 2064],
                   help="keys a row reads (the benchmark's mean 256 + 16 steps; a "
                        "2k-token stack prompt)")
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    p.add_argument("--small", nargs="+", default=["l0s2w4", "l2s3w4"],
                   help="schedules timed at batches below 64")
    p.add_argument("--risky", nargs="*", default=list(RISKY), help="b64 only, run last")
    p.add_argument("--parts", type=int, nargs="*", default=[2, 4],
                   help="share counts also timed at b64 (rows of several splits)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--json", default="")
    p.add_argument("--best", default="", help="write the fastest equal schedule here")
    p.add_argument("--smoke", action="store_true",
                   help="CPU under TRITON_INTERPRET=1, tiny: the script's own check")
    a = p.parse_args(argv)
    dev = torch.device("cpu" if a.smoke else "cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if not a.smoke else 132
    mem_copy_gbps(dev)                              # the first copy of a process reads low
    res: dict[str, object] = {"hbm_copy_gbps": mem_copy_gbps(dev),
                              "device": "cpu" if a.smoke else torch.cuda.get_device_name()}
    _log(f"HBM copy {res['hbm_copy_gbps']:.0f} GB/s")
    parse = ta.DecodeSchedule.parse
    all_same = True
    for ctx in a.ctx:
        for b in a.batches:
            names = a.schedules if b == 64 else a.small
            scheds = [SHIPPED] + [parse(s) for s in names if parse(s) != SHIPPED]
            shares = [splits_for(b, KV_HEADS, sms)]
            if b == 64 and ctx > ta.KEY_SPLIT:
                shares += [n for n in a.parts if n not in shares]
            case = bench_case(b, ctx, a.layers, scheds, shares, dev,
                              (str(SHIPPED), str(ta.AHEAD_DECODE)))
            res[f"b{b}_ctx{ctx}"] = case
            all_same &= all(bool(r["same_bits"]) for r in case.values())
            save_json(res, a.json)
    res["all_same_bits"] = all_same
    key = f"b64_ctx{a.ctx[0]}"
    if key in res and all_same:
        case = res[key]
        assert isinstance(case, dict)
        best = min(case, key=lambda k: case[k]["us"])
        res["best_b64"] = best.split("p")[0]
        _log(f"fastest at b64 ctx {a.ctx[0]}: {best} ({case[best]['us']:.1f} us)")
        if a.best:
            from security.secret_files import write_private

            write_private(a.best, str(res["best_b64"]))
    save_json(res, a.json)
    for ctx in a.ctx:                               # last: an illegal address ends the rest
        if 64 in a.batches and a.risky:
            try:
                case = bench_case(64, ctx, a.layers, [SHIPPED] + [
                    parse(s) for s in a.risky], [splits_for(64, KV_HEADS, sms)], dev)
            except Exception as e:
                _log(f"risky schedules failed: {e!r}"[:300])
                break
            res[f"b64_ctx{ctx}_risky"] = case
            save_json(res, a.json)
    save_json(res, a.json)


if __name__ == "__main__":
    main()
