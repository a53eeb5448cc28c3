"""``kvserve bench hashing``: block-key chain throughput, native vs its ceiling and fallback.

Side by side in one run, interleaved so background load hits all three alike:

- native:   ``kvstore.keys.chain_keys_native`` (public API, C chain, list of keys),
            on the default leaf path (``native.HASH_PATH``: the fastest SIMD path)
- ceiling:  ``hashlib.blake2b(digest_size=16)`` over one buffer of the same bytes
            (the same algorithm with no per-block work: what one BLAKE2b stream does here)
- fallback: ``kvstore.keys.chain_keys_py`` (the hashlib loops, two calls per block)
- paths:    the native chain forced onto each leaf path this CPU has (scalar, avx2,
            avx512), so the table shows what CPUs without the SIMD paths get

GB/s = token bytes (4 per token) / best time over interleaved rounds (timeit's
convention: the minimum is the sample least disturbed by other load). A block-size sweep on the
128k prompt shows where per-block costs dominate.
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial

import numpy as np
from tqdm import tqdm

import native
from benchmarks.harness import Chart, Goal, Report, Table, calls_to_last, check_goals, interleaved
from kvserve.cli import UsageError
from kvstore.keys import chain_keys_native, chain_keys_py

PROMPTS = {"8k": 8 * 1024, "128k": 128 * 1024}
SWEEP_BLOCKS = (16, 32, 64, 128, 256)
FINGERPRINT = bytes(range(16))
GOAL_VS_CEILING = 0.8
GOAL_VS_FALLBACK = 3.0


def _goals(prompt: str) -> tuple[Goal, ...]:
    return (Goal(f"{prompt}: native >= {GOAL_VS_CEILING}x ceiling (same run)", "native_gbps",
                 at_least=GOAL_VS_CEILING, ref="ceiling_gbps"),
            Goal(f"{prompt}: native >= {GOAL_VS_FALLBACK}x fallback (same run)", "native_gbps",
                 at_least=GOAL_VS_FALLBACK, ref="fallback_gbps"))


@dataclass(frozen=True, slots=True)
class HashingResult:
    prompt: str
    tokens: int
    block_tokens: int
    native_gbps: float
    ceiling_gbps: float
    fallback_gbps: float
    paths_gbps: dict[str, float]  # leaf path -> native GB/s forced onto that path

    @property
    def vs_ceiling(self) -> float:
        return self.native_gbps / self.ceiling_gbps

    @property
    def vs_fallback(self) -> float:
        return self.native_gbps / self.fallback_gbps


def _best_gbps(fns: dict[str, Callable[[], object]], nbytes: int, rounds: int,
                 min_s: float = 0.002) -> dict[str, float]:
    """Interleaved rounds; each round times enough calls of each fn to last ``min_s``."""
    calls = {name: calls_to_last(fn, min_s) for name, fn in fns.items()}
    timings = interleaved({name: (lambda _r, fn=fn: fn()) for name, fn in fns.items()},
                          rounds=rounds, calls=calls)
    return {name: nbytes / tm.min / 1e9 for name, tm in timings.items()}


def measure(prompt: str, n_tokens: int, block_tokens: int, rounds: int) -> HashingResult:
    tokens = np.random.default_rng(n_tokens).integers(0, 2**32, n_tokens, dtype=np.uint64)
    tokens = tokens.astype("<u4")
    raw = tokens.tobytes()
    kw = dict(block_tokens=block_tokens, tenant="bench", fingerprint=FINGERPRINT)
    want = chain_keys_py(tokens, **kw)
    if any(chain_keys_native(tokens, path=p, **kw) != want for p in native.hash_paths()):
        raise RuntimeError("native and fallback keys differ: the extension is broken")
    fns: dict[str, Callable[[], object]] = {
        "native": lambda: chain_keys_native(tokens, **kw),
        "ceiling": lambda: hashlib.blake2b(raw, digest_size=16).digest(),
        "fallback": lambda: chain_keys_py(tokens, **kw),
    }
    others = [p for p in native.hash_paths() if p != native.HASH_PATH]
    for p in others:
        fns[p] = partial(chain_keys_native, tokens, path=p, **kw)
    gbps = _best_gbps(fns, len(raw), rounds)
    paths = {p: gbps[p] if p in others else gbps["native"] for p in native.hash_paths()}
    return HashingResult(prompt, n_tokens, block_tokens, gbps["native"], gbps["ceiling"],
                         gbps["fallback"], paths)


def run_bench(block_tokens: int, rounds: int, sweep: bool) -> tuple[list[HashingResult],
                                                                      list[HashingResult]]:
    main_cases = [(p, n, block_tokens) for p, n in PROMPTS.items()]
    sweep_cases = [("128k", PROMPTS["128k"], b) for b in SWEEP_BLOCKS] if sweep else []
    results: list[HashingResult] = []
    for prompt, n, b in tqdm(main_cases + sweep_cases, desc="bench hashing", file=sys.stderr):
        results.append(measure(prompt, n, b, rounds))
    return results[:len(main_cases)], results[len(main_cases):]


def _table(results: list[HashingResult], title: str) -> Table:
    table = Table(("prompt", "block", "native", "ceiling", "fallback", "n/ceil", "n/fb",
                   *native.hash_paths()), title=title)
    for r in results:
        table.add(r.prompt, r.block_tokens, r.native_gbps, r.ceiling_gbps, r.fallback_gbps,
                  f"{r.vs_ceiling:.2f}x", f"{r.vs_fallback:.2f}x", *r.paths_gbps.values())
    return table


def _chart(sweep: list[HashingResult]) -> Chart:
    series = {f"native (C, {native.HASH_PATH})": [r.native_gbps for r in sweep],
              "ceiling (hashlib, one buffer)": [r.ceiling_gbps for r in sweep],
              "fallback (hashlib loops)": [r.fallback_gbps for r in sweep]}
    if "scalar" in native.hash_paths() and native.HASH_PATH != "scalar":
        series["native, scalar path (no SIMD)"] = [r.paths_gbps["scalar"] for r in sweep]
    return Chart("block-key chain, 128k-token prompt", tuple(r.block_tokens for r in sweep),
                 series, ylabel="GB/s (token bytes)", xlabel="block_tokens", kind="line",
                 logx=2)


def report(args: argparse.Namespace) -> Report:
    """``kvserve bench hashing``: the flags in, the harness's report out."""
    if not native.HAVE_NATIVE:
        raise UsageError("the native extension is not available (not built, or "
                         "KVSERVE_NO_NATIVE=1): nothing to compare")
    if args.block_tokens < 1 or args.rounds < 1:
        raise UsageError("--block-tokens and --rounds must be >= 1")
    main, sweep = run_bench(args.block_tokens, args.rounds, not args.no_sweep)
    by_prompt = {r.prompt: r for r in main}
    big, small = by_prompt["128k"], by_prompt["8k"]
    verdicts = [v for r in main for v in check_goals(_goals(r.prompt), asdict(r))]
    out = {
        "native_gbps": big.native_gbps, "ceiling_gbps": big.ceiling_gbps,
        "fallback_gbps": big.fallback_gbps, "native_vs_ceiling": big.vs_ceiling,
        "native_vs_fallback": big.vs_fallback,
        "native_8k_gbps": small.native_gbps, "ceiling_8k_gbps": small.ceiling_gbps,
        "fallback_8k_gbps": small.fallback_gbps, "native_vs_ceiling_8k": small.vs_ceiling,
        "native_vs_fallback_8k": small.vs_fallback,
        "block_tokens": args.block_tokens,
        "hash_path": native.HASH_PATH,
        "paths_gbps": big.paths_gbps, "paths_8k_gbps": small.paths_gbps,
        "goals_met": all(v.met for v in verdicts),
        "sweep": [asdict(r) for r in sweep],
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "python": platform.python_version(),
    }
    tables = [_table(main, "")]
    if sweep:
        tables.append(_table(sweep, "block-size sweep, 128k-token prompt"))
    return Report("block-key chain throughput, GB/s of token bytes (best of interleaved "
                  f"rounds); native = {native.HASH_PATH} path, the last columns = native "
                  "forced onto each leaf path", out, tables, verdicts,
                  chart=_chart(sweep) if sweep else None)
