"""The router's in-memory picture of the cluster, built for placement speed.

``ClusterView`` holds the live instances (``kvstore.registry.InstanceInfo``
records from heartbeats) and hands the policies a ``CandidateSet``: the
instances of one role as parallel numpy arrays, rebuilt only when the
membership or a heartbeat changes, so a decision reads arrays instead of
walking objects.

``PrefixView`` answers "which instance can restore how much of this prompt,
from which tier". It is fed by KV events (``kvstore.events.KVEvent``):

* a *location* is where blocks live: an engine instance for G1 (its local
  prefix cache), a node for G2/G3 (the node's kvstore, shared by the engines
  on that node), and ``GLOBAL`` for G4 (object storage, reachable from
  everywhere);
* state is one ``uint8`` matrix ``[rows, locations]`` whose cells are tier bit
  masks (bit t = tier G{t+1}), plus a dict from block key to row. Applying an
  event flips bits in place; a row whose bits all clear goes back to a free
  list, so the steady state allocates nothing per block;
* an instance's *sources* are three columns: its own id (G1), its node
  (G2/G3) and ``GLOBAL`` (G4). A match gathers the prompt's rows once, ORs
  each candidate's source columns and takes the leading run of blocks present
  (block keys are chained prefix hashes, so a block after a miss is useless).
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.events import KIND_STORED, KINDS, KVEvent
from kvstore.registry import InstanceInfo

TIERS: tuple[str, ...] = ("G1", "G2", "G3", "G4")
TIER_INDEX: dict[str, int] = {t: i for i, t in enumerate(TIERS)}
N_TIERS = len(TIERS)
GLOBAL = "*"                      # location of the shared object tier (G4)
_NONE = N_TIERS                   # "no tier" in the best-tier lookup
# Per-tier block counters packed in one integer per candidate: a block whose
# fastest tier is t adds (2 ** t) ** 8 = 1 << (8 * t) (uint32, 8 bits per tier,
# prompts up to 255 blocks) or (2 ** t) ** 16 (uint64, 16 bits per tier),
# computed from its lowest set tier bit by squaring, which is far cheaper than
# a table lookup on a [blocks, candidates] array; one column sum then counts.
_SHIFTS = np.array([0, 16, 32, 48], dtype=np.uint64)
_FIELD = np.uint64(0xFFFF)
_MAX_PACKED_BLOCKS = 0xFFFF
# Prompts of at most 255 blocks (16k tokens at 64) fit 8-bit counters in a uint32.
_SHIFTS8 = np.array([0, 8, 16, 24], dtype=np.uint32)
_FIELD8 = np.uint32(0xFF)
_MAX_BYTE_BLOCKS = 0xFF


class ViewError(ValueError):
    """Bad input to the view (unknown tier or event kind)."""


def tier_index(tier: str) -> int:
    try:
        return TIER_INDEX[tier]
    except KeyError:
        raise ViewError(f"unknown tier {tier!r}; known: {list(TIERS)}") from None


def event_location(ev: KVEvent) -> str:
    """Where an event's blocks can be restored from (see module doc)."""
    tier = tier_index(ev.tier)
    if tier == TIER_INDEX["G4"]:
        return GLOBAL
    if tier == TIER_INDEX["G1"]:
        return ev.instance or ev.node
    return ev.node or ev.instance


# ------------------------------------------------------------------ instances


@dataclass(frozen=True, slots=True)
class CandidateSet:
    """Instances of one role as parallel arrays (index i = ``ids[i]``)."""

    ids: tuple[str, ...]
    nodes: tuple[str, ...]
    infos: tuple[InstanceInfo, ...]
    load: np.ndarray            # [C] utilization 0..1
    queue: np.ndarray           # [C] requests waiting
    pending_tokens: np.ndarray  # [C] tokens in flight (prefill: prompt tokens queued or
                                #   computing; decode: context tokens of running sequences)
    imbalance: np.ndarray       # [C] expert imbalance, max/mean rank load (1.0 = balanced)

    @classmethod
    def of(cls, infos: Sequence[InstanceInfo],
           extra_pending: dict[str, float] | None = None) -> CandidateSet:
        infos = tuple(sorted(infos, key=lambda i: i.instance_id))
        extra = extra_pending or {}
        return cls(
            ids=tuple(i.instance_id for i in infos),
            nodes=tuple(i.node for i in infos),
            infos=infos,
            load=np.array([i.load for i in infos], dtype=np.float64),
            queue=np.array([i.queue for i in infos], dtype=np.float64),
            pending_tokens=np.maximum(np.array(
                [i.tokens_in_flight + extra.get(i.instance_id, 0.0) for i in infos],
                dtype=np.float64), 0.0),
            # A reported imbalance below 1 is meaningless (max >= mean); clamp it.
            imbalance=np.maximum(np.array([i.expert_imbalance for i in infos],
                                          dtype=np.float64), 1.0),
        )

    def __len__(self) -> int:
        return len(self.ids)

    def without(self, exclude: Iterable[str]) -> CandidateSet:
        drop = set(exclude)
        if not drop.intersection(self.ids):
            return self
        keep = [k for k, i in enumerate(self.ids) if i not in drop]
        return CandidateSet(
            ids=tuple(self.ids[k] for k in keep), nodes=tuple(self.nodes[k] for k in keep),
            infos=tuple(self.infos[k] for k in keep), load=self.load[keep],
            queue=self.queue[keep], pending_tokens=self.pending_tokens[keep],
            imbalance=self.imbalance[keep])


