"""The configuration pieces both engine services share (engine, endpoint,
cost, writer) and the split of flat CLI overrides over them: slotted
dataclasses validated at construction, built from the kvserve TOML config plus
command-line overrides at the entry point only.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass, field, replace
from typing import Any

from common.config import ConfigError, KVServeConfig, parse_size
from security.config import SecurityConfig

_TENANT = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_DTYPES = ("float32", "bfloat16", "float16")


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{name} must be > 0, got {value}")


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """Which model an instance serves and how its KV pool is laid out."""

    model: str = "smollm2"
    dtype: str = "float32"
    device: str = "cpu"
    block_tokens: int = 64
    num_blocks: int = 2048
    decode_bucket: int = 8
    seed: int = 0
    prefill_chunk: int = 0              # 0: the engine's default (docs/engine.md)
    kernels: str = "auto"               # engine/kernels.py: auto | torch | bik | triton | triton_bi
    threads: int = 0                    # CPU threads of the engine; 0 = all cores
    gpu_fraction: float = 0.0           # CUDA: cap on this process's share of the GPU; 0: none

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("engine.model must name a model or an HF-layout directory")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"engine.dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"engine.device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        for name in ("block_tokens", "num_blocks", "decode_bucket"):
            if getattr(self, name) < 1:
                raise ConfigError(f"engine.{name} must be >= 1, got {getattr(self, name)}")
        from engine.config import KERNEL_NAMES

        if self.kernels not in KERNEL_NAMES:
            raise ConfigError(f"engine.kernels must be one of {KERNEL_NAMES}, got {self.kernels!r}")
        if self.threads < 0 or self.prefill_chunk < 0:
            raise ConfigError("engine.threads and engine.prefill_chunk must be >= 0")
        if not 0.0 <= self.gpu_fraction <= 1.0:
            raise ConfigError(f"engine.gpu_fraction must be in 0..1, got {self.gpu_fraction}")
        if self.prefill_chunk % self.block_tokens:
            raise ConfigError(f"engine.prefill_chunk ({self.prefill_chunk}) must be a multiple "
                              f"of the block ({self.block_tokens} tokens)")

    def engine_config(self) -> Any:
        from engine import EngineConfig

        return EngineConfig(model=self.model, dtype=self.dtype, device=self.device,
                            block_tokens=self.block_tokens, num_blocks=self.num_blocks,
                            decode_bucket=self.decode_bucket, seed=self.seed,
                            prefill_chunk=self.prefill_chunk, kernels=self.kernels,
                            threads=self.threads, gpu_fraction=self.gpu_fraction)


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where an instance listens and whom it talks to."""

    host: str = "127.0.0.1"
    port: int = 0                       # 0: pick a free port
    node: str = "node-0"
    redis_url: str = ""                 # empty: do not register (single-process use)
    store_address: str = ""             # empty: no warehouse
    instance_id: str = ""               # empty: role-host-port
    advertise_host: str = ""            # what others dial; empty: host (hostname for 0.0.0.0)
    heartbeat_s: float = 1.0
    instance_ttl_s: float = 5.0
    call_timeout_s: float = 5.0         # deadline on every outgoing call
    drain_grace_s: float = 5.0
    metrics_port: int = -1              # -1: no /metrics endpoint; 0: a free port
    max_message_bytes: int = 256 * 2**20
    security: SecurityConfig | None = None  # mTLS + deployment secret; None: the environment
    health_port: int = -1               # plain-text health-only port (k8s probes); -1 off

    def __post_init__(self) -> None:
        if not (0 <= self.port <= 65535):
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        if not (-1 <= self.metrics_port <= 65535):
            raise ConfigError(
                f"metrics_port must be -1 (off) or in 0..65535, got {self.metrics_port}")
        if not _TENANT.match(self.node):
            raise ConfigError(f"node {self.node!r} must match [A-Za-z0-9._-]{{1,64}}")
        for name in ("heartbeat_s", "call_timeout_s"):
            _positive(name, getattr(self, name))
        if self.instance_ttl_s <= self.heartbeat_s:
            raise ConfigError("instance_ttl_s must exceed heartbeat_s")
        if self.drain_grace_s < 0:
            raise ConfigError("drain_grace_s must be >= 0")
        object.__setattr__(self, "max_message_bytes",
                           parse_size(self.max_message_bytes, "max_message_bytes"))
        if self.max_message_bytes < 4 * 2**20:
            raise ConfigError("max_message_bytes must be at least 4MiB")

    def security_for(self, role: str) -> SecurityConfig:
        """This process's credentials as ``role`` (from the environment when unset)."""
        if self.security is None:
            return SecurityConfig.from_env(role)
        return self.security.for_role(role) if self.security.role != role else self.security

    def dial_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        return socket.gethostname() if self.host in ("0.0.0.0", "::", "[::]") else self.host


