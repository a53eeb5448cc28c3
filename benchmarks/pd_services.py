"""``kvserve bench pd`` (services): TTFT cold vs warm for a 6-turn agent
conversation through the real disaggregated services.

One run starts Redis, a kvstore, two prefill instances and one decode
instance (child processes, free loopback ports). Both prefill instances keep
no local prefix cache; the *cold* one never reads the warehouse
(``--fetch-policy never``), the *warm* one uses the cost-aware rule. Each turn
resends the whole conversation (the previous prompt + the model's answer +
a new tool result), as an agent does, at the token level so the context is an
exact prefix of the next turn, with zero think time: the warm conversation
runs first, each turn sent the moment the previous answer's final event
arrives (decode stores the answer's canonical blocks before sending it); then
the cold instance answers the same contexts (its writes cannot help the warm
turns, which are over).
TTFT is the client-side time of the Prefill call (the first token is in its
reply); ``end_wait_s`` is what holding the final event for the canonical
write added to the end of the answer (client-side gap before the final event
less the gap before the token ahead of it, both net of the server's own
per-token times).
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from common.config import KVServeConfig
from kvserve.children import Child, start_children, stop_children
from kvserve.launcher import to_toml
from proto import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from security.config import TLS_DIR_ENV, SecurityConfig
from security.secret_files import redis_url_args

SYSTEM = (
    "You are a coding agent working in a Python repository. You can call tools: "
    "read_file(path), list_dir(path), run_tests(selector), grep(pattern). After each tool "
    "result, decide the next step and explain it in one or two sentences. Keep answers short. "
    "Follow the repository's style: type hints, small modules, tests beside the code. Never "
    "invent file contents; read them first. When a test fails, read the failing test and the "
    "code it exercises before proposing a change. ")


def tool_result(turn: int, n_lines: int = 6) -> str:
    """A deterministic, realistic-looking tool output (~200 tokens at 6 lines)."""
    lines = [f"$ list_dir src/pkg{turn}"]
    for i in range(n_lines):
        lines.append(f"src/pkg{turn}/module_{i:02d}.py  {120 + 17 * i + turn} lines  "
                     f"def handler_{i}(request: Request) -> Response")
    lines.append(f"tests: {40 + turn} passed, {turn % 3} failed (test_module_{turn:02d}.py)")
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class TurnResult:
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft_cold_s: float
    ttft_warm_s: float
    decode_tok_s: float
    output_tokens: int
    identical: bool
    fetch_decision: str
    warm_lookup_s: float            # the warm prefill's own timings (KVHandle.timings)
    warm_fetch_s: float
    warm_compute_s: float
    cold_compute_s: float
    rule_tokens: int                # the hit rule on the previous prompt + output
    end_wait_s: float               # added to the end of the warm answer (canonical write)

    @property
    def rule_met(self) -> bool:
        return self.cached_tokens >= self.rule_tokens

    @property
    def speedup(self) -> float:
        return self.ttft_cold_s / self.ttft_warm_s if self.ttft_warm_s else 0.0


def run(args: Any) -> list[TurnResult]:
    from engine import Engine, EngineConfig
    from kvserve.commands.serve_cmds import load_config

    cfg = load_config(args.config)
    cfg = replace(cfg, model=replace(cfg.model, name=args.model))
    # The tokenizer only: build the prompts here exactly as an agent harness would.
    eng = Engine(EngineConfig(model=args.model, num_blocks=2,
                              block_tokens=cfg.blocks.block_tokens))
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-pd-") as tmp:
        return asyncio.run(_bench(args, cfg, eng.tokenizer, eng.hit_rule, Path(tmp)))


async def _bench(args: Any, cfg: KVServeConfig, tok: Any, hit_rule: Any,
                 tmp: Path) -> list[TurnResult]:
    from kvstore.redis_server import EmbeddedRedis, free_port

    # mTLS as deployed; children, health checks and channels find it in the env.
    tls = os.environ[TLS_DIR_ENV] = SecurityConfig.for_local_run(tmp / "tls").cert_dir
    with EmbeddedRedis() as redis:
        ports = {name: free_port() for name in ("store", "cold", "warm", "decode")}
        config = tmp / "kvserve.toml"
        config.write_text(to_toml(cfg))
        base = [sys.executable, "-m", "kvserve.cli"]
        # Children inherit no credential variable (kvserve.credentials): named here.
        common = ["--config", str(config), "--host", "127.0.0.1",
                  *redis_url_args(redis.url, tmp), "--tls-dir", tls]
        store = f"127.0.0.1:{ports['store']}"

        def engine(role: str, name: str, *extra: str) -> Child:
            return Child(name, [*base, role, "serve", *common, "--port", str(ports[name]),
                                "--store", store, "--model", args.model, *extra],
                         f"127.0.0.1:{ports[name]}", tmp / f"{name}.log")

        children = [
            Child("store", [*base, "store", "serve", *common, "--port", str(ports["store"]),
                            "--metrics-port", "-1"], store, tmp / "store.log"),
            engine("prefill", "cold", "--no-local-prefix-cache", "--fetch-policy", "never"),
            engine("prefill", "warm", "--no-local-prefix-cache"),
            engine("decode", "decode", "--canonical-wait", str(args.canonical_wait)),
        ]
        print(f"starting store, 2 prefill and 1 decode instances ({args.model}) ...",
              file=sys.stderr, flush=True)
        start_children(children, args.ready_timeout)
        try:
            return await _conversation(args, cfg, tok, hit_rule, ports)
        finally:
            stop_children(children, 10.0)


async def _conversation(args: Any, cfg: KVServeConfig, tok: Any, hit_rule: Any,
                        ports: dict[str, int]) -> list[TurnResult]:
    from tqdm import tqdm

    sec = SecurityConfig.from_env("operator")
    chans = {n: sec.aio_channel(f"127.0.0.1:{ports[n]}", "") for n in ("cold", "warm", "decode")}
    cold = prefill_pb2_grpc.PrefillStub(chans["cold"])
    warm = prefill_pb2_grpc.PrefillStub(chans["warm"])
    dec = decode_pb2_grpc.DecodeStub(chans["decode"])
    sampling = common_pb2.SamplingParams(max_tokens=args.max_tokens)
    first = tool_result(0, args.tool_lines)
    context = tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                       {"role": "user", "content": first}])
    results: list[TurnResult] = []
    warm_turns: list[tuple[list[int], float, Any, list[int], float, int, float]] = []
    prev_kv = 0
    try:
        # The agent: every turn goes out the moment the previous answer ends.
        for _ in tqdm(range(args.turns), desc="warm turns", file=sys.stderr):
            rule = hit_rule.usable_tokens(prev_kv, len(context)) if prev_kv else 0
            t_warm, h_warm = await _prefill(warm, context, sampling)
            out_warm, tps, end_wait = await _decode(dec, h_warm, sampling)
            warm_turns.append((context, t_warm, h_warm, out_warm, tps, rule, end_wait))
            prev_kv = len(context) + len(out_warm) - 1
            joint = "\n" if out_warm and out_warm[-1] in tok.eos_token_ids else "<|im_end|>\n"
            context = context + out_warm + tok.encode(
                f"{joint}<|im_start|>user\n{tool_result(len(warm_turns), args.tool_lines)}"
                "<|im_end|>\n<|im_start|>assistant\n", special=True)   # our own markup
        # The same contexts without the warehouse (this instance never reads it).
        for turn, (ctx, t_warm, h_warm, out_warm, tps, rule, end_wait) in enumerate(
                tqdm(warm_turns, desc="cold turns", file=sys.stderr), start=1):
            t_cold, h_cold = await _prefill(cold, ctx, sampling)
            out_cold, _, _ = await _decode(dec, h_cold, sampling)
            tw = h_warm.timings
            results.append(TurnResult(turn, len(ctx), h_warm.cached_tokens, t_cold, t_warm,
                                      tps, len(out_warm), out_warm == out_cold,
                                      h_warm.fetch_decision, tw.lookup_s, tw.fetch_s,
                                      tw.compute_s, h_cold.timings.compute_s, rule, end_wait))
    finally:
        for ch in chans.values():
            await ch.close()
    return results


async def _prefill(stub: prefill_pb2_grpc.PrefillStub, tokens: list[int],
                   sampling: common_pb2.SamplingParams) -> tuple[float, prefill_pb2.KVHandle]:
    t0 = time.perf_counter()
    h = await stub.Prefill(prefill_pb2.PrefillRequest(
        ctx=common_pb2.RequestContext(tenant="bench", traffic_class="agent"),
        token_ids=tokens, sampling=sampling), timeout=600)
    return time.perf_counter() - t0, h


async def _decode(stub: decode_pb2_grpc.DecodeStub, handle: prefill_pb2.KVHandle,
                  sampling: common_pb2.SamplingParams) -> tuple[list[int], float, float]:
    """Tokens, decode tokens/s, and the delay the final event had beyond its
    token (the canonical write), net of the delivery lag of the token before."""
    t0 = time.perf_counter()
    toks: list[int] = []
    lags: list[float] = []                  # client receive time - server token time
    async for ev in stub.Decode(decode_pb2.DecodeRequest(handle=handle, sampling=sampling),
                                timeout=600):
        toks.extend(ev.token_ids)
        lags.append(time.perf_counter() - t0 - ev.t_s)
    dt = time.perf_counter() - t0
    end_wait = lags[-1] - lags[-2] if len(lags) > 1 else 0.0
    return toks, (len(toks) - 1) / dt if len(toks) > 1 and dt > 0 else 0.0, max(end_wait, 0.0)

