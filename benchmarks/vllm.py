"""``kvserve bench vllm``: what the warehouse gives vLLM, measured side by side.

One machine, one kvstore, the same 1,493-token prompts (seeded token ids):

1. server 1 (fresh store): TTFT cold, then the same prompt again, answered from
   vLLM's own prefix cache (``ttft_warm_local_s``);
2. server 1 stops; server 2 is a **fresh** vLLM process: after one warm-up prompt
   that server 1 also computed (its first-forward costs, as server 1 paid them
   on its cold prompts, and the connector's one-time costs: attaching the
   store's shared memory, the first host buffer), the measured prompts are
   answered restoring the prefix from the warehouse (``ttft_warm_warehouse_s``),
   with the cached tokens it reports and whether its tokens equal the cold run's.

TTFT is measured as a streaming client sees it (request sent to first token).
Medians over ``--reps`` prompts; the target is warehouse-warm <= 1.2 x local-warm.

The split (``split_ms``, the median over the warm requests of each part, each
request's counters read on its own, from the connector's own counters,
``connectors.vllm_worker``): ``lookup`` (scheduler-side Lookup), ``get`` (Get
issued -> landed in this process, verified), ``wait`` (the forward blocked on
it: synchronous loads only), ``copy`` (scatter into vLLM's paged cache),
``first_step`` (the step computing the request's first token: metadata bound ->
saves handed off; includes ``wait`` and ``copy`` for synchronous loads), and
``rest`` = TTFT minus lookup, the load's own time and the first step (HTTP,
tokenization, the scheduler's loop, and for asynchronous loads the polls until
vLLM learns the load is over). ``split_local_ms`` gives the same for vLLM's own
cache (its ``first_step``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import ssl
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness import Chart, Goal, Report, Table, check_goals
from kvserve.cli import UsageError
from kvserve.launch_vllm import VLLMProcess, VLLMSpec, client_ssl, engine_identity
from security.secret_files import redis_url_args

PROMPT_TOKENS = 1493
TARGET_RATIO = 1.2
SPLIT_COUNTERS = ("us_lookup", "us_get", "us_wait", "us_copy", "us_step_new", "steps_new",
                  "lookups", "loads_sync", "loads_async")


@dataclass(frozen=True, slots=True)
class Timed:
    ttft_s: float
    token_ids: tuple[int, ...]
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class VLLMBenchResult:
    prompt_tokens: int
    reps: int
    load: str
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
    split_ms: dict[str, float] = field(default_factory=dict)
    split_local_ms: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Client:
    """How the bench calls one server: its URL, TLS context and API key."""

    base: str
    ssl_context: ssl.SSLContext | None = None
    api_key: str = ""
    salt: str = ""

    @classmethod
    def of(cls, spec: VLLMSpec) -> Client:
        from security.vllm_trust import tenant_salt

        secret = spec.security().require_secret() if not spec.insecure else b""
        return cls(spec.base_url, client_ssl(spec), "" if spec.insecure else spec.api_key(),
                   tenant_salt("bench", secret))


def bench_prompts(reps: int, seed: int = 0, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(reps)]


def timed_completion(client: Client, prompt: list[int], *, max_tokens: int = 16) -> Timed:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True, "cache_salt": client.salt}
    headers = {"content-type": "application/json"}
    if client.api_key:
        headers["authorization"] = f"Bearer {client.api_key}"
    req = urllib.request.Request(client.base + "/v1/completions",
                                 data=json.dumps(body).encode(), headers=headers)
    t0 = time.perf_counter()
    first = None
    ids: list[int] = []
    usage: dict[str, Any] = {}
    with urllib.request.urlopen(req, timeout=900, context=client.ssl_context) as resp:
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


def _counters(redis_url: str, instance: str) -> dict[str, int]:
    import redis

    from connectors.vllm_presence import stats_key

    r = redis.Redis.from_url(redis_url)
    try:
        return {k.decode(): int(v) for k, v in r.hgetall(stats_key(instance)).items()}
    finally:
        r.close()


def _settled(redis_url: str, instance: str) -> dict[str, int]:
    """Counters once the presence thread has flushed (it does so every ~0.5 s)."""
    time.sleep(1.5)
    return _counters(redis_url, instance)


def split(before: dict[str, int], after: dict[str, int], timed: Timed) -> dict[str, float]:
    """Milliseconds of each part of one request's warm path (module doc)."""
    d = {k: after.get(k, 0) - before.get(k, 0) for k in SPLIT_COUNTERS}
    steps = max(1, d["steps_new"])
    out = {"lookup": d["us_lookup"] / 1e3, "get": d["us_get"] / 1e3,
           "wait": d["us_wait"] / 1e3, "copy": d["us_copy"] / 1e3,
           "first_step": d["us_step_new"] / steps / 1e3, "ttft": timed.ttft_s * 1e3}
    load = 0.0 if d["loads_sync"] else out["get"] + out["copy"]   # async: outside the step
    out["rest"] = out["ttft"] - out["lookup"] - load - out["first_step"]
    return out


