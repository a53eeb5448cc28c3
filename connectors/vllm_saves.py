"""Saves: blocks vLLM completed this step (prompt and generated) into the warehouse.

``save_layer`` (inside the forward, after each attention layer wrote its KV)
gathers this step's completed blocks of that layer into one leased host buffer
``[n, layers, *block]`` (``non_blocking`` from GPU memory into pinned memory);
``wait_for_save`` hands the buffer to background Puts (on CUDA after an event
that orders the device-to-host copies first) and returns: the warehouse is never
on the forward path. The scheduler keeps a request's blocks until ``finished``
says its Puts are over, and the buffer goes back to the pool when they are.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from connectors.vllm_bridge import StoreBridge
from connectors.vllm_buffers import HostBuffers, Lease
from connectors.vllm_meta import BlockTransfer

log = logging.getLogger(__name__)
Count = Callable[[str, int], None]


class SaveSide:
    def __init__(self, bridge: StoreBridge | None, put_timeout_s: float, block_tokens: int,
                 count: Count) -> None:
        self.bridge = bridge
        self.put_timeout_s = put_timeout_s
        self.block_tokens = block_tokens
        self._count = count
        self.buffers: HostBuffers | None = None
        self.layout_name = ""
        self.groups: tuple[int, ...] = ()
        self.device = torch.device("cpu")
        self._index: dict[str, int] = {}
        # (transfer, host lease, block ids per group, device staging or None)
        self._staged: list[tuple[BlockTransfer, Lease, list[torch.Tensor], Any]] = []
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}       # req -> Puts in flight
        self._saving: set[str] = set()           # requests that had saves
        self._waiting: set[str] = set()          # finished, saves not yet over

    def register(self, names: tuple[str, ...], groups: tuple[int, ...], layout_name: str,
                 device: torch.device, buffers: HostBuffers) -> None:
        self._index = {n: i for i, n in enumerate(names)}
        self.groups, self.layout_name, self.device, self.buffers = (groups, layout_name, device,
                                                                    buffers)

    def bind(self, saves: list[BlockTransfer]) -> None:
        """Every request with a save this step is reported by ``finished`` later,
        whether or not a layer copy happened (the scheduler holds its blocks)."""
        if saves:
            with self._lock:
                self._saving.update(t.req_id for t in saves)

    def save_layer(self, saves: list[BlockTransfer], layer_name: str,
                   kv_layer: torch.Tensor) -> None:
        if not saves or self.buffers is None:
            return
        li = self._index.get(layer_name)
        if li is None:
            return
        if not self._staged:
            cuda = self.device.type == "cuda"
            for t in saves:
                lease = self.buffers.take(len(t.keys))
                ids = [torch.tensor(g, dtype=torch.long, device=self.device)
                       for g in t.block_ids]
                stage = torch.empty(lease.view.shape, dtype=lease.view.dtype,
                                    device=self.device) if cuda else None
                self._staged.append((t, lease, ids, stage))
        gi = self.groups[li]
        for _t, lease, ids, stage in self._staged:
            dst = stage if stage is not None else lease.view
            dst[:, li].copy_(kv_layer.index_select(0, ids[gi]))

    def wait_for_save(self) -> None:
        staged, self._staged = self._staged, []
        if not staged:
            return
        if self.bridge is None:
            for _t, lease, _ids, _stage in staged:
                self.buffers.give(lease)  # type: ignore[union-attr]
            return
        ready = None
        if self.device.type == "cuda":
            for _t, lease, _ids, stage in staged:   # contiguous device -> pinned: async
                lease.view.copy_(stage, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        for t, lease, _ids, _stage in staged:
            with self._lock:
                self._pending[t.req_id] = self._pending.get(t.req_id, 0) + 1
            self._put(t, lease, ready)

    def _put(self, t: BlockTransfer, lease: Lease, ready: Any) -> None:
        assert self.bridge is not None
        layout, tokens = self.layout_name, self.block_tokens

        async def put(c: Any) -> Any:
            if ready is not None:          # the device-to-host copies must be over first
                await asyncio.to_thread(ready.synchronize)
            return await c.put(t.keys, lease.view, layout=layout, token_count=tokens, ctx=t.ctx)

        fut = self.bridge.submit(put, self.put_timeout_s)
        fut.add_done_callback(lambda f: self._put_done(t, lease, f))

    def _put_done(self, t: BlockTransfer, lease: Lease,
                  fut: concurrent.futures.Future[Any]) -> None:
        try:
            res = fut.result()
            self._count("saved_blocks", res.stored)
            self._count("save_skipped_present", res.skipped)
            if self.buffers is not None:
                self.buffers.give(lease)
        except Exception as exc:
            # Not back to the pool: a Put cut off by its deadline may still be
            # reading the buffer on a thread, and a reused buffer would feed it
            # another request's bytes under these keys.
            log.info("kvstore Put for %s failed: %s", t.req_id, exc)
            self._count("put_failures", 1)
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
