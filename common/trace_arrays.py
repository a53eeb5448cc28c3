"""A trace as a few flat arrays: what the native replay core reads.

Block uses are interned to dense ``uint32`` ids (4 bytes each; Belady's next
use adds 4 more), requests are rows of parallel arrays. A trace saved with
``save`` is a directory of ``.npy`` files plus ``meta.json``; ``load`` maps
them (``mmap_mode="r"``), so a trace larger than memory streams from disk
while it replays. The format (docs/operators.md, "Compact traces"):

- ``ids.npy``: uint32 [uses], interned block ids in request order, each
  request's blocks root first;
- ``offsets.npy``: int64 [requests + 1], request i's blocks are
  ``ids[offsets[i]:offsets[i + 1]]``;
- ``times.npy``: float64 [requests], seconds, non-decreasing;
- ``input_length.npy``: int64 [requests], prompt tokens;
- ``classes.npy``: uint8 [requests], index into ``meta["classes"]``;
- ``sessions.npy``: uint32 [requests], interned session ids;
- ``meta.json``: ``{"format": "kvtrace", "version": 1, "name", "block_tokens",
  "classes", "n_keys", "arrival_note"}``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.trace_types import Trace, TraceRequest

FORMAT = "kvtrace"
_ARRAYS = ("ids", "offsets", "times", "input_length", "classes", "sessions")


@dataclass(frozen=True, slots=True)
class CompactTrace:
    name: str
    block_tokens: int
    ids: np.ndarray            # uint32 [uses]
    offsets: np.ndarray        # int64 [requests + 1]
    times: np.ndarray          # float64 [requests]
    input_length: np.ndarray   # int64 [requests]
    classes: np.ndarray        # uint8 [requests]
    sessions: np.ndarray       # uint32 [requests]
    class_names: tuple[str, ...]
    n_keys: int
    arrival_note: str = ""

    def __post_init__(self) -> None:
        n = len(self.times)
        if len(self.offsets) != n + 1 or len(self.input_length) != n or len(
                self.classes) != n or len(self.sessions) != n:
            raise ValueError("CompactTrace: per-request arrays differ in length")
        if n and (int(self.offsets[0]) != 0 or int(self.offsets[-1]) != len(self.ids)):
            raise ValueError("CompactTrace: offsets must span ids")
        if not 1 <= len(self.class_names) <= 255:
            raise ValueError("CompactTrace: 1..255 traffic classes")

    @property
    def n_requests(self) -> int:
        return len(self.times)

    @property
    def n_uses(self) -> int:
        return len(self.ids)

    @property
    def span_s(self) -> float:
        return float(self.times[-1] - self.times[0]) if len(self.times) else 0.0

    def nbytes(self) -> int:
        return sum(int(getattr(self, a).nbytes) for a in _ARRAYS)

    # ------------------------------------------------------------ conversions
    @classmethod
    def from_trace(cls, trace: Trace) -> CompactTrace:
        reqs = trace.requests
        lens = np.fromiter((len(r.hash_ids) for r in reqs), dtype=np.int64, count=len(reqs))
        offsets = np.zeros(len(reqs) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        raw = np.fromiter((h for r in reqs for h in r.hash_ids), dtype=np.uint64,
                          count=int(offsets[-1]))
        uniq, inverse = np.unique(raw, return_inverse=True)
        names: dict[str, int] = {}
        sessions: dict[str, int] = {}
        classes = np.fromiter((names.setdefault(r.traffic_class, len(names)) for r in reqs),
                              dtype=np.uint8, count=len(reqs))
        sess = np.fromiter((sessions.setdefault(r.session, len(sessions)) for r in reqs),
                           dtype=np.uint32, count=len(reqs))
        return cls(name=trace.name, block_tokens=trace.block_tokens,
                   ids=inverse.astype(np.uint32).reshape(-1), offsets=offsets,
                   times=np.fromiter((r.t for r in reqs), dtype=np.float64, count=len(reqs)),
                   input_length=np.fromiter((r.input_length for r in reqs), dtype=np.int64,
                                            count=len(reqs)),
                   classes=classes, sessions=sess, class_names=tuple(names) or ("chat",),
                   n_keys=len(uniq), arrival_note=trace.arrival_note)

    def to_trace(self) -> Trace:
        """Back to request objects (interned ids as hash ids), for the Python policies."""
        ids = self.ids.tolist()
        off = self.offsets.tolist()
        reqs = tuple(
            TraceRequest(t=float(t), session=str(s), hash_ids=tuple(ids[off[i]:off[i + 1]]),
                         input_length=int(n), output_length=0,
                         traffic_class=self.class_names[c])
            for i, (t, s, n, c) in enumerate(zip(self.times.tolist(), self.sessions.tolist(),
                                                 self.input_length.tolist(),
                                                 self.classes.tolist(), strict=True)))
        return Trace(name=self.name, block_tokens=self.block_tokens, requests=reqs,
                     arrival_note=self.arrival_note)

    def select(self, rows: np.ndarray) -> CompactTrace:
        """The requests at ``rows`` (sorted indices), ids kept as they are."""
        lens = np.diff(self.offsets)[rows]
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        take = np.concatenate([np.arange(self.offsets[i], self.offsets[i + 1])
                               for i in rows]) if len(rows) else np.zeros(0, np.int64)
        return CompactTrace(self.name, self.block_tokens, self.ids[take], offsets,
                            self.times[rows], self.input_length[rows], self.classes[rows],
                            self.sessions[rows], self.class_names, self.n_keys,
                            self.arrival_note)

    # ------------------------------------------------------------ files
    def save(self, path: str | Path) -> Path:
        d = Path(path)
        d.mkdir(parents=True, exist_ok=True)
        for a in _ARRAYS:
            np.save(d / f"{a}.npy", np.ascontiguousarray(getattr(self, a)))
        meta = {"format": FORMAT, "version": 1, "name": self.name,
                "block_tokens": self.block_tokens, "classes": list(self.class_names),
                "n_keys": self.n_keys, "arrival_note": self.arrival_note}
        (d / "meta.json").write_text(json.dumps(meta, indent=1))
        return d

    @classmethod
    def load(cls, path: str | Path, *, mmap: bool = True) -> CompactTrace:
        d = Path(path)
        try:
            meta = json.loads((d / "meta.json").read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{d}: not a compact trace directory ({exc})") from None
        if meta.get("format") != FORMAT:
            raise ValueError(f"{d}/meta.json: format is not {FORMAT!r}")
        mode = "r" if mmap else None
        arrs = {a: np.load(d / f"{a}.npy", mmap_mode=mode) for a in _ARRAYS}
        want = {"ids": np.uint32, "offsets": np.int64, "times": np.float64,
                "input_length": np.int64, "classes": np.uint8, "sessions": np.uint32}
        for a, dt in want.items():
            if arrs[a].dtype != dt or arrs[a].ndim != 1:
                raise ValueError(f"{d}/{a}.npy: want a 1-d {np.dtype(dt).name} array")
        return cls(name=str(meta.get("name", d.name)), block_tokens=int(meta["block_tokens"]),
                   class_names=tuple(meta["classes"]), n_keys=int(meta["n_keys"]),
                   arrival_note=str(meta.get("arrival_note", "")), **arrs)


def is_compact_dir(path: str | Path) -> bool:
    p = Path(path) / "meta.json"
    if not p.is_file():
        return False
    try:
        return json.loads(p.read_text()).get("format") == FORMAT
    except (OSError, json.JSONDecodeError):
        return False


def memory_budget_bytes() -> int:
    """Physical memory, for deciding whether to map a trace rather than read it."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 1 << 34


__all__ = ["CompactTrace", "is_compact_dir", "memory_budget_bytes"]

