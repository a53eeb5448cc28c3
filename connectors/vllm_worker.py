"""The worker half of ``KVServeConnector``: moving bytes between vLLM's paged
KV cache and the warehouse.

A warehouse block holds every layer of ``block_tokens`` tokens:
``[layers, *vLLM's per-layer block]``; with vLLM's CPU and CUDA backends the
per-layer block is ``[kv_heads, block_tokens, K|V content]`` (layout LBHNC).

Loads: ``start_load`` issues one Get per request (all its blocks, on the
bridge's loop: the same-host shared-memory path or gRPC, every payload checked
against its checksum by the store/client) into a host buffer (pinned on CUDA).
``wait_layer`` waits for those Gets once, then copies only that layer's slice
into the paged cache, so on a GPU each layer's host-to-device copy overlaps the
previous layer's compute. A block the warehouse cannot return intact (missing,
evicted meanwhile, failed its checksum) and every block after it in that
request are reported by ``load_errors``: vLLM recomputes them (policy
"recompute"); they are never served.

Saves: ``save_layer`` gathers the blocks this step completed from that layer
into a host staging buffer (asynchronous on CUDA); ``wait_for_save`` hands the
buffers to background Puts and returns: nothing waits for the warehouse on the
forward path. The scheduler keeps a request's blocks until ``finished`` says its
Puts are over.
"""

from __future__ import annotations

import concurrent.futures
import logging
import re
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from connectors.vllm_bridge import StoreBridge
from connectors.vllm_config import ConnectorConfig
from connectors.vllm_meta import BlockTransfer, KVServeMeta
from connectors.vllm_presence import Presence
from kvstore.errors import KVStoreError

log = logging.getLogger(__name__)
NULL_BLOCK = 0            # vLLM's block pool hands block 0 out as its null block
_LAYER_NO = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class PagedLayout:
    """Where each layer's blocks live and what a warehouse block looks like."""

    names: tuple[str, ...]            # layers in block order
    groups: tuple[int, ...]           # KV cache group of each layer
    block_shape: tuple[int, ...]      # one layer's block, e.g. (kv_heads, tokens, content)
    dtype: torch.dtype
    device: torch.device

    @property
    def name(self) -> str:
        """The store's layout name: L<layers>xH<heads>xT<tokens>xD<content/2>:<dtype>."""
        if len(self.block_shape) != 3 or self.block_shape[2] % 2:
            raise ValueError(f"per-layer block shape {self.block_shape} is not "
                             "[kv_heads, tokens, K|V content]")
        h, t, c = self.block_shape
        return f"L{len(self.names)}xH{h}xT{t}xD{c // 2}:{str(self.dtype).removeprefix('torch.')}"


def paged_layout(kv_caches: dict[str, torch.Tensor], kv_cache_config: Any) -> PagedLayout:
    group_of: dict[str, int] = {}
    for gi, g in enumerate(kv_cache_config.kv_cache_groups):
        for n in g.layer_names:
            group_of[n] = gi

    def order(name: str) -> tuple[int, str]:
        m = _LAYER_NO.search(name)
        return (int(m.group(1)) if m else 1 << 30, name)

    names = tuple(sorted(kv_caches, key=order))
    shapes = {tuple(kv_caches[n].shape[1:]) for n in names}
    dtypes = {kv_caches[n].dtype for n in names}
    if len(shapes) != 1 or len(dtypes) != 1:
        raise ValueError(f"layers differ in block shape {shapes} or dtype {dtypes}: "
                         "one warehouse block cannot hold them")
    first = kv_caches[names[0]]
    return PagedLayout(names, tuple(group_of.get(n, 0) for n in names), shapes.pop(),
                       dtypes.pop(), first.device)


@dataclass(slots=True)
class _Load:
    transfer: BlockTransfer
    buf: torch.Tensor                          # [n, layers, *block]
    fut: concurrent.futures.Future[Any] | None
    valid: int = 0
    ids: list[torch.Tensor] = field(default_factory=list)   # per group, valid blocks


