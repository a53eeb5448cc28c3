"""Micro-benchmark of the batch-invariant kernels (engine/bik.py): GEMM at the
SmolLM2 prefill and decode shapes against torch.mm (MKL), attention at 1.5k
keys and over an agent's 5.5k-token context (30 to 512 new rows; read
contiguously and through a block table), and optionally cold TTFT and the TTFT
of a resent 5.5k-token context; with ``--against OLD.so`` every figure is also taken on
another build of the kernels in the same process, the two timed in alternation
(on a shared host the load moves between runs; alternating keeps the ratio
fair), and every attention output of the two builds must be bit-identical
(else it raises). Timing is the best of several rounds.

    python -m benchmarks.bik [--against /path/to/old/_bik.so] [--ttft] [--json]
        [--threads 1]   # one thread, timed by its CPU time: steady on a loaded host
        [--attention-only]  # attention alone (no GEMM shapes)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from benchmarks.harness import Chart, Report, Table, emit, interleaved, output_flags
from engine import bik

# (M, K, N): q/o (576 -> 576), k/v (576 -> 192), gate_up (576 -> 3072), down (1536 -> 576)
PREFILL_SHAPES = ((512, 576, 576), (512, 576, 192), (512, 576, 3072), (512, 1536, 576))
DECODE_SHAPES = tuple((m, k, n) for m in (1, 8) for k, n in ((576, 576), (576, 3072),
                                                            (1536, 576)))
HEADS, KV_HEADS, HEAD_DIM, KEYS = 9, 3, 64, 1493
# Agent traffic: a turn's new rows over a cached context of AGENT_KEYS tokens.
AGENT_KEYS, AGENT_ROWS = 5504, (30, 60, 128, 512)
RESEND_NEW = 52             # new tokens of a resent agent context (--ttft)
# A returning turn's tail (rows over TAIL_KEYS cached keys) and a cold prefill's
# 512-row causal chunks at these first positions: where the score kernel matters.
TAIL_KEYS, TAIL_ROWS, CHUNK_STARTS = 5000, (32, 128), (0, 512, 1024)


@dataclass(frozen=True, slots=True)
class BenchBikOptions:
    against: str = ""        # another build's .so, timed in alternation
    rounds: int = 5
    ttft: bool = False       # also cold TTFT of SmolLM2 at KEYS tokens (loads the model)
    threads: int = 0         # 0 = torch's default
    attention_only: bool = False  # skip the GEMM shapes

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError("rounds must be >= 1")
        if self.against and not os.path.isfile(self.against):
            raise ValueError(f"--against {self.against}: no such file")


@dataclass(slots=True)
class BenchBikResult:
    machine: str
    values: dict[str, float] = field(default_factory=dict)


def _clock() -> Callable[[], float]:
    """On one thread the calling thread does all the work: its CPU time leaves
    out the slices other processes take on a shared host. Else wall time."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def _best(fns: dict[str, Callable[[], object]], reps: int, rounds: int) -> dict[str, float]:
    """Best seconds per call of each fn, the fns interleaved round by round."""
    timings = interleaved({name: (lambda _r, fn=fn: fn()) for name, fn in fns.items()},
                          rounds=rounds, warmup=True, calls=dict.fromkeys(fns, reps),
                          clock=_clock())
    return {name: tm.min for name, tm in timings.items()}


Ctx = Callable[[], contextlib.AbstractContextManager[None]]


def _builds(opts: BenchBikOptions) -> dict[str, Ctx]:
    out: dict[str, Ctx] = {"bik": contextlib.nullcontext}
    if opts.against:
        out["other"] = lambda: bik.build(opts.against)
    return out


