"""The prefill service's configuration: a slotted dataclass validated at
construction over the shared pieces in ``service.config``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace
from typing import Any

from common.config import ConfigError, KVServeConfig, PrefillSection, TrafficClasses, parse_size
from service.config import CostConfig, Endpoint, EngineSpec, WriterConfig, split_overrides

_TENANT = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{name} must be > 0, got {value}")


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    engine: EngineSpec = field(default_factory=EngineSpec)
    endpoint: Endpoint = field(default_factory=Endpoint)
    classes: TrafficClasses = field(default_factory=TrafficClasses)
    cost: CostConfig = field(default_factory=CostConfig)
    writer: WriterConfig = field(default_factory=WriterConfig)
    scheduler: PrefillSection = field(default_factory=PrefillSection)   # [prefill]
    default_tenant: str = "default"
    buffer_ttl_s: float = 3600.0        # a handle's KV nobody pulled this long is dropped
                                        # (decode rebuilds it); not an expiry of live handles
    buffer_max_bytes: int = 4 * 2**30
    chunk_bytes: int = 4 * 2**20        # PullKV stream chunk size
    shm_dir: str = "/dev/shm"           # same-host pulls; empty: stream only
    ipc_pulls: bool = True              # same-GPU pulls as a CUDA IPC handle (service/kv_ipc.py)
    ipc_hold_s: float = 60.0            # a shared device copy decode did not release this long
                                        # is dropped (longer than decode's pull deadline)
    max_prompt_tokens: int = 0          # 0: the model's context length
    local_prefix_cache: bool = True     # keep prompt blocks in the engine (G1) after a request
    warmup_tokens: int = 128            # measure prefill speed at start; 0: skip

    def __post_init__(self) -> None:
        if not _TENANT.match(self.default_tenant):
            raise ConfigError(f"default_tenant {self.default_tenant!r} must match "
                              "[A-Za-z0-9._-]{1,64}")
        _positive("buffer_ttl_s", self.buffer_ttl_s)
        _positive("ipc_hold_s", self.ipc_hold_s)
        for name in ("buffer_max_bytes", "chunk_bytes"):
            object.__setattr__(self, name, parse_size(getattr(self, name), name))
        if self.chunk_bytes < 64 * 2**10:
            raise ConfigError("chunk_bytes must be at least 64KiB")
        if self.max_prompt_tokens < 0 or self.warmup_tokens < 0:
            raise ConfigError("max_prompt_tokens and warmup_tokens must be >= 0")

    @classmethod
    def from_kvserve(cls, cfg: KVServeConfig, **overrides: Any) -> PrefillConfig:
        """The prefill section of a deployment config; ``overrides`` are
        Endpoint/EngineSpec/PrefillSection/PrefillConfig field names (CLI flags)."""
        names = {f.name for f in fields(PrefillSection)}
        sched = {k: overrides.pop(k) for k in list(overrides) if k in names}
        sched = {k: v for k, v in sched.items() if v is not None}
        parts = split_overrides(cfg, cfg.ports.prefill, overrides, cls)
        parts.setdefault("scheduler", replace(cfg.prefill, **sched))
        return cls(**parts)
