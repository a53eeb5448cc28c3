"""The K split of the narrow ``triton_bi`` GEMMs (qkv, o, down) measured in the
engine: one llama-8b-shape ``triton_bi`` engine, and for each variant (the
split rule on or off, the plan of the 33-64-row decode tiles, how a split GEMM
of many rows runs) its prefill tok/s and decode tok/s with the roofline
fraction, the decode graphs recaptured per variant. Variants of one split rule
must give the same bits: their first decode step's logits are compared with
the first variant's of that rule.

``python3 -m benchmarks.gemm_splits --json OUT.json`` (CUDA; issue 21 item 1).
The engine's model fingerprint keeps the shipped rule's name (nothing here is
stored or shared).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks.engine import (
    _prompt,
    bench_decode,
    bench_prefill,
    decode_limit_tok_s,
    mem_copy_gbps,
)
from benchmarks.harness import save_json
from engine import triton_gemm as tg
from engine.config import EngineConfig
from engine.runner import Engine


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    splits: int                         # tg.SPLITS: 1 is the unsplit arithmetic (tbi4)
    narrow_64: tg.GemmPlan | None       # 33-64 rows, narrow outputs; None: the table's
    prefill: tg.GemmPlan | None = None  # more rows, narrow outputs; None: the table's
    loop: bool = True                   # more rows: the splits in turn in one program


def _plans(v: Variant) -> Callable[[int, int, int], tg.GemmPlan]:
    def plan(m: int, n: int, splits: int = 1) -> tg.GemmPlan:
        if 32 < m <= 64 and n < 128 * 128 and v.narrow_64 is not None:
            return v.narrow_64
        if m > 64 and n < 128 * 128 and v.prefill is not None:
            return v.prefill
        return tg.plan_16bit(m, n, splits)
    return plan


VARIANTS = (
    Variant("unsplit (tbi4)", 1, None),
    Variant("split2 table", 2, None),
    Variant("split2 64x64 s4 k128", 2, tg.GemmPlan(64, 64, 4, 4, bk=128)),
    Variant("split2 64x64 s6 k128", 2, tg.GemmPlan(64, 64, 4, 6, bk=128)),
    Variant("split2 swap 64x64 s6 k64", 2, tg.GemmPlan(64, 64, 4, 6, swap=True)),
    Variant("split2 swap 64x128 s4 k128", 2, tg.GemmPlan(64, 128, 4, 4, swap=True, bk=128)),
    Variant("split2 prefill a program a split", 2, None, tg.GemmPlan(128, 128, 8, 4),
            loop=False),
    Variant("unsplit, prefill 128x128", 1, None, tg.GemmPlan(128, 128, 8, 4)),
)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="llama-8b-shape")
    p.add_argument("--prefill", type=int, default=4096)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--only", type=int, nargs="*", default=None, help="variant indices")
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    eng = Engine(EngineConfig(model=a.model, dtype="bfloat16", device="cuda",
                              kernels="triton_bi", block_tokens=64, num_blocks=1024,
                              prefill_chunk=2048, decode_bucket=max(a.batches)))
    runner = eng._paged
    assert runner is not None
    shipped = dict(tg.PLANS), tg.SPLITS, tg.LOOP_ROWS
    bw = mem_copy_gbps(eng.device) * 1e9
    res: dict[str, object] = {"model": a.model, "copy_gbps": bw / 1e9}
    first: dict[int, torch.Tensor] = {}
    picked = [VARIANTS[i] for i in a.only] if a.only else list(VARIANTS)
    for v in picked:
        tg.PLANS[torch.bfloat16] = _plans(v)
        tg.SPLITS = v.splits
        tg.LOOP_ROWS = shipped[2] if v.loop else 1 << 30
        runner.reset_graphs()
        row: dict[str, object] = {}
        try:
            row["prefill_tok_s"] = a.prefill / bench_prefill(eng, a.prefill, 3)
            # the first step's logits of a 64-row batch: the bits of this rule
            sids = [f"s{i}" for i in range(64)]
            try:
                for i, s in enumerate(sids):
                    eng.prefill(s, _prompt(a.ctx, eng.model_config.vocab_size, 500 + i))
                seqs = [eng._seqs[s] for s in sids]
                # the pending token's block first (at a block's end it is a new one),
                # as decode_step does
                eng._grow(seqs)
                logits = eng._decode_logits(seqs, len(seqs)).float().cpu()
            finally:                        # a failed variant leaves none live for the next
                for s in sids:
                    if s in eng._seqs:
                        eng.free(s)
            ref = first.setdefault(v.splits, logits)
            row["same_bits_as_rule"] = bool(torch.equal(ref, logits))
            for b in a.batches:
                tok_s = bench_decode(eng, b, a.steps, a.ctx)
                row[f"decode_tok_s_b{b}"] = tok_s
                row[f"decode_b{b}_vs_roofline"] = tok_s / decode_limit_tok_s(
                    eng, b, a.ctx, a.steps, bw)
        except Exception as e:              # a plan the compiler refuses: say so, go on
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        res[v.name] = row
        _log(f"{v.name:<42} " + " ".join(
            f"{k}={val:.4g}" if isinstance(val, float) else f"{k}={val}"
            for k, val in row.items()))
    tg.PLANS.update(shipped[0])
    tg.SPLITS, tg.LOOP_ROWS = shipped[1], shipped[2]
    save_json(res, a.json)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
