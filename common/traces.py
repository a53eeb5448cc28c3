"""Request traces with prefix block hashes, loaded into one typed form.

Formats (detected from the file; where each public trace comes from: README.md,
"Public traces and expert-load recordings"):

- **Mooncake** JSONL: ``timestamp`` (ms), ``input_length``, ``output_length``,
  ``hash_ids`` (512-token prefix blocks, ids global to the file, last block may
  be partial). No sessions: they are inferred (see ``_infer_sessions``).
- **Bailian/Qwen** JSONL: ``chat_id``, ``parent_chat_id``, ``timestamp`` (s),
  ``type``, ``turn``, ``hash_ids`` (16-token blocks, global to the file). A
  session is a ``parent_chat_id`` chain.
- **CSV / Parquet** (operators' own logs): one row per request with ``time``
  (s), ``session``, ``hashes`` (block hashes root first) and optional
  ``input_length``, ``output_length``, ``class``; see ``_load_table``.
- **Compact trace directory** (``common.trace_arrays``, written by
  ``kvserve trace synth`` or ``kvserve trace compact``): arrays mapped from disk.
- **Claude Code agent sessions** (weka-claude-code): a ``traces.tar.xz`` of
  ``trace_NNNN.json``, a directory of them, or one such file. Hash ids are
  local to each session, so each session gets its own namespace; sub-agent
  requests sit at parent ``t`` + sub-agent ``t``; sessions are placed on one
  timeline by a seeded Poisson arrival process (``arrival_note`` says how).

Block ids are namespaced so that ids of different files and sessions never
collide: ``file_tag << 48 | session << 32 | local`` (session 0 for files whose
ids are global), which stays below 2**62 so ids remain small ints.
"""

from __future__ import annotations

import fnmatch
import hashlib
import heapq
import json
import math
import re
import tarfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from common.trace_arrays import CompactTrace, is_compact_dir
from common.trace_types import Trace, TraceRequest

FILE_SHIFT = 48
SESSION_SHIFT = 32
_FILE_TAGS = 1 << 14
SESSION_LIMIT = (1 << (FILE_SHIFT - SESSION_SHIFT)) - 1
# Little's law: sessions overlapping on average = arrival rate x mean duration.
DEFAULT_OVERLAP_SESSIONS = 16.0


class TraceFormatError(ValueError):
    """A trace file is missing, unreadable or not in a known format."""


@dataclass(frozen=True, slots=True)
class ClassRule:
    """``--class-of`` rules: comma-separated ``PATTERN=CLASS`` items, first match
    wins. PATTERN is a glob on the trace file name, ``type:GLOB`` on a Bailian
    request's ``type``, ``session:GLOB`` on the session name; a bare ``CLASS``
    (or ``*=CLASS``) matches everything. Unmatched requests keep the format's
    default (agent for Claude Code sessions, chat otherwise)."""

    items: tuple[tuple[str, str, str], ...] = ()   # (field, glob, class)

    @classmethod
    def parse(cls, text: str | None) -> ClassRule:
        items: list[tuple[str, str, str]] = []
        for raw in (text or "").split(","):
            part = raw.strip()
            if not part:
                continue
            pattern, _, klass = part.rpartition("=")
            pattern = pattern or "*"
            if not re.fullmatch(r"[a-z][a-z0-9_-]{0,31}", klass):
                raise ValueError(f"--class-of item {part!r}: class {klass!r} must match "
                                 "[a-z][a-z0-9_-]*")
            field, _, glob = pattern.partition(":") if ":" in pattern else ("file", "", pattern)
            if field not in ("file", "type", "session"):
                raise ValueError(f"--class-of item {part!r}: unknown field {field!r}; "
                                 "use file (default), type: or session:")
            items.append((field, glob, klass))
        return cls(tuple(items))

    def classify(self, file: str, rtype: str, session: str, default: str) -> str:
        values = {"file": file, "type": rtype, "session": session}
        for field, glob, klass in self.items:
            if fnmatch.fnmatchcase(values[field], glob):
                return klass
        return default