def _on(ctx: Ctx, fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        with ctx():
            return fn()
    return run


def _gemm(opts: BenchBikOptions, res: BenchBikResult) -> None:
    g = torch.Generator().manual_seed(0)
    for m, k, n in PREFILL_SHAPES + DECODE_SHAPES:
        x, w_t = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
        w = bik.pack(w_t)
        fns = {name: _on(ctx, lambda x=x, w=w: bik.linear(x, w))
               for name, ctx in _builds(opts).items()}
        fns["mkl"] = lambda x=x, w_t=w_t: torch.mm(x, w_t)
        reps = 3 if m > 8 else 50
        for name, t in _best(fns, reps, opts.rounds).items():
            res.values[f"gemm_{m}x{k}x{n}_{name}_gflops"] = 2 * m * k * n / t / 1e9
        res.values[f"gemm_{m}x{k}x{n}_bik_vs_mkl"] = (res.values[f"gemm_{m}x{k}x{n}_bik_gflops"]
                                                      / res.values[f"gemm_{m}x{k}x{n}_mkl_gflops"])


def _attention(opts: BenchBikOptions, res: BenchBikResult) -> None:
    g = torch.Generator().manual_seed(1)
    cap = KEYS + 43
    kv = torch.randn(2, KV_HEADS, cap, HEAD_DIM, generator=g)
    rows, start = 512, KEYS - 512           # the last prefill chunk of a 1,493-token prompt
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=g)
    out = torch.empty(rows, HEADS * HEAD_DIM)
    pre = [bik.AttnSegment(0, rows, start, kv)]
    qd = torch.randn(8, HEADS, HEAD_DIM, generator=g)
    outd = torch.empty(8, HEADS * HEAD_DIM)
    dec = [bik.AttnSegment(i, 1, KEYS - 1, kv) for i in range(8)]
    pairs_pre = HEADS * sum(start + r + 1 for r in range(rows))
    pairs_dec = HEADS * 8 * KEYS
    for what, fn_q, segs, o, pairs, reps in (("prefill512", q, pre, out, pairs_pre, 2),
                                             ("decode8", qd, dec, outd, pairs_dec, 20)):
        outs = {name: torch.empty_like(o) for name in _builds(opts)}
        fns = {name: _on(ctx, lambda q=fn_q, s=segs, o=outs[name]: bik.attend(q, s, KV_HEADS, 0, o))
               for name, ctx in _builds(opts).items()}
        for name, t in _best(fns, reps, opts.rounds).items():
            res.values[f"attend_{what}_{name}_ns_per_row_head_key"] = t / pairs * 1e9
        _same_bits(outs, f"attention {what}")
    kv = torch.randn(2, KV_HEADS, AGENT_KEYS + 8, HEAD_DIM, generator=g)
    for rows in AGENT_ROWS:
        q = torch.randn(rows, HEADS, HEAD_DIM, generator=g)
        outs = {name: torch.empty(rows, HEADS * HEAD_DIM) for name in _builds(opts)}
        segs = [bik.AttnSegment(0, rows, AGENT_KEYS - rows, kv)]
        # 2 * D flops per (row, head, key) for the score, 2 * D for the values
        flops = 4 * HEAD_DIM * HEADS * sum(AGENT_KEYS - rows + r + 1 for r in range(rows))
        fns = {name: _on(ctx, lambda q=q, s=segs, o=outs[name]: bik.attend(q, s, KV_HEADS, 0, o))
               for name, ctx in _builds(opts).items()}
        for name, t in _best(fns, 1 if rows > 128 else 3, opts.rounds).items():
            res.values[f"attend_ctx{AGENT_KEYS}_rows{rows}_{name}_gflops"] = flops / t / 1e9
        _same_bits(outs, f"attention over {AGENT_KEYS} keys, {rows} rows")
        if bik.paged():
            res.values[f"attend_ctx{AGENT_KEYS}_rows{rows}_paged_vs_contiguous"] = \
                _paged_vs_contiguous(g, kv, q, rows, opts.rounds)


def _attention_cases(opts: BenchBikOptions, res: BenchBikResult) -> None:
    """GFLOP/s (4 * D per row, head and key) of the tails and causal chunks."""
    g = torch.Generator().manual_seed(2)
    kv = torch.randn(2, KV_HEADS, TAIL_KEYS + max(CHUNK_STARTS) + 512, HEAD_DIM, generator=g)
    cases = [(f"tail{TAIL_KEYS}_rows{r}", r, TAIL_KEYS - r) for r in TAIL_ROWS]
    cases += [(f"chunk512_at{s}", 512, s) for s in CHUNK_STARTS]
    for what, rows, start in cases:
        q = torch.randn(rows, HEADS, HEAD_DIM, generator=g)
        outs = {name: torch.empty(rows, HEADS * HEAD_DIM) for name in _builds(opts)}
        segs = [bik.AttnSegment(0, rows, start, kv)]
        flops = 4 * HEAD_DIM * HEADS * sum(start + r + 1 for r in range(rows))
        fns = {name: _on(ctx, lambda q=q, s=segs, o=outs[name]: bik.attend(q, s, KV_HEADS, 0, o))
               for name, ctx in _builds(opts).items()}
        for name, t in _best(fns, 1 if rows > 128 else 3, opts.rounds).items():
            res.values[f"attend_{what}_{name}_gflops"] = flops / t / 1e9
        _same_bits(outs, f"attention {what}")


def _same_bits(outs: dict[str, torch.Tensor], what: str) -> None:
    """With --against, the two builds must agree bit for bit (KERNEL_ID holds)."""
    first = next(iter(outs.values()))
    for name, o in outs.items():
        if not torch.equal(o, first):
            raise AssertionError(f"{what}: build '{name}' changed the bits")


