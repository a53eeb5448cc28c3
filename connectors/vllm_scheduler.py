"""The scheduler half of ``KVServeConnector``: what to load, what to save.

Per request it keeps the prompt's chain of 128-bit block keys (tenant from
``cache_salt``, class from ``kv_transfer_params``), computed once.

* ``matched`` (vLLM's ``get_num_new_matched_tokens``): one warehouse Lookup of
  the whole chain; the store applies the hit rule and this side applies its
  own reserve too (hybrid SWA models: window + backtrack), so the count vLLM
  gets is ``floor_to_block(min(matched, L - reserve))`` minus what vLLM's own
  prefix cache already holds. The answer is cached per request (vLLM may ask
  twice and wants no side effects). A store that cannot answer is a miss.
* ``allocated``: remembers which vLLM blocks receive which warehouse blocks.
* ``build_meta``: this step's loads, and saves of the prompt blocks that become
  complete in this step (skipping those the warehouse already holds), plus G1
  events for the router.
* ``finished``: a request with saves keeps its blocks until the workers report
  the saves done (``get_finished``), since on GPU the copy out of the paged
  cache is still in flight when the step ends.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from connectors.vllm_bridge import StoreBridge
from connectors.vllm_config import ConnectorConfig
from connectors.vllm_identity import IdentityError, tenant_of, traffic_class_of
from connectors.vllm_meta import BlockTransfer, KVServeMeta
from connectors.vllm_presence import Load, LocalBlocks, Presence
from kvstore.errors import KVStoreError
from kvstore.keys import chain_keys
from kvstore.types import RequestCtx

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Req:
    ctx: RequestCtx
    keys: list[bytes]
    prompt_tokens: int
    local_tokens: int = 0                # vLLM's own prefix-cache hit, at lookup
    usable_tokens: int = 0               # the hit rule's answer
    store_blocks: int = 0                # leading blocks the warehouse holds
    block_ids: list[list[int]] = field(default_factory=list)
    saved: int = 0                       # leading blocks saved or known stored
    any_save: bool = False
    load: BlockTransfer | None = None


class SchedulerSide:
    def __init__(self, cfg: ConnectorConfig, fingerprint: bytes, bridge: StoreBridge | None,
                 presence: Presence | None, *, max_requests: int, local_blocks: int,
                 secret: bytes = b"") -> None:
        self.cfg = cfg
        self.secret = secret
        self.fingerprint = fingerprint
        self.fp_hex = fingerprint.hex()
        self.bridge = bridge
        self.presence = presence
        self.classes = cfg.traffic_classes()
        self.max_requests = max_requests
        self.local = LocalBlocks(cfg.local_blocks or local_blocks)
        self._reqs: dict[str, _Req] = {}
        self._loads: list[BlockTransfer] = []
        self._events: list[Any] = []

    def _count(self, name: str, n: int = 1) -> None:
        if self.presence is not None:
            self.presence.count(name, n)

    def load(self) -> Load:
        return Load(len(self._reqs), sum(r.prompt_tokens for r in self._reqs.values()),
                    self.max_requests)

    # -- identity ------------------------------------------------------------------------
    def _state(self, request: Any) -> _Req:
        st = self._reqs.get(request.request_id)
        if st is not None:
            return st
        try:
            cls = traffic_class_of(request.kv_transfer_params, self.classes)
        except IdentityError as exc:
            log.warning("request %s: %s; using class %s", request.request_id, exc,
                        self.classes.default)
            self._count("bad_class")
            cls = self.classes.default
        ctx = RequestCtx(request_id=request.request_id[:256], tenant=tenant_of(request.cache_salt),
                         traffic_class=cls, model_fingerprint=self.fp_hex)
        prompt = list(request.prompt_token_ids or [])
        keys = chain_keys(prompt, block_tokens=self.cfg.block_tokens, tenant=ctx.tenant,
                          fingerprint=self.fingerprint, secret=self.secret)
        st = _Req(ctx, keys, len(prompt))
        self._reqs[request.request_id] = st
        return st

    # -- vLLM hooks --------------------------------------------------------------------
    def matched(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        st = self._state(request)
        if st.load is not None or not st.keys:
            return 0, False
        st.local_tokens = num_computed_tokens
        if self.bridge is None or not self.cfg.load:
            return 0, False
        n_keys = len(st.keys)
        try:
            res = self.bridge.call(lambda c: c.lookup(st.keys, prompt_tokens=st.prompt_tokens,
                                                      ctx=st.ctx), self.cfg.lookup_timeout_s)
        except KVStoreError as exc:
            self._count("lookup_failures")
            log.info("kvstore lookup failed (%s): recomputing %s", exc, request.request_id)
            return 0, False
        st.store_blocks = min(res.matched_blocks, n_keys)
        st.saved = max(st.saved, st.store_blocks)
        own = self.cfg.hit_rule.usable_tokens(st.store_blocks * self.cfg.block_tokens,
                                              st.prompt_tokens)
        st.usable_tokens = min(res.usable_tokens, own)
        self._count("lookups")
        ext = max(0, st.usable_tokens - num_computed_tokens)
        return ext, False

    def allocated(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self._state(request)
        st.block_ids = [list(g) for g in blocks.get_block_ids()]
        if num_external_tokens <= 0 or st.load is not None:
            return
        bt = self.cfg.block_tokens
        first = st.local_tokens // bt
        last = (st.local_tokens + num_external_tokens) // bt
        st.load = BlockTransfer(request.request_id, st.ctx, st.keys[first:last],
                                [g[first:last] for g in st.block_ids], first)
        self._loads.append(st.load)
        self._count("hit_requests")
        self._count("hit_tokens", num_external_tokens)

    def build_meta(self, so: Any) -> KVServeMeta:
        meta = KVServeMeta(loads=self._loads)
        self._loads = []
        for t in meta.loads:               # consumed: a preempted request may load again
            if (st := self._reqs.get(t.req_id)) is not None:
                st.load = None
        for new in so.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is not None:
                st.block_ids = [list(g) for g in new.block_ids]
                self._plan_save(meta, new.req_id, st,
                                new.num_computed_tokens + so.num_scheduled_tokens[new.req_id])
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            ids = cached.new_block_ids[i]
            if ids is not None:
                if req_id in cached.resumed_req_ids:   # after preemption: the whole list
                    st.block_ids = [list(g) for g in ids]
                else:
                    for g, more in zip(st.block_ids, ids, strict=True):
                        g.extend(more)
            self._plan_save(meta, req_id, st,
                            cached.num_computed_tokens[i] + so.num_scheduled_tokens[req_id])
        return meta

    def _plan_save(self, meta: KVServeMeta, req_id: str, st: _Req, computed: int) -> None:
        full = min(len(st.keys), computed // self.cfg.block_tokens)
        self._publish_g1(st.keys[:full])
        start = st.saved
        if full <= start:
            return
        st.saved = full
        if self.bridge is None or not self.cfg.save:
            return
        if self.bridge.degraded:
            self._count("saves_skipped", full - start)
            return
        meta.saves.append(BlockTransfer(req_id, st.ctx, st.keys[start:full],
                                        [g[start:full] for g in st.block_ids], start))
        st.any_save = True

    def _publish_g1(self, keys: list[bytes]) -> None:
        if self.presence is None or not keys:
            return
        stored, evicted = self.local.touch(keys)
        if stored or evicted:
            self.presence.publish_g1(self.cfg.node, stored, evicted)
            self._events.extend(_vllm_events(stored, evicted, self.cfg.block_tokens))

    def finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        params = {"kv_cached_tokens": st.usable_tokens, "kv_tenant": st.ctx.tenant,
                  "kv_class": st.ctx.traffic_class}
        return st.any_save, params

    def take_events(self) -> list[Any]:
        events, self._events = self._events, []
        return events


def _vllm_events(stored: list[bytes], evicted: list[bytes], block_tokens: int) -> list[Any]:
    """The same facts as vLLM KV events, for vLLM's own publisher (medium "kvserve")."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    out: list[Any] = []
    if stored:
        out.append(BlockStored(block_hashes=list(stored), parent_block_hash=None, token_ids=[],
                               block_size=block_tokens, lora_id=None, medium="kvserve",
                               lora_name=None))
    if evicted:
        out.append(BlockRemoved(block_hashes=list(evicted), medium="kvserve"))
    return out
