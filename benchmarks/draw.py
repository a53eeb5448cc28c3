"""The cost of drawing one decode step's tokens, per batch size: engine/draw.py
(one pass over the batch's logits) against the per-row host draw it replaced
(each row's logits to the host, softmax there, ``torch.multinomial`` on a CPU
generator seeded per row: what engine/sampling.py did until issue 18's run 6
found it took 398 ms of a decode step at batch 46 on the H200).

``python3 -m benchmarks.draw --device cuda`` (a 128k vocabulary, llama-8b-shape's;
temperature 1, top-p 1: the stack's requests). Times end with the tokens on the host.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from engine.draw import draw_rows
from engine.sampling import SamplingParams


def per_row_host(logits: torch.Tensor, params: list[SamplingParams], step: int) -> list[int]:
    """The replaced draw, kept here only to measure against."""
    out = []
    for i, p in enumerate(params):
        probs = torch.softmax(logits[i].float().cpu() / p.temperature, dim=-1)
        gen = torch.Generator(device="cpu").manual_seed(p.key(step))
        out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out


def batched(logits: torch.Tensor, params: list[SamplingParams], step: int) -> list[int]:
    return draw_rows(logits, [p.temperature for p in params], [p.top_p for p in params],
                     [p.key(step) for p in params])


def _median_ms(fn: Callable[[], object], sync: Callable[[], None], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cuda")
    p.add_argument("--vocab", type=int, default=128_256)
    p.add_argument("--batches", default="1,10,46,64")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out: dict[str, float] = {}
    for b in (int(x) for x in args.batches.split(",")):
        logits = torch.randn(b, args.vocab, device=dev) * 2
        params = [SamplingParams(temperature=1.0, seed=i) for i in range(b)]
        old = _median_ms(lambda x=logits, ps=params: per_row_host(x, ps, 3), sync,
                         max(1, args.repeats // (1 + b // 16)))
        new = _median_ms(lambda x=logits, ps=params: batched(x, ps, 3), sync, args.repeats)
        out[f"per_row_host_ms_b{b}"], out[f"draw_ms_b{b}"] = old, new
        print(f"batch {b:3d}: per-row host draw {old:8.2f} ms, one-pass draw {new:7.3f} ms "
              f"({old / new:,.0f}x)", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
