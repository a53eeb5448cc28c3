"""``kvserve trace export``: our traces in the formats the peers' tools replay.

Sources: anything ``common.traces.load_trace`` reads (Claude Code sessions,
Mooncake, Bailian, operators' tables). Outputs, one JSON object per line:

* ``mooncake``: ``timestamp`` (ms), ``input_length``, ``output_length``,
  ``hash_ids`` — what AIPerf's ``--custom-dataset-type mooncake_trace`` and
  ``vllm bench serve --dataset-name timed_trace`` load. Give the tools the
  exported block size: ``--timed-trace-chunk-hash-size 64`` (vLLM; timestamps
  in ms: ``--timed-trace-sec-multiplier 0.001``), ``--prompt-input-tokens-block-size
  64`` (AIPerf's synthesis).
* ``aiperf``: ``timestamp``, ``text_input``, ``output_length`` and
  ``extra: {"session_id": ...}`` — the prompt already written as text, so
  AIPerf synthesises nothing (its hash-id synthesis is what crashed its dataset
  process pool here), and the per-request ``extra`` puts the session in the body,
  where kvserve's router reads it for affinity.

Keeping the prefix structure visible to a 64-token block cache. Hash ids are
*prefix* ids (id i names the whole prefix through block i), so:

* **context scale** — a source block count is reduced by coarsening (``rebin``:
  every k-th id stands for k source blocks, exactly), or a coarse source block
  (Mooncake's 512 tokens) is split into r exported blocks; each exported id is
  one whole ``block_tokens`` block. Two requests sharing j exported ids share
  exactly j * 64 tokens, which a 64-token block cache can find. The scale is
  snapped so that k or r is a whole number, and chosen (unless given) to fit the
  longest prompt into ``max_input_tokens``.
* **text that tokenizes back to the same blocks** (``aiperf``): each exported
  id is 64 words drawn (seeded by the id) from the model's own single-token
  words with a leading space; byte-level BPE never merges across such words,
  so the text of a block is exactly 64 tokens wherever it stands, and a shared
  prefix of text is a shared prefix of tokens.
* **time scale** multiplies every arrival time (0.1 = ten times the rate).
* **sessions in order** (``aiperf-sessions``): AIPerf's mooncake_trace payload
  rows with a top-level ``session_id``: AIPerf sends a session's turns one after
  another, each at its own time or, when the previous answer came later, the
  moment it comes, as an agent does. The row's ``payload`` is the
  ``/v1/completions`` body itself (prompt text, ``max_tokens`` with
  ``ignore_eos``, streaming with usage, the session for affinity), sent verbatim;
  a prompt never accumulates the tool's own history.
* **models with a byte tokenizer** (the random-weight shapes, e.g.
  llama-8b-shape): a block is 64 ASCII letters, 64 tokens wherever it stands.
* **paused sessions** (``Interleave``, ``--interleave N``): the first N agent
  sessions (main agents, in name order) that have ``turns`` turns fitting the
  context, their turns sent round-robin — turn 0 of every session, then turn 1
  of every session, ... — one request every ``gap_s`` seconds. Each session
  pauses ``N * gap_s`` between two turns while the other N - 1 sessions'
  prompts go through the engine: when those exceed the engine's KV budget
  (``min_tokens_between_turns`` says by how much at least), an LRU prefix cache
  has evicted the session by the time it comes back, and only a cache beyond
  the engine's (kvserve's warehouse) can serve the returning turn's prefix.

Where the seen run lost its hits (issue 18): 8 tokens per 64-token hash block
means a kvserve block spans 8 trace blocks, reuse ends mid-block (up to 63
tokens lost per request, small), but vLLM's ``timed_trace`` draws each chunk's
tokens from Python's ``hash()`` of the id, which is salted per process
(PYTHONHASHSEED), and the partial last chunk of every request uses other tokens
than the same id's full chunk; the large losses were the 26 failed requests
(no blocks written, so their sessions' later turns missed) and what they
displaced. ``reuse_profile`` is the exact reuse a trace offers to a 64-token
block cache of unbounded size, so an achieved hit rate can be read against it.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from common.traces import Trace, TraceRequest, load_trace, rebin

FORMATS = ("mooncake", "aiperf", "aiperf-sessions")


class ExportError(ValueError):
    """Options that cannot produce a trace (the message names the option)."""


@dataclass(frozen=True, slots=True)
class ExportOptions:
    fmt: str = "mooncake"
    block_tokens: int = 64              # tokens per exported hash id (the serving block size)
    context_scale: float = 0.0          # exported tokens per source token; 0: fit max_input
    max_input_tokens: int = 6000        # longer prompts are cut (at a block boundary)
    time_scale: float = 1.0
    output_tokens: int = 0              # 0: the trace's own output lengths
    max_output_tokens: int = 64         # cap (CPU decode is slow)
    model: str = "smollm2"              # tokenizer (and served name) for the text formats
    seed: int = 0

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ExportError(f"--format must be one of {list(FORMATS)}, got {self.fmt!r}")
        if self.block_tokens < 1 or self.max_input_tokens < self.block_tokens:
            raise ExportError("--block-tokens must be >= 1 and --max-input at least one block")
        if self.context_scale < 0 or self.time_scale <= 0 or not math.isfinite(self.time_scale):
            raise ExportError("--context-scale must be >= 0 and --time-scale > 0")
        if self.output_tokens < 0 or self.max_output_tokens < 1:
            raise ExportError("--output-tokens must be >= 0 and --max-output >= 1")


@dataclass(frozen=True, slots=True)
class ExportSummary:
    requests: int
    sessions: int
    source_block_tokens: int
    context_scale: float                # the one applied (after snapping)
    source_blocks_per_block: float      # k (>= 1) or 1/r
    truncated: int                      # prompts cut to max_input_tokens
    prompt_tokens: int
    reusable_tokens: int                # of them in a block an earlier request had (reuse_profile)
    span_s: float
    # Fewest prompt tokens of other requests sent between two consecutive turns of
    # one session (what an LRU cache takes in before the session returns); -1: no
    # session returns.
    min_tokens_between_turns: int = -1


@dataclass(frozen=True, slots=True)
class Interleave:
    """Agent sessions that pause and come back (module docstring, "paused sessions")."""
    sessions: int                       # N sessions, sent round-robin
    turns: int = 6                      # the first turns of each
    gap_s: float = 2.0                  # between consecutive requests; a session pauses N * gap_s
    min_first_input: int = 0            # a session's first turn has at least this many tokens

    def __post_init__(self) -> None:
        if self.sessions < 2 or self.turns < 2:
            raise ExportError("--interleave must be >= 2 sessions and --turns >= 2")
        if not self.gap_s > 0 or not math.isfinite(self.gap_s) or self.min_first_input < 0:
            raise ExportError("--gap must be > 0 and --min-first-input >= 0")


def _snap(scale: float, src_bt: int, bt: int) -> tuple[float, int, int]:
    """(scale, k, r): k source blocks per exported block or r exported blocks per
    source block (one of them 1), the scale rounded down to make it whole."""
    per = src_bt * scale / bt          # exported blocks per source block
    if per >= 1:
        r = math.floor(per + 1e-9)
        return r * bt / src_bt, 1, r
    k = math.ceil(1 / per - 1e-9)
    return bt / (k * src_bt), k, 1


def _scaled_ids(r: TraceRequest, r_split: int) -> tuple[int, ...]:
    if r_split == 1:
        return r.hash_ids
    # Source block h becomes r_split exported blocks, ids (h, j) packed into one int.
    return tuple(h * r_split + j for h in r.hash_ids for j in range(r_split))


def _exported_size(r: TraceRequest, scale: float, k: int, r_split: int) -> tuple[int, int]:
    """(blocks, tokens) of ``r`` once exported at the snapped scale, before any cut."""
    blocks = math.ceil(len(r.hash_ids) / k) * r_split
    return blocks, max(1, round(r.input_length * scale))


def interleave(trace: Trace, iv: Interleave, opts: ExportOptions) -> Trace:
    """The paused-sessions slice of ``trace``: its first ``iv.sessions`` main-agent
    sessions in name order whose first ``iv.turns`` turns all fit ``opts``' context
    uncut (a cut prompt would repeat the same prefix turn after turn) and whose first
    turn has at least ``iv.min_first_input`` tokens at ``opts.context_scale``, their
    turns round-robin, one request every ``iv.gap_s`` seconds."""
    if opts.context_scale <= 0:
        raise ExportError("--interleave needs --context-scale (sessions are picked by their "
                          "size once scaled)")
    scale, k, r_split = _snap(opts.context_scale, trace.block_tokens, opts.block_tokens)
    max_blocks = opts.max_input_tokens // opts.block_tokens
    by: dict[str, list[TraceRequest]] = {}
    for r in trace.requests:
        if "/" not in r.session:            # sub-agents are "<session>/<agent>"
            by.setdefault(r.session, []).append(r)
    picked: list[list[TraceRequest]] = []
    for name in sorted(by):
        turns = by[name][:iv.turns]
        if len(turns) < iv.turns:
            continue
        sizes = [_exported_size(r, scale, k, r_split) for r in turns]
        if all(b <= max_blocks and n <= opts.max_input_tokens for b, n in sizes) \
                and sizes[0][1] >= iv.min_first_input:
            picked.append(turns)
            if len(picked) == iv.sessions:
                break
    if len(picked) < iv.sessions:
        raise ExportError(f"--interleave {iv.sessions}: only {len(picked)} sessions have "
                          f"{iv.turns} turns within --max-input {opts.max_input_tokens} and a "
                          f"first turn of --min-first-input {iv.min_first_input} tokens or more")
    n = iv.sessions
    out = [replace(turns[t], t=(t * n + i) * iv.gap_s)
           for t in range(iv.turns) for i, turns in enumerate(picked)]
    return Trace(name=trace.name, block_tokens=trace.block_tokens, requests=tuple(out),
                 arrival_note=f"{n} agent sessions ({', '.join(t[0].session for t in picked)}), "
                              f"first {iv.turns} turns each, round-robin, one request every "
                              f"{iv.gap_s:g} s (each session pauses {n * iv.gap_s:g} s)")


def min_tokens_between_turns(requests: Iterable[TraceRequest]) -> int:
    """Fewest prompt tokens of other requests sent between two consecutive turns
    of one session (requests in time order); -1 when no session returns."""
    before: list[int] = [0]             # prompt tokens sent before request i
    last: dict[str, int] = {}
    best = -1
    for i, r in enumerate(requests):
        j = last.get(r.session)
        if j is not None:
            between = before[i] - before[j + 1]
            best = between if best < 0 else min(best, between)
        last[r.session] = i
        before.append(before[-1] + r.input_length)
    return best


def scale_trace(trace: Trace, opts: ExportOptions) -> tuple[Trace, ExportSummary]:
    """The trace at ``opts``' block size, context and time scales, ids renumbered
    densely in order of first use (0, 1, 2, ...), prompts within max_input_tokens."""
    bt, src_bt = opts.block_tokens, trace.block_tokens
    longest = max(r.input_length for r in trace.requests)
    scale = opts.context_scale or min(1.0, opts.max_input_tokens / max(longest, 1))
    scale, k, r_split = _snap(scale, src_bt, bt)
    coarse = rebin(trace, src_bt * k) if k > 1 else trace
    dense: dict[int, int] = {}
    max_blocks = opts.max_input_tokens // bt
    out: list[TraceRequest] = []
    truncated = 0
    for r in coarse.requests:
        ids = _scaled_ids(r, r_split)
        n_in = max(1, round(r.input_length * scale))
        if len(ids) > max_blocks or n_in > opts.max_input_tokens:
            truncated += 1
            ids = ids[:max_blocks]
            n_in = min(n_in, opts.max_input_tokens)
        # The ids must cover the prompt: (n - 1) full blocks and a last one, partial or full.
        n_in = min(max(n_in, (len(ids) - 1) * bt + 1), len(ids) * bt)
        new = tuple(dense.setdefault(h, len(dense)) for h in ids)
        out_len = opts.output_tokens or r.output_length or opts.max_output_tokens
        out.append(replace(r, t=r.t * opts.time_scale, hash_ids=new, input_length=n_in,
                           output_length=max(1, min(out_len, opts.max_output_tokens))))
    t0 = out[0].t if out else 0.0
    out = [replace(r, t=r.t - t0) for r in out]
    scaled = Trace(name=trace.name, block_tokens=bt, requests=tuple(out),
                   arrival_note=f"{trace.arrival_note}; exported at context scale "
                                f"{scale:.4g} ({bt}-token blocks), time scale "
                                f"{opts.time_scale:g}")
    prompt, reusable = reuse_totals(scaled)
    return scaled, ExportSummary(
        requests=len(out), sessions=len({r.session for r in out}), source_block_tokens=src_bt,
        context_scale=scale, source_blocks_per_block=k if k > 1 else 1 / r_split,
        truncated=truncated, prompt_tokens=prompt, reusable_tokens=reusable,
        span_s=scaled.span_s, min_tokens_between_turns=min_tokens_between_turns(out))


def reuse_profile(trace: Trace) -> list[int]:
    """Per request (in time order), the leading full blocks already in some
    earlier request: what an unbounded cache of ``trace.block_tokens`` blocks
    could serve. A last block is only counted when it is full."""
    seen: set[int] = set()
    out = []
    bt = trace.block_tokens
    for r in trace.requests:
        full = min(len(r.hash_ids), r.input_length // bt)
        k = 0
        while k < full and r.hash_ids[k] in seen:
            k += 1
        out.append(k)
        seen.update(r.hash_ids[:full])
    return out


def reuse_totals(trace: Trace) -> tuple[int, int]:
    """(prompt tokens, of them reusable by a block cache) over the whole trace."""
    prof = reuse_profile(trace)
    return (sum(r.input_length for r in trace.requests),
            sum(k * trace.block_tokens for k in prof))


def text_reuse(texts: Iterable[str], model: str = "smollm2",
               block_tokens: int = 64) -> tuple[int, int]:
    """(prompt tokens, of them in whole blocks an earlier prompt had) of text prompts in
    arrival order, tokenized by ``model``: the reuse of a trace that carries text
    instead of hash ids, measured as a block cache would see it (prefix-chained blocks)."""
    from tokenizers import Tokenizer

    from engine.fetch import KNOWN_MODELS, fetch_model

    root = fetch_model(model) if model in KNOWN_MODELS else Path(model).expanduser()
    tok = Tokenizer.from_file(str(root / "tokenizer.json"))
    seen: set[int] = set()
    prompt = reusable = 0
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False).ids
        prompt += len(ids)
        chain, hit = 0, True
        for i in range(0, len(ids) - block_tokens + 1, block_tokens):
            chain = hash((chain, tuple(ids[i:i + block_tokens])))
            if hit and chain in seen:
                reusable += block_tokens
            else:
                hit = False
            seen.add(chain)
    return prompt, reusable


# -------------------------------------------------------------------------- text

_WORD = re.compile(r"^\u0120[a-z]{3,9}$")      # byte-level BPE: \u0120 is the leading space


class BlockText:
    """Text of exported blocks: ``block_tokens`` single-token words per id, drawn
    by a generator seeded with (seed, id), so a block reads the same in every
    request and tokenizes to exactly ``block_tokens`` tokens wherever it stands.
    A named random-weight config reads bytes (engine.tokenizer.ByteTokenizer): its
    words are single ASCII letters."""

    def __init__(self, model: str, block_tokens: int, seed: int = 0) -> None:
        from tokenizers import Tokenizer

        from engine.config import named_configs
        from engine.fetch import KNOWN_MODELS, fetch_model

        self.block_tokens = block_tokens
        self.seed = seed
        if model in named_configs():
            self.words = list("abcdefghijklmnopqrstuvwxyz")
            self._tok = None
            return
        root = fetch_model(model) if model in KNOWN_MODELS else Path(model).expanduser()
        tok = Tokenizer.from_file(str(root / "tokenizer.json"))
        words = sorted(" " + t[1:] for t in tok.get_vocab() if _WORD.match(t))
        # Keep the words that are one token on their own (the vocabulary says so,
        # but merges decide): checked once here, in one batch.
        enc = tok.encode_batch(words, add_special_tokens=False)
        self.words = [w for w, e in zip(words, enc, strict=True) if len(e.ids) == 1]
        if len(self.words) < 256:
            raise ExportError(f"model {model!r}: its tokenizer has too few single-token words "
                              "for text prompts (not a byte-level BPE?)")
        self._tok = tok

    def block(self, hash_id: int, n: int | None = None) -> str:
        rng = random.Random(f"{self.seed}:{hash_id}")
        words = [rng.choice(self.words) for _ in range(self.block_tokens)]
        return "".join(words[:n])

    def prompt(self, r: TraceRequest) -> str:
        bt = self.block_tokens
        last = r.input_length - (len(r.hash_ids) - 1) * bt
        return "".join(self.block(h) for h in r.hash_ids[:-1]) + self.block(r.hash_ids[-1],
                                                                            last)

    def count(self, text: str) -> int:
        if self._tok is None:
            return len(text.encode())
        return len(self._tok.encode(text, add_special_tokens=False).ids)


# ------------------------------------------------------------------------ writing

def rows(trace: Trace, opts: ExportOptions) -> Iterator[dict[str, object]]:
    text = BlockText(opts.model, opts.block_tokens, opts.seed) if opts.fmt != "mooncake" \
        else None
    for r in trace.requests:
        row: dict[str, object] = {"timestamp": round(r.t * 1000.0, 3)}
        if text is None:
            row |= {"input_length": r.input_length, "output_length": r.output_length,
                    "hash_ids": list(r.hash_ids)}
        elif opts.fmt == "aiperf":
            row |= {"text_input": text.prompt(r), "output_length": r.output_length,
                    "extra": {"session_id": r.session}}
        else:
            row |= {"session_id": r.session,
                    "payload": completion_body(served_name(opts.model), text.prompt(r),
                                               r.output_length, r.session)}
        yield row


def served_name(model: str) -> str:
    """The model id a stack serving ``model`` answers to (router.model_meta's rule)."""
    return Path(model).name if "/" in model else model


def completion_body(model: str, prompt: str, max_tokens: int,
                    session: str = "") -> dict[str, object]:
    """A streaming ``/v1/completions`` body that generates exactly ``max_tokens``
    tokens and reports its usage (cached tokens included) in the last chunk."""
    body: dict[str, object] = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                               "ignore_eos": True, "stream": True,
                               "stream_options": {"include_usage": True}}
    if session:
        body["session_id"] = session
    return body


