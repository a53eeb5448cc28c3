"""``kvserve bench vllm``: what the warehouse gives vLLM, measured side by side.

One machine, one kvstore, the same 1,493-token prompts (seeded token ids):

1. server 1 (fresh store): TTFT cold, then the same prompt again, answered from
   vLLM's own prefix cache (``ttft_warm_local_s``);
2. server 1 stops; server 2 is a **fresh** vLLM process: after one unrelated
   prompt (its first-forward costs, as server 1 paid them on its cold prompts),
   the same prompts are answered restoring the prefix from the warehouse
   (``ttft_warm_warehouse_s``), with the cached tokens it reports and whether its
   tokens equal the cold run's.

TTFT is measured as a streaming client sees it (request sent to first token).
Medians over ``--reps`` prompts; the target is warehouse-warm <= 1.3 x local-warm.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import Chart, Goal, Report, Table, check_goals, quantile
from kvserve.cli import UsageError
from kvserve.launch_vllm import VLLMProcess, VLLMSpec
from security.secret_files import redis_url_args

PROMPT_TOKENS = 1493
TARGET_RATIO = 1.3


@dataclass(frozen=True, slots=True)
class Timed:
    ttft_s: float
    token_ids: tuple[int, ...]
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class VLLMBenchResult:
    prompt_tokens: int
    reps: int
    ttft_cold_s: float
    ttft_warm_local_s: float
    ttft_warm_warehouse_s: float
    ratio_warehouse_to_local: float
    target_ratio: float
    met: bool
    cached_tokens_local: int
    cached_tokens_warehouse: int
    identical: bool
    start_s: list[float]


def bench_prompts(reps: int, seed: int = 0, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(reps)]


def timed_completion(base: str, prompt: list[int], *, max_tokens: int = 16,
                     salt: str = "bench") -> Timed:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True, "cache_salt": salt}
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    t0 = time.perf_counter()
    first = None
    ids: list[int] = []
    usage: dict[str, Any] = {}
    with urllib.request.urlopen(req, timeout=900) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices") or []:
                if c.get("token_ids"):
                    first = first or time.perf_counter()
                    ids.extend(c["token_ids"])
            usage = chunk.get("usage") or usage
    if first is None:
        raise RuntimeError("the server streamed no token")
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return Timed(first - t0, tuple(ids), cached)


def run_bench(model_dir: str, *, reps: int, work: Path, store_address: str, redis_url: str,
              tls_dir: str, insecure: bool, port: int,
              log: Any = print) -> VLLMBenchResult:
    seed = int(time.time())
    prompts = bench_prompts(reps, seed=seed)   # unseen by any earlier run
    spec = VLLMSpec(model_dir=model_dir, port=port, store=store_address, redis_url=redis_url,
                    instance_id="bench-1", tls_dir=tls_dir, insecure=insecure,
                    kv_cache_mib=512, max_num_seqs=16)
    one = VLLMProcess(spec, work / "vllm-1.log").start().wait_ready()
    log(f"server 1 ready in {one.ready_s:.0f}s")
    try:
        cold = [timed_completion(spec.base_url, p) for p in prompts]
        local = [timed_completion(spec.base_url, p) for p in prompts]
        _wait_saved(redis_url, "bench-1", reps * (PROMPT_TOKENS // spec.block_tokens))
    finally:
        one.stop()
    spec2 = VLLMSpec(**{**asdict(spec), "instance_id": "bench-2"})
    two = VLLMProcess(spec2, work / "vllm-2.log").start().wait_ready()
    log(f"server 2 (fresh) ready in {two.ready_s:.0f}s")
    try:
        # Server 1 ran cold prompts before its local-warm ones; give server 2 the
        # same footing (first-forward costs paid on a prompt nobody stored), so the
        # ratio compares the two caches, not a fresh process with a warm one.
        timed_completion(spec2.base_url, bench_prompts(1, seed=seed + 1)[0])
        warm = [timed_completion(spec2.base_url, p) for p in prompts]
    finally:
        two.stop()
    med = lambda xs: quantile([x.ttft_s for x in xs], 0.5)  # noqa: E731
    ratio = med(warm) / med(local)
    return VLLMBenchResult(
        prompt_tokens=PROMPT_TOKENS, reps=reps, ttft_cold_s=med(cold),
        ttft_warm_local_s=med(local), ttft_warm_warehouse_s=med(warm),
        ratio_warehouse_to_local=ratio, target_ratio=TARGET_RATIO, met=ratio <= TARGET_RATIO,
        cached_tokens_local=min(x.cached_tokens for x in local),
        cached_tokens_warehouse=min(x.cached_tokens for x in warm),
        identical=all(c.token_ids == w.token_ids == x.token_ids
                      for c, w, x in zip(cold, warm, local, strict=True)),
        start_s=[round(one.ready_s, 1), round(two.ready_s, 1)])


def report(args: argparse.Namespace) -> Report:
    """``kvserve bench vllm``: the flags in, the harness's report out."""
    from connectors.vllm import _client_takes_security
    from kvserve.commands.vllm_cmds import need_vllm

    need_vllm()
    if args.reps < 1:
        raise UsageError("--reps must be >= 1")
    tls = args.tls_dir or os.environ.get("KVSERVE_TLS_DIR", "")
    insecure = args.insecure or not (tls and _client_takes_security())
    r = measure(args.reps, tls_dir="" if insecure else tls, insecure=insecure)
    table = Table(("", "TTFT s", ""))
    table.add("TTFT cold", r.ttft_cold_s, "")
    table.add("TTFT warm, vLLM's own prefix cache", r.ttft_warm_local_s,
              f"cached {r.cached_tokens_local}")
    table.add("TTFT warm, fresh process via warehouse", r.ttft_warm_warehouse_s,
              f"cached {r.cached_tokens_warehouse}")
    table.add("identical tokens", "", f"{r.identical}: {r.reps} prompts of {r.prompt_tokens}")
    verdicts = check_goals((Goal(f"warehouse-warm TTFT <= {r.target_ratio} x local-warm "
                                 "(same run)", "ttft_warm_warehouse_s",
                                 at_most=r.target_ratio, ref="ttft_warm_local_s"),), asdict(r))
    return Report(f"kvserve bench vllm: ratio warehouse / local {r.ratio_warehouse_to_local:.2f}"
                  f" x, target <= {r.target_ratio} ({'met' if r.met else 'missed'})",
                  asdict(r), [table], verdicts, notes=[f"vLLM start: {r.start_s} s"],
                  chart=Chart(f"vLLM TTFT, {r.prompt_tokens}-token prompts",
                              ("cold", "warm: own cache", "warm: warehouse"),
                              {"TTFT s": [r.ttft_cold_s, r.ttft_warm_local_s,
                                          r.ttft_warm_warehouse_s]}, ylabel="s"))


