"""``kvserve bench vllm-trace``: vLLM's own client (``vllm bench serve
--dataset-name timed_trace``) replaying a trace against kvserve, two ways.

* ``--mode engines``: one vLLM-CPU server alone vs one with kvserve's connector,
  the same KV budget (``--kv-cache-mib``: make it smaller than the trace's
  working set), the same trace, one after the other on this machine. The trace's
  returning prefixes that vLLM evicted come back from the warehouse.
* ``--mode router``: ``kvserve up --engine vllm`` (two vLLM-CPU servers with the
  connector behind kvserve's router), once per router policy (``cache_aware``,
  ``round_robin``), ``vllm bench serve`` pointed at the router.

vLLM's client cannot present a client certificate, so ``engines`` runs the
servers in plain text (``--insecure``); ``router`` keeps kvserve's trust model
(HTTPS + API key between the router and vLLM; the router's own HTTP front has
no API keys here). The tool's own JSON is kept under the work directory; the
table and ``--json`` give TTFT p50/p90, TPOT p50, goodput (requests meeting
``--slo-ttft-ms``), completed/failed, and the prefix-cache hit fraction vLLM
reports (``vllm:prefix_cache_hits`` / ``queries``, local and external; and the
external part alone).

The previous answer. ``timed_trace`` writes every prompt from the trace's hash
ids, so a turn's text after the previous prompt stands for the previous answer
but is never the answer vLLM generated: no replayed turn can hit the answer's
blocks. In ``engines`` mode each server therefore also answers a returning-session
probe after the replay (``answer_probe``): turn 1, its answer fed back in turn 2
after other prompts of 1.5 x the KV budget went through, and turn 2's cached
tokens as vLLM reports them (``usage.prompt_tokens_details.cached_tokens``).

The trace is any ``timed_trace`` JSONL (``timestamp`` in seconds once multiplied by
``--sec-multiplier``: 0.001 for ``kvserve trace export`` files, written in ms;
``input_length``, ``output_length``, ``hash_ids``; ``--chunk-hash-size`` tokens per
hash). The agent-trace target's slice is ``kvserve trace export --interleave``
(docs/bench-notes/h5-vllm.md, section 3).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import Chart, Report, Table
from kvserve.cli import UsageError
from kvserve.launch_vllm import VLLMProcess, VLLMSpec
from security.secret_files import redis_url_args

POLICIES = ("cache_aware", "round_robin")
_PROM = re.compile(r"^(vllm:(?:external_)?prefix_cache_(?:hits|queries)(?:_total)?)\{[^}]*\}"
                   r"\s+([0-9.eE+-]+)\s*$", re.M)


@dataclass(frozen=True, slots=True)
class TraceRun:
    label: str
    completed: int
    failed: int
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    goodput_rps: float
    duration_s: float
    prefix_hit_fraction: float
    raw: str                                   # the tool's own result file
    external_hit_fraction: float = float("nan")  # of the prefix hits, the connector's
    answer_probe: AnswerProbe | None = None


@dataclass(frozen=True, slots=True)
class AnswerProbe:
    """A returning session's second turn after the engine's own cache was flushed."""
    prompt: int                 # turn 1's prompt tokens
    answer: int                 # turn 1's answer tokens, fed back in turn 2
    flushed: int                # other prompts' tokens sent between the two turns
    cached: int                 # turn 2's cached tokens, as vLLM reports them
    answer_cached: int          # of them past turn 1's prompt: the previous answer's


def vllm_bench(base_url: str, trace: Path, *, model_dir: str, chunk: int, prompts: int,
               slo_ttft_ms: float, out: Path, label: str,
               sec_multiplier: float = 1.0) -> dict[str, Any]:
    """Run ``vllm bench serve`` (vLLM's own CLI, unmodified) and return its JSON."""
    cmd = [sys.executable, "-m", "connectors.vllm_cli", "bench", "serve", "--backend", "vllm",
           "--base-url", base_url, "--endpoint", "/v1/completions", "--model", "smollm2",
           "--tokenizer", model_dir, "--dataset-name", "timed_trace", "--dataset-path",
           str(trace), "--timed-trace-chunk-hash-size", str(chunk),
           "--timed-trace-sec-multiplier", repr(sec_multiplier), "--num-prompts",
           str(prompts), "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles",
           "50,90,99", "--goodput", f"ttft:{slo_ttft_ms}", "--temperature", "0",
           "--save-result", "--save-detailed", "--result-dir",
           str(out), "--result-filename", f"{label}.json", "--ready-check-timeout-sec", "0"]
    # vLLM's timed_trace seeds its synthetic tokens with Python's str hash: fix it,
    # so every run (and both sides of a comparison) sends the same token ids.
    env = {**os.environ, "PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1"}
    with open(out / f"{label}.log", "wb") as log:
        subprocess.run(cmd, check=True, env=env, stdout=log, stderr=subprocess.STDOUT)
    return json.loads((out / f"{label}.json").read_text())


def prefix_hits(base_url: str) -> tuple[float, float]:
    """(local + external, external) prefix-cache hits over queried prompt tokens."""
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except OSError:
        return float("nan"), float("nan")
    got: dict[str, float] = {}
    for name, value in _PROM.findall(text):
        key = name.removesuffix("_total")
        got[key] = got.get(key, 0.0) + float(value)
    hits = got.get("vllm:prefix_cache_hits", 0.0) + got.get("vllm:external_prefix_cache_hits",
                                                            0.0)
    queries = got.get("vllm:prefix_cache_queries", 0.0)
    if not queries:
        return float("nan"), float("nan")
    return hits / queries, got.get("vllm:external_prefix_cache_hits", 0.0) / queries


def _complete(base_url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "return_token_ids": True}
    req = urllib.request.Request(base_url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        out: dict[str, Any] = json.loads(resp.read())
    return out


def kv_bytes_per_token(model_dir: str) -> int:
    """fp32 K and V of every layer for one token (the servers run float32)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * 4 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head


def answer_probe(base_url: str, *, flush_tokens: int, block: int = 64,
                 seed: int = 0) -> AnswerProbe:
    """Turn 1 (15 blocks) answered with 2 blocks + 1 tokens (the last generated
    token is never fed back, so the answer completes exactly 2 blocks), prompts of
    ``flush_tokens`` in all from other sessions, then turn 2 = turn 1 + the answer
    + 16 new tokens: what turn 2's cached tokens cover of the answer."""
    rng = random.Random(seed)

    # Ids far from SmolLM2's special tokens (the first few) and its vocabulary's end.
    def tokens(n: int) -> list[int]:
        return [rng.randrange(1000, 48000) for _ in range(n)]

    turn1 = tokens(15 * block)
    answer = list(_complete(base_url, turn1, 2 * block + 1)["choices"][0]["token_ids"])
    sent = 0
    while sent < flush_tokens:          # pieces well inside max-model-len
        n = min(2000, flush_tokens - sent)
        _complete(base_url, tokens(n), 1)
        sent += n
    usage = _complete(base_url, turn1 + answer + tokens(16), 1)["usage"]
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return AnswerProbe(len(turn1), len(answer), sent, cached, max(0, cached - len(turn1)))


def summary(label: str, res: dict[str, Any], hit: float, raw: Path, external: float = float("nan"),
            probe: AnswerProbe | None = None) -> TraceRun:
    return TraceRun(label, int(res.get("completed", 0)), int(res.get("failed", 0)),
                    res.get("p50_ttft_ms", float("nan")) / 1e3,
                    res.get("p90_ttft_ms", float("nan")) / 1e3,
                    res.get("p99_ttft_ms", float("nan")) / 1e3,
                    res.get("p50_tpot_ms", float("nan")) / 1e3,
                    float(res.get("request_goodput") or 0.0), float(res.get("duration", 0.0)),
                    round(hit, 4), str(raw), round(external, 4), probe)


def run_engines(trace: Path, work: Path, *, model_dir: str, chunk: int, prompts: int,
                kv_cache_mib: int, slo_ttft_ms: float, log: Any,
                sec_multiplier: float = 1.0) -> list[TraceRun]:
    from kvserve.children import Child, start_children, stop_children
    from kvstore.redis_server import EmbeddedRedis, free_port
    from security.config import SecurityConfig

    runs = []
    for label, connector in (("vllm", False), ("vllm+kvserve", True)):
        with EmbeddedRedis() as redis:
            port, health = free_port(), free_port()
            store = Child("kvstore", [
                sys.executable, "-m", "kvserve.cli", "store", "serve", "--host", "127.0.0.1",
                "--port", str(port), "--metrics-port", "-1",
                *redis_url_args(redis.url_for("kvstore"), work, f"redis-{label}.url"),
                "--g2-bytes", "2GiB", "--no-prefault", "--health-port", str(health),
                "--insecure"], f"127.0.0.1:{health}", work / f"kvstore-{label}.log",
                security=SecurityConfig(insecure=True))
            spec = VLLMSpec(model_dir=model_dir, port=free_port(), store=f"127.0.0.1:{port}",
                            redis_url=redis.url, instance_id=label.replace("+", "-"),
                            insecure=True, connector=connector, kv_cache_mib=kv_cache_mib,
                            max_num_seqs=16, log_stats=True)
            try:
                if connector:
                    start_children([store], 120.0)
                server = VLLMProcess(spec, work / f"{label}.server.log").start().wait_ready()
                log(f"{label}: ready in {server.ready_s:.0f}s; replaying {trace.name}")
                try:
                    res = vllm_bench(spec.base_url, trace, model_dir=model_dir, chunk=chunk,
                                     prompts=prompts, slo_ttft_ms=slo_ttft_ms, out=work,
                                     label=label, sec_multiplier=sec_multiplier)
                    # The replay's hit fractions first: the probe's prompts would count.
                    hit, external = prefix_hits(spec.base_url)
                    flush = kv_cache_mib * 2**20 * 3 // 2 // kv_bytes_per_token(model_dir)
                    probe = answer_probe(spec.base_url, flush_tokens=flush)
                    runs.append(summary(label, res, hit, work / f"{label}.json", external,
                                        probe))
                finally:
                    server.stop()
            finally:
                stop_children([store], 10.0)
        log(f"{label}: {runs[-1]}")
    return runs


def run_router(trace: Path, work: Path, *, model_dir: str, chunk: int, prompts: int,
               kv_cache_mib: int, slo_ttft_ms: float, log: Any,
               sec_multiplier: float = 1.0) -> list[TraceRun]:
    runs = []
    for policy in POLICIES:
        state = work / f"up-{policy}"
        cfg = work / f"{policy}.toml"
        cfg.write_text(f'[router]\npolicy = "{policy}"\n')
        up = subprocess.Popen(
            [sys.executable, "-m", "kvserve.cli", "up", "--engine", "vllm", "--config", str(cfg),
             "--vllm-instances", "2", "--vllm-kv-cache-mib", str(kv_cache_mib), "--free-ports",
             "--state-dir", str(state)], stdout=open(work / f"up-{policy}.log", "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT, start_new_session=True)
        try:
            info = _wait_up(state / "up.json", up)
            log(f"router {policy}: stack up at {info['router_http']}")
            res = vllm_bench(info["router_http"], trace, model_dir=model_dir, chunk=chunk,
                             prompts=prompts, slo_ttft_ms=slo_ttft_ms, out=work,
                             label=f"router-{policy}", sec_multiplier=sec_multiplier)
            runs.append(summary(f"router {policy}", res, float("nan"),
                                work / f"router-{policy}.json"))
        finally:
            os.killpg(up.pid, signal.SIGINT)
            try:
                up.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
                up.wait()
        log(f"router {policy}: {runs[-1]}")
    return runs


def _wait_up(state: Path, proc: subprocess.Popen[bytes], timeout_s: float = 1800.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvserve up exited ({proc.returncode}); see its log")
        if state.exists():
            return json.loads(state.read_text())
        time.sleep(1.0)
    raise RuntimeError("kvserve up did not come up in time")


def report(args: argparse.Namespace) -> Report:
    """``kvserve bench vllm-trace``: the flags in, the harness's report out (the
    ``--json`` document: one object per run, as ``TraceRun``)."""
    from engine.fetch import fetch_model
    from kvserve.commands.vllm_cmds import need_vllm

    need_vllm()
    if min(args.chunk_hash_size, args.prompts, args.kv_cache_mib) < 1:
        raise UsageError("--chunk-hash-size, --prompts and --kv-cache-mib must be >= 1")
    if not args.sec_multiplier > 0:
        raise UsageError("--sec-multiplier must be > 0")
    trace = Path(args.trace).resolve()
    if not trace.is_file():
        raise UsageError(f"--trace {args.trace}: no such file")
    work = Path(tempfile.mkdtemp(prefix="kvserve-bench-vllm-trace-"))
    model_dir = str(fetch_model("smollm2"))
    run = run_engines if args.mode == "engines" else run_router
    runs = run(trace, work, model_dir=model_dir, chunk=args.chunk_hash_size,
               prompts=args.prompts, kv_cache_mib=args.kv_cache_mib,
               slo_ttft_ms=args.slo_ttft_ms, log=lambda m: print(m, file=sys.stderr, flush=True),
               sec_multiplier=args.sec_multiplier)
    return Report(f"kvserve bench vllm-trace ({args.mode}): {trace.name}, "
                  f"{args.prompts} prompts at most", [asdict(r) for r in runs], [table(runs)],
                  notes=[*comparison(runs), f"results and logs in {work}"],
                  chart=Chart(f"vllm bench serve on {trace.name}",
                              tuple(r.label for r in runs),
                              {"TTFT p50 s": [r.ttft_p50_s for r in runs],
                               "TTFT p90 s": [r.ttft_p90_s for r in runs],
                               "TTFT p99 s": [r.ttft_p99_s for r in runs]}, ylabel="s"))


def table(runs: list[TraceRun]) -> Table:
    t = Table(("run", "done", "fail", "TTFT p50 s", "TTFT p90 s", "TTFT p99 s", "TPOT p50 s",
               "goodput rps", "prefix hit", "external hit", "answer cached"))
    for r in runs:
        probe = r.answer_probe
        t.add(r.label, r.completed, r.failed, r.ttft_p50_s, r.ttft_p90_s, r.ttft_p99_s,
              r.tpot_p50_s,
              r.goodput_rps, r.prefix_hit_fraction, r.external_hit_fraction,
              f"{probe.answer_cached}/{probe.answer}" if probe else "-")
    return t


def comparison(runs: list[TraceRun]) -> list[str]:
    """The second run against the first (connector vs alone; round_robin vs cache_aware)."""
    if len(runs) != 2:
        return []
    a, b = runs
    good = b.goodput_rps / a.goodput_rps if a.goodput_rps else float("inf")
    p90 = b.ttft_p90_s / a.ttft_p90_s if a.ttft_p90_s else float("nan")
    p50 = b.ttft_p50_s / a.ttft_p50_s if a.ttft_p50_s else float("nan")
    p99 = b.ttft_p99_s / a.ttft_p99_s if a.ttft_p99_s else float("nan")
    return [f"{b.label} / {a.label}: TTFT p50 {p50:.2f} x, p90 {p90:.2f} x, p99 {p99:.2f} x, "
            f"goodput {good:.2f} x"]