def _paged_vs_contiguous(g: torch.Generator, kv: torch.Tensor, q: torch.Tensor, rows: int,
                         rounds: int) -> float:
    """Time of the same keys read through a block table (blocks scattered in a
    pool, as the engine reads them) over the contiguous read, this build."""
    B = 64
    n = -(-AGENT_KEYS // B)
    spare = 3 * n                                    # other sessions' blocks between them
    pool = torch.randn(1, 2, KV_HEADS, n + spare, B, HEAD_DIM, generator=g)
    table = torch.randperm(n + spare, generator=g)[:n].to(torch.int64)
    for i, blk in enumerate(table.tolist()):
        lo, hi = i * B, min((i + 1) * B, AGENT_KEYS)
        pool[0, :, :, blk, :hi - lo] = kv[:, :, lo:hi]
    contiguous = [bik.AttnSegment(0, rows, AGENT_KEYS - rows, kv)]
    plan = bik.PagedAttention(pool, [bik.PagedSegment(0, rows, AGENT_KEYS - rows, table)])
    o1, o2 = torch.empty(rows, HEADS * HEAD_DIM), torch.empty(rows, HEADS * HEAD_DIM)
    best = _best({"paged": lambda: plan(0, q, 0, o1),
                  "contiguous": lambda: bik.attend(q, contiguous, KV_HEADS, 0, o2)},
                 1 if rows > 128 else 3, rounds)
    if not torch.equal(o1, o2):
        raise AssertionError("paged attention changed the bits")
    return best["paged"] / best["contiguous"]


def _ttft(opts: BenchBikOptions, res: BenchBikResult) -> None:
    """Cold TTFT at KEYS tokens, and an agent's resend: AGENT_KEYS cached in G1,
    RESEND_NEW tokens to compute (its admission included: on builds without
    paged attention it fills the sequence's contiguous copy of the prefix)."""
    from engine.config import EngineConfig
    from engine.runner import Engine

    engines = {}
    for name, ctx in _builds(opts).items():
        with ctx():                 # the engine reads the pool only on builds that can
            engines[name] = Engine(EngineConfig(model="smollm2", block_tokens=64,
                                                num_blocks=512))
    g = torch.Generator().manual_seed(7)
    vocab = engines["bik"].model_config.vocab_size
    toks = torch.randint(0, vocab, (KEYS,), generator=g).tolist()
    ctx_toks = torch.randint(0, vocab, (AGENT_KEYS + RESEND_NEW,), generator=g).tolist()
    keys = [i.to_bytes(8, "little") * 2 for i in range(AGENT_KEYS // 64)]
    for eng in engines.values():        # the context in G1, as a finished turn leaves it
        eng.prefill("ctx", ctx_toks[:AGENT_KEYS], block_keys=keys)
        eng.free("ctx", keep_keys=keys)

    def cold(eng: Engine) -> None:
        eng.prefill("c", toks)
        eng.free("c")

    def resend(eng: Engine) -> None:
        got = eng.prefill("r", ctx_toks, block_keys=keys)
        eng.free("r", keep_keys=keys)
        if got.g1_tokens != AGENT_KEYS:
            raise AssertionError(f"the resend found {got.g1_tokens} tokens in G1")

    for what, fn in (("cold", cold), ("resend", resend)):
        fns = {name: _on(ctx, lambda fn=fn, eng=engines[name]: fn(eng))
               for name, ctx in _builds(opts).items()}
        for name, t in _best(fns, 1, opts.rounds).items():
            label = f"{KEYS}" if what == "cold" else f"{AGENT_KEYS}+{RESEND_NEW}"
            res.values[f"ttft_{what}_{label}_{name}_s"] = t


def run_bench_bik(opts: BenchBikOptions) -> BenchBikResult:
    if not bik.available():
        raise RuntimeError("native._bik is not built")
    if opts.threads:
        torch.set_num_threads(opts.threads)
    bik.set_threads(torch.get_num_threads())
    load = os.getloadavg()[0]
    clock = "thread CPU time" if torch.get_num_threads() == 1 else "wall time"
    res = BenchBikResult(machine=f"cpu-{torch.get_num_threads()}t {bik.current_path()}, {clock}")
    if not opts.attention_only:
        _gemm(opts, res)
    _attention(opts, res)
    _attention_cases(opts, res)
    if opts.ttft:
        _ttft(opts, res)
    res.values["load_average_start"] = load
    res.values["load_average_end"] = os.getloadavg()[0]
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bik", description=__doc__)
    ap.add_argument("--against", default="", help="another build's _bik .so, timed alongside")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ttft", action="store_true", help="also cold TTFT of SmolLM2 (loads it)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--attention-only", action="store_true", help="skip the GEMM shapes")
    output_flags(ap)
    a = ap.parse_args(argv)
    res = run_bench_bik(BenchBikOptions(against=a.against, rounds=a.rounds, ttft=a.ttft,
                                        threads=a.threads,
                                        attention_only=a.attention_only))
    ratios = {k.removeprefix("gemm_").removesuffix("_bik_vs_mkl"): v
              for k, v in res.values.items() if k.endswith("_bik_vs_mkl")}
    emit(Report(f"bik kernels on {res.machine}", {"machine": res.machine, "values": res.values},
                [Table(("metric", "value"), list(res.values.items()))],
                chart=Chart("bik GEMM / torch.mm (MKL), same run", tuple(ratios),
                            {"bik / MKL": list(ratios.values())}, kind="barh",
                            xlabel="throughput ratio") if ratios else None),
         as_json=a.json, png=a.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