def measure(reps: int, *, tls_dir: str = "", insecure: bool = False) -> VLLMBenchResult:
    from engine.fetch import fetch_model
    from kvserve import launcher
    from kvstore.redis_server import EmbeddedRedis, free_port
    from security.config import SecurityConfig

    work = work_dir()
    model_dir = str(fetch_model("smollm2"))
    with EmbeddedRedis() as redis:
        port, health = free_port(), free_port()
        sec = ["--insecure"] if insecure else ["--tls-dir", tls_dir] if tls_dir else []
        store = launcher.Child("kvstore", [
            sys.executable, "-m", "kvserve.cli", "store", "serve", "--host", "127.0.0.1",
            "--port", str(port), "--metrics-port", "-1",
            *redis_url_args(redis.url_for("kvstore"), work),
            "--g2-bytes", "1GiB", "--no-prefault", "--health-port", str(health), *sec],
            f"127.0.0.1:{health}", work / "kvstore.log",
            security=SecurityConfig(insecure=True))   # the health-only port is plain text
        try:
            launcher.start_children([store], 120.0)
            result = run_bench(model_dir, reps=reps, work=work,
                               store_address=f"127.0.0.1:{port}", redis_url=redis.url,
                               tls_dir=tls_dir, insecure=insecure, port=free_port(), log=_log)
        finally:
            launcher.stop_children([store], 10.0)
    _log(f"logs in {work}")
    return result


def _wait_saved(redis_url: str, instance: str, blocks: int, timeout_s: float = 120.0) -> None:
    """Puts run in the background: wait until the connector counted them all."""
    import redis

    from connectors.vllm_presence import stats_key

    r = redis.Redis.from_url(redis_url)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if int(r.hget(stats_key(instance), "saved_blocks") or 0) >= blocks:
                return
            time.sleep(0.2)
    finally:
        r.close()
    raise RuntimeError(f"{instance} saved fewer than {blocks} blocks in {timeout_s:.0f}s")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def work_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="kvserve-bench-vllm-"))