def measured(client: Client, prompts: list[list[int]], redis_url: str,
             instance: str) -> tuple[list[Timed], dict[str, float]]:
    """The prompts one by one, each with its own split; the split's medians."""
    timed, parts = [], []
    for p in prompts:
        before = _settled(redis_url, instance)
        t = timed_completion(client, p)
        parts.append(split(before, _settled(redis_url, instance), t))
        timed.append(t)
    return timed, {k: round(statistics.median(x[k] for x in parts), 2) for k in parts[0]}


def run_bench(model_dir: str, *, reps: int, work: Path, store_address: str, redis_url: str,
              tls_dir: str, insecure: bool, port: int, load_async: bool = True,
              log: Any = print) -> VLLMBenchResult:
    seed = int(time.time())
    prompts = bench_prompts(reps, seed=seed)   # unseen by any earlier run
    warmup = bench_prompts(1, seed=seed + 1)[0]

    def spec_for(name: str) -> VLLMSpec:
        ident = "" if insecure else str(engine_identity(tls_dir, name))
        return VLLMSpec(model_dir=model_dir, port=port, store=store_address,
                        redis_url=redis_url, instance_id=name, tls_dir=ident,
                        insecure=insecure, secret_file="" if insecure else
                        str(Path(tls_dir) / "secret"), kv_cache_mib=512, max_num_seqs=16,
                        extra_config={"load_async": load_async})

    one = VLLMProcess(spec_for("bench-1"), work / "vllm-1.log").start().wait_ready()
    log(f"server 1 ready in {one.ready_s:.0f}s")
    c1 = Client.of(one.spec)
    try:
        cold = [timed_completion(c1, p) for p in prompts]
        timed_completion(c1, warmup)
        local, split_local = measured(c1, prompts, redis_url, "bench-1")
        _wait_saved(redis_url, "bench-1", (reps + 1) * (PROMPT_TOKENS // one.spec.block_tokens))
    finally:
        one.stop()
    two = VLLMProcess(spec_for("bench-2"), work / "vllm-2.log").start().wait_ready()
    log(f"server 2 (fresh) ready in {two.ready_s:.0f}s")
    c2 = Client.of(two.spec)
    try:
        # Server 1 ran cold prompts before its local-warm ones; give server 2 the
        # same footing (first-forward and the connector's one-time costs, paid on a
        # warehouse hit of the warm-up prompt), so the ratio compares the two
        # caches in steady state, not a fresh process with a warm one.
        timed_completion(c2, warmup)
        warm, split_warm = measured(c2, prompts, redis_url, "bench-2")
    finally:
        two.stop()
    med = lambda xs: statistics.median(x.ttft_s for x in xs)  # noqa: E731
    ratio = med(warm) / med(local)
    return VLLMBenchResult(
        prompt_tokens=PROMPT_TOKENS, reps=reps, load="async" if load_async else "sync",
        ttft_cold_s=med(cold),
        ttft_warm_local_s=med(local), ttft_warm_warehouse_s=med(warm),
        ratio_warehouse_to_local=ratio, target_ratio=TARGET_RATIO, met=ratio <= TARGET_RATIO,
        cached_tokens_local=min(x.cached_tokens for x in local),
        cached_tokens_warehouse=min(x.cached_tokens for x in warm),
        identical=all(c.token_ids == w.token_ids == x.token_ids
                      for c, w, x in zip(cold, warm, local, strict=True)),
        start_s=[round(one.ready_s, 1), round(two.ready_s, 1)],
        split_ms=split_warm, split_local_ms=split_local)


def report(args: argparse.Namespace) -> Report:
    """``kvserve bench vllm``: the flags in, the harness's report out."""
    from kvserve.commands.vllm_cmds import need_vllm

    need_vllm()                   # before anything imports vLLM: one line, no traceback
    from connectors.vllm import _client_takes_security

    if args.reps < 1:
        raise UsageError("--reps must be >= 1")
    tls = args.tls_dir or os.environ.get("KVSERVE_TLS_DIR", "")
    insecure = args.insecure or not (tls and _client_takes_security())
    r = measure(args.reps, tls_dir="" if insecure else tls, insecure=insecure,
                load_async=args.load == "async")
    table = Table(("", "TTFT s", ""))
    table.add("TTFT cold", r.ttft_cold_s, "")
    table.add("TTFT warm, vLLM's own prefix cache", r.ttft_warm_local_s,
              f"cached {r.cached_tokens_local}")
    table.add("TTFT warm, fresh process via warehouse", r.ttft_warm_warehouse_s,
              f"cached {r.cached_tokens_warehouse}, {r.load} load")
    table.add("identical tokens", "", f"{r.identical}: {r.reps} prompts of {r.prompt_tokens}")
    for name, sp in (("split, warehouse (ms)", r.split_ms), ("split, local (ms)",
                                                            r.split_local_ms)):
        table.add(name, "", ", ".join(f"{k} {v:.1f}" for k, v in sp.items()))
    verdicts = check_goals((Goal(f"warehouse-warm TTFT <= {r.target_ratio} x local-warm "
                                 "(same run)", "ttft_warm_warehouse_s",
                                 at_most=r.target_ratio, ref="ttft_warm_local_s"),), asdict(r))
    return Report(f"kvserve bench vllm: ratio warehouse / local {r.ratio_warehouse_to_local:.2f}"
                  f" x, target <= {r.target_ratio} ({'met' if r.met else 'missed'}), "
                  f"{r.load} load", asdict(r), [table], verdicts,
                  notes=[f"vLLM start: {r.start_s} s"],
                  chart=Chart(f"vLLM TTFT, {r.prompt_tokens}-token prompts",
                              ("cold", "warm: own cache", "warm: warehouse"),
                              {"TTFT s": [r.ttft_cold_s, r.ttft_warm_local_s,
                                          r.ttft_warm_warehouse_s]}, ylabel="s"))


def measure(reps: int, *, tls_dir: str = "", insecure: bool = False,
            load_async: bool = True) -> VLLMBenchResult:
    from engine.fetch import fetch_model
    from kvserve.children import Child, start_children, stop_children
    from kvstore.redis_server import EmbeddedRedis, free_port
    from security.config import SecurityConfig

    work = work_dir()
    model_dir = str(fetch_model("smollm2"))
    with EmbeddedRedis() as redis:
        port, health = free_port(), free_port()
        sec = ["--insecure"] if insecure else ["--tls-dir", tls_dir] if tls_dir else []
        store = Child("kvstore", [
            sys.executable, "-m", "kvserve.cli", "store", "serve", "--host", "127.0.0.1",
            "--port", str(port), "--metrics-port", "-1",
            *redis_url_args(redis.url_for("kvstore"), work),
            "--g2-bytes", "1GiB", "--no-prefault", "--health-port", str(health), *sec],
            f"127.0.0.1:{health}", work / "kvstore.log",
            security=SecurityConfig(insecure=True))   # the health-only port is plain text
        try:
            start_children([store], 120.0)
            result = run_bench(model_dir, reps=reps, work=work,
                               store_address=f"127.0.0.1:{port}", redis_url=redis.url,
                               tls_dir=tls_dir, insecure=insecure, port=free_port(),
                               load_async=load_async, log=_log)
        finally:
            stop_children([store], 10.0)
    _log(f"logs in {work}")
    return result


def _wait_saved(redis_url: str, instance: str, blocks: int, timeout_s: float = 120.0) -> None:
    """Puts run in the background: wait until the connector counted them all."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _counters(redis_url, instance).get("saved_blocks", 0) >= blocks:
            return
        time.sleep(0.2)
    raise RuntimeError(f"{instance} saved fewer than {blocks} blocks in {timeout_s:.0f}s")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def work_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="kvserve-bench-vllm-"))
