"""The decode service's configuration (slotted, validated; built at the entry point)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from common.config import ConfigError, KVServeConfig
from service.config import CostConfig, Endpoint, EngineSpec, WriterConfig, split_overrides


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    engine: EngineSpec = field(default_factory=EngineSpec)
    endpoint: Endpoint = field(default_factory=Endpoint)
    cost: CostConfig = field(default_factory=CostConfig)        # for rebuilds from the warehouse
    writer: WriterConfig = field(default_factory=WriterConfig)  # canonical blocks of prompt+output
    max_seqs: int = 64                  # sequences decoding at once; more wait
    max_waiting: int = 64               # calls taken beyond max_seqs (pulling or waiting for a
                                        # slot); more are refused (RESOURCE_EXHAUSTED) up front
    pull_timeout_s: float = 30.0        # deadline of a PullKV (cut to the request's own); a
                                        # pull that fails is rebuilt, never an error
    use_shm: bool = True                # same-host pulls through /dev/shm
    use_ipc: bool = True                # same-GPU pulls device to device (CUDA IPC, kv_ipc.py)
    shm_dir: str = "/dev/shm"
    canonical_write: bool = True        # write prompt+output blocks after each request
    canonical_wait_s: float = 10.0      # hold the final event until they are stored (0: don't)
    early_first_token: bool = True      # send prefill's token before the KV pull (needs a store)
    ep_ranks: int = 4                   # MoE: expert-parallel ranks the imbalance is measured on
    expert_plan: str = ""               # MoE: "" contiguous | "auto" (EPLB from own counts) | JSON
    ep_redundant: int = 0               # MoE "auto": redundant expert slots for the planner
    expert_replan_steps: int = 256      # MoE "auto": re-plan every this many steps
    expert_window_steps: int = 64
    warmup_tokens: int = 64
    # A prompt sent with no prefill (the router saw its prefix here): computed here when
    # this instance's G1 leaves at most this many tokens, whatever the router asks; more
    # are declined before any work (docs/services.md, "A short tail on decode").
    local_tail_max_tokens: int = 2048
    # Such a prompt of which this instance holds nothing: computed here when it has at
    # most this many tokens, whatever the router asks (docs/services.md, "A short prompt
    # on decode"); a longer one is declined, and prefill restores what the warehouse has.
    local_cold_max_tokens: int = 256
    # Prompt tokens computed per sequence between two decode steps (short tails, rebuilds):
    # a tail up to this size gets its first token after one step; a longer one delays the
    # decode of the others by at most one chunk per step.
    prefill_chunk_tokens: int = 512

    def __post_init__(self) -> None:
        if self.max_seqs < 1:
            raise ConfigError(f"max_seqs must be >= 1, got {self.max_seqs}")
        if self.max_waiting < 0:
            raise ConfigError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if not self.pull_timeout_s > 0:
            raise ConfigError("pull_timeout_s must be > 0")
        if min(self.ep_ranks, self.expert_window_steps, self.expert_replan_steps) < 1:
            raise ConfigError("ep_ranks, expert_window_steps, expert_replan_steps must be >= 1")
        if self.ep_redundant < 0:
            raise ConfigError("ep_redundant must be >= 0")
        if self.canonical_wait_s < 0:
            raise ConfigError("canonical_wait_s must be >= 0")
        if self.warmup_tokens < 0:
            raise ConfigError("warmup_tokens must be >= 0")
        if self.local_tail_max_tokens < 0:
            raise ConfigError("local_tail_max_tokens must be >= 0 (0: always prefill)")
        if self.local_cold_max_tokens < 0:
            raise ConfigError("local_cold_max_tokens must be >= 0 (0: always prefill)")
        if self.prefill_chunk_tokens < 1:
            raise ConfigError("prefill_chunk_tokens must be >= 1")

    @classmethod
    def from_kvserve(cls, cfg: KVServeConfig, **overrides: Any) -> DecodeConfig:
        return cls(**split_overrides(cfg, cfg.ports.decode, overrides, cls))
