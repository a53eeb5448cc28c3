"""The figures of ``kvserve bench stack``, from AIPerf's per-request records, the
services' counters (deltas over a phase) and the limits of the same run.

Effective prefill tokens/s: every prompt token served, cached ones included,
over the time the phase took to give every request its first token (first
request sent to last first token). Its limit is the same prompts on this device
with nothing but the unavoidable work, done one after the other: the compute of
each request's misses at the reference prefill's speed (``Limits.miss_time``:
its prompt L with c tokens cached costs t(L) - t(c)) plus the tokens the prefill
service restored from the warehouse (G2) at the pinned host -> device copy's
speed. G1 hits (the engine's own pool) cost nothing in the limit.

Decode tokens/s at the batch the SLO allows: the phase keeps ``batch`` requests
in flight; the decode service's counters give the batch it ran (tokens per
step), AIPerf the time between tokens (median over requests), so tokens/s =
mean batch / inter-token time. The roofline is that batch reading every weight
and its sequences' KV once per step at the device copy's bandwidth.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from benchmarks.stack_aiperf import Record
from benchmarks.stack_limits import Limits
from prefill_svc.scheduler import WAIT_REASONS


def pct(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(xs, q)) if len(xs) else 0.0


def counter(delta: Mapping[str, float], suffix: str) -> float:
    """The sum of the samples whose name ends with ``suffix`` (labels summed)."""
    return sum(v for k, v in delta.items() if k.endswith(suffix))


def latency(records: Sequence[Record]) -> dict[str, float]:
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_s for r in ok]
    itl = [r.itl_s for r in ok if r.output_tokens > 1]
    return {"ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90),
            "ttft_p99_s": pct(ttft, 99), "itl_p50_s": pct(itl, 50), "itl_p90_s": pct(itl, 90)}


def pull_paths(decode: Mapping[str, float]) -> dict[str, float]:
    """How decode's pulls came over the phase: device to device, file, stream."""
    return {f"pulls_{k}": counter(decode, f"_kv_sources_total:{k}")
            for k in ("ipc", "shm", "stream")}


def queue_split(prefill: Mapping[str, float],
                router: Mapping[str, float] | None = None) -> dict[str, float]:
    """Where a request waited before prefill computed it, in seconds per request:
    the router's admission (per turn admitted), then prefill's own queue (per
    request admitted into its engine) split by cause (prefill_svc/scheduler.py,
    ``WAIT_REASONS``), and the engine thread's time copying unpulled residents out."""
    admitted = counter(prefill, "_prefill_admitted_total")
    out = {"prefill_admitted": admitted,
           "prefill_queue_s": counter(prefill, "_queue_wait_s_total") / admitted
           if admitted else 0.0,
           "prefill_demote_s_total": counter(prefill, "_demote_seconds_total")}
    for why in WAIT_REASONS:
        secs = counter(prefill, f"_queue_split_seconds_total:{why}")
        out[f"prefill_queue_{why}_s"] = secs / admitted if admitted else 0.0
    if router:
        turns = counter(router, "_queue_wait_seconds_count")
        out["router_queue_s"] = (counter(router, "_queue_wait_seconds_sum") / turns
                                 if turns else 0.0)
    return out


def queue_line(pf: Mapping[str, float]) -> str:
    """``queue_split``'s figures as one line of the report."""
    parts = ", ".join(f"{why} {pf.get(f'prefill_queue_{why}_s', 0.0):.3f}"
                      for why in WAIT_REASONS)
    return (f"a turn waited {pf.get('router_queue_s', 0.0):.3f} s in the router's admission; "
            f"prefill's queue held each of its {pf.get('prefill_admitted', 0.0):.0f} requests "
            f"{pf.get('prefill_queue_s', 0.0):.3f} s = {parts}; residents copied out whole "
            f"on its engine thread {pf.get('prefill_demote_s_total', 0.0):.2f} s in all")


