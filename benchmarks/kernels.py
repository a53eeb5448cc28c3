"""Side-by-side throughput of kernel families on one model (the cost of the
batch-invariant ``triton_bi`` against ``triton``): prefill tok/s and decode
tok/s per batch, each family on its own engine, built and timed one after the
other in one process.

``python3 -m benchmarks.kernels --device cuda --model llama-8b-shape --dtype bfloat16``
"""

from __future__ import annotations

import argparse
import gc
import json
import sys

import torch

from benchmarks.engine import bench_decode, bench_prefill
from benchmarks.harness import Chart, Report, Table, emit
from engine.config import EngineConfig
from engine.runner import Engine


def bench_family(model: str, dtype: str, device: str, kernels: str, prefill: int,
                 batches: tuple[int, ...], steps: int, ctx: int) -> dict[str, float]:
    eng = Engine(EngineConfig(model=model, dtype=dtype, device=device, kernels=kernels,
                              block_tokens=64, num_blocks=1024, prefill_chunk=2048,
                              decode_bucket=max(batches)))
    out = {"prefill_tok_s": prefill / bench_prefill(eng, prefill, repeat=3)}
    for b in batches:
        out[f"decode_tok_s_b{b}"] = bench_decode(eng, b, steps, ctx)
    del eng
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="smollm2-shape")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kernels", nargs="+", default=["triton", "triton_bi"])
    p.add_argument("--prefill", type=int, default=2048)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--png", default="", help="also draw the throughputs into this PNG")
    a = p.parse_args(argv)
    res: dict[str, object] = {"model": a.model, "dtype": a.dtype}
    for k in a.kernels:
        res[k] = bench_family(a.model, a.dtype, a.device, k, a.prefill, tuple(a.batches),
                              a.steps, a.ctx)
        print(json.dumps({k: res[k]}), file=sys.stderr, flush=True)
    base, other = a.kernels[0], a.kernels[-1]
    fb, fo = res[base], res[other]
    assert isinstance(fb, dict) and isinstance(fo, dict)
    res[f"{other}_vs_{base}"] = {key: fo[key] / fb[key] for key in fb}
    families = {k: res[k] for k in a.kernels}
    table = Table(("metric", *a.kernels, f"{other}/{base}"))
    for key in fb:
        table.add(key, *[families[k][key] for k in a.kernels], fo[key] / fb[key])
    # JSON on stdout always (the GPU runs collect it), the table on stderr.
    emit(Report(f"kernel families on {a.model} {a.dtype}, {a.device}", res, [table],
                chart=Chart(f"kernel families, {a.model} {a.dtype}", tuple(fb),
                            {k: list(families[k].values()) for k in a.kernels},
                            ylabel="tokens/s")), as_json=True, png=a.png)


if __name__ == "__main__":
    main()