@dataclass(frozen=True, slots=True)
class Sent:
    """Work the router placed on an instance: hand it back to ``ClusterView.done``
    when the instance has finished it."""

    instance_id: str
    tokens: float
    at: float                   # time.time() when placed


class ClusterView:
    """Live instances by role. ``replace`` takes a registry listing; instances
    whose last heartbeat is older than ``expiry_s`` are left out of the
    candidates even before the registry drops them.

    An instance's pending work is its last report plus what the router knows
    better since then:

    * ``add_pending`` records work the router sent after the report (so a burst
      between two heartbeats does not all land on one instance); the next
      heartbeat, which counts that work itself, resets it;
    * ``done`` takes finished work off again at once: sent after the report, it
      leaves the router's own count; sent before, the report still counts it, so
      it is subtracted until a report taken after it finished arrives. Without
      this a client's next request saw the one it had just finished for up to a
      heartbeat and went to a cold instance instead of the one holding its prefix.
    """

    def __init__(self, *, expiry_s: float = 5.0) -> None:
        if expiry_s <= 0:
            raise ViewError(f"expiry_s must be > 0, got {expiry_s}")
        self.expiry_s = expiry_s
        self._infos: dict[str, InstanceInfo] = {}
        self._pending: dict[str, float] = {}
        self._finished: dict[str, list[tuple[float, float]]] = {}   # (when, tokens)
        self._cache: dict[str, CandidateSet] = {}

    def replace(self, infos: Iterable[InstanceInfo]) -> None:
        new = {i.instance_id: i for i in infos}
        for iid, info in new.items():
            old = self._infos.get(iid)
            if old is None or old.last_heartbeat != info.last_heartbeat:
                self._pending.pop(iid, None)
                self._forget_finished(iid, info.last_heartbeat)
        self._pending = {k: v for k, v in self._pending.items() if k in new}
        self._finished = {k: v for k, v in self._finished.items() if k in new}
        self._infos = new
        self._cache.clear()

    def upsert(self, info: InstanceInfo) -> None:
        self._infos[info.instance_id] = info
        self._pending.pop(info.instance_id, None)
        self._forget_finished(info.instance_id, info.last_heartbeat)
        self._cache.clear()

    def remove(self, instance_id: str) -> None:
        if self._infos.pop(instance_id, None) is not None:
            self._pending.pop(instance_id, None)
            self._finished.pop(instance_id, None)
            self._cache.clear()

    def add_pending(self, instance_id: str, tokens: float) -> Sent:
        if instance_id in self._infos:
            self._pending[instance_id] = self._pending.get(instance_id, 0.0) + tokens
            self._cache.clear()
        return Sent(instance_id, tokens, time.time())

    def done(self, sent: Sent) -> None:
        info = self._infos.get(sent.instance_id)
        if info is None or sent.tokens <= 0:
            return
        iid = sent.instance_id
        if info.last_heartbeat < sent.at:
            if iid in self._pending:
                self._pending[iid] = max(0.0, self._pending[iid] - sent.tokens)
        else:
            self._finished.setdefault(iid, []).append((time.time(), sent.tokens))
        self._cache.clear()

    def _forget_finished(self, instance_id: str, reported_at: float) -> None:
        # A report taken after the work finished no longer counts it.
        left = [f for f in self._finished.get(instance_id, ()) if f[0] > reported_at]
        if left:
            self._finished[instance_id] = left
        else:
            self._finished.pop(instance_id, None)

    def _adjustments(self) -> dict[str, float]:
        adj = dict(self._pending)
        for iid, finished in self._finished.items():
            adj[iid] = adj.get(iid, 0.0) - sum(n for _, n in finished)
        return adj

    def get(self, instance_id: str) -> InstanceInfo | None:
        return self._infos.get(instance_id)

    def instances(self, role: str | None = None) -> list[InstanceInfo]:
        return [i for i in self._infos.values() if role is None or i.role == role]

    def candidates(self, role: str, *, exclude: Iterable[str] = (),
                   now: float | None = None) -> CandidateSet:
        """Live instances of ``role`` (cached until the view changes)."""
        cached = self._cache.get(role)
        if cached is None or now is not None:
            t = time.time() if now is None else now
            live = [i for i in self._infos.values() if i.role == role
                    and (i.last_heartbeat <= 0 or t - i.last_heartbeat <= self.expiry_s)]
            cached = CandidateSet.of(live, self._adjustments())
            if now is None:
                self._cache[role] = cached
        return cached.without(exclude)


