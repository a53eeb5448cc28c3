"""AIPerf, unchanged, as ``kvserve bench stack``'s load generator: one run of
``aiperf profile`` against the stack's router, and its per-request export read
back as typed records.

AIPerf runs in processes of its own: from its virtualenv
(scripts/install_aiperf.sh), or, where nothing can be installed (the lent GPU
machine), as ``python3 -m aiperf`` over a folder of its wheels unpacked with
``pip install --target`` (``site``: put first on the PYTHONPATH of AIPerf's
processes only, never the stack's). Rows are AIPerf mooncake_trace payload rows
(``kvserve trace export --format aiperf-sessions`` and ``decode_rows``): the
``/v1/completions`` body is sent verbatim, so AIPerf tokenizes nothing; token
counts, cached ones included, are the server's (``--use-server-token-count``).
Its dataset service still loads a tokenizer: it gets a local directory
(``tokenizer_dir``). Hugging Face's offline switch stays off on purpose: with it,
AIPerf 0.13 resolves even a local directory as a hub repository id and fails
(docs/benchmark-tools.md); a local directory needs no network either way, which
matters on a machine that has none.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

EXPORT = "profile_export.jsonl"


@dataclass(frozen=True, slots=True)
class AIPerf:
    """How to start AIPerf: ``argv`` (its executable, or ``python3 -m aiperf``) and
    the wheel folder its processes import first ("" = its own environment)."""

    argv: tuple[str, ...]
    site: str = ""

    def env(self, seed: int, scratch: Path) -> dict[str, str]:
        drop = {"PYTHONPATH", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"}
        env = {k: v for k, v in os.environ.items() if k not in drop}
        if self.site:
            env["PYTHONPATH"] = self.site
        # Its dataset files in the phase's folder, never a cache shared across runs: a
        # cache hit would skip the path a fresh machine takes (the tokenizer's load).
        env.update({"AIPERF_DATASET_MMAP_CACHE_ENABLED": "false",
                    "AIPERF_DATASET_MMAP_BASE_PATH": str(scratch),
                    "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1",
                    "PYTHONHASHSEED": str(seed), "PYTHONUNBUFFERED": "1"})
        return env


@dataclass(frozen=True, slots=True)
class Phase:
    """One ``aiperf profile`` run: the rows, and fixed schedule or a concurrency."""

    name: str
    rows: Path
    requests: int
    concurrency: int = 0                # 0: --fixed-schedule (the rows' own times)
    timeout_s: float = 600.0
    seed: int = 1
    extra: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Record:
    """One request as AIPerf saw it; times in seconds, token counts the server's."""

    ok: bool
    start_s: float                      # request sent (AIPerf's clock, ns / 1e9)
    end_s: float
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    itl_s: float                        # mean time between tokens after the first
    error: str = ""

    @property
    def first_token_s(self) -> float:
        return self.start_s + self.ttft_s


@dataclass(frozen=True, slots=True)
class PhaseResult:
    phase: Phase
    records: tuple[Record, ...]
    artifacts: Path                     # AIPerf's own output folder
    log: Path
    summary: dict[str, object] = field(default_factory=dict)  # its profile_export_aiperf.json

    @property
    def ok(self) -> list[Record]:
        return [r for r in self.records if r.ok]

    @property
    def errors(self) -> int:
        return len(self.records) - len(self.ok)


def command(tool: AIPerf, phase: Phase, url: str, model: str, art: Path,
            tokenizer: Path) -> list[str]:
    cmd = [*tool.argv, "profile", "--model", model, "--url", url, "--endpoint-type",
           "completions", "--streaming", "--tokenizer", str(tokenizer.resolve()),
           "--input-file", str(phase.rows),
           "--custom-dataset-type", "mooncake_trace", "--request-count", str(phase.requests),
           "--random-seed", str(phase.seed), "--output-artifact-dir", str(art),
           "--ui-type", "none", "--use-server-token-count", "--no-server-metrics",
           "--no-gpu-telemetry", "--no-auto-plot"]
    if phase.concurrency:
        cmd += ["--no-fixed-schedule", "--concurrency", str(phase.concurrency)]
    else:
        cmd += ["--fixed-schedule"]
    return cmd + list(phase.extra)


