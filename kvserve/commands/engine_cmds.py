"""Engine commands: ``generate``, ``model fetch``, ``model import-gguf``."""

from __future__ import annotations

import argparse
import sys
import time

from kvserve.cli import CommandRegistry, UsageError


def _user_errors() -> tuple[type[Exception], ...]:
    """Errors that mean "bad input or bad model", printed without a traceback
    (imported late: importing torch would slow every kvserve command down)."""
    from engine.errors import EngineError

    return (EngineError, FileNotFoundError)


def engine_args(p: argparse.ArgumentParser, model: str = "smollm2") -> None:
    p.add_argument("--model", default=model,
                   help="named config (tiny-dense, ...), 'smollm2', or an HF-layout directory")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--block-tokens", type=int, default=64)
    p.add_argument("--num-blocks", type=int, default=512)


def _gen_configure(p: argparse.ArgumentParser) -> None:
    engine_args(p)
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


def register(reg: CommandRegistry) -> None:
    reg.add("generate", help="generate a completion with the local engine",
            configure=_gen_configure, run=_gen_run)
    reg.group("model", help="model files")
    reg.add("model fetch", help="download and import a known model (smollm2) into the cache",
            configure=_fetch_configure, run=_fetch_run)
    reg.add("model import-gguf", help="import a Llama GGUF file into an HF-layout directory",
            configure=_import_configure, run=_import_run)
