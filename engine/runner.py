"""The Engine: prefill (with G1 hits and restored blocks), batched decode,
block export/import, canonical blocks. See docs/engine.md. Admission and
batched prefill steps (what a scheduler drives) are engine/prefill_steps.py,
mixed in; ``prefill`` here is their one-shot form.

Exactness by construction, in one of two ways (engine/kernels.py):
- batch-invariant kernels (``bik``, the CPU fp32 default): a row's bits depend
  on that row alone, so reuse starts at any block boundary, decode runs exactly
  its sequences' rows, and decode KV is canonical as computed (no recompute);
- otherwise (``torch``): prefill runs in chunks (``prefill_chunk``) aligned to
  absolute positions and reuse is cut to a chunk boundary, so a cold run and a
  restored run execute the same ops on the same inputs for every later token;
  decode always runs ``decode_bucket`` rows per forward (padding the rest), and
  blocks written by decode are recomputed through the prefill path before they
  are stored (``canonical_blocks``).
In both, attention is per sequence, so co-tenants never change a sequence's bits.
"""

from __future__ import annotations

import gc
import hashlib
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from engine import bik
from engine.attention import BatchAttention, Segment
from engine.checks import check_prompt
from engine.config import KV_LAYOUT_VERSION, EngineConfig
from engine.constrained import Constraint, GrammarCompiler, GrammarSpec
from engine.errors import DeviceError, EngineInputError, PrefillStopped
from engine.kernels import BIKernels, select_kernels
from engine.kv_pool import BlockPool, KVLayout, KVStorage
from engine.layer_restore import HostRuns
from engine.memory import EngineMemory, engine_memory, mirror_bytes
from engine.model import Transformer
from engine.prefill_steps import PrefillSteps
from engine.sampling import RowSampler, SamplingParams, sample_rows
from engine.sequence import G1Admission, GenerationResult, PrefillResult, Sequence
from engine.shared_rows import SharedStats
from engine.source import load_source
from engine.staging import PinnedChunks
from engine.step_clock import StepClock, StepTimes

if TYPE_CHECKING:
    from engine.paged_decode import DecodeRunner

GREEDY = SamplingParams()
INVARIANT_CHUNK = 512          # default prefill chunk (tokens) with invariant kernels


def _device(name: str) -> torch.device:
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"device {name!r} requested but no CUDA device is available "
                          "(torch.cuda.is_available() is False)")
    if dev.type == "cuda":
        # cuDNN's SDPA builds a new execution plan for every new sequence length, which
        # decode and chunked prefill produce at every call: 2.5 ms of CPU per layer per
        # step on an H200 (measured), 10x the GPU work. Flash/efficient kernels need none.
        torch.backends.cuda.enable_cudnn_sdp(False)
    return dev


