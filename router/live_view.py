"""The router's live picture of the cluster, kept current from Redis.

Two background tasks feed it:

* the instance registry, polled every ``poll_s``: instances whose heartbeat
  hash expired are gone from the listing, so a killed instance leaves the
  view within ``instance_ttl_s + poll_s``. An instance the router itself saw
  fail is quarantined at once (until it stops heartbeating, or for
  ``instance_ttl_s`` if it keeps heartbeating: it may have recovered);
* the KV event stream (``kvserve:events``), applied to the prefix view so
  affinity reflects blocks stored and evicted since the last lookup.

The state lives in the router-core library's ``ClusterView``/``PrefixView``
and choosing is its ``Placer`` (router.placement): this module only keeps
them current and turns a ``Decision`` into the ``Choice`` the flow records.
The event reader starts from the oldest retained entry, so a restarted router
rebuilds which location holds which prefix from the stream's history
(stored and evicted events replayed in order).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace

from common.config import ConfigError, HitRule
from kvstore.events import KIND_DELETED, EventReader, KVEvent
from kvstore.registry import InstanceInfo, InstanceRegistry
from router.errors import InvalidRequestError, NoInstanceError
from router.metrics import RouterMetrics
from router.placement import Decision, NoCandidateError, Placer, make_router_policy
from router.session import DecodeAnchors, SessionConfig, SessionMap
from router.view import TIERS, CandidateSet, ClusterView, PrefixView, Sent, ViewError

log = logging.getLogger(__name__)

ENGINE_ROLES = ("prefill", "decode")
_TRACKED_ROLES = frozenset({"prefill", "decode", "kvstore"})
OnChange = Callable[[Sequence[str]], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class ViewConfig:
    policy: str = "cache_aware"
    hit_rule: HitRule = field(default_factory=HitRule)
    heartbeat_s: float = 1.0
    instance_ttl_s: float = 5.0
    poll_s: float = 0.5
    events_block_ms: int = 500
    sessions: SessionConfig = field(default_factory=SessionConfig)

    def __post_init__(self) -> None:
        if self.heartbeat_s <= 0 or self.instance_ttl_s <= self.heartbeat_s:
            raise ConfigError("router instance_ttl_s must exceed heartbeat_s > 0")
        if not 0 < self.poll_s <= self.instance_ttl_s:
            raise ConfigError("router poll_s must be in (0, instance_ttl_s]")
        if self.events_block_ms < 1:
            raise ConfigError("router events_block_ms must be >= 1")
        try:
            make_router_policy(self.policy)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc


@dataclass(frozen=True, slots=True)
class Choice:
    """One placement decision, with what the log and /metrics show about it."""

    instance: InstanceInfo
    score: float
    reason: str
    policy: str
    detail: str = ""
    sent: Sent | None = None     # for ``LiveView.finished``


class LiveView:
    def __init__(self, redis_url: str, cfg: ViewConfig, metrics: RouterMetrics) -> None:
        self.redis_url = redis_url
        self.cfg = cfg
        self.metrics = metrics
        self.cluster = ClusterView(expiry_s=cfg.instance_ttl_s)
        self.prefixes = PrefixView()
        self.placer = Placer(make_router_policy(cfg.policy), self.prefixes,
                             hit_rule=cfg.hit_rule)
        self._quarantine: dict[str, float] = {}      # id -> until (monotonic)
        self.sessions = SessionMap(cfg.sessions)
        self.decode_anchors = DecodeAnchors(cfg.sessions.max_sessions)
        self._nodes_with_store: set[str] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._listeners: list[OnChange] = []
        self._admit: Callable[[InstanceInfo], bool] = lambda info: True
        self._on_stop: list[Callable[[], Awaitable[None]]] = []
        self._registry: InstanceRegistry | None = None
        self._events: EventReader | None = None
        self._stopping = asyncio.Event()

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        self._registry = InstanceRegistry(self.redis_url, ttl_s=self.cfg.instance_ttl_s)
        self._events = EventReader(self.redis_url, start_id="0")
        await self.refresh()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._poll_registry(), name="view-registry"),
                       loop.create_task(self._follow_events(), name="view-events")]

    async def stop(self) -> None:
        # Ask the loops to end rather than cancelling them: a cancel that lands in
        # redis-py's blocking XREAD can leave the task stuck "cancelling" forever
        # (seen with redis 8.1). Each loop checks the flag at least every poll or
        # blocking read; cancel only what is still running after that.
        self._stopping.set()
        for hook in self._on_stop:
            await hook()
        if self._tasks:
            grace = max(self.cfg.poll_s, self.cfg.events_block_ms / 1000) + 2.0
            _, pending = await asyncio.wait(self._tasks, timeout=grace)
            for t in pending:
                t.cancel()
        self._tasks = []
        if self._events is not None:
            await self._events.close()
        if self._registry is not None:
            await self._registry.close()

    def set_admission(self, admit: Callable[[InstanceInfo], bool]) -> None:
        """Only instances ``admit`` accepts enter the view (a backend's trust rule,
        e.g. signed registry entries)."""
        self._admit = admit

    def on_stop(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Run ``hook`` first when the view stops (sources that feed it)."""
        self._on_stop.append(hook)

    def on_change(self, listener: OnChange) -> None:
        """Called with the live addresses whenever the instance set changes."""
        self._listeners.append(listener)

    # -- registry -----------------------------------------------------------------

    async def refresh(self) -> None:
        assert self._registry is not None
        listed = [i for i in await self._registry.list_instances()
                  if i.role in _TRACKED_ROLES and self._admit(i)]
        before = {i.instance_id for i in self.cluster.instances()}
        self.cluster.replace(listed)
        now_ids = {i.instance_id for i in listed}
        # Quarantine ends when the instance stops heartbeating (it leaves the
        # listing) or when it runs out while heartbeats continue (it recovered).
        now = time.monotonic()
        self._quarantine = {k: until for k, until in self._quarantine.items()
                            if k in now_ids and until > now}
        for gone in before - now_ids:
            self.prefixes.drop_location(gone)             # its G1 blocks went with it
            self.sessions.forget_instance(gone)
            self.decode_anchors.forget_instance(gone)
        stores = {i.node for i in listed if i.role == "kvstore"}
        for node in self._nodes_with_store - stores:
            self.prefixes.drop_location(node)             # its G2/G3 blocks are unreachable
        self._nodes_with_store = stores
        for role in ENGINE_ROLES:
            self.metrics.instances.labels(role=role).set(len(self._candidates(role, set())))
        if before != now_ids:
            log.info("live instances: %s", sorted(now_ids))
            addresses = [i.address for i in listed if i.role in ENGINE_ROLES]
            for listener in self._listeners:
                await listener(addresses)

    async def _poll_registry(self) -> None:
        while not await self._stop_within(self.cfg.poll_s):
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis hiccup: keep the last view, retry next poll
                log.warning("registry poll failed: %s", exc)

    def _candidates(self, role: str, exclude: set[str]) -> CandidateSet:
        # The cluster view rebuilds its candidate arrays at each registry poll,
        # leaving out instances whose last heartbeat is older than the expiry;
        # between polls a decision reuses them (the placer caches by identity).
        return self.cluster.candidates(role, exclude=exclude | self._quarantine.keys())

    def live_counts(self) -> dict[str, int]:
        return {role: len(self._candidates(role, set())) for role in ENGINE_ROLES}

    def mark_failed(self, instance_id: str) -> None:
        self._quarantine[instance_id] = time.monotonic() + self.cfg.instance_ttl_s

    def known_blocks(self, keys: Sequence[bytes]) -> int:
        """The longest leading run of ``keys`` any location holds, in any tier."""
        return max((c.blocks for c in self.placer.prefixes.match(keys).values()), default=0)

    def fingerprint(self) -> str:
        """The model fingerprint the prefill instances serve (block keys depend on it)."""
        prints = {i.model_fingerprint for i in self._candidates("prefill", set()).infos
                  if i.model_fingerprint}
        if not prints:
            raise NoInstanceError("no live prefill instance is registered")
        if len(prints) > 1:
            # Mixed models behind one router would split the cache and the answers.
            raise NoInstanceError(f"prefill instances disagree on the model fingerprint: "
                                  f"{sorted(prints)}")
        return prints.pop()

    # -- KV events ---------------------------------------------------------------------

    async def _follow_events(self) -> None:
        assert self._events is not None
        while not self._stopping.is_set():
            try:
                for ev in await self._events.read(block_ms=self.cfg.events_block_ms):
                    self._apply(ev)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("KV event stream read failed: %s", exc)
                await self._stop_within(self.cfg.poll_s)

    async def _stop_within(self, seconds: float) -> bool:
        """Wait up to ``seconds``; True when the view is stopping."""
        try:
            await asyncio.wait_for(self._stopping.wait(), seconds)
        except TimeoutError:
            return False
        return True

    def _apply(self, ev: KVEvent) -> None:
        try:
            if ev.kind == KIND_DELETED and not ev.tier:
                # The index dropped these entries outright (Delete RPC, TTL sweep):
                # the blocks are gone from every tier and location.
                for location in self.prefixes.locations:
                    for tier in TIERS:
                        self.prefixes.apply_event(KIND_DELETED, location, tier, ev.keys)
            else:
                self.prefixes.apply(ev)
        except ViewError as exc:
            log.warning("skipping KV event %s: %s", ev.id, exc)
            return
        self.metrics.kv_events.labels(kind=ev.kind).inc()

    # -- placement ---------------------------------------------------------------------

    def choose_prefill(self, keys: Sequence[bytes], prompt_tokens: int, *,
                       exclude: set[str], tenant: str = "", session: str = "") -> Choice:
        """Placement by the policy, kept on the session's previous instance
        while that one is not overloaded (router.session)."""
        cands = self._candidates("prefill", exclude)
        try:
            decision = self.placer.place_prefill(
                cands, keys, prompt_tokens, sticky=self.sessions.get(tenant, session),
                slack_tokens=self.cfg.sessions.slack_tokens)
        except NoCandidateError:
            raise self._none("prefill", exclude) from None
        sent = self.cluster.add_pending(decision.instance_id, prompt_tokens)
        self.sessions.record(tenant, session, decision.instance_id)
        return self._choice(cands, decision, sent)

    def store_address(self, tenant: str = "", session: str = "") -> str:
        """A live kvstore to warm a request's blocks in: the one on the node of the
        session's instance when known, else any ("" when none is live)."""
        stores = self.cluster.candidates("kvstore", exclude=set())
        if not len(stores):
            return ""
        where = self.sessions.get(tenant, session)
        prefills = self._candidates("prefill", set())
        node = prefills.nodes[prefills.ids.index(where)] if where in prefills.ids else ""
        for info in stores.infos:
            if info.node == node:
                return info.address
        return stores.infos[0].address

    def choose_decode(self, prompt_tokens: int, *, exclude: set[str],
                      kv_tokens: int = 0, keys: Sequence[bytes] = ()) -> Choice:
        """``kv_tokens``: the KV the sequence may grow to (prompt + max_tokens).
        Instances whose last report leaves less unreserved KV than that are
        passed over while one has room (there it would wait for blocks); when
        none has, the policy picks among all and the request queues there.
        ``keys``: the prompt's chain keys; cache-aware policies keep a prompt on
        the decode instance that decoded its prefix (``DecodeAnchors``) while
        its load is within ``slack_tokens`` of the least loaded."""
        cands = self._candidates("decode", exclude)
        if kv_tokens > 0:
            short = [i.instance_id for i in cands.infos if 0 <= i.kv_free_tokens < kv_tokens]
            if short and len(short) < len(cands):
                cands = cands.without(short)
        sticky = (self.decode_anchors.find(keys)[0] if self.placer.policy.uses_cache
                  else "")
        try:
            decision = self.placer.place_decode(cands, prompt_tokens, sticky=sticky,
                                                slack_tokens=self.cfg.sessions.slack_tokens)
        except NoCandidateError:
            raise self._none("decode", exclude) from None
        if self.placer.policy.uses_cache:
            self.decode_anchors.record(keys, decision.instance_id)
        sent = self.cluster.add_pending(decision.instance_id, prompt_tokens)
        return self._choice(cands, decision, sent)

    def choose_local(self, keys: Sequence[bytes], prompt_tokens: int, *, kv_tokens: int,
                     max_tail_tokens: int, max_cold_tokens: int = 0) -> Choice | None:
        """The decode instance to compute the prompt on with no prefill hop, or
        None. A short tail (reason ``local_tail``): where the prompt's prefix was
        decoded (``DecodeAnchors``; cache-aware policies only), leaving at most
        ``max_tail_tokens`` to compute after the recorded prefix (the part the
        previous turn did not have: its answer, the new message). A short cold
        prompt (``local_cold``): no decode instance holds it and it has at most
        ``max_cold_tokens``; the policy's decode choice. Either way the instance
        must be live, report room for ``kv_tokens`` and carry no more pending
        work than the least loaded decode instance plus ``slack_tokens``."""
        block = self.cfg.hit_rule.block_tokens
        where, blocks = ("", 0)
        if max_tail_tokens > 0 and self.placer.policy.uses_cache:
            where, blocks = self.decode_anchors.find(keys)
        if where and prompt_tokens - blocks * block <= max_tail_tokens:
            reason = "local_tail"
        elif not where and 0 < prompt_tokens <= max_cold_tokens:
            reason = "local_cold"
        else:
            return None
        cands = self._candidates("decode", set())
        if len(cands) == 0:
            return None
        pending = cands.pending_tokens
        if reason == "local_tail":
            if where not in cands.ids:
                return None
            at = cands.ids.index(where)
            decision = Decision(where, {}, reason, at, self.placer.policy.name,
                                blocks * block, float(pending[at]))
        else:
            decision = replace(self.placer.place_decode(cands, prompt_tokens), reason=reason)
        i = decision.index
        if 0 <= cands.infos[i].kv_free_tokens < kv_tokens or (
                pending[i] - pending.min() > self.cfg.sessions.slack_tokens):
            return None
        if self.placer.policy.uses_cache:
            self.decode_anchors.record(keys, decision.instance_id)
        return self._choice(cands, decision,
                            self.cluster.add_pending(decision.instance_id, prompt_tokens))

    def check_decode_room(self, kv_tokens: int) -> None:
        """Refuse before any work a sequence that grows to ``kv_tokens`` (prompt +
        max_tokens) when every live decode instance that reports its pool holds
        less than that: no wait could make room, and prefill would be wasted.
        Instances that do not report (-1) are assumed to have room."""
        caps = [i.kv_capacity_tokens for i in self._candidates("decode", set()).infos]
        # The KV of the last sampled token is never computed: kv_tokens - 1 must fit.
        if caps and all(0 <= c < kv_tokens - 1 for c in caps):
            raise InvalidRequestError(
                f"the prompt plus max_tokens needs KV for {kv_tokens - 1} tokens; the largest "
                f"decode KV pool holds {max(caps)} tokens: lower max_tokens or shorten the "
                "prompt", param="max_tokens")

    @staticmethod
    def _choice(cands: CandidateSet, d: Decision, sent: Sent) -> Choice:
        detail = ""
        if log.isEnabledFor(logging.DEBUG):   # every candidate's score, only when shown
            scores = ", ".join(f"{k}={v:.1f}" for k, v in d.scores.items())
            detail = f"{d.detail}; scores: {scores}"
        return Choice(cands.infos[d.index], d.score, d.reason, d.policy, detail, sent)

    def finished(self, choice: Choice) -> None:
        """The instance is done with the prompt it was chosen for (answered or failed):
        its pending work drops now, not at its next heartbeat (router.view)."""
        if choice.sent is not None:
            self.cluster.done(choice.sent)

    def _none(self, role: str, exclude: set[str]) -> NoInstanceError:
        why = f" (abandoned after failures: {sorted(exclude)})" if exclude else ""
        return NoInstanceError(f"no live {role} instance available{why}")