@dataclass(slots=True)
class _Raw:
    """A request before placement and classification."""

    t: float
    session: str
    hash_ids: tuple[int, ...]
    input_length: int
    output_length: int
    rtype: str = ""
    klass: str = ""             # a class the file names (CSV/Parquet ``class``), else ""


def file_tag(path: Path) -> int:
    """A stable namespace tag from the file name (pass ``namespace`` to pin one)."""
    digest = hashlib.blake2b(path.name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % _FILE_TAGS


def load_trace(path: str | Path, *, max_requests: int | None = None, seed: int = 0,
               session_rate_per_s: float | None = None, time_scale: float = 1.0,
               max_sessions: int | None = None, class_of: ClassRule | str | None = None,
               namespace: int | None = None) -> Trace:
    """Load a trace file (format detected). ``time_scale`` multiplies every
    time (72 turns a 1-hour trace into 3 days); ``max_requests`` keeps the
    earliest requests; ``max_sessions`` keeps a seeded random subset of agent
    sessions; ``session_rate_per_s`` is the Poisson rate placing agent sessions."""
    p = Path(path)
    if not p.exists():
        raise TraceFormatError(f"trace {p} does not exist")
    if time_scale <= 0 or not math.isfinite(time_scale):
        raise ValueError(f"time_scale must be a positive number, got {time_scale}")
    if max_requests is not None and max_requests < 1:
        raise ValueError(f"max_requests must be >= 1, got {max_requests}")
    if max_sessions is not None and max_sessions < 1:
        raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
    if session_rate_per_s is not None and session_rate_per_s <= 0:
        raise ValueError(f"session_rate_per_s must be > 0, got {session_rate_per_s}")
    tag = file_tag(p) if namespace is None else namespace
    if not 0 <= tag < _FILE_TAGS:
        raise ValueError(f"namespace must be in 0..{_FILE_TAGS - 1}, got {namespace}")
    rule = class_of if isinstance(class_of, ClassRule) else ClassRule.parse(class_of)
    if is_compact_dir(p):
        return _from_compact(p, max_requests, time_scale, rule)
    if _is_agent_archive(p):
        raws, block_tokens, note = _load_agent(p, tag, seed, session_rate_per_s, max_sessions)
        default_class = "agent"
    elif p.name.endswith((".csv", ".csv.gz", ".parquet")):
        raws, block_tokens, note = _load_table(p, tag)
        default_class = "chat"
    else:
        raws, block_tokens, note = _load_jsonl(p, tag)
        default_class = "chat"
    raws.sort(key=lambda r: r.t)
    if max_requests is not None:
        raws = raws[:max_requests]
    if time_scale != 1.0:
        note += f"; times multiplied by time_scale={time_scale:g}"
    requests = tuple(
        TraceRequest(t=r.t * time_scale, session=r.session, hash_ids=r.hash_ids,
                     input_length=r.input_length, output_length=r.output_length,
                     traffic_class=rule.classify(p.name, r.rtype, r.session,
                                                 r.klass or default_class))
        for r in raws)
    if not requests:
        raise TraceFormatError(f"trace {p} holds no requests")
    return Trace(name=p.name, block_tokens=block_tokens, requests=requests, arrival_note=note)


# ---------------------------------------------------------------- JSONL formats

def _read_jsonl(p: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with p.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceFormatError(f"{p}:{lineno}: not JSON ({exc})") from None
            if not isinstance(row, dict) or "hash_ids" not in row or "timestamp" not in row:
                raise TraceFormatError(f"{p}:{lineno}: a trace row needs timestamp and hash_ids")
            yield lineno, row


def _load_jsonl(p: Path, tag: int) -> tuple[list[_Raw], int, str]:
    rows = list(_read_jsonl(p))
    if not rows:
        raise TraceFormatError(f"trace {p} holds no requests")
    base = tag << FILE_SHIFT
    if "chat_id" in rows[0][1]:
        return _bailian(p, rows, base), 16, "Bailian timestamps (s) as recorded"
    raws = []
    for lineno, row in rows:
        try:
            ids = tuple(base | int(h) for h in row["hash_ids"])
            raws.append(_Raw(float(row["timestamp"]) / 1000.0, "", ids,
                             int(row["input_length"]), int(row.get("output_length", 0))))
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceFormatError(f"{p}:{lineno}: bad Mooncake row ({exc!r})") from None
    _infer_sessions(raws, p.stem)
    return raws, 512, "Mooncake timestamps (ms) as recorded; sessions inferred from shared prefixes"


def _bailian(p: Path, rows: list[tuple[int, dict[str, Any]]], base: int) -> list[_Raw]:
    root: dict[int, int] = {}
    raws = []
    for lineno, row in sorted(rows, key=lambda r: float(r[1]["timestamp"])):
        try:
            chat, parent = int(row["chat_id"]), int(row.get("parent_chat_id", -1))
            root[chat] = root.get(parent, parent) if parent >= 0 else chat
            ids = tuple(base | int(h) for h in row["hash_ids"])
            raws.append(_Raw(float(row["timestamp"]), f"{p.stem}:{root[chat]}", ids,
                             int(row["input_length"]), int(row.get("output_length", 0)),
                             str(row.get("type", ""))))
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceFormatError(f"{p}:{lineno}: bad Bailian row ({exc!r})") from None
    return raws


def _infer_sessions(raws: list[_Raw], stem: str) -> None:
    """Mooncake has no session ids. A request continues the session that
    introduced the block where its cached prefix ends, if it is the first to
    branch there (the next turn of a conversation extends its previous turn);
    a later branch at the same block, or no cached prefix, starts a new
    session (a shared system prompt is branched from many times)."""
    owner: dict[int, int] = {}
    branched: set[int] = set()
    sessions = 0
    for r in raws:
        k = 0
        for h in r.hash_ids:
            if h not in owner:
                break
            k += 1
        last = r.hash_ids[k - 1] if k else None
        if last is not None and (k == len(r.hash_ids) or last not in branched):
            if k < len(r.hash_ids):
                branched.add(last)
            sid = owner[last]
        else:
            sid, sessions = sessions, sessions + 1
        for h in r.hash_ids[k:]:
            owner[h] = sid
        r.session = f"{stem}:{sid}"


# ------------------------------------------------------------ operators' tables

def _hash_token(tok: str, p: Path, lineno: int) -> str:
    if not tok:
        raise TraceFormatError(f"{p}:{lineno}: empty block hash")
    return tok


def _table_rows(p: Path) -> tuple[Iterator[tuple[int, dict[str, Any]]], int]:
    """(line, row) pairs and the block size of a CSV or Parquet trace."""
    if p.name.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise TraceFormatError(f"{p}: reading Parquet needs pyarrow (pip install pyarrow); "
                                   "CSV needs nothing") from None
        table = pq.read_table(p)
        meta = table.schema.metadata or {}
        bt = int(meta.get(b"block_tokens", b"64"))
        return ((i + 2, row) for i, row in enumerate(table.to_pylist())), bt
    import csv
    import gzip
    import io

    opener: Any = gzip.open if p.name.endswith(".gz") else open
    try:
        with opener(p, "rt", newline="") as f:
            text = io.StringIO(f.read())
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceFormatError(f"{p}: unreadable ({exc})") from None
    first = text.readline()
    bt = 64
    skip = 1
    m = re.match(r"#\s*block_tokens\s*[:=]\s*(\d+)", first)
    if m:
        bt = int(m.group(1))
    else:
        text.seek(0)
        skip = 0
    reader = csv.DictReader(text)
    return ((i + 2 + skip, row) for i, row in enumerate(reader)), bt


def _load_table(p: Path, tag: int) -> tuple[list[_Raw], int, str]:
    """The operators' form: one row per request with ``time`` (seconds),
    ``session``, ``hashes`` (the prompt's block hashes root first: a list, or
    one string of space-separated tokens; any token text, e.g. hex digests)
    and optional ``input_length`` (tokens; default blocks x block size),
    ``output_length`` and ``class``. CSV may start with ``# block_tokens=N``
    (default 64); Parquet keeps it in the schema metadata key ``block_tokens``."""
    rows, bt = _table_rows(p)
    if bt < 1:
        raise TraceFormatError(f"{p}: block_tokens must be >= 1")
    base = tag << FILE_SHIFT
    local: dict[str, int] = {}
    raws: list[_Raw] = []
    for lineno, row in rows:
        try:
            hashes = row["hashes"]
            toks = hashes.split() if isinstance(hashes, str) else [str(h) for h in hashes]
            ids = tuple(base | local.setdefault(_hash_token(t, p, lineno), len(local))
                        for t in toks)
            n_in = row.get("input_length")
            cls = str(row.get("class") or "")
            if cls and not re.fullmatch(r"[a-z][a-z0-9_-]{0,31}", cls):
                raise ValueError(f"class {cls!r} must match [a-z][a-z0-9_-]*")
            raws.append(_Raw(float(row["time"]), str(row["session"]), ids,
                             int(n_in) if n_in not in (None, "") else len(ids) * bt,
                             int(row.get("output_length") or 0), klass=cls))
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceFormatError(f"{p}:{lineno}: bad row ({exc!r}); columns are time, "
                                   "session, hashes[, input_length, output_length, class]"
                                   ) from None
    if len(local) >= 1 << FILE_SHIFT:
        raise TraceFormatError(f"{p}: more than 2**48 distinct block hashes")
    return raws, bt, "times (s) as recorded in the table"


def _from_compact(p: Path, max_requests: int | None, time_scale: float,
                  rule: ClassRule) -> Trace:
    ct = CompactTrace.load(p)
    tr = ct.to_trace()
    reqs = tr.requests[:max_requests] if max_requests else tr.requests
    reqs = tuple(replace(r, t=r.t * time_scale, traffic_class=rule.classify(
        p.name, "", r.session, r.traffic_class)) for r in reqs)
    return replace(tr, requests=reqs)


def load_compact(path: str | Path, **kwargs: Any) -> CompactTrace:
    """A trace as arrays: a compact directory is mapped from disk as it is
    (no options apply), any other format is loaded and converted."""
    p = Path(path)
    if is_compact_dir(p) and not any(v not in (None, 1.0, 0) for v in kwargs.values()):
        return CompactTrace.load(p)
    return CompactTrace.from_trace(load_trace(p, **kwargs))


# ------------------------------------------------------------ agent sessions

def _is_agent_archive(p: Path) -> bool:
    return p.is_dir() or p.name.endswith((".tar.xz", ".tar", ".tar.gz")) or p.suffix == ".json"


def _agent_members(p: Path, keep: set[str]) -> Iterator[tuple[str, bytes]]:
    """(member name, bytes) of the kept sessions, read lazily in archive order."""
    if p.is_dir() or p.suffix == ".json":
        for f in sorted(p.glob("*.json")) if p.is_dir() else [p]:
            if f.name in keep:
                yield f.name, f.read_bytes()
        return
    try:
        with tarfile.open(p, "r:*") as tf:
            for m in tf:
                name = Path(m.name).name
                if m.isfile() and name in keep:
                    fh = tf.extractfile(m)
                    if fh is not None:
                        yield name, fh.read()
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise TraceFormatError(f"{p}: not a readable tar archive ({exc})") from None


def _select(names: list[str], max_sessions: int | None, seed: int) -> set[str]:
    if max_sessions is None or max_sessions >= len(names):
        return set(names)
    rng = np.random.default_rng(seed)
    return {names[i] for i in rng.choice(len(names), size=max_sessions, replace=False)}


def _session_requests(reqs: Iterable[dict[str, Any]], t0: float, session: str,
                      base: int, out: list[_Raw]) -> None:
    for r in reqs:
        t = t0 + float(r["t"])
        if r.get("type") == "subagent":
            agent = str(r.get("agent_id", "sub"))
            _session_requests(r.get("requests", []), t, f"{session}/{agent}", base, out)
            continue
        ids = tuple(base | int(h) for h in r["hash_ids"])
        out.append(_Raw(t, session, ids, int(r["in"]), int(r.get("out", 0))))


def _load_agent(p: Path, tag: int, seed: int, rate: float | None,
                max_sessions: int | None) -> tuple[list[_Raw], int, str]:
    keep = _select(_names_only(p), max_sessions, seed)
    sessions: list[tuple[str, list[_Raw]]] = []
    block_tokens = 64
    for index, (name, data) in enumerate(_agent_members(p, keep)):
        if index >= SESSION_LIMIT:
            raise TraceFormatError(f"{p}: more than {SESSION_LIMIT} sessions in one file")
        try:
            doc = json.loads(data)
            block_tokens = int(doc.get("block_size", block_tokens))
            reqs: list[_Raw] = []
            base = tag << FILE_SHIFT | (index + 1) << SESSION_SHIFT
            _session_requests(doc["requests"], 0.0, Path(name).stem, base, reqs)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise TraceFormatError(f"{p}:{name}: bad agent session ({exc!r})") from None
        if reqs:
            sessions.append((name, sorted(reqs, key=lambda r: r.t)))
    if not sessions:
        raise TraceFormatError(f"{p}: no agent sessions found")
    durations = [max(s[-1].t - s[0].t, 1.0) for _, s in sessions]
    if rate is None:
        rate = DEFAULT_OVERLAP_SESSIONS / float(np.mean(durations))
        why = (f"default rate = {DEFAULT_OVERLAP_SESSIONS:g} overlapping sessions / mean "
               f"session duration {np.mean(durations):.0f} s")
    else:
        why = "rate given"
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(sessions))
    starts = np.cumsum(rng.exponential(1.0 / rate, size=len(sessions)))
    starts -= starts[0]
    raws: list[_Raw] = []
    for start, i in zip(starts, order, strict=True):
        for r in sessions[i][1]:
            r.t += float(start)
            raws.append(r)
    note = (f"{len(sessions)} agent sessions placed by a Poisson arrival process "
            f"(seed {seed}, {rate:.3g} sessions/s, {why}; random session order); "
            f"sub-agent requests at parent t + sub-agent t")
    return raws, block_tokens, note


def _names_only(p: Path) -> list[str]:
    if p.is_dir():
        return sorted(f.name for f in p.glob("*.json"))
    if p.suffix == ".json":
        return [p.name]
    try:
        with tarfile.open(p, "r:*") as tf:
            return sorted(Path(m.name).name for m in tf.getmembers()
                          if m.isfile() and m.name.endswith(".json"))
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise TraceFormatError(f"{p}: not a readable tar archive ({exc})") from None


# ------------------------------------------------------------ transformations

def rebin(trace: Trace, block_tokens: int) -> Trace:
    """The same trace at a coarser block size (a multiple of the current one).
    Ids are prefix hashes, so the id of a fine block at the end of a coarse
    block identifies that coarse block exactly; a trailing partial coarse
    block keeps the last fine id (it stays partial, as in Mooncake)."""
    if block_tokens == trace.block_tokens:
        return trace
    if block_tokens < trace.block_tokens or block_tokens % trace.block_tokens:
        raise ValueError(f"can only coarsen blocks: {block_tokens} is not a multiple of "
                         f"{trace.block_tokens}")
    f = block_tokens // trace.block_tokens
    reqs = []
    for r in trace.requests:
        ids = r.hash_ids[f - 1::f]
        if len(r.hash_ids) % f:
            ids += (r.hash_ids[-1],)
        reqs.append(replace(r, hash_ids=ids))
    return replace(trace, block_tokens=block_tokens, requests=tuple(reqs),
                   arrival_note=f"{trace.arrival_note}; rebinned {trace.block_tokens}->"
                                f"{block_tokens}-token blocks")


def merge_traces(traces: Iterable[Trace], name: str | None = None) -> Trace:
    """One timeline of several traces (each already namespaced apart), coarsened
    to the largest block size among them."""
    parts = list(traces)
    if not parts:
        raise ValueError("merge_traces needs at least one trace")
    if len(parts) == 1:
        return parts[0]
    bt = max(t.block_tokens for t in parts)
    parts = [rebin(t, bt) for t in parts]
    merged = heapq.merge(*(t.requests for t in parts), key=lambda r: r.t)
    note = " | ".join(f"{t.name}: {t.arrival_note}" for t in parts)
    return Trace(name=name or "+".join(t.name for t in parts), block_tokens=bt,
                 requests=tuple(merged), arrival_note=note)