def run(tool: AIPerf, phase: Phase, url: str, model: str, out: Path,
        tokenizer: Path) -> PhaseResult:
    """Run the phase; raises RuntimeError (with the log's tail) when AIPerf fails
    or writes no per-request export."""
    art = out / f"aiperf-{phase.name}"
    log = out / f"aiperf-{phase.name}.log"
    scratch = out / f"aiperf-{phase.name}-data"
    art.mkdir(parents=True, exist_ok=True)
    scratch.mkdir(parents=True, exist_ok=True)
    cmd = command(tool, phase, url, model, art, tokenizer)
    with open(log, "wb") as f:
        f.write((" ".join(cmd) + "\n").encode())
        f.flush()
        try:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, env=tool.env(phase.seed, scratch),
                                  timeout=phase.timeout_s, check=False)
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            rc = f"timeout after {phase.timeout_s:.0f} s"
    export = next(iter(sorted(art.rglob(EXPORT))), None)
    if rc != 0 or export is None:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"aiperf ({phase.name}) exited {rc}"
                           f"{'' if export else ', no ' + EXPORT}; log {log}:\n{tail}")
    summary_file = next(iter(sorted(art.rglob("profile_export_aiperf.json"))), None)
    summary = json.loads(summary_file.read_text()) if summary_file else {}
    return PhaseResult(phase, tuple(parse_records(export.read_text().splitlines())), art, log,
                       summary)


def _metric(rec: dict[str, object], name: str) -> float:
    m = (rec.get("metrics") or {}).get(name)  # type: ignore[union-attr]
    if isinstance(m, dict):
        m = m.get("value")
    return float(m) if isinstance(m, int | float) else 0.0


def parse_records(lines: Iterable[str]) -> list[Record]:
    """AIPerf's per-request export (one JSON object a line; its times in ms and ns)."""
    out = []
    for line in lines:
        if not line.strip():
            continue
        rec = json.loads(line)
        meta = rec.get("metadata") or {}
        err = rec.get("error")
        ttft = _metric(rec, "time_to_first_token") / 1e3
        start = float(meta.get("request_start_ns") or 0) / 1e9
        end = float(meta.get("request_end_ns") or 0) / 1e9
        ok = not err and ttft > 0 and not meta.get("was_cancelled")
        out.append(Record(
            ok=ok, start_s=start, end_s=end, ttft_s=ttft,
            prompt_tokens=int(_metric(rec, "usage_prompt_tokens")),
            cached_tokens=int(_metric(rec, "usage_prompt_cache_read_tokens")),
            output_tokens=int(_metric(rec, "usage_completion_tokens")
                              or _metric(rec, "output_sequence_length")),
            itl_s=_metric(rec, "inter_token_latency") / 1e3,
            error="" if ok else str(err or "no first token")[:300]))
    return out


def decode_rows(model: str, prompts: Sequence[str], max_tokens: int) -> list[dict[str, object]]:
    """Payload rows for a concurrency run: one request per prompt, no times."""
    from kvserve.trace_export import completion_body

    return [{"payload": completion_body(model, p, max_tokens)} for p in prompts]


def tokenizer_dir(model: str, root: Path) -> Path:
    """A local tokenizer AIPerf can load (its dataset service loads one even when
    the server counts the tokens): the model's own directory, or, for a named
    random-weight config, a byte-level one written under ``root`` whose ids are
    the bytes, as engine.tokenizer.ByteTokenizer's are."""
    from engine.config import named_configs

    if model not in named_configs():
        from engine.fetch import KNOWN_MODELS, fetch_model

        return fetch_model(model) if model in KNOWN_MODELS else Path(model).expanduser()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    out = root / f"tokenizer-{model}"
    out.mkdir(parents=True, exist_ok=True)
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20}))
    return out


def _bytes_to_unicode() -> dict[int, str]:
    """Byte-level BPE's printable stand-in for each byte (the GPT-2 table)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def write_rows(path: Path, rows: Iterable[dict[str, object]]) -> int:
    n = 0
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")
            n += 1
    return n
