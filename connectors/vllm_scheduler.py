"""The scheduler half of ``KVServeConnector``: what to load, what to save.

Per request it keeps the chain of 128-bit block keys of the request's tokens
(tenant proven by ``cache_salt`` or the untrusted namespace:
``connectors.vllm_identity``; class from ``kv_transfer_params``). The chain
grows with the request: prompt blocks at admission, then every block the
answer completes, so a returning session's next turn (prompt + previous answer
+ new text, the same token ids) hits both in any instance.

* ``matched`` (vLLM's ``get_num_new_matched_tokens``): one warehouse Lookup of
  the prompt's chain; the store applies the hit rule and this side applies its
  own reserve too (hybrid SWA models: window + backtrack), so the count vLLM
  gets is ``floor_to_block(min(matched, L - reserve))`` minus what vLLM's own
  prefix cache already holds. The answer is cached per request (vLLM may ask
  twice and wants no side effects). A store that cannot answer is a miss. The
  load is asynchronous (``load_async``: vLLM parks the request and keeps
  running others while the blocks move) or synchronous (the step that computes
  the request waits); hybrid models always load asynchronously (vLLM reports
  their failures per request, not per block).
* ``allocated``: remembers which vLLM blocks receive which warehouse blocks.
* ``build_meta``: this step's loads, and saves of the blocks that become
  complete in this step (prompt and generated; those the Lookup found are not
  written again), plus G1 events for the router.
* ``finished``: a request with saves keeps its blocks until the workers report
  the saves done (``get_finished``), since on GPU the copy out of the paged
  cache is still in flight when the step ends.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from connectors.vllm_bridge import StoreBridge
from connectors.vllm_config import ConnectorConfig
from connectors.vllm_identity import IdentityError, identity_of, traffic_class_of
from connectors.vllm_meta import BlockTransfer, KVServeMeta
from connectors.vllm_presence import Load, LocalBlocks, Presence
from kvstore.keys import chain_keys
from kvstore.types import RequestCtx

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Req:
    request: Any                         # vLLM's Request (its token list grows)
    ctx: RequestCtx
    fingerprint: bytes                   # chain identity (untrusted salts folded in)
    keys: list[bytes]
    prompt_tokens: int
    local_tokens: int = 0                # vLLM's own prefix-cache hit, at lookup
    usable_tokens: int = 0               # the hit rule's answer
    store_blocks: int = 0                # leading blocks the warehouse holds
    block_ids: list[list[int]] = field(default_factory=list)
    saved: int = 0                       # leading blocks saved or known stored
    any_save: bool = False
    load: BlockTransfer | None = None
    load_async: bool = False


class SchedulerSide:
    def __init__(self, cfg: ConnectorConfig, fingerprint: bytes, bridge: StoreBridge | None,
                 presence: Presence | None, *, max_requests: int, local_blocks: int,
                 secret: bytes = b"", kv_groups: int = 1) -> None:
        self.cfg = cfg
        self.secret = secret
        self.fingerprint = fingerprint
        self.bridge = bridge
        self.presence = presence
        self.classes = cfg.traffic_classes()
        self.max_requests = max_requests
        self.load_async = cfg.load_async or kv_groups > 1
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
        ident = identity_of(request.cache_salt, self.fingerprint, self.secret)
        if not ident.trusted:
            self._count("untrusted_salt")
        ctx = RequestCtx(request_id=request.request_id[:256], tenant=ident.tenant,
                         traffic_class=cls, model_fingerprint=ident.fingerprint.hex())
        prompt = list(request.prompt_token_ids or [])
        st = _Req(request, ctx, ident.fingerprint, self._keys(prompt, ident.tenant,
                                                              ident.fingerprint), len(prompt))
        self._reqs[request.request_id] = st
        return st

    def _keys(self, tokens: list[int], tenant: str, fingerprint: bytes) -> list[bytes]:
        return chain_keys(tokens, block_tokens=self.cfg.block_tokens, tenant=tenant,
                          fingerprint=fingerprint, secret=self.secret)

    def _extend(self, st: _Req, blocks: int) -> None:
        """Keys for the request's first ``blocks`` blocks, from the tokens it holds
        now (prompt + generated; a block whose tokens are not all known yet waits)."""
        if blocks <= len(st.keys):
            return
        tokens = list(st.request.all_token_ids)
        blocks = min(blocks, len(tokens) // self.cfg.block_tokens)
        if blocks > len(st.keys):
            st.keys = self._keys(tokens[:blocks * self.cfg.block_tokens], st.ctx.tenant,
                                 st.fingerprint)

    # -- vLLM hooks --------------------------------------------------------------------
    def matched(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        st = self._state(request)
        if st.load is not None or not st.keys:
            return 0, False
        st.local_tokens = num_computed_tokens
        if self.bridge is None or not self.cfg.load:
            return 0, False
        n_keys = min(len(st.keys), st.prompt_tokens // self.cfg.block_tokens)
        t0 = time.perf_counter()
        try:
            res = self.bridge.call(lambda c: c.lookup(st.keys[:n_keys],
                                                      prompt_tokens=st.prompt_tokens,
                                                      ctx=st.ctx), self.cfg.lookup_timeout_s)
        except Exception as exc:           # a store that cannot answer is a miss
            self._count("lookup_failures")
            log.info("kvstore lookup failed (%s): recomputing %s", exc, request.request_id)
            return 0, False
        finally:
            self._count("us_lookup", int((time.perf_counter() - t0) * 1e6))
        st.store_blocks = min(res.matched_blocks, n_keys)
        st.saved = max(st.saved, st.store_blocks)
        own = self.cfg.hit_rule.usable_tokens(st.store_blocks * self.cfg.block_tokens,
                                              st.prompt_tokens)
        st.usable_tokens = min(res.usable_tokens, own)
        self._count("lookups")
        ext = max(0, st.usable_tokens - num_computed_tokens)
        st.load_async = self.load_async and ext > 0
        return ext, st.load_async

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
        meta = KVServeMeta(new_requests=len(so.scheduled_new_reqs))
        for t in self._loads:              # consumed: a preempted request may load again
            st = self._reqs.get(t.req_id)
            (meta.async_loads if st is not None and st.load_async else meta.loads).append(t)
            if st is not None:
                st.load = None
        self._loads = []
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
        """Blocks whose every token has KV after this step: the prompt's, and the
        answer's as decode completes them (the same bits vLLM's own prefix cache
        would reuse for them)."""
        self._extend(st, computed // self.cfg.block_tokens)
        full = min(len(st.keys), computed // self.cfg.block_tokens,
                   min((len(g) for g in st.block_ids), default=0))
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
        if full > st.prompt_tokens // self.cfg.block_tokens:
            self._count("answer_blocks_planned", full - max(start, st.prompt_tokens
                                                              // self.cfg.block_tokens))
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
