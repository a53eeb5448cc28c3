"""Where a cold prefill's time goes on the CPU, op by op (issue 18): the
engine's ``bik`` kernels wrapped with timers (GEMMs by shape, attention, the
residual add + RMSNorm, SiLU, RoPE, the KV write, the LM head), a
``--tokens`` random prompt prefilled ``--runs`` times, the fastest run's
split printed. Wrapped calls nest (``add_rms_norm`` holds an ``rms_norm``),
so "other" can come out below zero.

    python -m benchmarks.prefill_ops [--tokens 1493] [--runs 3]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from engine import bik, kernels
from engine.config import EngineConfig
from engine.runner import Engine

Times = dict[str, list[float]]


def _wrap(obj: Any, name: str, key: Callable[[tuple, Any], str], times: Times) -> None:
    f = getattr(obj, name)

    def timed(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        r = f(*a, **kw)
        times[key(a, r)].append(time.perf_counter() - t0)
        return r
    setattr(obj, name, timed)


def _gemm_key(a: tuple, r: torch.Tensor) -> str:
    return "lm_head" if r.shape[1] > 40000 else f"linear {a[1].shape[0]} rows -> {r.shape[1]}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.prefill_ops", description=__doc__)
    ap.add_argument("--tokens", type=int, default=1493)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args(argv)
    times: Times = defaultdict(list)
    k = kernels.BIKernels
    _wrap(k, "linear", _gemm_key, times)
    for op in ("rms_norm", "add_rms_norm", "silu_mul", "rope"):
        _wrap(k, op, lambda _a, _r, op=op: op, times)
    _wrap(bik.PagedAttention, "__call__", lambda _a, _r: "attention", times)
    eng = Engine(EngineConfig(model="smollm2", block_tokens=64, num_blocks=512, kernels="bik"))
    _wrap(type(eng.storage), "write", lambda _a, _r: "kv write", times)
    g = torch.Generator().manual_seed(7)
    toks = torch.randint(0, eng.model_config.vocab_size, (a.tokens,), generator=g).tolist()
    best: tuple[float, dict[str, float]] | None = None
    for _ in range(a.runs):
        times.clear()
        t0 = time.perf_counter()
        eng.prefill("c", toks)
        total = time.perf_counter() - t0
        eng.free("c")
        print(f"run: {total:.3f} s")
        if best is None or total < best[0]:
            best = (total, {op: sum(ts) for op, ts in times.items()})
    assert best is not None
    total, split = best
    print(f"fastest {total * 1e3:.0f} ms; bik threads {bik.threads()}, torch threads "
          f"{torch.get_num_threads()}")
    for op in sorted(split, key=lambda op: -split[op]):
        print(f"  {op:28s} {split[op] * 1e3:8.1f} ms")
    print(f"  {'other':28s} {(total - sum(split.values())) * 1e3:8.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