def prefill_figures(records: Sequence[Record], limits: Limits,
                    prefill: Mapping[str, float], decode: Mapping[str, float],
                    router: Mapping[str, float] | None = None) -> dict[str, float]:
    """``prefill`` / ``decode`` / ``router``: counter deltas of the services over the phase."""
    ok = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    span = (max(r.first_token_s for r in ok) - min(r.start_s for r in ok)) if ok else 0.0
    warehouse = counter(prefill, "_warehouse_tokens_total")
    compute_s = sum(limits.miss_time(r.prompt_tokens, r.cached_tokens) for r in ok)
    pcie_s = warehouse * limits.kv_bytes_per_token / (limits.h2d_gbps * 1e9)
    limit_s = compute_s + pcie_s
    eff = prompt / span if span > 0 else 0.0
    limit = prompt / limit_s if limit_s > 0 else 0.0
    pull_s = counter(decode, "_pull_seconds_total")
    # How much of the phase prefill computed: below 1 the figure is bound by the
    # offered load (turns waiting for their previous answers), not by prefill.
    busy_s = counter(prefill, "_step_seconds_total")
    return {"requests": float(len(records)), "errors": float(len(records) - len(ok)),
            "prefill_busy_s": busy_s, "prefill_busy_fraction": busy_s / span if span else 0.0,
            "prompt_tokens": float(prompt), "cached_tokens": float(cached),
            "cached_fraction": cached / prompt if prompt else 0.0,
            "g1_tokens": counter(prefill, "_g1_tokens_total"),
            "warehouse_tokens": warehouse,
            "computed_tokens": counter(prefill, "_computed_tokens_total"),
            "span_s": span, "effective_prefill_tps": eff,
            "limit_compute_s": compute_s, "limit_pcie_s": pcie_s, "limit_tps": limit,
            "vs_limit": eff / limit if limit else 0.0,
            # Where the rest goes: every prompt's whole KV crosses the host to decode.
            "handoff_gb": prompt * limits.kv_bytes_per_token / 1e9,
            "decode_pull_gbps": (counter(decode, "_pull_bytes_total") / pull_s / 1e9
                                 if pull_s > 0 else 0.0),
            "decode_rebuilds": counter(decode, "_rebuilds_total"),
            **pull_paths(decode), **queue_split(prefill, router), **latency(records)}


def decode_figures(records: Sequence[Record], limits: Limits, decode: Mapping[str, float], *,
                   batch: int, context: int, tokens: int, slo_tpot_s: float) -> dict[str, float]:
    ok = [r for r in records if r.ok]
    lat = latency(records)
    steps = counter(decode, "_batch_steps_total")
    rows = counter(decode, "_batch_step_rows_total") or counter(decode, "_batch_tokens_total")
    mean_batch = rows / steps if steps else 0.0
    itl = lat["itl_p50_s"]
    tps = mean_batch / itl if itl > 0 else 0.0
    roof = limits.decode_roofline(mean_batch, context + tokens / 2) if mean_batch else 0.0
    span = (max(r.end_s for r in ok) - min(r.start_s for r in ok)) if ok else 0.0
    out_tokens = sum(r.output_tokens for r in ok)
    return {"batch": float(batch), "requests": float(len(records)),
            "errors": float(len(records) - len(ok)), "context": float(context),
            "tokens": float(tokens), "steps": steps, "mean_batch": mean_batch,
            "decode_tps": tps, "roofline_tps": roof, "vs_roofline": tps / roof if roof else 0.0,
            "slo_tpot_s": slo_tpot_s, "tpot_met": float(0 < itl <= slo_tpot_s),
            "wall_output_tps": out_tokens / span if span > 0 else 0.0,
            "pull_gbps": (counter(decode, "_pull_bytes_total")
                          / counter(decode, "_pull_seconds_total") / 1e9
                          if counter(decode, "_pull_seconds_total") > 0 else 0.0),
            **pull_paths(decode), **step_breakdown(decode), **lat}


STEP_PARTS = ("wait", "forward", "sample", "read", "chunk")


def step_breakdown(decode: Mapping[str, float]) -> dict[str, float]:
    """A decode step's mean time and its parts in ms (decode_svc/batcher.py's
    ``step_*`` counters); ``step_loop_ms`` is what the parts leave: the event
    loop's work between steps and the hop to the engine thread."""
    steps = counter(decode, "_batch_step_seconds_count")
    if not steps:
        return {}
    out = {"step_ms": counter(decode, "_batch_step_seconds_sum") / steps * 1e3}
    for part in STEP_PARTS:
        out[f"step_{part}_ms"] = counter(decode, f"_batch_step_{part}_seconds_total") / steps * 1e3
    out["step_loop_ms"] = out["step_ms"] - sum(out[f"step_{p}_ms"] for p in STEP_PARTS)
    # Of the wait: other engine jobs (adopts, canonical exports); the rest is the hop.
    out["step_wait_jobs_ms"] = counter(decode, "_batch_step_wait_jobs_seconds_total") / steps * 1e3
    for q in (10, 50, 90):
        if (v := bucket_quantile(decode, "_batch_forward_seconds_bucket", q)) is not None:
            out[f"step_forward_p{q}_ms"] = v * 1e3
    return out


def bucket_quantile(delta: Mapping[str, float], suffix: str, q: float) -> float | None:
    """The upper bound of the bucket holding quantile ``q`` (percent) of a
    histogram whose cumulative buckets are ``<name><suffix>:<le>`` (as
    benchmarks.stack scrapes them); None with no observations."""
    # The scrape also keeps each sample summed over its labels, under the bare name.
    cum = sorted((float(k.rsplit(":", 1)[1]), v) for k, v in delta.items()
                 if ":" in k and k.rsplit(":", 1)[0].endswith(suffix))
    if not cum or cum[-1][1] <= 0:
        return None
    want = cum[-1][1] * q / 100
    return next(le for le, n in cum if n >= want)