def write_jsonl(path: str | Path, items: Iterable[dict[str, object]]) -> int:
    n = 0
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in items:
            f.write(json.dumps(row, separators=(",", ":")) + "\n")
            n += 1
    return n


def export(source: str | Path, out: str | Path, opts: ExportOptions, *,
           max_sessions: int | None = None, max_requests: int | None = None,
           session_rate_per_s: float | None = None,
           paused: Interleave | None = None) -> ExportSummary:
    trace = load_trace(source, max_sessions=max_sessions, max_requests=max_requests,
                       seed=opts.seed, session_rate_per_s=session_rate_per_s)
    if paused is not None:
        trace = interleave(trace, paused, opts)
    scaled, summary = scale_trace(trace, opts)
    write_jsonl(out, rows(scaled, opts))
    return summary


def read_export(path: str | Path, block_tokens: int = 64) -> Trace:
    """An exported ``mooncake`` file read back as a Trace (ids as written), for
    round-trip checks and for ``kvserve bench serve`` to report the trace's reuse."""
    reqs = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            reqs.append(TraceRequest(t=float(row["timestamp"]) / 1000.0,
                                     session=str((row.get("extra") or {}).get("session_id", "")),
                                     hash_ids=tuple(int(h) for h in row.get("hash_ids", ())),
                                     input_length=int(row.get("input_length", 0)),
                                     output_length=int(row.get("output_length", 0)),
                                     traffic_class="chat"))
    reqs.sort(key=lambda r: r.t)
    return Trace(name=Path(path).name, block_tokens=block_tokens, requests=tuple(reqs),
                 arrival_note="exported trace as written")
