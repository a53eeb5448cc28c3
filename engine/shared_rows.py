"""Prompt rows a prefilling sequence takes from another sequence's KV instead of
computing them (docs/engine.md, "Shared prompt rows").

Two prompts that agree on tokens [0, a + n) have bit-identical KV for those
positions under batch-invariant kernels: a row's KV depends only on its token,
its position and the rows before it. So when a step would compute rows
[a, a + n) of a sequence whose tokens there (and everything before) equal
another sequence's, it copies that sequence's rows instead:

- from a sequence whose rows are in the pool already (decoding, or prefilled
  that far): copied before the forward, every layer at once;
- from a sequence computing them in the same forward (a *leader*): copied
  layer by layer, after the layer's KV write and before its attention.

The prefix cache shares whole blocks only (64 tokens: block identity). This
shares any number of rows, so prompts that arrive together and agree on a
chat template, a system prompt shorter than a block or the partial block
after their common full ones compute it once. A follower always computes at
least its chunk's last row (its first token is sampled from it), and shares
only runs of at least ``MIN_ROWS`` (below that the copy is not worth a plan).

Rows are shared only within one ``share_scope`` (the tenant, given at
admission; None shares with no one), as G1 blocks are: a faster first token
must not tell a tenant what another tenant's live prompts start with. And only
a source's prompt rows are taken, never rows its decode steps wrote.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from engine.sequence import Sequence

MIN_ROWS = 8

Part = tuple[Sequence, int, int]       # (sequence, first row, end row) of one step


@dataclass(frozen=True, slots=True)
class SharedStats:
    """For /metrics (``kvserve_<role>_engine_shared_rows_total``)."""

    shared_rows_total: int      # prompt rows copied from another sequence, not computed


@dataclass(frozen=True, slots=True)
class RowCopy:
    """Rows [start, start + n) of ``dst`` are ``src``'s."""

    src: Sequence
    dst: Sequence
    start: int
    n: int


@dataclass(frozen=True, slots=True)
class SharedPlan:
    parts: list[Part]          # the step's parts, followers starting after their copies
    before: list[RowCopy]      # from rows in the pool: copied before the forward
    in_step: list[RowCopy]     # from a leader of this forward: copied layer by layer


def _agree(x: Seq[int], y: Seq[int], a: int, end: int) -> int:
    """Tokens of ``x`` from ``a`` that equal ``y``'s, up to ``end``, given that both
    agree on [0, a); 0 where they do not."""
    if end <= a or x[a] != y[a] or (a and (x[a - 1] != y[a - 1] or x[:a] != y[:a])):
        return 0
    n = 1
    while a + n < end and x[a + n] == y[a + n]:
        n += 1
    return n


def _feeding(s: Sequence) -> bool:
    # Restored rows still arriving layer by layer are not in the pool yet.
    return s.prefill is not None and s.prefill.feed is not None


def plan(parts: list[Part], live: Iterable[Sequence]) -> SharedPlan:
    """Which rows of the step's ``parts`` are copied from whom. ``live``: every
    sequence of the engine (their rows below ``kv_len`` are in the pool)."""
    sources = [s for s in live if s.share_scope is not None and s.kv_len > 0
               and not _feeding(s)]
    out: list[Part] = []
    before: list[RowCopy] = []
    in_step: list[RowCopy] = []
    leaders: list[Part] = []
    for s, a, e in parts:
        limit = e - 1                          # the chunk's last row is always computed
        best, src, same_step = 0, None, False
        shares = s.share_scope is not None and not _feeding(s)
        if shares and limit - a >= MIN_ROWS:
            for o in sources:
                held = min(o.kv_len, o.prompt_len)          # prompt rows in the pool
                if o is not s and o.share_scope == s.share_scope and held > a:
                    n = _agree(s.tokens, o.tokens, a, min(limit, held))
                    if n > best:
                        best, src, same_step = n, o, False
            for o, oa, oe in leaders:
                if oa == a and o.share_scope == s.share_scope:
                    n = _agree(s.tokens, o.tokens, a, min(limit, oe))
                    if n > best:
                        best, src, same_step = n, o, True
        if src is not None and best >= MIN_ROWS:
            (in_step if same_step else before).append(RowCopy(src, s, a, best))
            out.append((s, a + best, e))
        else:
            out.append((s, a, e))
            if shares:
                leaders.append((s, a, e))
    return SharedPlan(out, before, in_step)
