"""vLLM instances' own KV events (``--kv-events-config``) into the router's view.

With these the router places by cache affinity on vLLM servers with or without
kvserve's connector: a plain vLLM fleet registered with ``kvserve vllm-attach``
advertises its ZMQ endpoint in its (signed) registry entry, and this module
subscribes to it.

vLLM's block hashes are its own (SHA-256 over its parent hash, the block's
tokens and extra keys); the router's are kvserve's keyed chain
(``kvstore.keys``). ``ChainMap`` maps one to the other from what each
``BlockStored`` carries: the blocks' token ids and the parent's hash. A root
block's cache salt (its extra keys) names the tenant, but only a salt that
proves one (``security.vllm_trust``: the router's own salts) is mapped: the
router never routes a request under an unproven salt, so such blocks could
never match. For a child block the parent's mapping gives the chain state (the
last kvserve key and the tokens not yet filling a kvserve block), so vLLM block
sizes that differ from ``block_tokens`` map too (e.g. vLLM 16 -> kvserve 64: a
kvserve key is announced when the vLLM block completing it is stored, and
withdrawn when that block is removed). A block whose parent is unknown (events
before the router subscribed, or dropped by ZMQ's high-water mark) maps to
nothing; the view is advisory (placement), never correctness.

Skipped: LoRA blocks and groups other than the full-attention one (kvserve's
keys name neither), and events with medium ``kvserve`` (the connector's own
G1 events, which reach the router through Redis already).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from typing import TYPE_CHECKING, NamedTuple

import msgspec
import zmq
import zmq.asyncio

from common.vllm_kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode
from kvstore.events import KIND_EVICTED, KIND_STORED
from kvstore.keys import chain_identity, extend_chain
from security.vllm_trust import salt_scope

if TYPE_CHECKING:
    from router.live_view import LiveView

log = logging.getLogger(__name__)
CONNECTOR_MEDIUM = "kvserve"
MAX_NODES = 1 << 20


class _Node(NamedTuple):
    person: bytes
    last: bytes                  # kvserve key of the last full kvserve block so far
    tail: tuple[int, ...]        # tokens after it (< block_tokens)
    keys: tuple[bytes, ...]      # kvserve keys this vLLM block completed


def salt_of(extra: tuple[object, ...] | None, lora: bool) -> str | None:
    """The cache salt among a root block's extra keys (after the LoRA name, if any)."""
    strs = [x for x in (extra or ()) if isinstance(x, str)]
    if lora:
        strs = strs[1:]
    return strs[-1] if strs else None


class ChainMap:
    """One instance's vLLM block hashes -> kvserve block keys (module doc)."""

    def __init__(self, *, block_tokens: int, fingerprint: bytes, secret: bytes,
                 max_nodes: int = MAX_NODES) -> None:
        self.block_tokens = block_tokens
        self.fingerprint = fingerprint
        self.secret = secret
        self.max_nodes = max_nodes
        self._nodes: collections.OrderedDict[bytes | int, _Node] = collections.OrderedDict()
        self.unmapped = 0                 # blocks that could not be mapped (counted)

    def __len__(self) -> int:
        return len(self._nodes)

    def stored(self, ev: BlockStored) -> list[bytes]:
        hashes, bs, tokens = ev.block_hashes, ev.block_size, ev.token_ids
        if (ev.medium == CONNECTOR_MEDIUM or ev.lora_name or ev.lora_id
                or ev.group_idx not in (None, 0) or bs < 1 or len(tokens) != bs * len(hashes)):
            self.unmapped += len(hashes)
            return []
        if ev.parent_block_hash is None:
            extra = ev.extra_keys[0] if ev.extra_keys else None
            scope = salt_scope(salt_of(extra, False), self.secret)
            if not scope.trusted:
                self.unmapped += len(hashes)
                return []
            person, root = chain_identity(scope.tenant, self.fingerprint, self.secret)
            state = _Node(person, root, (), ())
        else:
            found = self._nodes.get(ev.parent_block_hash)
            if found is None:
                self.unmapped += len(hashes)
                return []
            state = found
        person, last, tail = state.person, state.last, state.tail
        out: list[bytes] = []
        B = self.block_tokens
        for i, h in enumerate(hashes):
            seq = tail + tuple(tokens[i * bs:(i + 1) * bs])
            full = len(seq) // B * B
            keys = extend_chain(last, seq[:full], block_tokens=B, person=person) if full else []
            if keys:
                last = keys[-1]
            tail = seq[full:]
            self._put(h, _Node(person, last, tail, tuple(keys)))
            out.extend(keys)
        return out

    def _put(self, h: bytes | int, node: _Node) -> None:
        self._nodes[h] = node
        self._nodes.move_to_end(h)
        while len(self._nodes) > self.max_nodes:
            self._nodes.popitem(last=False)

    def removed(self, ev: BlockRemoved) -> list[bytes]:
        if ev.medium == CONNECTOR_MEDIUM or ev.group_idx not in (None, 0):
            return []
        out: list[bytes] = []
        for h in ev.block_hashes:
            node = self._nodes.pop(h, None)
            if node is not None:
                out.extend(node.keys)
        return out

    def clear(self) -> None:
        self._nodes.clear()