class Engine(PrefillSteps):
    def __init__(self, cfg: EngineConfig) -> None:
        self.config = cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.device = _device(cfg.device)
        if self.device.type == "cuda":
            # What this process dropped before this engine goes back to the driver
            # first. An engine on CUDA is a reference cycle (its paged decode runner
            # holds its bound forward), so one dropped earlier keeps its weights,
            # pool and decode graphs' private pools until the cycle collector runs;
            # and freed cache blocks the new engine's tensors were split from stay
            # reserved as long as those tensors live (empty_cache frees whole
            # segments only). Either way the cap, the budget check below and
            # memory() counted another engine's leftovers as this one's (seen on the
            # H200 in the GPU tests' process: 1.93 GB reserved, 0.30 GB allocated
            # after a tiny engine's start).
            gc.collect()
            torch.cuda.empty_cache()
        if cfg.gpu_fraction and self.device.type == "cuda":
            # Before the weights: every allocation of this process counts against it.
            index = self.device.index if self.device.index is not None \
                else torch.cuda.current_device()
            torch.cuda.set_per_process_memory_fraction(cfg.gpu_fraction, index)
        self.dtype: torch.dtype = getattr(torch, cfg.dtype)
        src = load_source(cfg.model, self.device, self.dtype, cfg.seed)
        mc = src.config
        if cfg.max_position:
            mc = replace(mc, max_position=cfg.max_position)
        self.model_config = mc
        self.tokenizer = src.tokenizer
        self.kernels = select_kernels(cfg.kernels, self.device, self.dtype, cfg.threads)
        if isinstance(self.kernels, BIKernels):
            # Pack the matmul weights once; the embedding table is only gathered from
            # (a tied LM head is a separate transposed view and is packed as such).
            self.kernels.prepare([t for t in src.weights.tensors()
                                  if t is not src.weights.embed])
        # True: a row's result is independent of the rows sharing its call.
        self.invariant: bool = self.kernels.invariant
        self.model = Transformer(mc, src.weights, self.device, self.dtype, self.kernels)
        self.layout = KVLayout(mc.num_layers, mc.num_kv_heads, cfg.block_tokens, mc.head_dim,
                               cfg.dtype)
        if cfg.gpu_fraction and self.device.type == "cuda":
            self._check_gpu_budget(cfg)
        self.storage = KVStorage(self.layout, cfg.num_blocks, self.device)
        # Attention reads a sequence's contiguous mirror only on the torch path:
        # invariant kernels read the paged pool (triton_bi on CUDA, bik's
        # attend_paged on the CPU). Where nothing reads it, no sequence gets one: each
        # was 1.5x its prompt's KV outside the pool, so 64 sequences of 2k tokens took
        # 24 GiB that admission never counted (issue 18 run 4's OOM), and filling one
        # on the CPU cost as long as the tail it served (a 5.5k-token resend).
        self._attn_mirror: bool = not (self.invariant and (
            self.device.type == "cuda" or (self.device.type == "cpu" and bik.paged())))
        L, _, H, _, D = self.layout.block_shape
        self._no_mirror = torch.empty(L, 2, H, 0, D, dtype=self.dtype, device=self.device)
        self._decode_mirror = self._attn_mirror      # until the paged runner says otherwise
        self.blocks = BlockPool(cfg.num_blocks)
        self.hit_rule = mc.hit_rule(cfg.block_tokens)
        h = hashlib.blake2b(digest_size=16)
        h.update(src.weights_id)
        # Without invariant kernels the chunk decides a canonical block's bits, so it
        # is part of the identity; with them the kernel family is (and chunking is not).
        bits = f"K{self.kernels.name}" + ("" if self.invariant else f"C{cfg.chunk_tokens}")
        h.update(f"|{cfg.dtype}|kv{KV_LAYOUT_VERSION}|B{cfg.block_tokens}|{bits}".encode())
        self.fingerprint: bytes = h.digest()
        self._seqs: dict[str, Sequence] = {}
        self._windows = mc.layer_windows
        self._counts = (torch.zeros(mc.num_layers, mc.moe.n_experts, dtype=torch.int64,
                                    device=self.device) if mc.moe else None)
        self._gen_ids = 0
        self.shared_rows_total = 0
        self.last_step: StepTimes | None = None     # the latest decode_step's times
        self._grammars: GrammarCompiler | None = None   # built on the first grammar
        self._paged = self._paged_runner(cfg)
        # The paged decode kernel reads the pool: decode steps need no mirror either.
        self._decode_mirror = self._attn_mirror and self._paged is None
        if self.device.type == "cuda":
            # Random weights are drawn [out, in] and copied transposed (engine/weights.py):
            # the drawn ones, freed, stayed in this process's cache (15 GiB for
            # llama-8b-shape, measured on the H200), out of reach of an engine beside it.
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ info
    @property
    def fingerprint_hex(self) -> str:
        return self.fingerprint.hex()

    @property
    def live_sequences(self) -> list[str]:
        return list(self._seqs)

    @property
    def free_blocks(self) -> int:
        return self.blocks.num_free

    def kv_blocks_for(self, prompt_tokens: int, max_tokens: int, *,
                      canonical: bool = False) -> int:
        """The most pool blocks a sequence of ``prompt_tokens`` that samples up
        to ``max_tokens`` (its first one included) can hold at once: its KV grows
        to the prompt plus every sampled token but the last, at most the context;
        ``canonical``: plus the shadow blocks ``canonical_blocks`` allocates
        (none with invariant kernels). No G1 sharing is assumed."""
        if prompt_tokens < 1 or max_tokens < 1:
            raise EngineInputError(f"prompt_tokens and max_tokens must be >= 1, got "
                                   f"{prompt_tokens}, {max_tokens}")
        B = self.config.block_tokens
        kv = min(prompt_tokens + max_tokens - 1, max(prompt_tokens, self.model_config.max_position))
        need = -(-kv // B)
        if canonical and not self.invariant:
            C = self._canon_unit
            need += max(0, kv // C * C // B - prompt_tokens // C * C // B)
        return need

    def seq_tokens(self, seq_id: str) -> list[int]:
        """Prompt plus every sampled token (the last one has no KV yet)."""
        return list(self._seq(seq_id).tokens)

    def canonical_full(self, seq_id: str) -> int:
        """Leading blocks of the sequence whose KV is canonical (safe to store):
        the prompt's blocks before its last chunk boundary. Later full blocks
        come canonical from ``canonical_blocks``."""
        return self._seq(seq_id).canonical_full

    def g1_match(self, block_keys: Seq[bytes]) -> int:
        return len(self.blocks.match(block_keys))

    def g1_admission(self, block_keys: Seq[bytes], prompt_tokens: int) -> G1Admission:
        """What admitting a prompt now would find in G1 and take from
        ``free_blocks``: its fresh blocks plus the G1 blocks it reuses that no
        running sequence holds (idle cached blocks count as free until pinned;
        two prompts reusing the same idle blocks take them once). A scheduler's
        estimate made before G1 grew charged a resent context its whole length
        and held everything queued behind it."""
        if prompt_tokens < 1:
            raise EngineInputError(f"prompt_tokens must be >= 1, got {prompt_tokens}")
        B, C = self.config.block_tokens, self._canon_unit
        g1 = self.blocks.match(block_keys)
        cap = self.hit_rule.usable_tokens(len(g1) * B, prompt_tokens) // C * C
        use = g1[:min(len(g1), cap // B)]
        idle = tuple(b for b in use if self.blocks.ref_count(b) == 0)
        return G1Admission(len(g1), len(use) * B, -(-prompt_tokens // B) - len(use), idle)

    def expert_counts(self) -> torch.Tensor | None:
        """MoE: [layers, n_experts] tokens routed since the previous call."""
        if self._counts is None:
            return None
        out = self._counts.cpu().clone()
        self._counts.zero_()
        return out

    def shared_stats(self) -> SharedStats:
        return SharedStats(self.shared_rows_total)

    def memory(self) -> EngineMemory:
        """What the live sequences' mirrors and the device allocator hold
        (engine/memory.py); safe to call from another thread."""
        mirrors = mirror_bytes(lambda: [s.mirror for s in list(self._seqs.values())])
        return engine_memory(self.device, mirrors, self.config.gpu_fraction)

    def release_mirror(self, seq_id: str) -> None:
        """Drop the sequence's mirror: it takes no more steps here for now (a
        finished prompt the prefill service holds only for decode's pull copies
        its KV out of the pool). A decode step later rebuilds it from the pool."""
        self._seq(seq_id).mirror = self._no_mirror

    # --------------------------------------------------------------- prefill
    @torch.inference_mode()
    def prefill(self, seq_id: str, tokens: Seq[int], *,
                sampling: SamplingParams = GREEDY,
                block_keys: Seq[bytes] | None = None,
                restored: torch.Tensor | HostRuns | None = None,
                max_restore_tokens: int | None = None,
                restored_start_block: int | None = None,
                stop: Callable[[], bool] | None = None,
                share_scope: str | None = None) -> PrefillResult:
        """Make ``seq_id`` live with the prompt's KV and sample its first token:
        ``admit`` then ``prefill_step`` of this sequence alone, one chunk at a
        time. ``stop`` is polled before each chunk; when it returns True the
        prefill ends with ``PrefillStopped`` (the caller is gone: no more compute)."""
        self.admit(seq_id, tokens, sampling=sampling, block_keys=block_keys, restored=restored,
                   max_restore_tokens=max_restore_tokens,
                   restored_start_block=restored_start_block, share_scope=share_scope)
        seq = self._seqs[seq_id]
        try:
            while True:
                if stop is not None and stop():
                    raise PrefillStopped(f"prefill of {seq_id!r} stopped at token "
                                         f"{seq.kv_len} of {seq.prompt_len}")
                done = self.prefill_step({seq_id: self._chunk - seq.kv_len % self._chunk})
                if done:
                    return done[0].result
        except BaseException:
            self.free(seq_id)
            raise

    def _run_chunks(self, seq: Sequence, start: int, end: int, *, all_logits: bool,
                    table: torch.Tensor | None = None,
                    mirror: torch.Tensor | None = None) -> torch.Tensor:
        """Recompute tokens [start, end) of ``seq`` (into ``table`` / ``mirror``
        when given) in chunks aligned to absolute positions, as a prefill does;
        returns the last chunk's hidden states (or all logits)."""
        chunk = self._chunk
        table = seq.table if table is None else table
        mirror = seq.mirror if mirror is None else mirror
        outs: list[torch.Tensor] = []
        hidden = torch.empty(0)
        s = start
        while s < end:
            e = min(end, (s // chunk + 1) * chunk)
            toks = torch.tensor(seq.tokens[s:e], dtype=torch.int64, device=self.device)
            pos = torch.arange(s, e, device=self.device)
            attn = BatchAttention(self.storage, [Segment(0, e - s, s, table, mirror)],
                                  self._windows, self.model_config.num_heads, e - s,
                                  self.invariant)
            hidden = self.model.forward(toks, pos, attn, e - s, self._counts)
            if all_logits:
                outs.append(self.model.logits(hidden))
            s = e
        return torch.cat(outs) if all_logits else hidden

    @torch.inference_mode()
    def score(self, tokens: Seq[int]) -> torch.Tensor:
        """Logits of every position of ``tokens`` ([T, V] fp32) through the
        prefill path; nothing stays live (for tests and oracles)."""
        toks = check_prompt(tokens, self.model_config)
        B = self.config.block_tokens
        blocks = self.blocks.allocate(-(-len(toks) // B))
        try:
            table = torch.tensor(blocks, dtype=torch.int64, device=self.device)
            seq = Sequence("_score", toks, len(toks), 0, blocks, table, GREEDY,
                           self._mirror(table, 0, len(toks)), canonical_full=0)
            return self._run_chunks(seq, 0, len(toks), all_logits=True).cpu()
        finally:
            self.blocks.release(blocks)

    # ---------------------------------------------------------------- decode
    @torch.inference_mode()
    def decode_step(self, seq_ids: Seq[str]) -> dict[str, int]:
        """Feed each sequence's pending token and sample its next one."""
        if len(set(seq_ids)) != len(seq_ids):
            raise EngineInputError("decode_step got the same sequence twice")
        seqs = [self._seq(s) for s in seq_ids]
        limit = self.model_config.max_position
        for s in seqs:
            if s.prefill is not None:
                raise EngineInputError(f"sequence {s.seq_id!r} is still prefilling "
                                       f"({s.prompt_len - s.kv_len} prompt tokens to go)")
            if s.kv_len >= limit:
                raise EngineInputError(f"sequence {s.seq_id!r} reached the context limit "
                                       f"of {limit} tokens")
        clock = StepClock(self.device)
        self._grow(seqs)
        out: dict[str, int] = {}
        rows = self._rows_per_forward(len(seqs))
        for i in range(0, len(seqs), rows):
            group = seqs[i: i + rows]
            logits = clock.forward(lambda g=group: self._decode_logits(g, rows))  # [len(g), V]
            nxt = sample_rows(logits, [self._row(s) for s in group])
            for s, t in zip(group, nxt, strict=True):
                s.kv_len += 1
                s.tokens.append(t)
                out[s.seq_id] = t
        self.last_step = clock.stop(len(seqs))
        return out

    def capture_decode_graphs(self) -> int:
        """Capture the CUDA paged decode's graph of every batch bucket now (an
        instance's start-up); the number captured, 0 without graphs."""
        return self._paged.capture_all() if self._paged is not None else 0

    def _rows_per_forward(self, n: int) -> int:
        """CUDA paged decode: a graph bucket (up to 64). Invariant kernels: exactly
        the live rows. Otherwise a fixed bucket of rows, padding included, so a
        sequence's bits never depend on how many others share the step."""
        if self._paged is not None:
            return self._paged.bucket(n)
        return n if self.invariant else self.config.decode_bucket

    def _decode_logits(self, group: list[Sequence], rows: int) -> torch.Tensor:
        if self._paged is not None:
            # one paged-attention kernel per layer, replayed from the bucket's graph
            return self._paged.step([s.pending for s in group], [s.kv_len for s in group],
                                    [s.blocks for s in group])
        pad = rows - len(group)
        toks = torch.tensor([s.pending for s in group] + [0] * pad, device=self.device)
        pos = torch.tensor([s.kv_len for s in group] + [0] * pad, device=self.device)
        segs = [Segment(j, 1, s.kv_len, s.table, s.mirror) for j, s in enumerate(group)]
        attn = BatchAttention(self.storage, segs, self._windows,
                              self.model_config.num_heads, rows, self.invariant)
        hidden = self.model.forward(toks, pos, attn, len(group), self._counts)
        return self.model.logits(hidden)[: len(group)]

    def _paged_forward(self, toks: torch.Tensor, pos: torch.Tensor,
                       attn: object) -> torch.Tensor:
        n = int(toks.shape[0])
        hidden = self.model.forward(toks, pos, attn, n, self._counts)  # type: ignore[arg-type]
        return self.model.logits(hidden)

    def _grow(self, seqs: list[Sequence]) -> None:
        """Give every sequence a slot for its pending token (all or nothing)."""
        B = self.config.block_tokens
        need = [s for s in seqs if s.kv_len // B >= len(s.blocks)]
        new = self.blocks.allocate(len(need))
        for s, b in zip(need, new, strict=True):
            s.blocks.append(b)
            s.table = torch.tensor(s.blocks, dtype=torch.int64, device=self.device)
        if self._paged is not None:
            return                  # paged decode reads the pool; no mirror to grow
        for s in seqs:
            if s.mirror.shape[3] == 0:
                # released (release_mirror): the pool holds the same bits
                s.mirror = self._mirror(s.table, s.kv_len, self._capacity(s.kv_len + 1))
            elif s.mirror.shape[3] <= s.kv_len:
                grown = self._mirror(s.table, 0, self._capacity(s.kv_len * 3 // 2 + 1))
                grown[:, :, :, :s.kv_len] = s.mirror[:, :, :, :s.kv_len]
                s.mirror = grown

    def finish_reason(self, seq_id: str) -> str | None:
        """"stop" (EOS or a stop string), "length" (max_tokens or context), or None."""
        s = self._seq(seq_id)
        gen, p = s.generated, s.sampling
        if not p.ignore_eos and gen and gen[-1] in self.tokenizer.eos_token_ids:
            return "stop"
        if p.stop and any(x in self._text(s, gen) for x in p.stop):
            return "stop"
        if len(gen) >= p.max_tokens or s.kv_len >= self.model_config.max_position:
            return "length"
        return None

    def completion_text(self, seq_id: str) -> str:
        s = self._seq(seq_id)
        gen = s.generated
        if gen and gen[-1] in self.tokenizer.eos_token_ids and not s.sampling.ignore_eos:
            gen = gen[:-1]
        text = self._text(s, gen)
        cuts = [text.find(x) for x in s.sampling.stop if x in text]
        return text[: min(cuts)] if cuts else text

    def _text(self, s: Sequence, ids: list[int]) -> str:
        """``tokenizer.decode(ids)`` for ids that begin with ``s.generated``'s
        first tokens, decoding only what follows the text kept from earlier
        calls (``Tokenizer.stable_prefix``). Decoding the whole completion again
        each step was 2-2.5 ms of every decode step at batch 28-38 on the H200
        stack (the step's ``read``; docs/benchmarks-history.md, run 15)."""
        k, head = s.text_cache
        if k > len(ids):                    # never, while tokens only grow; stay exact
            k, head = 0, ""
        tail = ids[k:]
        j = self.tokenizer.stable_prefix(tail)
        if j:
            head += self.tokenizer.decode(tail[:j])
            s.text_cache = (k + j, head)
            tail = tail[j:]
        return head + self.tokenizer.decode(tail)

    def generate(self, tokens: Seq[int], sampling: SamplingParams = GREEDY,
                 restored: torch.Tensor | None = None,
                 block_keys: Seq[bytes] | None = None) -> GenerationResult:
        self._gen_ids += 1
        sid = f"_generate-{self._gen_ids}"
        pre = self.prefill(sid, tokens, sampling=sampling, restored=restored,
                           block_keys=block_keys)
        try:
            while (reason := self.finish_reason(sid)) is None:
                self.decode_step([sid])
            return GenerationResult(self._seq(sid).generated, self.completion_text(sid),
                                    reason, pre)
        finally:
            self.free(sid)

    # -------------------------------------------------------- blocks in/out
    @torch.no_grad()  # exported tensors are ordinary (inference tensors refuse in-place use)
    def export_blocks(self, seq_id: str, start_block: int = 0, n_blocks: int | None = None,
                      out: torch.Tensor | None = None, *, on_device: bool = False
                      ) -> torch.Tensor:
        """Full blocks of the sequence as [n, layers, 2, kv_heads, B, head_dim];
        ``on_device``: a gather on the engine's device, queued and not waited for."""
        s = self._seq(seq_id)
        full = s.kv_len // self.config.block_tokens
        n = full - start_block if n_blocks is None else n_blocks
        if start_block < 0 or n < 0 or start_block + n > full:
            raise EngineInputError(f"blocks [{start_block}, {start_block + n}) out of range: "
                                   f"sequence {seq_id!r} has {full} full blocks")
        return self.storage.export(s.table[start_block: start_block + n], out,
                                   on_device=on_device)

    @torch.no_grad()
    def export_tokens(self, seq_id: str, start: int, end: int, *,
                      out: torch.Tensor | None = None,
                      chunks: PinnedChunks | None = None,
                      on_device: bool = False) -> torch.Tensor:
        """KV of tokens [start, end) as [layers, 2, kv_heads, end - start, head_dim],
        on the host. ``out`` (contiguous, host, that shape and dtype): written
        in place, through ``chunks`` where given (the hand-off's copy-out).
        ``on_device``: a new contiguous tensor on the engine's device instead,
        complete on return (another process may read it next)."""
        s = self._seq(seq_id)
        if not 0 <= start <= end <= s.kv_len:
            raise EngineInputError(f"tokens [{start}, {end}) out of range: sequence "
                                   f"{seq_id!r} has KV for {s.kv_len} tokens")
        if on_device:
            # Slots from the host's block list (as below): a side stream, nothing
            # waited for on the default one.
            host = self._slots(torch.tensor(s.blocks, dtype=torch.int64), start, end)
            return self.storage.export_tokens_device(host)
        if out is None:
            return self.storage.export_tokens(self._slots(s.table, start, end)).cpu()
        L, _, H, _, D = self.layout.block_shape
        if (tuple(out.shape) != (L, 2, H, end - start, D) or out.dtype != self.dtype
                or not out.is_contiguous() or out.device.type != "cpu"):
            raise EngineInputError(f"export destination {tuple(out.shape)} {out.dtype} "
                                   f"{out.device} does not fit tokens [{start}, {end})")
        if chunks is not None:
            # Slots from the host's block list, not the device table: the copy runs
            # on a side stream, and nothing on the default stream (the step in
            # flight) is waited for or raced with.
            host = self._slots(torch.tensor(s.blocks, dtype=torch.int64), start, end)
            return self.storage.export_tokens_into(host, out, chunks)
        return out.copy_(self.storage.export_tokens(self._slots(s.table, start, end)))

    @torch.inference_mode()
    def pin_prefix(self, block_keys: Seq[bytes]) -> list[int]:
        """The blocks of the leading ``block_keys`` G1 holds, pinned (no longer
        evictable) for a later ``adopt(prefix=...)``; ``unpin`` them if unused."""
        held = self.blocks.match(block_keys)
        self.blocks.acquire(held)
        return held

    def unpin(self, blocks: Seq[int]) -> None:
        self.blocks.release(blocks)

    def adopt(self, seq_id: str, tokens: Seq[int], kv: torch.Tensor, first_token: int,
              sampling: SamplingParams = GREEDY, *, prefix: Seq[int] = (),
              block_keys: Seq[bytes] | None = None) -> None:
        """Make a live sequence from KV computed elsewhere.

        ``prefix``: blocks from ``pin_prefix`` holding the leading tokens (their
        pins become the sequence's on success, stay the caller's on an error);
        ``kv`` covers the tokens after them. ``block_keys``: the prompt's chain
        keys, under which ``free`` keeps its canonical blocks in G1 when it is
        given no keys of its own (a session's next turn then pulls only its tail)."""
        if seq_id in self._seqs:
            raise EngineInputError(f"sequence {seq_id!r} is already live")
        toks = check_prompt(tokens, self.model_config)
        check_prompt([first_token], self.model_config)
        B = self.config.block_tokens
        start = len(prefix) * B
        if start >= len(toks):
            raise EngineInputError(f"a prefix of {len(prefix)} blocks leaves none of the "
                                   f"{len(toks)} prompt tokens to adopt")
        L, _, H, _, D = self.layout.block_shape
        want = (L, 2, H, len(toks) - start, D)
        if tuple(kv.shape) != want or kv.dtype != self.dtype:
            raise EngineInputError(f"adopted KV has shape {tuple(kv.shape)} {kv.dtype}; "
                                   f"expected {want} {self.dtype}")
        # The first token was sampled by prefill under the same parameters: replay it
        # into this sequence's sampling state (grammar, penalty counts).
        sampler = self._sampler(sampling)
        sampler.accept(first_token)
        blocks = [*prefix, *self.blocks.allocate(-(-len(toks) // B) - len(prefix))]
        table = torch.tensor(blocks, dtype=torch.int64, device=self.device)
        self.storage.import_tokens(self._slots(table, start, len(toks)), kv)
        # Adopted sequences only decode: no mirror where decode steps read the pool.
        mirror = (self._mirror(table, len(toks), self._capacity(len(toks)))
                  if self._decode_mirror else self._no_mirror)
        self._seqs[seq_id] = Sequence(
            seq_id, [*toks, first_token], len(toks), len(toks), blocks, table, sampling,
            mirror,
            canonical_full=len(toks) // self._canon_unit * self._canon_unit // B,
            sampler=sampler, keys=list(block_keys or ()))

    @torch.no_grad()
    def canonical_blocks(self, seq_id: str, *, on_device: bool = False
                         ) -> tuple[int, torch.Tensor]:
        """(first block index, blocks) for the full blocks after the prompt's
        last chunk boundary, up to the sequence's last chunk boundary (with the
        default chunk == block: every full block), recomputed through the
        prefill path: exactly the KV a cold chunked prefill of these tokens gives.
        ``on_device``: the blocks gathered on the engine's device and not waited
        for (``export_blocks``), so the caller's thread need not wait for the copy."""
        s = self._seq(seq_id)
        B, C = self.config.block_tokens, self._canon_unit
        # Only whole chunks are canonical: a partial chunk's row count depends
        # on where the sequence happens to end.
        first, last = s.canonical_full, s.kv_len // C * C // B
        self.blocks.release(s.shadow)
        s.shadow = []
        if last <= first:
            return first, torch.empty(0, *self.layout.block_shape, dtype=self.dtype)
        if self.invariant:
            # Decode wrote these blocks with the same per-row arithmetic as a cold
            # prefill: they are canonical as they are.
            return first, self.storage.export(s.table[first:last], on_device=on_device)
        s.shadow = self.blocks.allocate(last - first)
        table = torch.tensor(s.blocks[:first] + s.shadow, dtype=torch.int64,
                             device=self.device)
        mirror = self._mirror(table, first * B, last * B)
        self._run_chunks(s, first * B, last * B, all_logits=False, table=table, mirror=mirror)
        return first, self.storage.export(table[first:], on_device=on_device)

    def free(self, seq_id: str, keep_keys: Seq[bytes] | None = None) -> None:
        """Release the sequence; its canonical full blocks stay in G1 under
        ``keep_keys`` (key i names block i; None: the keys it was adopted with)."""
        s = self._seqs.pop(seq_id, None)
        if s is None:
            raise EngineInputError(f"no live sequence {seq_id!r}")
        if s.prefill is not None and s.prefill.feed is not None:
            s.prefill.feed.close()      # a restore still arriving lands before reuse
        self._publish(s, keep_keys)
        self.blocks.release(s.blocks)
        self.blocks.release(s.shadow)

    def publish(self, seq_id: str, keep_keys: Seq[bytes] | None = None) -> None:
        """Put the live sequence's canonical full blocks in G1 now, as ``free``
        would, and keep it live: a prompt held for a later copy-out is already
        a G1 hit for the next request sharing its prefix."""
        self._publish(self._seq(seq_id), keep_keys)

    def _publish(self, s: Sequence, keep_keys: Seq[bytes] | None) -> None:
        B = self.config.block_tokens
        canon = s.kv_len // B if self.invariant else s.canonical_full
        if s.prefill is not None:
            # Stopped mid-prompt: only blocks already computed may be published.
            canon = min(canon, s.kv_len // B)
        for i, key in enumerate(s.keys if keep_keys is None else keep_keys):
            if i < canon:
                self.blocks.cache(s.blocks[i], key)
            elif 0 <= i - s.canonical_full < len(s.shadow):
                self.blocks.cache(s.shadow[i - s.canonical_full], key)
            else:
                break

    # --------------------------------------------------------------- helpers
    def _paged_runner(self, cfg: EngineConfig) -> DecodeRunner | None:
        """CUDA with Triton: batched paged decode (graphs for dense models). With
        invariant kernels (``triton_bi``) its attention is theirs (the prefill
        kernel), so decode KV is prefill KV and padding rows change no bits."""
        if self.device.type != "cuda" or not cfg.paged_decode:
            return None
        try:
            from engine.paged_decode import AttentionFactory, DecodeRunner, PagedDecodeAttention
        except ImportError:                 # no Triton: the per-sequence SDPA path
            return None
        attention: AttentionFactory = PagedDecodeAttention
        if self.invariant:
            from engine.triton_invariant import DecodeAttention
            attention = DecodeAttention
        mc = self.model_config
        scratch = self.blocks.allocate(1)[0]  # padding rows write here, never live KV
        return DecodeRunner(self.storage, self._windows, mc.num_heads,
                            -(-mc.max_position // cfg.block_tokens), scratch,
                            self._paged_forward, cfg.cuda_graphs and mc.moe is None,
                            attention)

    def _check_gpu_budget(self, cfg: EngineConfig) -> None:
        """Refuse to start, rather than fail requests later, when this process's
        share of the GPU cannot hold the weights (loaded), the pool, and one
        context's KV twice over: the largest transient (a pulled prompt on its
        way into the pool, a sequence's blocks gathered for the warehouse). The
        rest of a step's workspace is per batch (decode's bucket graphs), not
        per sequence: nothing else grows with what admission lets in."""
        props = torch.cuda.get_device_properties(self.device)
        cap = int(cfg.gpu_fraction * props.total_memory)
        B, per_block = cfg.block_tokens, self.layout.block_nbytes
        pool = cfg.num_blocks * per_block
        context = min(-(-self.model_config.max_position // B), cfg.num_blocks) * per_block
        weights = torch.cuda.memory_allocated(self.device)
        if weights + pool + 2 * context > cap:
            gib = 2**30
            raise DeviceError(
                f"gpu_fraction {cfg.gpu_fraction} of {props.total_memory / gib:.1f} GiB is "
                f"{cap / gib:.1f} GiB, less than the weights ({weights / gib:.1f} GiB) + the KV "
                f"pool ({pool / gib:.1f} GiB) + twice one context's KV "
                f"({context / gib:.1f} GiB): raise the share or shrink the pool")

    @property
    def _canon_unit(self) -> int:
        """Tokens per canonical unit: a block with invariant kernels, else a chunk."""
        return self.config.block_tokens if self.invariant else self.config.chunk_tokens

    @property
    def _chunk(self) -> int:
        """Prefill chunk. Invariant kernels give the same bits for any chunk, so the
        default is a large one (fewer passes over the weights); otherwise the chunk
        is part of exactness and defaults to a block."""
        cfg = self.config
        if cfg.prefill_chunk or not self.invariant:
            return cfg.chunk_tokens
        return max(cfg.block_tokens, INVARIANT_CHUNK // cfg.block_tokens * cfg.block_tokens)

    def _sampler(self, sampling: SamplingParams) -> RowSampler:
        return RowSampler.create(sampling, self.model_config.vocab_size, self._constraint)

    def _constraint(self, spec: GrammarSpec) -> Constraint:
        if self._grammars is None:
            self._grammars = GrammarCompiler.for_tokenizer(self.tokenizer,
                                                           self.model_config.vocab_size)
        return self._grammars.constraint(spec)

    @staticmethod
    def _row(s: Sequence) -> RowSampler:
        assert s.sampler is not None, "a live sequence always has its sampler"
        return s.sampler

    def _seq(self, seq_id: str) -> Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise EngineInputError(f"no live sequence {seq_id!r}") from None

    def _slots(self, table: torch.Tensor, start: int, end: int) -> torch.Tensor:
        B = self.config.block_tokens
        pos = torch.arange(start, end, device=table.device)
        return table[pos // B] * B + pos % B
