"""Loads: warehouse blocks into vLLM's paged KV cache, verified, never served torn.

Where the bytes go. On CPU the Get's verified copy out of the store's shared
memory writes each block straight into its slot in every layer's paged cache
(``KVStoreClient.get`` with per-block destinations in pieces: one copy, hashed
as it is made, instead of a copy into a host buffer and a scatter out of it).
On CUDA, or where a sliding-window group has no block for some layer, the Get
fills a leased host buffer (pinned on CUDA) and a scatter per layer follows
(on CUDA one asynchronous host-to-device copy of the whole buffer, then the
per-layer scatters on the device, in stream order).

When. Two ways, chosen per request by the scheduler side (``KVServeMeta``):

* **synchronous** (``loads``): the step that computes the request's first tokens
  needs them. ``start`` issues one Get per request; the first ``wait_layer``
  waits for them, resolves each request's intact leading blocks and, with a
  buffer, scatters every layer of every request (one ``index_copy_`` per layer).
* **asynchronous** (``async_loads``, vLLM's ``load_kv_async``): the scheduler
  parks the request (``WAITING_FOR_REMOTE_KVS``) and other requests' forwards go
  on; the Get runs on the bridge's loop, and when it lands a copy thread
  resolves it (and scatters, on CUDA on a side stream, done when its event has
  completed). ``finished`` reports the request to vLLM only after that, so it
  is scheduled on KV that is already in place.

Either way a block the warehouse cannot return intact (missing, evicted since
the Lookup, failing its checksum: the store and client verify every payload,
shared memory included, as they copy it) and every later block of that request
are reported (``errors``; ``failed`` for hybrid models, whose block ids vLLM
cannot map back per group) and recomputed by vLLM (policy "recompute"): vLLM
discards the step's output for them and recomputes from the first bad block,
so whatever bytes such a block holds are never served. A Get that failed on a
deadline is waited for until nothing can still write (the bridge's deadline
cancels the call, and the client's copies end with it) before it is reported.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from connectors.vllm_bridge import StoreBridge
from connectors.vllm_buffers import HostBuffers, Lease
from connectors.vllm_meta import BlockTransfer
from kvstore.errors import KVStoreError

log = logging.getLogger(__name__)
NULL_BLOCK = 0            # vLLM's block pool hands block 0 out as its null block
Count = Callable[[str, int], None]


@dataclass(slots=True)
class _Part:
    transfer: BlockTransfer
    row: int                                   # first row in the batch's buffer
    fut: concurrent.futures.Future[Any] | None
    t0: float
    valid: int = 0


@dataclass(slots=True)
class _Batch:
    """Loads that share one leased buffer and one copy plan."""

    lease: Lease | None                       # None: written straight into the cache
    parts: list[_Part]
    ids: list[torch.Tensor] = field(default_factory=list)     # [group] destination blocks
    rows: list[Any] = field(default_factory=list)             # [group] source rows
    errors: set[int] = field(default_factory=set)
    failed: bool = False
    tainted: bool = False          # a Get raised: its copy threads may still write the buffer
    device_buf: torch.Tensor | None = None
    event: Any = None                                         # CUDA: copy done


class LoadSide:
    def __init__(self, bridge: StoreBridge | None, get_timeout_s: float, count: Count) -> None:
        self.bridge = bridge
        self.get_timeout_s = get_timeout_s
        self._count = count
        self.kv: dict[str, torch.Tensor] = {}
        self.names: tuple[str, ...] = ()
        self.groups: tuple[int, ...] = ()
        self.n_groups = 1
        self.device = torch.device("cpu")
        self.buffers: HostBuffers | None = None
        self._index: dict[str, int] = {}
        self._step: _Batch | None = None
        self._resolved = True
        self._errors: set[int] = set()
        self._lock = threading.Lock()
        self._landed: list[tuple[str, _Batch]] = []        # async: copied (or copying on CUDA)
        self._copier = concurrent.futures.ThreadPoolExecutor(1, "kvserve-load-copy")
        self._returning: list[tuple[Any, Lease]] = []     # (event or None, lease)
        self._ret_lock = threading.Lock()
        self._stream: Any = None

    def register(self, kv: dict[str, torch.Tensor], names: tuple[str, ...],
                 groups: tuple[int, ...], buffers: HostBuffers) -> None:
        self.kv, self.names, self.groups, self.buffers = kv, names, groups, buffers
        self.n_groups = max(groups, default=0) + 1
        self._index = {n: i for i, n in enumerate(names)}
        self.device = kv[names[0]].device
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=self.device)

    # -- issuing -------------------------------------------------------------------------
    def _direct_targets(self, t: BlockTransfer) -> list[list[memoryview]] | None:
        """Per block, its slot in every layer's paged cache, in warehouse order
        (layer by layer): the Get's verified copy writes there directly, one copy
        instead of two. CPU caches only, and only when every layer has a block
        (a sliding-window group's null block has no slot to receive its bytes)."""
        if self.device.type != "cpu":
            return None
        out: list[list[memoryview]] = []
        for i in range(len(t.keys)):
            ids = [t.block_ids[g][i] if g < len(t.block_ids) else NULL_BLOCK
                   for g in self.groups]
            if NULL_BLOCK in ids:
                return None
            # As bytes: numpy has no bfloat16, and the copy is bytes anyway.
            out.append([memoryview(self.kv[n][b].view(torch.uint8).numpy()).cast("B")
                        for n, b in zip(self.names, ids, strict=True)])
        return out

    def _issue(self, transfers: list[BlockTransfer]) -> _Batch:
        assert self.buffers is not None
        direct = [self._direct_targets(t) for t in transfers]
        lease = None if all(d is not None for d in direct) else self.buffers.take(
            sum(len(t.keys) for t in transfers))
        parts, row = [], 0
        for t, targets in zip(transfers, direct, strict=True):
            n, fut = len(t.keys), None
            if self.bridge is not None:
                out: Any = targets if lease is None else lease.view[row:row + n]
                fut = self.bridge.submit(lambda c, t=t, out=out: c.get(t.keys, ctx=t.ctx, out=out),
                                         self.get_timeout_s)
            parts.append(_Part(t, row, fut, time.perf_counter()))
            row += n
        return _Batch(lease, parts)

    def start(self, loads: list[BlockTransfer], async_loads: list[BlockTransfer]) -> None:
        self._step = None
        if self.buffers is None:
            return
        self._recycle()
        if loads:
            self._step = self._issue(loads)
            self._resolved = False
            self._count("loads_sync", len(loads))
        for t in async_loads:
            batch = self._issue([t])
            self._count("loads_async", 1)
            part = batch.parts[0]
            if part.fut is None:
                self._copier.submit(self._land, t.req_id, batch)
            else:
                part.fut.add_done_callback(
                    lambda _f, r=t.req_id, b=batch: self._copier.submit(self._land, r, b))

    # -- resolving -----------------------------------------------------------------------
    def _resolve(self, batch: _Batch) -> None:
        """Wait for the batch's Gets; plan the copy of each request's intact leading
        blocks; collect the rest as errors."""
        for p in batch.parts:
            t, n = p.transfer, len(p.transfer.keys)
            try:
                if p.fut is None:
                    raise KVStoreError("no kvstore configured")
                p.valid = min(n, p.fut.result(self.get_timeout_s + 1.0).hit_prefix)
            except Exception as exc:        # whatever went wrong, these blocks are recomputed
                if batch.lease is None and p.fut is not None:
                    # Written straight into vLLM's cache: nothing may still be writing
                    # once vLLM learns these blocks failed (the bridge's deadline ends
                    # the call, and the client's copies, soon after it fires).
                    concurrent.futures.wait([p.fut])
                log.warning("kvstore Get for %s failed (%s): recomputing %d blocks",
                            t.req_id, exc, n)
                self._count("get_failures", 1)
                p.valid = 0
                batch.tainted = p.fut is not None
            self._count("us_get", int((time.perf_counter() - p.t0) * 1e6))
            self._count("loaded_blocks", p.valid)
            if p.valid < n:
                self._count("load_errors", n - p.valid)
                batch.failed = True
                for g in t.block_ids:
                    batch.errors.update(b for b in g[p.valid:] if b != NULL_BLOCK)
        if batch.lease is None:
            return                          # the Get wrote the cache: no copy to plan
        for gi in range(self.n_groups):
            ids: list[int] = []
            rows: list[int] = []
            for p in batch.parts:
                g = p.transfer.block_ids[gi] if gi < len(p.transfer.block_ids) else []
                for i in range(min(p.valid, len(g))):
                    if g[i] != NULL_BLOCK:          # SWA groups: blocks outside the window
                        ids.append(g[i])
                        rows.append(p.row + i)
            batch.ids.append(torch.tensor(ids, dtype=torch.long, device=self.device))
            contiguous = rows == list(range(len(rows)))
            batch.rows.append(slice(0, len(rows)) if contiguous
                              else torch.tensor(rows, dtype=torch.long))

    def _copy_layer(self, batch: _Batch, li: int) -> None:
        # One index_copy_ per layer for all the batch's requests.
        gi = self.groups[li]
        ids = batch.ids[gi]
        if ids.numel() == 0:
            return
        assert batch.lease is not None
        src_all = batch.device_buf if batch.device_buf is not None else batch.lease.view
        rows = batch.rows[gi]
        if isinstance(rows, torch.Tensor) and src_all.device != rows.device:
            rows = rows.to(src_all.device)
        self.kv[self.names[li]].index_copy_(0, ids, src_all[rows, li])

    def _copy_all(self, batch: _Batch) -> None:
        # One thread: torch's index_copy_ already runs on the intra-op threads, and
        # the copy is memory-bound (2 Python threads measured no faster here).
        if batch.lease is None:
            return
        for li in range(len(self.names)):
            self._copy_layer(batch, li)

    def _to_device(self, batch: _Batch) -> None:
        # One asynchronous copy of the whole (contiguous, pinned) buffer; each layer's
        # scatter then runs on the device, in stream order.
        if self.device.type == "cuda" and batch.lease is not None:
            n = batch.parts[-1].row + len(batch.parts[-1].transfer.keys)
            batch.device_buf = batch.lease.view[:n].to(self.device, non_blocking=True)

    def wait_layer(self, layer_name: str) -> None:
        """The first attention layer of a step with loads waits for the Gets and
        writes every layer of every request (one scatter per layer); later layers
        find it done. All at once rather than layer by layer: on CPU nothing would
        overlap the copies anyway, and no layer can be missed."""
        batch = self._step
        if batch is None or self._resolved:
            return
        t0 = time.perf_counter()
        self._resolve(batch)
        t1 = time.perf_counter()
        self._to_device(batch)
        self._copy_all(batch)
        self._resolved = True
        self._count("us_wait", int((t1 - t0) * 1e6))
        self._count("us_copy", int((time.perf_counter() - t1) * 1e6))
        with self._lock:
            self._errors |= batch.errors

    def end_step(self) -> None:
        """After the forward (vLLM's wait_for_save): the step's buffer goes back."""
        batch, self._step = self._step, None
        if batch is None:
            return
        if not self._resolved:             # no attention layer ran: still account for it
            self._resolve(batch)
            self._resolved = True
            with self._lock:
                self._errors |= batch.errors
        self._release(batch, self._event())

    def _event(self) -> Any:
        if self.device.type != "cuda":
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev

    def _release(self, batch: _Batch, event: Any) -> None:
        """Give the batch's buffer back once nothing can still touch it: a device copy
        may still be reading (its event); a Get cut off by its deadline may still be
        writing from the client's copy threads (that buffer is dropped)."""
        assert self.buffers is not None
        if batch.lease is not None and not batch.tainted:   # a tainted one is dropped
            self._give_later(event, batch.lease)
        self._recycle()

    def _give_later(self, event: Any, lease: Lease) -> None:
        with self._ret_lock:
            self._returning.append((event, lease))

    def _recycle(self) -> None:
        assert self.buffers is not None
        ready: list[Lease] = []
        with self._ret_lock:
            keep = []
            for ev, lease in self._returning:
                if ev is None or ev.query():
                    ready.append(lease)
                else:
                    keep.append((ev, lease))
            self._returning = keep
        for lease in ready:
            self.buffers.give(lease)

    # -- asynchronous loads ------------------------------------------------------------
    def _land(self, req_id: str, batch: _Batch) -> None:
        """On the copy thread: resolve the Get and write every layer into the cache."""
        try:
            t0 = time.perf_counter()
            if self._stream is not None:
                # Everything on the side stream, the block-id tensors included, so
                # the scatter is ordered after the copies that feed it.
                with torch.cuda.stream(self._stream):
                    self._resolve(batch)
                    t0 = time.perf_counter()
                    self._to_device(batch)
                    self._copy_all(batch)
                    batch.event = torch.cuda.Event()
                    batch.event.record(self._stream)
            else:
                self._resolve(batch)
                t0 = time.perf_counter()
                self._copy_all(batch)
            self._count("us_copy", int((time.perf_counter() - t0) * 1e6))
        except Exception as exc:            # never leave vLLM waiting on this request
            log.warning("kvserve async load of %s failed: %s", req_id, exc)
            batch.failed = True
            for p in batch.parts:
                for g in p.transfer.block_ids:
                    batch.errors.update(b for b in g if b != NULL_BLOCK)
        with self._lock:
            self._landed.append((req_id, batch))

    def finished(self) -> tuple[set[str], set[str]]:
        """(requests whose async load is over, those of them that failed wholly)."""
        done: set[str] = set()
        failed: set[str] = set()
        with self._lock:
            keep: list[tuple[str, _Batch]] = []
            for req_id, batch in self._landed:
                if batch.event is not None and not batch.event.query():
                    keep.append((req_id, batch))
                    continue
                done.add(req_id)
                if batch.failed and self.n_groups > 1:
                    # vLLM cannot map flat block ids back to groups: recompute it all.
                    failed.add(req_id)
                else:
                    self._errors |= batch.errors
                self._release(batch, None)     # its copies are over (event completed)
            self._landed = keep
        return done, failed

    def errors(self) -> set[int]:
        with self._lock:
            errors, self._errors = self._errors, set()
        return errors

    def close(self) -> None:
        self._copier.shutdown(wait=False, cancel_futures=True)
