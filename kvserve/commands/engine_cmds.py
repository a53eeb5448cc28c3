"""Engine commands: ``generate``, ``model fetch``, ``model import-gguf``, ``bench engine``."""

from __future__ import annotations

import argparse
import json
import sys
import time

from kvserve.cli import CommandRegistry, UsageError


def _user_errors() -> tuple[type[Exception], ...]:
    """Errors that mean "bad input or bad model", printed without a traceback
    (imported late: importing torch would slow every kvserve command down)."""
    from engine.errors import EngineError

    return (EngineError, FileNotFoundError)


def _engine_args(p: argparse.ArgumentParser, model: str = "smollm2") -> None:
    p.add_argument("--model", default=model,
                   help="named config (tiny-dense, ...), 'smollm2', or an HF-layout directory")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--block-tokens", type=int, default=64)
    p.add_argument("--num-blocks", type=int, default=512)


def _gen_configure(p: argparse.ArgumentParser) -> None:
    _engine_args(p)
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stats", action="store_true", help="print timings to stderr")


def _gen_run(args: argparse.Namespace) -> int:
    from engine import Engine, EngineConfig, SamplingParams

    try:
        sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                  seed=args.seed, max_tokens=args.max_tokens,
                                  stop=tuple(args.stop))
        eng = Engine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                                  block_tokens=args.block_tokens, num_blocks=args.num_blocks))
        if args.chat:
            msgs = ([{"role": "system", "content": args.system}] if args.system else [])
            msgs.append({"role": "user", "content": args.prompt})
            tokens = eng.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
        else:
            tokens = eng.tokenizer.encode(args.prompt)
        t0 = time.perf_counter()
        res = eng.generate(tokens, sampling)
        dt = time.perf_counter() - t0
    except _user_errors() as exc:
        raise UsageError(str(exc)) from exc
    print(res.text)
    if args.stats:
        decode_s = max(dt - res.prefill.compute_s, 1e-9)
        print(f"prompt {len(tokens)} tokens, TTFT {res.prefill.compute_s:.3f} s, "
              f"{len(res.tokens)} tokens in {dt:.2f} s "
              f"({(len(res.tokens) - 1) / decode_s:.1f} tok/s decode), "
              f"finish {res.finish_reason}", file=sys.stderr)
    return 0


def _fetch_configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="known model to fetch (smollm2)")


def _fetch_run(args: argparse.Namespace) -> int:
    from engine.fetch import fetch_model

    try:
        print(fetch_model(args.name))
    except _user_errors() as exc:
        raise UsageError(str(exc)) from exc
    return 0


def _import_configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="a Llama-architecture GGUF file")
    p.add_argument("out", help="output HF-layout directory")


def _import_run(args: argparse.Namespace) -> int:
    from engine.gguf_import import import_gguf

    try:
        res = import_gguf(args.file, args.out)
    except _user_errors() as exc:
        raise UsageError(str(exc)) from exc
    print(f"{res.out_dir}: {res.tensors} tensors, {res.params / 1e6:.1f}M parameters")
    return 0


def _bench_configure(p: argparse.ArgumentParser) -> None:
    _engine_args(p)
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--prefill-chunk", type=int, default=0,
                   help="prefill chunk, a multiple of --block-tokens (default: the block on "
                        "CPU, 2048 on CUDA); restores snap to chunk boundaries")
    p.add_argument("--prefill-tokens", type=int, nargs="*", default=None,
                   help="prompt lengths to time (default: 256 and 1493 on CPU; 4k/16k on CUDA)")
    p.add_argument("--decode-batches", type=int, nargs="*", default=None,
                   help="decode batch sizes (default 1 8 on CPU; 1 8 64 on CUDA)")
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--big-model", default="llama-8b-shape",
                   help="second model timed on CUDA (bf16); '' to skip")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    p.add_argument("--decode-bucket", type=int, default=0,
                   help="decode rows per forward (default 8 on CPU, the biggest batch on CUDA)")


def _bench_run(args: argparse.Namespace) -> int:
    from benchmarks.engine import BenchOptions, print_table, run_engine_bench

    try:
        opts = BenchOptions(model=args.model, device=args.device, dtype=args.dtype,
                            block_tokens=args.block_tokens, num_blocks=args.num_blocks,
                            prefill_chunk=args.prefill_chunk,
                            prefill_tokens=tuple(args.prefill_tokens or ()),
                            decode_batches=tuple(args.decode_batches or ()),
                            decode_steps=args.decode_steps, big_model=args.big_model,
                            threads=args.threads, decode_bucket=args.decode_bucket)
        result = run_engine_bench(opts)
    except _user_errors() as exc:
        raise UsageError(str(exc)) from exc
    print_table(result, file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    return 0


def register(reg: CommandRegistry) -> None:
    reg.add("generate", help="generate a completion with the local engine",
            configure=_gen_configure, run=_gen_run)
    reg.group("model", help="model files")
    reg.add("model fetch", help="download and import a known model (smollm2) into the cache",
            configure=_fetch_configure, run=_fetch_run)
    reg.add("model import-gguf", help="import a Llama GGUF file into an HF-layout directory",
            configure=_import_configure, run=_import_run)
    reg.group("bench", help="benchmarks")
    reg.add("bench engine", help="engine prefill/decode throughput and KV export/import",
            configure=_bench_configure, run=_bench_run)