class WorkerSide:
    def __init__(self, cfg: ConnectorConfig, bridge: StoreBridge | None,
                 presence: Presence | None) -> None:
        self.cfg = cfg
        self.bridge = bridge
        self.presence = presence
        self.layout: PagedLayout | None = None
        self.kv: dict[str, torch.Tensor] = {}
        self._index: dict[str, int] = {}
        self._loads: list[_Load] = []
        self._resolved = True
        self._errors: set[int] = set()
        self._staged: list[tuple[BlockTransfer, torch.Tensor]] = []
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}       # req -> Puts in flight
        self._saving: set[str] = set()           # requests that had saves
        self._waiting: set[str] = set()          # finished, saves not yet over

    def _count(self, name: str, n: int = 1) -> None:
        if self.presence is not None:
            self.presence.count(name, n)

    def register(self, kv_caches: dict[str, torch.Tensor], kv_cache_config: Any) -> None:
        self.layout = paged_layout(kv_caches, kv_cache_config)
        self.kv = dict(kv_caches)
        self._index = {n: i for i, n in enumerate(self.layout.names)}
        log.info("kvserve connector: %d layers, layout %s", len(self.layout.names),
                 self.layout.name)

    def _host(self, n: int) -> torch.Tensor:
        assert self.layout is not None
        return torch.empty((n, len(self.layout.names), *self.layout.block_shape),
                           dtype=self.layout.dtype,
                           pin_memory=self.layout.device.type == "cuda")

    def bind(self, meta: KVServeMeta) -> None:
        """Every request with a save this step is reported by ``finished`` later,
        whether or not a layer copy happened (the scheduler holds its blocks)."""
        if meta.saves:
            with self._lock:
                self._saving.update(t.req_id for t in meta.saves)

    # -- loads -------------------------------------------------------------------------
    def start_load(self, meta: KVServeMeta) -> None:
        self._loads = []
        if not meta.loads or self.layout is None:
            return
        for t in meta.loads:
            buf = self._host(len(t.keys))
            fut = None
            if self.bridge is not None:
                fut = self.bridge.submit(
                    lambda c, t=t, buf=buf: c.get(t.keys, ctx=t.ctx, out=buf),
                    self.cfg.get_timeout_s)
            self._loads.append(_Load(t, buf, fut))
        self._resolved = False

    def _resolve(self) -> None:
        """Wait for this step's Gets; keep each request's intact leading blocks."""
        self._resolved = True
        assert self.layout is not None
        for ld in self._loads:
            t = ld.transfer
            n = len(t.keys)
            try:
                if ld.fut is None:
                    raise KVStoreError("no kvstore configured")
                res = ld.fut.result(self.cfg.get_timeout_s + 1.0)
                valid = res.hit_prefix
            except (KVStoreError, concurrent.futures.TimeoutError) as exc:
                log.warning("kvstore Get for %s failed (%s): recomputing %d blocks",
                            t.req_id, exc, n)
                self._count("get_failures")
                valid = 0
            if valid < n:
                self._count("load_errors", n - valid)
                for g in t.block_ids:
                    self._errors.update(b for b in g[valid:] if b != NULL_BLOCK)
            self._count("loaded_blocks", valid)
            ld.valid = valid
            dev = self.layout.device
            ld.ids = [torch.tensor(g[:valid], dtype=torch.long, device=dev) for g in t.block_ids]

    def wait_layer(self, layer_name: str) -> None:
        if not self._loads:
            return
        if not self._resolved:
            self._resolve()
        li = self._index.get(layer_name)
        if li is None:
            return
        assert self.layout is not None
        dst = self.kv[layer_name]
        gi = self.layout.groups[li]
        for ld in self._loads:
            if ld.valid == 0:
                continue
            ids = ld.ids[gi]
            src = ld.buf[:ld.valid, li]
            keep = ids != NULL_BLOCK               # SWA groups: blocks outside the window
            if not bool(keep.all()):
                ids, src = ids[keep], src[keep.cpu()]
            dst.index_copy_(0, ids, src.to(dst.device, non_blocking=True))

    def load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    # -- saves -------------------------------------------------------------------------
    def save_layer(self, meta: KVServeMeta, layer_name: str, kv_layer: torch.Tensor) -> None:
        if not meta.saves or self.layout is None:
            return
        li = self._index.get(layer_name)
        if li is None:
            return
        if not self._staged:
            self._staged = [(t, self._host(len(t.keys))) for t in meta.saves]
        gi = self.layout.groups[li]
        for t, buf in self._staged:
            ids = torch.tensor(t.block_ids[gi], dtype=torch.long, device=kv_layer.device)
            buf[:, li].copy_(kv_layer.index_select(0, ids), non_blocking=True)

    def wait_for_save(self) -> None:
        staged, self._staged = self._staged, []
        if not staged or self.bridge is None or self.layout is None:
            return
        ready = None
        if self.layout.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        for t, buf in staged:
            with self._lock:
                self._pending[t.req_id] = self._pending.get(t.req_id, 0) + 1
            self._put(t, buf, ready)

    def _put(self, t: BlockTransfer, buf: torch.Tensor, ready: Any) -> None:
        assert self.bridge is not None and self.layout is not None
        layout = self.layout.name

        async def put(c: Any) -> Any:
            if ready is not None:          # the device-to-host copies must be over first
                import asyncio

                await asyncio.to_thread(ready.synchronize)
            return await c.put(t.keys, buf, layout=layout, token_count=self.cfg.block_tokens,
                               ctx=t.ctx)

        fut = self.bridge.submit(put, self.cfg.put_timeout_s)
        fut.add_done_callback(lambda f: self._put_done(t, f))

    def _put_done(self, t: BlockTransfer, fut: concurrent.futures.Future[Any]) -> None:
        try:
            res = fut.result()
            self._count("saved_blocks", res.stored)
            self._count("save_skipped_present", res.skipped)
        except Exception as exc:
            log.info("kvstore Put for %s failed: %s", t.req_id, exc)
            self._count("put_failures")
        with self._lock:
            self._pending[t.req_id] -= 1
            if self._pending[t.req_id] == 0:
                del self._pending[t.req_id]

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """Requests whose blocks the scheduler held and whose Puts are all over."""
        with self._lock:
            self._waiting |= finished_req_ids & self._saving
            done = {r for r in self._waiting if r not in self._pending}
            self._waiting -= done
            self._saving -= done
        return done

    def close(self) -> None:
        if self.bridge is not None:
            self.bridge.close()