class NativeEvents:
    """Subscribes to every admitted instance's ``kv_events`` endpoint and applies
    what it hears to the view's G1 column of that instance."""

    def __init__(self, view: LiveView, *, secret: bytes, block_tokens: int,
                 poll_s: float = 1.0) -> None:
        self.view = view
        self.secret = secret
        self.block_tokens = block_tokens
        self.poll_s = poll_s
        self._ctx: zmq.asyncio.Context | None = None
        self._subs: dict[str, tuple[tuple[str, str], asyncio.Task[None]]] = {}
        self.maps: dict[str, ChainMap] = {}
        self._watch: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self.batches = 0                  # batches applied (tests, status)

    def start(self) -> None:
        self._watch = asyncio.get_running_loop().create_task(self._watch_loop(),
                                                             name="vllm-native-events")

    async def stop(self) -> None:
        self._stopping.set()
        tasks = [t for _, t in self._subs.values()] + ([self._watch] if self._watch else [])
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._subs.clear()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _wanted(self) -> dict[str, tuple[str, str]]:
        return {i.instance_id: (i.kv_events, i.model_fingerprint)
                for i in self.view.cluster.instances()
                if i.kv_events and i.model_fingerprint and i.role in ("prefill", "decode")}

    def sync(self) -> None:
        """Start subscriptions for new endpoints, end those of instances gone."""
        wanted = self._wanted()
        for iid, (spec, task) in list(self._subs.items()):
            if wanted.get(iid) != spec:
                task.cancel()
                del self._subs[iid]
                self.maps.pop(iid, None)
        for iid, spec in wanted.items():
            if iid not in self._subs:
                task = asyncio.get_running_loop().create_task(self._follow(iid, *spec),
                                                              name=f"vllm-events-{iid}")
                self._subs[iid] = (spec, task)

    async def _watch_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self.sync()
            except Exception as exc:
                log.warning("native KV events: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.poll_s)

    async def _follow(self, instance: str, endpoint: str, fingerprint: str) -> None:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        chains = self.maps[instance] = ChainMap(block_tokens=self.block_tokens,
                                                fingerprint=bytes.fromhex(fingerprint),
                                                secret=self.secret)
        sock = self._ctx.socket(zmq.SUB)
        try:
            sock.connect(endpoint)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            log.info("following vLLM KV events of %s at %s", instance, endpoint)
            while True:
                frames = await sock.recv_multipart()
                if len(frames) != 3:
                    continue
                try:
                    batch = decode(frames[2])
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    log.warning("bad KV event batch from %s: %s", instance, exc)
                    continue
                self.apply(instance, chains, batch.events)
        finally:
            sock.close(linger=0)

    def apply(self, instance: str, chains: ChainMap, events: list[object]) -> None:
        prefixes = self.view.prefixes
        for ev in events:
            if isinstance(ev, BlockStored):
                keys = chains.stored(ev)
                if keys:
                    prefixes.apply_event(KIND_STORED, instance, "G1", keys)
            elif isinstance(ev, BlockRemoved):
                keys = chains.removed(ev)
                if keys:
                    prefixes.apply_event(KIND_EVICTED, instance, "G1", keys)
            elif isinstance(ev, AllBlocksCleared):
                chains.clear()
                prefixes.drop_location(instance)
        self.batches += 1
