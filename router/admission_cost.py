"""What a request costs the admission queue: the prompt tokens someone must still
compute, not the prompt's length.

An agent resends its whole context every turn, often several times at once
while the first copy is still queued or in prefill. Counted at full length, a
burst of four 5.5k-token resends looked like 22k tokens of work ahead of every
later arrival, and the queue refused those as over the SLO (429), though three
of the four cost a few blocks once the first is computed (the prefill scheduler
holds them for it, prefill_svc/scheduler.py). So a request costs its length
minus the longest leading run of its blocks that is either known to the cluster
(router.view.PrefixView, any tier) or being computed for a request admitted
before it that has not left prefill yet; never less than one block (the tail
and the restore are work too).

The queue's drain rate is measured in the same unit (router.admission_limits),
so its wait estimate stays consistent.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence


def admission_cost(prompt_tokens: int, block_tokens: int, held_blocks: int) -> int:
    """Tokens left to compute when ``held_blocks`` leading blocks need none."""
    return max(min(prompt_tokens, block_tokens), prompt_tokens - held_blocks * block_tokens)


class InflightPrefixes:
    """Block keys of admitted requests until they leave prefill (counted, so two
    requests with one prefix keep it until both have left)."""

    def __init__(self) -> None:
        self._count: Counter[bytes] = Counter()

    def __len__(self) -> int:
        return len(self._count)

    def leading(self, keys: Sequence[bytes]) -> int:
        n = 0
        for k in keys:
            if k not in self._count:
                break
            n += 1
        return n

    def claim(self, keys: Sequence[bytes]) -> Claim:
        self._count.update(keys)
        return Claim(self, keys)

    def _drop(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            left = self._count[k] - 1
            if left > 0:
                self._count[k] = left
            else:
                del self._count[k]


class Claim:
    """One request's keys in ``InflightPrefixes``; ``release`` is idempotent."""

    __slots__ = ("_keys", "_owner")

    def __init__(self, owner: InflightPrefixes, keys: Sequence[bytes]) -> None:
        self._owner: InflightPrefixes | None = owner
        self._keys = keys

    def release(self) -> None:
        if self._owner is not None:
            self._owner._drop(self._keys)
            self._owner = None
