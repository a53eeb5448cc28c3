"""Admission and batched prefill steps, the part of ``Engine`` a scheduler
drives (docs/engine.md, "Batched prefill").

``admit`` makes a sequence *prefilling*: its blocks allocated, its reused KV
(G1 hit, restored blocks) in place, nothing computed. ``prefill_step`` then
computes the next chunk of several prefilling sequences and hands back those
whose prompt is complete, first token sampled; a scheduler calls it once per
step with a token budget per sequence, so a long prompt advances a chunk at a
time while short ones finish beside it. ``Engine.prefill`` is the one-shot
form on top (admit, then steps of one chunk).

Exactness: with invariant kernels (``bik``, ``triton_bi``) all chunks of a
step share ONE forward, a segment per sequence, and a row's bits depend on
that row alone, so a sequence's KV and first token are those of a prefill
alone, whatever shares its steps. With other kernels each sequence runs alone,
one forward per chunk at boundaries aligned to absolute positions, exactly
what a one-shot prefill of it runs (sequences still interleave between steps).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

from common.config import HitRule
from engine import shared_rows
from engine.attention import BatchAttention, Segment
from engine.checks import check_blocks, check_prompt
from engine.config import EngineConfig, ModelConfig
from engine.errors import EngineInputError
from engine.kv_pool import BlockPool, KVLayout, KVStorage
from engine.layer_restore import HostRuns, LayerFeed, feed_applies
from engine.model import Transformer
from engine.sampling import RowSampler, SamplingParams
from engine.sequence import Admission, PrefillDone, PrefillResult, PrefillState, Sequence

GREEDY = SamplingParams()


class PrefillSteps:
    """Mixed into ``Engine`` (engine/runner.py), which owns the state below."""

    config: EngineConfig
    model_config: ModelConfig
    layout: KVLayout
    device: torch.device
    dtype: torch.dtype
    model: Transformer
    storage: KVStorage
    blocks: BlockPool
    hit_rule: HitRule
    invariant: bool
    _seqs: dict[str, Sequence]
    _windows: tuple[int, ...]
    _counts: torch.Tensor | None
    _attn_mirror: bool          # attention reads sequences' mirrors (engine/runner.py)
    _decode_mirror: bool        # decode steps read them too
    _no_mirror: torch.Tensor    # the empty mirror of a sequence nothing reads it for
    shared_rows_total: int      # prompt rows copied from another sequence (engine/shared_rows.py)

    if TYPE_CHECKING:
        def free(self, seq_id: str, keep_keys: Seq[bytes] | None = None) -> None: ...

        def _sampler(self, sampling: SamplingParams) -> RowSampler: ...

        def _slots(self, table: torch.Tensor, start: int, end: int) -> torch.Tensor: ...

        def _seq(self, seq_id: str) -> Sequence: ...

        @property
        def _canon_unit(self) -> int: ...

    @torch.inference_mode()
    def admit(self, seq_id: str, tokens: Seq[int], *,
              sampling: SamplingParams = GREEDY,
              block_keys: Seq[bytes] | None = None,
              restored: torch.Tensor | HostRuns | None = None,
              max_restore_tokens: int | None = None,
              restored_start_block: int | None = None,
              first_token: int | None = None,
              share_scope: str | None = None) -> Admission:
        """Make ``seq_id`` a prefilling sequence: its blocks allocated, its reused
        KV in place, nothing computed yet (``prefill_step`` does that).

        KV is reused from the local prefix cache (leading ``block_keys`` found in
        G1) and then from ``restored`` (blocks right after the G1 hit, or from
        ``restored_start_block`` when given), within the hit rule. ``first_token``:
        the answer's first token is already known (a rebuild of a prefilled
        request): it is taken instead of sampled, as ``adopt`` does.
        ``share_scope``: who may share prompt rows with it (the tenant; None: no
        one), as G1 blocks are shared within a tenant (engine/shared_rows.py)."""
        t0 = time.perf_counter()
        if seq_id in self._seqs:
            raise EngineInputError(f"sequence {seq_id!r} is already live")
        mc = self.model_config
        toks = check_prompt(tokens, mc)
        if first_token is not None:
            check_prompt([first_token], mc)
        B, n = self.config.block_tokens, len(toks)
        keys = list(block_keys or ())
        if len(keys) > n // B:
            raise EngineInputError(f"{len(keys)} block keys given but the prompt has only "
                                   f"{n // B} full blocks of {B} tokens")
        n_rest = 0 if restored is None else check_blocks(restored, self.layout, self.dtype,
                                                         "restored")
        g1 = self.blocks.match(keys)
        if restored_start_block is not None:
            if len(g1) < restored_start_block:
                n_rest = 0                   # a gap before the restored blocks: recompute
            elif len(g1) > restored_start_block and n_rest:
                # G1 grew since the fetch was planned (a prompt sharing the prefix
                # finished meanwhile): its blocks first, the restored ones after them.
                # Ignoring them recomputed every held resend of an agent's context.
                over = len(g1) - restored_start_block
                if over >= n_rest:
                    restored, n_rest = None, 0
                else:
                    assert restored is not None
                    restored = (restored.skip(over) if isinstance(restored, HostRuns)
                                else restored[over:])
                    n_rest -= over
        cap = self.hit_rule.usable_tokens((len(g1) + n_rest) * B, n)
        if max_restore_tokens is not None:
            # The caller's cap was planned from the G1 hit it saw then; G1 found
            # since then is never cut by it.
            cap = min(cap, max(0, max_restore_tokens,
                               self.hit_rule.usable_tokens(len(g1) * B, n)))
        # Reuse ends on a chunk boundary: the chunks after it are then exactly
        # the cold run's (a boundary inside a chunk would change its row count).
        # Invariant kernels need no such cut: any block boundary gives the same bits.
        C = self._canon_unit
        cap = cap // C * C
        use_g1 = min(len(g1), cap // B)
        use_rest = min(n_rest, cap // B - use_g1)
        reuse = use_g1 + use_rest
        self.blocks.acquire(g1[:use_g1])
        try:
            fresh = self.blocks.allocate(-(-n // B) - use_g1)
        except Exception:
            self.blocks.release(g1[:use_g1])
            raise
        blocks = g1[:use_g1] + fresh
        table = torch.tensor(blocks, dtype=torch.int64, device=self.device)
        pipelined = bool(use_rest) and self.config.layer_restore and restored is not None \
            and feed_applies(self.device, restored)
        try:
            if use_rest and not pipelined:
                assert restored is not None
                used = (restored.head(use_rest).cat() if isinstance(restored, HostRuns)
                        else restored[:use_rest])
                self.storage.import_(table[use_g1:reuse], used)
            mirror = self._mirror(table, (use_g1 if pipelined else reuse) * B, self._capacity(n))
        except BaseException:
            self.blocks.release(blocks)
            raise
        state = PrefillState(keys, use_g1, use_rest, first_token=first_token)
        seq = Sequence(seq_id, toks, n, reuse * B, blocks, table, sampling, mirror,
                       canonical_full=n // C * C // B, prefill=state, share_scope=share_scope)
        self._seqs[seq_id] = seq
        try:
            seq.sampler = self._sampler(sampling)
            if pipelined:
                assert restored is not None
                state.feed = LayerFeed(self.storage, table[use_g1:reuse], restored, mirror,
                                       use_g1 * B).start()
        except BaseException:
            self.free(seq_id)
            raise
        state.compute_s = time.perf_counter() - t0     # the import and the mirror fill
        return Admission(seq_id, use_g1 * B, use_rest * B, n - reuse * B)

    def prefill_remaining(self, seq_id: str) -> int:
        """Prompt tokens of ``seq_id`` still to compute (0 once it is live for decode)."""
        s = self._seq(seq_id)
        return 0 if s.prefill is None else s.prompt_len - s.kv_len

    @torch.inference_mode()
    def prefill_step(self, budgets: Mapping[str, int]) -> list[PrefillDone]:
        """Compute the next chunk of each admitted sequence, up to its budget of
        tokens, and return those whose prompt is now complete, first token sampled.

        Invariant kernels: every sequence's chunk goes into ONE forward (a
        segment each); a row's bits do not depend on its co-tenants, so a
        sequence's KV and first token are those of a prefill alone. Otherwise
        each sequence runs alone at chunk boundaries aligned to absolute
        positions (a budget ending inside a chunk is cut down to the boundary,
        but a step always computes at least one chunk), one forward per chunk,
        which is exactly what a one-shot prefill of it runs."""
        if not budgets:
            return []
        t0 = time.perf_counter()
        parts: list[tuple[Sequence, int, int]] = []
        for sid, budget in budgets.items():
            s = self._seq(sid)
            if s.prefill is None:
                raise EngineInputError(f"sequence {sid!r} is not prefilling")
            if budget < 1:
                raise EngineInputError(f"prefill budget of {sid!r} must be >= 1, got {budget}")
            parts.append((s, s.kv_len, self._chunk_end(s, budget)))
        last: dict[str, torch.Tensor] = {}       # hidden state of a finished prompt's last row
        if self.invariant:
            copies: list[shared_rows.RowCopy] = []     # from a leader of this forward
            if not self._attn_mirror:            # rows are read from the pool alone
                shared = shared_rows.plan(parts, self._seqs.values())
                parts, copies = shared.parts, shared.in_step
                for c in shared.before:
                    self.storage.copy_rows(*self._copy_slots(c))
                for c in (*shared.before, *shared.in_step):
                    assert c.dst.prefill is not None
                    c.dst.prefill.shared_tokens += c.n
                    self.shared_rows_total += c.n
            hidden = self._prefill_forward(parts, copies)
            row = 0
            for s, a, e in parts:
                row += e - a
                if e == s.prompt_len:
                    last[s.seq_id] = hidden[row - 1: row]
        else:
            C = self.config.chunk_tokens
            for s, a, e in parts:
                while a < e:
                    b = min(e, (a // C + 1) * C)
                    hidden = self._prefill_forward([(s, a, b)])
                    a = b
                if e == s.prompt_len:
                    last[s.seq_id] = hidden[-1:]
        step_s = time.perf_counter() - t0
        for s, _, _ in parts:
            assert s.prefill is not None
            s.prefill.compute_s += step_s
        return [self._prefilled(s, last[s.seq_id]) for s, _, _ in parts if s.seq_id in last]

    def _chunk_end(self, s: Sequence, budget: int) -> int:
        end = min(s.prompt_len, s.kv_len + budget)
        if end == s.prompt_len or self.invariant:
            return end
        C = self.config.chunk_tokens
        return min(s.prompt_len, max(end // C * C, (s.kv_len // C + 1) * C))

    def _copy_slots(self, c: shared_rows.RowCopy) -> tuple[torch.Tensor, torch.Tensor]:
        return (self._slots(c.src.table, c.start, c.start + c.n),
                self._slots(c.dst.table, c.start, c.start + c.n))

    def _prefill_forward(self, parts: list[tuple[Sequence, int, int]],
                         copies: list[shared_rows.RowCopy] | None = None) -> torch.Tensor:
        """One forward over tokens [a, e) of each sequence; -> hidden [rows, hidden].
        ``copies``: rows taken from a leader of this forward, layer by layer."""
        segs, toks, pos = [], [], []
        feeds = []
        rows = 0
        for s, a, e in parts:
            segs.append(Segment(rows, e - a, a, s.table, s.mirror))
            toks += s.tokens[a:e]
            pos.append(torch.arange(a, e, device=self.device))
            rows += e - a
            if s.prefill is not None and s.prefill.feed is not None:
                feeds.append(s.prefill.feed)

        def before_layer(layer: int) -> None:
            for f in feeds:
                f.ready(layer)

        slots = [self._copy_slots(c) for c in copies or ()]

        def after_write(layer: int) -> None:
            for src, dst in slots:
                self.storage.copy_rows(src, dst, layer)

        attn = BatchAttention(self.storage, segs, self._windows, self.model_config.num_heads,
                              rows, self.invariant, before_layer=before_layer if feeds else None,
                              after_write=after_write if slots else None)
        hidden = self.model.forward(torch.tensor(toks, dtype=torch.int64, device=self.device),
                                    torch.cat(pos), attn, rows, self._counts)
        for s, _, e in parts:
            s.kv_len = e
            if s.prefill is not None and s.prefill.feed is not None:
                s.prefill.feed.finish()      # every layer has been waited for by now
                s.prefill.feed.close()
                s.prefill.feed = None
        return hidden

    def _prefilled(self, s: Sequence, hidden: torch.Tensor) -> PrefillDone:
        """The prompt of ``s`` is computed: its first token, its blocks into G1."""
        st = s.prefill
        assert st is not None and s.sampler is not None
        if st.first_token is None:
            first = s.sampler.sample(self.model.logits(hidden)[0])
        else:
            first = st.first_token
            s.sampler.accept(first)
        s.tokens.append(first)
        s.prefill = None
        if not self._decode_mirror:
            s.mirror = self._no_mirror      # only prefill chunks read it, and they are done
        for i in range(st.g1_blocks, min(len(st.keys), s.canonical_full)):
            self.blocks.cache(s.blocks[i], st.keys[i])
        B = self.config.block_tokens
        reused = (st.g1_blocks + st.restored_blocks) * B
        res = PrefillResult(first, st.restored_blocks * B, st.g1_blocks * B,
                            s.prompt_len - reused - st.shared_tokens, st.compute_s)
        return PrefillDone(s.seq_id, res)

    def _capacity(self, tokens: int) -> int:
        """Mirror capacity for ``tokens`` plus room to decode (grown 1.5x later);
        just ``tokens`` where decode steps do not read the mirror."""
        B = self.config.block_tokens
        cap = tokens + max(4 * B, tokens // 2) if self._decode_mirror else tokens
        return min(-(-cap // B) * B, -(-self.model_config.max_position // B) * B)

    def _mirror(self, table: torch.Tensor, filled: int, capacity: int) -> torch.Tensor:
        """A new mirror whose first ``filled`` tokens come from the pool (one gather);
        the empty one where attention reads the pool instead."""
        if not self._attn_mirror:
            return self._no_mirror
        L, _, H, _, D = self.layout.block_shape
        mirror = torch.empty(L, 2, H, capacity, D, dtype=self.dtype, device=self.device)
        if filled:
            n_blocks = -(-filled // self.config.block_tokens)
            mirror[:, :, :, :filled] = self.storage.gather_all(table[:n_blocks])[:, :, :, :filled]
        return mirror
