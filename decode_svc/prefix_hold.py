"""Decode's own G1 as the first source of a prompt's KV.

An agent's next turn resends the whole conversation; the decode instance that
answered the previous turn still has its blocks (prompt and answer, kept in
G1 under their chain keys when that sequence was freed). Pulling the whole
prompt again from prefill moved each turn's full context through host
memory (on the H200 stack 268 MB a turn at 0.3 GB/s; on a 2-core CPU host,
copies and checksums competing with the compute). Instead the blocks decode
holds are pinned, and only the tokens after them are pulled.

Pinned blocks can no longer be evicted, so they are reserved in the KV gate
first (``KVGate.reserve_now``): everything the gate promised to running
sequences stays allocatable. The reservation joins the call's own grant
(``Batcher.generate(held_blocks=...)``), and the pins become the sequence's
when ``Engine.adopt(prefix=...)`` takes them. Whatever was not handed on is
given back by ``release`` on every path (a failed pull rebuilds without them).

Exactness: a G1 block is the KV of exactly the tokens its chain key names
(tenant-salted keys computed here from the prompt, never taken from the
handle), written by prefill's chunked path or recomputed canonically after
the answer, so the adopted KV is bit-identical to a whole pull.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from decode_svc.kv_gate import KVGate
from service.engine_thread import EngineThread


@dataclass(slots=True, eq=False)
class PrefixHold:
    """Leading prompt blocks pinned in decode's G1 for one call."""

    keys: list[bytes]               # the chain keys to pin (a prefix of the prompt's)
    blocks: list[int] = field(default_factory=list)   # set on the engine thread
    reserved: int = 0               # gate blocks still this hold's (0 once handed on)
    adopted: bool = False           # the sequence took the pins (engine thread)
    dropped: bool = False           # pins given back (engine thread)

    def tokens(self, block_tokens: int) -> int:
        return len(self.blocks) * block_tokens

    def hand_over(self) -> int:
        """The gate reservation, now the caller's (``generate(held_blocks=...)``)."""
        held, self.reserved = self.reserved, 0
        return held


class PrefixHolds:
    def __init__(self, engine: Any, thread: EngineThread, gate: KVGate) -> None:
        self._engine = engine
        self._thread = thread
        self._gate = gate
        self._block_tokens: int = engine.layout.block_tokens

    async def hold(self, keys: Sequence[bytes], prompt_tokens: int) -> PrefixHold | None:
        """Pin the leading blocks of ``keys`` that G1 holds (at most up to the
        prompt's last token, which is always pulled: adopt needs some KV);
        None when there are none or the gate has no room for them now."""
        cap = min(len(keys), (prompt_tokens - 1) // self._block_tokens)
        # A hint read off the engine thread (dict lookups): it sizes the
        # reservation; what is pinned is re-matched on the engine thread.
        want = self._engine.g1_match(keys[:cap])
        if want <= 0 or not self._gate.reserve_now(want):
            return None
        h = PrefixHold(list(keys[:want]), reserved=want)
        try:
            await self._thread.call(self._pin, h)
        except BaseException:
            self.release(h)
            raise
        if len(h.blocks) < want:         # evicted since the hint
            self._gate.release_blocks(want - len(h.blocks))
            h.reserved = len(h.blocks)
        if not h.blocks:
            return None
        return h

    def release(self, h: PrefixHold) -> None:
        """Give back what ``h`` still holds; idempotent. The unpin runs on the
        engine thread after every job submitted before it (an adopt in flight
        included), so pins an adopt took are never released twice."""
        if h.reserved:
            self._gate.release_blocks(h.reserved)
            h.reserved = 0
        self._thread.submit(self._unpin, h)

    def drop_now(self, h: PrefixHold) -> None:
        """Engine thread: give the pins back at once (the sequence took its own
        references to the blocks, ``Engine.admit``); ``release`` then only
        returns what is left of the reservation."""
        self._unpin(h)

    def _pin(self, h: PrefixHold) -> None:
        h.blocks = self._engine.pin_prefix(h.keys)

    def _unpin(self, h: PrefixHold) -> None:
        if h.adopted or h.dropped:
            return
        h.dropped = True
        self._engine.unpin(h.blocks)
