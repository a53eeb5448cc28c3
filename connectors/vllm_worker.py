"""The worker half of ``KVServeConnector``: moving bytes between vLLM's paged KV
cache and the warehouse (``connectors.vllm_loads``, ``connectors.vllm_saves``).

A warehouse block holds every layer of ``block_tokens`` tokens:
``[layers, *vLLM's per-layer block]``; with vLLM's CPU and CUDA backends the
per-layer block is ``[kv_heads, block_tokens, K|V content]`` (layout LBHNC).
Host buffers for both directions come from one pool (``vllm_buffers``), pinned
on CUDA and faulted in once.

Timing (``us_*`` counters, summed over steps, read by ``kvserve bench vllm``):
``us_get`` Get issued -> landed, ``us_wait`` how long the forward waited for it,
``us_copy`` the scatter into the paged cache, ``us_step_new`` the whole step of
requests computing their first tokens (metadata bound -> wait_for_save).
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import Any

import torch

from connectors.vllm_bridge import StoreBridge
from connectors.vllm_buffers import HostBuffers
from connectors.vllm_config import ConnectorConfig
from connectors.vllm_loads import LoadSide
from connectors.vllm_meta import KVServeMeta
from connectors.vllm_presence import Presence
from connectors.vllm_saves import SaveSide

log = logging.getLogger(__name__)
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


class WorkerSide:
    def __init__(self, cfg: ConnectorConfig, bridge: StoreBridge | None,
                 presence: Presence | None) -> None:
        self.cfg = cfg
        self.bridge = bridge
        self.presence = presence
        self.layout: PagedLayout | None = None
        self.loads = LoadSide(bridge, cfg.get_timeout_s, self._count)
        self.saves = SaveSide(bridge, cfg.put_timeout_s, cfg.block_tokens, self._count)
        self._step_t0 = 0.0
        self._step_new = 0

    def _count(self, name: str, n: int = 1) -> None:
        if self.presence is not None:
            self.presence.count(name, n)

    def register(self, kv_caches: dict[str, torch.Tensor], kv_cache_config: Any) -> None:
        self.layout = lay = paged_layout(kv_caches, kv_cache_config)
        buffers = HostBuffers((len(lay.names), *lay.block_shape), lay.dtype,
                              pinned=lay.device.type == "cuda")
        self.loads.register(dict(kv_caches), lay.names, lay.groups, buffers)
        self.saves.register(lay.names, lay.groups, lay.name, lay.device, buffers)
        log.info("kvserve connector: %d layers, layout %s", len(lay.names), lay.name)

    def bind(self, meta: KVServeMeta) -> None:
        # Bound before the forward; start_load_kv may come after it (vLLM starts
        # async-only loads once the forward is launched).
        self._step_t0 = time.perf_counter()
        self._step_new = meta.new_requests
        self.saves.bind(meta.saves)

    def start_load(self, meta: KVServeMeta) -> None:
        self.loads.start(meta.loads, meta.async_loads)

    def wait_layer(self, layer_name: str) -> None:
        self.loads.wait_layer(layer_name)

    def save_layer(self, meta: KVServeMeta, layer_name: str, kv_layer: torch.Tensor) -> None:
        self.saves.save_layer(meta.saves, layer_name, kv_layer)

    def wait_for_save(self) -> None:
        self.loads.end_step()
        self.saves.wait_for_save()
        if self._step_new:
            self._count("us_step_new", int((time.perf_counter() - self._step_t0) * 1e6))
            self._count("steps_new", 1)
            self._step_new = 0

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(saves over, async loads over, async loads failed wholly)."""
        recving, failed = self.loads.finished()
        return self.saves.finished(finished_req_ids), recving, failed

    def load_errors(self) -> set[int]:
        return self.loads.errors()

    def close(self) -> None:
        self.loads.close()
        if self.bridge is not None:
            self.bridge.close()
