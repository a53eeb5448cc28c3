"""Side-by-side throughput of kernel families on one model (the cost of the
batch-invariant ``triton_bi`` against ``triton``): prefill tok/s per prompt
length and decode tok/s per batch, each family on its own engine, built and
timed one after the other in one process.

``python3 -m benchmarks.kernels --model llama-8b-shape`` (bf16, CUDA; issue 21's
targets: prefill at 4k, 16k and 32k, decode at batch 1, 8 and 64). The last
line, ``cost``, is 1 - the worst ratio: what ``engine.kernels.TRITON_BI_COST``
records for a kernel version (``auto`` takes ``triton_bi`` when it is <= 0.10).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys

import torch

from benchmarks.engine import bench_decode, bench_prefill, decode_limit_tok_s, mem_copy_gbps
from benchmarks.harness import Chart, Report, Table, emit, save_json
from engine.config import EngineConfig
from engine.runner import Engine


def bench_family(model: str, dtype: str, device: str, kernels: str, prefill: tuple[int, ...],
                 chunk: int, batches: tuple[int, ...], steps: int, ctx: int,
                 repeat: int) -> dict[str, float]:
    longest = max(prefill)
    eng = Engine(EngineConfig(model=model, dtype=dtype, device=device, kernels=kernels,
                              block_tokens=64, num_blocks=max(1024, -(-longest // 64) + 64),
                              prefill_chunk=chunk, decode_bucket=max(batches)))
    out: dict[str, float] = {}
    limit = eng.model_config.max_position - 1
    for n in prefill:
        n = min(n, limit)
        out[f"prefill_tok_s_{n}"] = n / bench_prefill(eng, n, repeat=repeat)
        print(f"  {kernels} prefill {n}: {out[f'prefill_tok_s_{n}']:,.0f} tok/s",
              file=sys.stderr, flush=True)
    # the HBM roofline from a copy timed just before, in this process (as
    # ``kvserve bench engine`` reports it)
    bw = mem_copy_gbps(eng.device) * 1e9 if device.startswith("cuda") else 0.0
    for b in batches:
        out[f"decode_tok_s_b{b}"] = bench_decode(eng, b, steps, ctx)
        frac = out[f"decode_tok_s_b{b}"] / decode_limit_tok_s(eng, b, ctx, steps, bw) if bw \
            else 0.0
        out[f"decode_b{b}_vs_roofline"] = frac
        print(f"  {kernels} decode b{b}: {out[f'decode_tok_s_b{b}']:,.1f} tok/s "
              f"({frac:.3f} of the roofline)", file=sys.stderr, flush=True)
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
    p.add_argument("--prefill", type=int, nargs="+", default=[4096, 16384, 32768],
                   help="prompt lengths (capped at the model's context - 1)")
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens)")
    p.add_argument("--repeat", type=int, default=3, help="timed prefills per length (median)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--json", default="", help="also write the result here")
    p.add_argument("--png", default="", help="also draw the throughputs into this PNG")
    a = p.parse_args(argv)
    res: dict[str, object] = {"model": a.model, "dtype": a.dtype, "chunk": a.chunk,
                              "ctx": a.ctx, "steps": a.steps}
    for k in a.kernels:
        res[k] = bench_family(a.model, a.dtype, a.device, k, tuple(a.prefill), a.chunk,
                              tuple(a.batches), a.steps, a.ctx, a.repeat)
        print(json.dumps({k: res[k]}), file=sys.stderr, flush=True)
    base, other = a.kernels[0], a.kernels[-1]
    fb, fo = res[base], res[other]
    assert isinstance(fb, dict) and isinstance(fo, dict)
    ratios = {key: fo[key] / fb[key] for key in fb if fb[key] and "roofline" not in key}
    res[f"{other}_vs_{base}"] = ratios
    res["cost"] = 1 - min(ratios.values())
    save_json(res, a.json)
    families = {k: res[k] for k in a.kernels}
    table = Table(("metric", *a.kernels, f"{other}/{base}"))
    for key in fb:
        table.add(key, *[families[k][key] for k in a.kernels], ratios.get(key, float("nan")))
    # JSON on stdout always (the GPU runs collect it), the table on stderr.
    emit(Report(f"kernel families on {a.model} {a.dtype}, {a.device}", res, [table],
                chart=Chart(f"kernel families, {a.model} {a.dtype}", tuple(fb),
                            {k: list(families[k].values()) for k in a.kernels},
                            ylabel="tokens/s")), as_json=True, png=a.png)


if __name__ == "__main__":
    main()