# ------------------------------------------------------------------ prefixes


@dataclass(frozen=True, slots=True)
class TierCounts:
    """Leading blocks restorable from one location (or one candidate), by the
    fastest tier holding each block."""

    blocks: int
    by_tier: tuple[int, int, int, int]     # G1, G2, G3, G4


class PrefixView:
    """Block key -> tier bits per location, fed by KV events (module doc)."""

    def __init__(self, *, initial_rows: int = 1 << 14, initial_locations: int = 16) -> None:
        if initial_rows < 1 or initial_locations < 2:
            raise ViewError("initial_rows must be >= 1 and initial_locations >= 2")
        # Column 0 stays all-zero: it pads candidates whose node is unknown.
        self._loc: dict[str, int] = {"": 0}
        self._loc_names: list[str] = [""]
        self._mat = np.zeros((initial_rows, initial_locations), dtype=np.uint8)
        self._rows: dict[Hashable, int] = {}
        self._free: list[int] = list(range(initial_rows - 1, -1, -1))
        self._nonzero = np.zeros(initial_rows, dtype=np.int32)  # set cells per row

    # -- bookkeeping ------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def locations(self) -> list[str]:
        return self._loc_names[1:]

    @property
    def location_count(self) -> int:
        return len(self._loc_names) - 1

    def column(self, location: str) -> int:
        """The column of ``location``, created on first use."""
        col = self._loc.get(location)
        if col is None:
            col = len(self._loc_names)
            if col == self._mat.shape[1]:
                grown = np.zeros((self._mat.shape[0], 2 * col), dtype=np.uint8)
                grown[:, :col] = self._mat
                self._mat = grown
            self._loc[location] = col
            self._loc_names.append(location)
        return col

    def _new_row(self) -> int:
        if not self._free:
            n = self._mat.shape[0]
            grown = np.zeros((2 * n, self._mat.shape[1]), dtype=np.uint8)
            grown[:n] = self._mat
            self._mat = grown
            self._nonzero = np.concatenate([self._nonzero, np.zeros(n, dtype=np.int32)])
            self._free = list(range(2 * n - 1, n - 1, -1))
        return self._free.pop()

    # -- events -----------------------------------------------------------------

    def apply(self, ev: KVEvent) -> None:
        """Apply one KV event from the stream."""
        self.apply_event(ev.kind, event_location(ev), ev.tier, ev.keys)

    def apply_event(self, kind: str, location: str, tier: str,
                    keys: Iterable[Hashable]) -> None:
        """``kind`` "stored" sets, "evicted"/"deleted" clears the tier's bit of
        ``keys`` at ``location``."""
        if kind not in KINDS:
            raise ViewError(f"unknown event kind {kind!r}; known: {sorted(KINDS)}")
        bit = np.uint8(1 << tier_index(tier))
        col = self.column(location)
        mat, rows, nonzero = self._mat, self._rows, self._nonzero
        if kind == KIND_STORED:
            for key in keys:
                r = rows.get(key)
                if r is None:
                    r = rows[key] = self._new_row()
                    mat, nonzero = self._mat, self._nonzero   # may have grown
                cell = mat[r, col]
                if not cell:
                    nonzero[r] += 1
                mat[r, col] = cell | bit
            return
        keep = np.uint8(~bit & 0xFF)
        for key in keys:
            r = rows.get(key)
            if r is None:
                continue
            cell = mat[r, col]
            if not cell & bit:
                continue
            cell &= keep
            mat[r, col] = cell
            if not cell:
                nonzero[r] -= 1
                if nonzero[r] == 0:
                    del rows[key]
                    self._free.append(r)

    def drop_location(self, location: str) -> None:
        """Forget everything held at ``location`` (an instance or node left)."""
        col = self._loc.get(location)
        if not col:
            return
        held = [k for k, r in self._rows.items() if self._mat[r, col]]
        for key in held:
            for tier in TIERS:
                self.apply_event("evicted", location, tier, (key,))

    # -- matching ----------------------------------------------------------------

    def _gather(self, keys: Iterable[Hashable]) -> np.ndarray:
        idx = list(map(self._rows.get, keys))        # C-speed lookups
        if None in idx:
            idx = idx[:idx.index(None)]               # nobody holds it: nobody matches past it
        return self._mat[idx]                         # [n, locations]

    @staticmethod
    def _count(bits: np.ndarray) -> np.ndarray:
        """[n, X] tier masks -> [X, 4] leading-run blocks by fastest tier."""
        run = np.logical_and.accumulate(bits != 0, axis=0)          # [n, X]
        held = bits * run                                           # [n, X] masks in the run
        low = held & (-held.view(np.int8)).view(np.uint8)            # fastest tier bit, 2**t
        n = bits.shape[0]
        if n <= _MAX_BYTE_BLOCKS:
            # 8-bit counters in a uint32: 2**t -> 2**(8 t) in three squarings.
            one32 = low.astype(np.uint32)
            for _ in range(3):
                one32 *= one32
            packed32 = one32.sum(axis=0, dtype=np.uint32)             # [X]
            return ((packed32[:, None] >> _SHIFTS8) & _FIELD8).astype(np.int64)
        if n <= _MAX_PACKED_BLOCKS:
            one = low.astype(np.uint64)
            for _ in range(4):
                one *= one                                           # 2**t -> 2**(16 t)
            packed = one.sum(axis=0)                                 # [X]
            return ((packed[:, None] >> _SHIFTS) & _FIELD).astype(np.int64)
        return np.stack([(low == (1 << t)).sum(axis=0) for t in range(N_TIERS)], axis=1)

    def match(self, keys: Sequence[Hashable]) -> dict[str, TierCounts]:
        """Per location holding at least the first block: its leading run."""
        sub = self._gather(keys)
        counts = self._count(sub)
        out: dict[str, TierCounts] = {}
        for col, name in enumerate(self._loc_names):
            row = counts[col] if col < counts.shape[0] else None
            if col == 0 or row is None:
                continue
            n = int(row.sum())
            if n:
                out[name] = TierCounts(n, (int(row[0]), int(row[1]), int(row[2]),
                                           int(row[3])))
        return out

    def sources(self, cands: CandidateSet) -> np.ndarray:
        """[C, 3] columns each candidate restores from: itself (G1), its node
        (G2/G3), GLOBAL (G4); column 0 (always empty) where a location has no
        blocks yet."""
        loc = self._loc
        return np.array([[loc.get(i, 0), loc.get(n, 0) if n else 0, loc.get(GLOBAL, 0)]
                         for i, n in zip(cands.ids, cands.nodes, strict=True)],
                        dtype=np.intp).reshape(len(cands), 3)

    def match_candidates(self, keys: Sequence[Hashable], cands: CandidateSet,
                         sources: np.ndarray | None = None) -> np.ndarray:
        """[C, 4] leading-run blocks each candidate can restore, by fastest tier.
        Pass ``sources`` (from ``sources``) to reuse it across decisions while
        no new location has appeared."""
        cols = self.sources(cands) if sources is None else sources
        sub = self._gather(keys)                                  # [n, locations]
        if sub.shape[0] == 0:
            return np.zeros((len(cands), N_TIERS), dtype=np.int64)
        # Three column takes and two ORs beat one reduce over a [n, C, 3] copy.
        bits = sub[:, cols[:, 0]] | sub[:, cols[:, 1]] | sub[:, cols[:, 2]]   # [n, C]
        # Only candidates holding the first block can match at all; without a
        # shared G4 prefix that is a few nodes' worth, so count just those.
        active = bits[0] != 0
        if active.all():
            return self._count(bits)
        out = np.zeros((len(cands), N_TIERS), dtype=np.int64)
        if active.any():
            out[active] = self._count(bits[:, active])
        return out


__all__ = ["GLOBAL", "N_TIERS", "TIERS", "TIER_INDEX", "CandidateSet", "ClusterView",
           "PrefixView", "TierCounts", "ViewError", "event_location", "tier_index"]