@dataclass(frozen=True, slots=True)
class CostConfig:
    """Priors of the cost-aware fetch rule, replaced online by measurements."""

    tier_bandwidth_Bps: dict[str, float] = field(default_factory=lambda: {
        "G2": 2e9, "G3": 0.8e9, "G4": 0.2e9})
    tier_latency_s: dict[str, float] = field(default_factory=lambda: {
        "G2": 0.001, "G3": 0.003, "G4": 0.05})
    prefill_tokens_per_s: float = 1000.0
    ewma_alpha: float = 0.3             # weight of the newest measurement
    fetch_margin: float = 1.0           # fetch only when fetch_time * margin < recompute_time
    fetch_policy: str = "cost"          # "cost" | "always" | "never"

    def __post_init__(self) -> None:
        if set(self.tier_bandwidth_Bps) != set(self.tier_latency_s):
            raise ConfigError(
                "cost: tier_bandwidth_Bps and tier_latency_s must name the same tiers")
        for tier, bw in self.tier_bandwidth_Bps.items():
            _positive(f"cost.tier_bandwidth_Bps.{tier}", bw)
        for tier, lat in self.tier_latency_s.items():
            if lat < 0:
                raise ConfigError(f"cost.tier_latency_s.{tier} must be >= 0")
        _positive("cost.prefill_tokens_per_s", self.prefill_tokens_per_s)
        if not (0 < self.ewma_alpha <= 1):
            raise ConfigError("cost.ewma_alpha must be in (0, 1]")
        _positive("cost.fetch_margin", self.fetch_margin)
        if self.fetch_policy not in ("cost", "always", "never"):
            raise ConfigError(f"cost.fetch_policy {self.fetch_policy!r} is not one of "
                              "cost, always, never")


@dataclass(frozen=True, slots=True)
class WriterConfig:
    """Write-through of new full blocks to the warehouse, off the reply path."""

    enabled: bool = True
    retries: int = 3
    backoff_s: float = 0.1
    max_queue: int = 64                 # jobs waiting; more are dropped and counted

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ConfigError("writer.retries must be >= 0")
        _positive("writer.backoff_s", self.backoff_s)
        if self.max_queue < 1:
            raise ConfigError("writer.max_queue must be >= 1")


def engine_spec_from(cfg: KVServeConfig) -> EngineSpec:
    spec = EngineSpec(model=cfg.model.name, dtype=cfg.model.dtype, device=cfg.model.device,
                      block_tokens=cfg.blocks.block_tokens, threads=cfg.engine.threads,
                      kernels=cfg.engine.kernels, prefill_chunk=cfg.engine.prefill_chunk,
                      gpu_fraction=cfg.engine.gpu_fraction)
    if cfg.engine.g1_bytes:
        spec = replace(spec, num_blocks=num_blocks_for(cfg.engine.g1_bytes, spec))
    return spec


def block_nbytes_for(spec: EngineSpec) -> int:
    """Bytes of one KV block of ``spec``'s model (reads its config, not its weights)."""
    from engine.config import ModelConfig, named_configs
    from engine.kv_pool import KVLayout

    if spec.model in named_configs():
        mc = ModelConfig.from_name(spec.model)
    else:
        from pathlib import Path

        from engine.config import read_config
        from engine.fetch import KNOWN_MODELS, fetch_model

        mc = read_config(fetch_model(spec.model) if spec.model in KNOWN_MODELS
                         else Path(spec.model).expanduser())
    return KVLayout(mc.num_layers, mc.num_kv_heads, spec.block_tokens, mc.head_dim,
                    spec.dtype).block_nbytes


def num_blocks_for(g1_bytes: int, spec: EngineSpec) -> int:
    """The G1 budget as whole blocks of ``spec``'s layout (the budget is a cap:
    rounded down, but never below one block)."""
    return max(1, g1_bytes // block_nbytes_for(spec))


def endpoint_from(cfg: KVServeConfig, port: int) -> Endpoint:
    return Endpoint(host=cfg.ports.host, port=port, node=cfg.tiers.node,
                    redis_url=cfg.redis.effective_url(),
                    store_address=f"{cfg.ports.host}:{cfg.ports.kvstore}",
                    heartbeat_s=cfg.router.heartbeat_s, instance_ttl_s=cfg.router.instance_ttl_s)


def split_overrides(cfg: KVServeConfig, port: int, overrides: dict[str, Any],
                    target: type) -> dict[str, Any]:
    """Distribute flat overrides (CLI flags; None = not given) over the engine,
    endpoint, cost and top-level fields of ``target``."""
    given = {k: v for k, v in overrides.items() if v is not None}
    parts: dict[str, tuple[type, Any]] = {"engine": (EngineSpec, engine_spec_from(cfg)),
                                          "endpoint": (Endpoint, endpoint_from(cfg, port)),
                                          "cost": (CostConfig, CostConfig())}
    top_fields = set(target.__dataclass_fields__) - set(parts)
    out: dict[str, Any] = {}
    for name, (cls, base) in parts.items():
        mine = {k: v for k, v in given.items() if k in cls.__dataclass_fields__}
        out[name] = replace(base, **mine)
    out.update({k: v for k, v in given.items() if k in top_fields})
    known = top_fields.union(*(cls.__dataclass_fields__ for cls, _ in parts.values()))
    unknown = set(overrides) - known
    if unknown:
        raise ConfigError(f"unknown setting(s) {sorted(unknown)}")
    if "classes" in top_fields:
        out.setdefault("classes", cfg.classes)
    return out
