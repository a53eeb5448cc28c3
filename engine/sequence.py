"""A live sequence's state and the engine's typed results."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.sampling import RowSampler, SamplingParams

if TYPE_CHECKING:
    from engine.layer_restore import LayerFeed


@dataclass(frozen=True, slots=True)
class PrefillResult:
    first_token: int
    restored_tokens: int        # tokens whose KV came in as `restored` blocks
    g1_tokens: int              # tokens whose KV was found in the local prefix cache
    computed_tokens: int        # tokens run through the model
    compute_s: float


@dataclass(frozen=True, slots=True)
class Admission:
    """A sequence admitted for prefill (``Engine.admit``): what it reuses and
    what is left to compute in ``Engine.prefill_step`` calls."""

    seq_id: str
    g1_tokens: int              # KV found in the local prefix cache
    restored_tokens: int        # KV taken from the given restored blocks
    to_compute: int             # prompt tokens still to run through the model (>= 1)


@dataclass(frozen=True, slots=True)
class G1Admission:
    """What admitting a prompt now would take from G1 (``Engine.g1_admission``)."""

    held_blocks: int            # leading blocks found in G1
    usable_tokens: int          # of them reused under the hit rule (and the chunk cut)
    fresh_blocks: int           # allocated for the rest of the prompt
    idle_blocks: tuple[int, ...]  # reused blocks no sequence holds: free until pinned


@dataclass(frozen=True, slots=True)
class PrefillDone:
    """A sequence whose prompt is complete: live for decode, first token sampled."""

    seq_id: str
    result: PrefillResult


@dataclass(slots=True)
class PrefillState:
    """What a sequence carries while its prompt is being computed."""

    keys: list[bytes]           # chain keys of its blocks: published into G1 when done
    g1_blocks: int              # leading blocks shared from the local prefix cache
    restored_blocks: int        # blocks after them imported from restored KV
    compute_s: float = 0.0      # admission work + forward time of the steps it took part in
    feed: LayerFeed | None = None   # CUDA: restored layers still arriving
    first_token: int | None = None  # given (a rebuild continues a known answer): not sampled
    shared_tokens: int = 0      # prompt rows copied from another sequence (engine/shared_rows.py)


@dataclass(frozen=True, slots=True)
class GenerationResult:
    tokens: list[int]           # sampled tokens (the EOS token included when it ended the run)
    text: str                   # their text, without EOS and cut before a stop string
    finish_reason: str          # "stop" | "length"
    prefill: PrefillResult


@dataclass(slots=True)
class Sequence:
    seq_id: str
    tokens: list[int]           # prompt + sampled; tokens[kv_len] is the pending token
    prompt_len: int
    kv_len: int                 # tokens whose KV is in the pool
    blocks: list[int]           # block table, append-only
    table: torch.Tensor         # the same ids as int64 on the pool device
    sampling: SamplingParams
    # The same KV as the pool, contiguous per layer, read by attention
    # (engine.attention): [layers, 2, kv_heads, capacity, head_dim].
    mirror: torch.Tensor
    # Leading full blocks whose KV is canonical (what a cold chunked prefill
    # gives): the prompt's full blocks. Blocks written by decode are not.
    canonical_full: int
    # Canonical recomputations of blocks [canonical_full, ...) made by
    # Engine.canonical_blocks, kept so free(keep_keys) can cache them in G1.
    shadow: list[int] = field(default_factory=list)
    # Sampling state (penalty counts, grammar matcher); made by the engine at prefill/adopt.
    sampler: RowSampler | None = None
    # Set from admission until the prompt's last token is computed (kv_len < prompt_len):
    # such a sequence takes prefill steps, never decode steps.
    prefill: PrefillState | None = None
    # Chain keys of its leading full blocks, kept in G1 on a free given no keys.
    keys: list[bytes] = field(default_factory=list)
    # (n, text): the first n generated tokens decode to text whatever follows
    # (Tokenizer.stable_prefix), so a step decodes only the tokens after them.
    text_cache: tuple[int, str] = (0, "")
    # Prompt rows are shared only between sequences of one scope (a tenant), as
    # G1 blocks are: None shares with no one (engine/shared_rows.py).
    share_scope: str | None = None

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def pending(self) -> int:
        return self.tokens[self.kv_len]
