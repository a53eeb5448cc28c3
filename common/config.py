"""kvserve's configuration: one TOML file (the Kubernetes ConfigMap holds the
same file), loaded into slotted dataclasses validated at construction.

Components receive their own section explicitly; nothing reads the
environment below the entry point except ``REDIS_URL`` (docs/architecture.md,
"Redis").
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50}
_CLASS_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")

DAY_S = 86_400
ACK_MODES = ("g2", "durable")     # classes.ack values


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field.

    ``problems`` lists every bad field when a whole file was checked."""

    def __init__(self, message: str, problems: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.problems = problems or (message,)


# Field types as the TOML file may spell them: a field's annotation (a string
# under ``from __future__ import annotations``) -> (check, what to write).
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_TYPE_CHECKS: dict[str, tuple[Any, str]] = {
    "int": (_is_int, "an integer"),
    "float": (lambda v: _is_int(v) or isinstance(v, float), "a number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "dict[str, int]": (lambda v: isinstance(v, dict) and all(
        isinstance(k, str) and _is_int(x) for k, x in v.items()),
        "a table of name = integer"),
    "dict[str, int | str]": (lambda v: isinstance(v, dict) and all(
        isinstance(k, str) and (_is_int(x) or isinstance(x, str)) for k, x in v.items()),
        "a table of name = size (an integer or e.g. \"1GiB\")"),
}
_SIZE_CHECK = (lambda v: _is_int(v) or isinstance(v, str), "an integer or a size such as 4GiB")


def _type_problem(section: str, name: str, annotation: str, value: Any) -> str | None:
    """"section.name: expected ..., got ..." when ``value`` has the wrong type."""
    check, want = _SIZE_CHECK if name.endswith("_bytes") else _TYPE_CHECKS.get(
        annotation, (lambda v: True, annotation))
    if check(value):
        return None
    return f"{section}.{name}: expected {want}, got {type(value).__name__} {value!r}"


def parse_size(value: int | str, what: str = "size") -> int:
    """Bytes from an int or a string such as "4GiB" / "512MB" / "1000"."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ConfigError(f"{what} must be >= 0, got {value}")
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise ConfigError(f"{what}: cannot parse {value!r} (use e.g. 4GiB, 512MB, 1000)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


@dataclass(frozen=True, slots=True)
class HitRule:
    """The hit rule (docs/architecture.md): usable = floor_to_block(min(matched, L - reserve))."""

    block_tokens: int = 64
    window: int = 0                 # sliding-window size of SWA layers; 0 = full attention
    backtrack: int = 0              # tokens speculative decoding may unwind
    replay_keep_tokens: int = 140

    def __post_init__(self) -> None:
        if self.block_tokens < 1 or self.block_tokens > 4096:
            raise ConfigError(f"blocks.block_tokens must be in 1..4096, got {self.block_tokens}")
        if self.window < 0 or self.backtrack < 0:
            raise ConfigError("blocks.window and blocks.backtrack must be >= 0")
        if self.replay_keep_tokens < self.reserve:
            raise ConfigError(
                f"blocks.replay_keep_tokens ({self.replay_keep_tokens}) must be >= the "
                f"reserve window+backtrack ({self.reserve})")

    @property
    def reserve(self) -> int:
        # The last token must always be computed to produce logits.
        return max(1, self.window + self.backtrack)

    def usable_tokens(self, matched_tokens: int, prompt_tokens: int) -> int:
        limit = min(matched_tokens, prompt_tokens - self.reserve)
        if limit <= 0:
            return 0
        return limit - limit % self.block_tokens


@dataclass(frozen=True, slots=True)
class TrafficClasses:
    """TTL per traffic class; DeepSeek's production values by default."""

    ttl_s: dict[str, int] = field(default_factory=lambda: {"agent": 3 * DAY_S, "chat": 7 * DAY_S})
    default: str = "chat"
    # When a Put is acknowledged, per class (docs/services.md): "g2" once the blocks are
    # in host memory (default: a cache may lose the last writes in a crash), "durable"
    # once they are fsynced in G3 (G4 when there is no G3) and indexed there.
    ack: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.ttl_s:
            raise ConfigError("classes.ttl_s must name at least one class")
        for name, ttl in self.ttl_s.items():
            if not _CLASS_NAME.match(name):
                raise ConfigError(f"classes.ttl_s: bad class name {name!r} (want [a-z][a-z0-9_-]*)")
            if not isinstance(ttl, int) or ttl <= 0:
                raise ConfigError(f"classes.ttl_s.{name} must be a positive integer of seconds")
        if self.default not in self.ttl_s:
            raise ConfigError(
                f"classes.default {self.default!r} is not a class; "
                f"choose one of {sorted(self.ttl_s)}")
        if not isinstance(self.ack, dict):
            raise ConfigError("classes.ack must be a table of class = \"g2\" | \"durable\"")
        for name, mode in self.ack.items():
            if name not in self.ttl_s:
                raise ConfigError(f"classes.ack.{name}: not a class; known: {sorted(self.ttl_s)}")
            if mode not in ACK_MODES:
                raise ConfigError(f"classes.ack.{name} must be one of {list(ACK_MODES)}, "
                                  f"got {mode!r}")

    def resolve(self, name: str) -> str:
        """The class a request belongs to: its own if known, else an error."""
        if not name:
            return self.default
        if name not in self.ttl_s:
            raise ConfigError(f"unknown traffic class {name!r}; known: {sorted(self.ttl_s)}")
        return name

    def ttl(self, name: str) -> int:
        return self.ttl_s[self.resolve(name)]

    def ack_mode(self, name: str) -> str:
        """"g2" or "durable": when a Put of this class is acknowledged."""
        return self.ack.get(self.resolve(name), "g2")

    @property
    def any_durable(self) -> bool:
        return "durable" in self.ack.values()


@dataclass(frozen=True, slots=True)
class TierConfig:
    g2_bytes: int = 2 * 2**30
    g3_path: str = ""               # empty: no disk tier
    g3_bytes: int = 20 * 2**30
    g4_url: str = ""                # fsspec URL; empty: no object tier
    lz4: bool = False
    eviction_policy: str = "lru"
    node: str = "node-0"

    def __post_init__(self) -> None:
        for name in ("g2_bytes", "g3_bytes"):
            object.__setattr__(self, name, parse_size(getattr(self, name), f"tiers.{name}"))
        if not re.match(r"^[A-Za-z0-9._-]{1,64}$", self.node):
            raise ConfigError(f"tiers.node {self.node!r} must match [A-Za-z0-9._-]{{1,64}}")


QUOTA_TIERS = ("G2", "G3", "G4")
ALL_TENANTS = "*"                   # a [quotas] table's entry for every tenant not listed
_TENANT_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


@dataclass(frozen=True, slots=True)
class QuotaSection:
    """Per-tenant byte quotas per tier (docs/operators.md, "Per-tenant quotas"): per
    tier a table of tenant = size, ``"*"`` for every tenant not listed; a tenant
    with no entry (and no ``"*"``) has no limit. Operators change them at run time
    (``kvserve store quota``); those settings live in Redis and win over these.
    ``max_tenants`` bounds the tenant-name table (every name that ever stored a
    block keeps an id in Redis): a new name beyond it is refused."""

    g2: dict[str, int | str] = field(default_factory=dict)
    g3: dict[str, int | str] = field(default_factory=dict)
    g4: dict[str, int | str] = field(default_factory=dict)
    max_tenants: int = 4096
    refresh_s: float = 10.0         # how often a store picks up other nodes' quota changes

    def __post_init__(self) -> None:
        for tier in ("g2", "g3", "g4"):
            table = getattr(self, tier)
            parsed: dict[str, int | str] = {}
            for name, value in table.items():
                if name != ALL_TENANTS and not _TENANT_NAME.match(name):
                    raise ConfigError(f"quotas.{tier}: {name!r} is not a tenant name "
                                      "([A-Za-z0-9._-]{1,64}) nor \"*\"")
                parsed[name] = parse_size(value, f"quotas.{tier}.{name}")
            object.__setattr__(self, tier, parsed)
        if not 1 <= self.max_tenants <= 2**32:
            raise ConfigError(f"quotas.max_tenants must be in 1..2^32, got {self.max_tenants}")
        if self.refresh_s <= 0:
            raise ConfigError(f"quotas.refresh_s must be > 0, got {self.refresh_s}")

    def table(self, tier: str) -> dict[str, int]:
        """Tenant (or "*") -> bytes for tier "G2" | "G3" | "G4"."""
        return {k: int(v) for k, v in getattr(self, tier.lower()).items()}


@dataclass(frozen=True, slots=True)
class ModelSection:
    name: str = "smollm2"           # a named model/config or a path to an HF-layout directory
    dtype: str = "float32"
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(
                f"model.dtype must be float32, bfloat16 or float16, got {self.dtype!r}")


@dataclass(frozen=True, slots=True)
class RedisSection:
    url: str = ""                   # empty: start the embedded server (REDIS_URL overrides)
    url_file: str = ""              # a file (0600) holding a URL with credentials

    def __post_init__(self) -> None:
        # A config file is not a secret (a Kubernetes ConfigMap, a 0644 file):
        # credentials belong in url_file (security.flags.redis_url_from).
        from urllib.parse import urlsplit

        try:
            password = urlsplit(self.url).password
        except ValueError:
            raise ConfigError("redis.url is not a URL") from None
        if password:
            raise ConfigError("redis.url carries a password, and config files are not secret: "
                              "put the URL in a file (chmod 600) and name it in "
                              "redis.url_file")

    def effective_url(self) -> str:
        """REDIS_URL or ``url`` (no file read here: entry points call
        ``security.flags.redis_url_from``, which also reads ``url_file``)."""
        return os.environ.get("REDIS_URL", self.url)


@dataclass(frozen=True, slots=True)
class RouterSection:
    policy: str = "cache_aware"
    heartbeat_s: float = 1.0
    instance_ttl_s: float = 5.0
    # A prompt whose prefix a decode instance holds (its previous turn was decoded there)
    # and that leaves at most this many tokens to compute goes to that instance with no
    # prefill hop (cache-aware policies only; 0: always prefill). docs/services.md,
    # "A short tail on decode".
    local_tail_tokens: int = 512
    # A prompt of at most this many tokens that no instance holds goes to the least loaded
    # decode instance with no prefill hop: computing it there costs about one decode step,
    # where the hop costs a prefill queue and a hand-off (0: always prefill).
    # docs/services.md, "A short prompt on decode".
    local_cold_tokens: int = 256

    def __post_init__(self) -> None:
        if self.heartbeat_s <= 0 or self.instance_ttl_s <= self.heartbeat_s:
            raise ConfigError("router.instance_ttl_s must exceed router.heartbeat_s > 0")
        if self.local_tail_tokens < 0:
            raise ConfigError("router.local_tail_tokens must be >= 0 (0: always prefill)")
        if self.local_cold_tokens < 0:
            raise ConfigError("router.local_cold_tokens must be >= 0 (0: always prefill)")


PREFILL_POLICIES = ("fcfs", "src")    # prefill_svc/policy.py registers each
PREFILL_AGING = ("share", "strict")   # prefill_svc/policy.py registers each


@dataclass(frozen=True, slots=True)
class PrefillSection:
    """Batching and scheduling of the prefill service (prefill_svc/scheduler.py):
    one loop, a token budget per step, a bounded waiting queue, an ordering
    policy. ``src`` (shortest remaining compute: prompt minus cached tokens)
    lets a returning agent turn pass cold prompts; requests that have waited
    ``max_delay_s`` go first (aging ``strict``: the whole step, oldest first;
    ``share``: one share of each step per aged request, so none holds a whole
    step)."""

    policy: str = "src"
    step_tokens: int = 512          # tokens computed per step, over every running prompt
    solo_step_tokens: int = 2048    # the step of a prompt computing alone, nothing waiting
                                    # (fewer passes over the weights); 0 = step_tokens
    max_running: int = 16           # prompts being computed at once (each holds its KV)
    max_waiting: int = 64           # requests waiting; more -> RESOURCE_EXHAUSTED
    max_waiting_tokens: int = 131_072   # tokens to compute waiting; more -> RESOURCE_EXHAUSTED
    max_delay_s: float = 10.0       # after this wait a request takes a share of each step first
    aging: str = "strict"           # strict: the aged take the whole step; share: one share each
    resident_s: float = 0.5         # a finished prompt stays in the engine this long for a
                                    # tail pull, then its whole KV is copied to the host buffer
    copy_yield_s: float = 2.0       # on a CPU, a finished prompt's bulk copies (decode's pull,
                                    # the write-through) wait up to this long for a step in
                                    # flight that completes prompts to end; 0 = never

    def __post_init__(self) -> None:
        if self.policy not in PREFILL_POLICIES:
            raise ConfigError(f"prefill.policy must be one of {list(PREFILL_POLICIES)}, "
                              f"got {self.policy!r}")
        for name in ("step_tokens", "max_running", "max_waiting", "max_waiting_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"prefill.{name} must be >= 1, got {getattr(self, name)}")
        if self.solo_step_tokens < 0:
            raise ConfigError(f"prefill.solo_step_tokens must be >= 0, got "
                              f"{self.solo_step_tokens}")
        if self.aging not in PREFILL_AGING:
            raise ConfigError(f"prefill.aging must be one of {list(PREFILL_AGING)}, "
                              f"got {self.aging!r}")
        if not self.max_delay_s >= 0:
            raise ConfigError(f"prefill.max_delay_s must be >= 0, got {self.max_delay_s}")
        if not self.resident_s >= 0:
            raise ConfigError(f"prefill.resident_s must be >= 0, got {self.resident_s}")
        if not self.copy_yield_s >= 0:
            raise ConfigError(f"prefill.copy_yield_s must be >= 0, got {self.copy_yield_s}")


@dataclass(frozen=True, slots=True)
class AdmissionSection:
    """The router's one admission layer (docs/router.md, "Admission"): per-tenant
    fair queues with a bounded wait, per-API-key rate and concurrency limits,
    429 + Retry-After for backpressure. Every decision is taken before any
    instance does work for the request."""

    max_queue_wait_s: float = 60.0    # the queue-wait SLO: refused up front when the wait
                                      # it would see exceeds it, 429 if still queued at it
    request_timeout_s: float = 3600.0  # end-to-end budget of an admitted request, sent to the
                                       # services as gRPC deadlines (no per-hop timers)
    max_queued: int = 1024            # requests waiting in all queues together
    prefill_depth: int = 16           # requests at once in prefill, per live prefill instance
    prefill_tokens: int = 16384       # their prompt tokens, per live prefill instance (one
                                      # request always passes an empty stage, however long)
    decode_slots: int = 128           # requests at once in service, per live decode instance
                                      # (decode's max_seqs + max_waiting)
    key_rate_per_s: float = 0.0       # per API key: token-bucket rate (0 = no rate limit)
    key_burst: int = 0                # per API key: bucket size (0 = max(1, rate))
    key_max_concurrency: int = 0      # per API key: requests in service at once (0 = no limit)
    key_max_queued: int = 256         # per API key: requests waiting at once
    fair_quantum_tokens: int = 2048   # prompt tokens a tenant may send per fair-queue round

    def __post_init__(self) -> None:
        for name in ("max_queue_wait_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"admission.{name} must be > 0, got {getattr(self, name)}")
        if self.request_timeout_s < self.max_queue_wait_s:
            raise ConfigError("admission.request_timeout_s must be >= max_queue_wait_s (the "
                              "budget includes the wait)")
        if self.key_rate_per_s < 0:
            raise ConfigError(f"admission.key_rate_per_s must be >= 0, got {self.key_rate_per_s}")
        for name in ("max_queued", "prefill_depth", "prefill_tokens", "decode_slots",
                     "key_max_queued", "fair_quantum_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"admission.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("key_burst", "key_max_concurrency"):
            if getattr(self, name) < 0:
                raise ConfigError(f"admission.{name} must be >= 0 (0 = off), "
                                  f"got {getattr(self, name)}")

    @property
    def burst(self) -> int:
        return self.key_burst or max(1, int(self.key_rate_per_s))


@dataclass(frozen=True, slots=True)
class Ports:
    host: str = "127.0.0.1"
    kvstore: int = 50051
    prefill: int = 50052
    decode: int = 50053
    router_grpc: int = 50054
    http: int = 8000
    metrics: int = 9100

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name != "host" and not (0 <= v <= 65535):
                raise ConfigError(f"ports.{f.name} must be in 0..65535, got {v}")


GPU_SHARES = ("time", "mps")


@dataclass(frozen=True, slots=True)
class EngineSection:
    """The engines ``kvserve up`` runs: how many of each role, and the G1 budget
    (each engine's own KV pool, the knob that decides how much of a returning
    session it still holds locally; same meaning as vLLM's KV-cache size).

    ``g1_bytes`` is per engine instance and becomes ``num_blocks`` once the
    model's block size is known (``service.config.num_blocks_for``); 0 keeps
    the services' default. ``threads``: torch CPU threads per engine; 0 lets
    ``kvserve up`` split the cores when it runs more than one engine per role."""

    g1_bytes: int = 0
    prefill: int = 1
    decode: int = 1
    threads: int = 0
    # Decode's pool holds running sequences only (its prompts come from prefill), so a
    # deployment may size it by concurrency x context instead: 0 = g1_bytes.
    decode_g1_bytes: int = 0
    # The engines' kernel family (engine/kernels.py, checked where the engine is known)
    # and prefill chunk in tokens (0: the engine's default, one block with
    # non-invariant kernels). A GPU needs chunks of hundreds of tokens to fill its
    # matrix units; with non-invariant kernels the chunk is part of the fingerprint and
    # restores are cut to it, so prefill and decode read it from this one section.
    kernels: str = "auto"
    prefill_chunk: int = 0
    # CUDA: each prefill engine's share of the GPU's memory (its allocator's cap) and
    # each decode engine's (0: gpu_fraction); 0 and 0: no caps. The engines of one
    # stack share the [model] device, so the shares must add up to at most 1: each
    # process keeps whatever it once held in torch's cache, and without a split one
    # engine's peak starved the other (issue 18 run 4: decode OOM beside prefill).
    gpu_fraction: float = 0.0
    decode_gpu_fraction: float = 0.0
    # CUDA: how the engines' processes share the one GPU (kvserve/gpu_share.py). "time":
    # the driver time-slices their contexts, so neither computes while the other holds
    # the GPU (issue 18 run 17: prefill's steps at 0.28x their speed alone). "mps": `up`
    # starts a private CUDA MPS daemon and the engines' kernels run side by side. The
    # SM percents (MPS only; 0: all SMs) cap each role's share of the multiprocessors.
    gpu_share: str = "time"
    prefill_sm_percent: int = 0
    decode_sm_percent: int = 0

    @property
    def decode_fraction(self) -> float:
        return self.decode_gpu_fraction or self.gpu_fraction

    def __post_init__(self) -> None:
        for name in ("gpu_fraction", "decode_gpu_fraction"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ConfigError(f"engine.{name} must be in 0..1 (0: no cap), got {v}")
        split = self.prefill * self.gpu_fraction + self.decode * self.decode_fraction
        if split > 1.0 + 1e-9:
            raise ConfigError(
                f"engine GPU shares add up to {split:.3g} of the device ({self.prefill} "
                f"prefill x {self.gpu_fraction} + {self.decode} decode x "
                f"{self.decode_fraction}); they must add up to at most 1")
        for name in ("g1_bytes", "decode_g1_bytes"):
            object.__setattr__(self, name, parse_size(getattr(self, name), f"engine.{name}"))
        for name in ("prefill", "decode"):
            n = getattr(self, name)
            if not 1 <= n <= 64:
                raise ConfigError(f"engine.{name} (instances) must be in 1..64, got {n}")
        if not 0 <= self.threads <= 1024:
            raise ConfigError(f"engine.threads must be in 0..1024, got {self.threads}")
        if not 0 <= self.prefill_chunk <= 65_536:
            raise ConfigError(f"engine.prefill_chunk must be in 0..65536, got "
                              f"{self.prefill_chunk}")
        if self.gpu_share not in GPU_SHARES:
            raise ConfigError(f"engine.gpu_share must be one of {', '.join(GPU_SHARES)}, got "
                              f"{self.gpu_share!r}")
        for name in ("prefill_sm_percent", "decode_sm_percent"):
            v = getattr(self, name)
            if not 0 <= v <= 100:
                raise ConfigError(f"engine.{name} must be in 0..100 (0: all SMs), got {v}")
            if v and self.gpu_share != "mps":
                raise ConfigError(f"engine.{name} needs engine.gpu_share = \"mps\" (time "
                                  f"slicing gives each process every SM in turn)")
        if not re.match(r"^[a-z][a-z0-9_]{0,31}$", self.kernels):
            raise ConfigError(f"engine.kernels must name a kernel family, got {self.kernels!r}")


_SPAN = re.compile(r"^(\d+(?:\.\d+)?(?:e\d+)?)([a-zA-Z]*)$")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": DAY_S, "w": 7 * DAY_S}
_TOKENS = {"": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9}


def _number_list(text: str, units: dict[str, int], what: str) -> tuple[float, ...]:
    """``"1h,3d,inf"`` -> (3600.0, 259200.0, inf); "inf" = unlimited."""
    out: list[float] = []
    for item in (x.strip() for x in text.split(",")):
        m = _SPAN.match(item)
        if item == "inf":
            out.append(float("inf"))
        elif m and m.group(2) in units and float(m.group(1)) > 0:
            out.append(float(m.group(1)) * units[m.group(2)])
        else:
            raise ConfigError(f"{what}: cannot parse {item!r} (e.g. {_EXAMPLES[what]})")
    if len(out) > 32:
        raise ConfigError(f"{what}: at most 32 values (each is a series in /metrics)")
    return tuple(out)


_EXAMPLES = {"whatif.ttls": "\"10m,1h,1d,3d,7d,inf\"", "whatif.capacities": "\"50M,1G,inf\""}


@dataclass(frozen=True, slots=True)
class WhatIfSection:
    """The TTLs and capacities (tokens) whose predicted hit rates the store
    exports in /metrics (docs/operators.md, "The live what-if in /metrics")."""

    ttls: str = "10m,1h,1d,3d,7d,inf"
    capacities: str = "inf"

    def __post_init__(self) -> None:
        self.ttl_values()
        self.capacity_values()

    def ttl_values(self) -> tuple[float, ...]:
        return _number_list(self.ttls, _SECONDS, "whatif.ttls")

    def capacity_values(self) -> tuple[float, ...]:
        return _number_list(self.capacities, _TOKENS, "whatif.capacities")


_SECTIONS: dict[str, type] = {
    "model": ModelSection,
    "blocks": HitRule,
    "classes": TrafficClasses,
    "tiers": TierConfig,
    "quotas": QuotaSection,
    "redis": RedisSection,
    "router": RouterSection,
    "admission": AdmissionSection,
    "ports": Ports,
    "prefill": PrefillSection,
    "engine": EngineSection,
    "whatif": WhatIfSection,
}


@dataclass(frozen=True, slots=True)
class KVServeConfig:
    model: ModelSection = field(default_factory=ModelSection)
    blocks: HitRule = field(default_factory=HitRule)
    classes: TrafficClasses = field(default_factory=TrafficClasses)
    tiers: TierConfig = field(default_factory=TierConfig)
    quotas: QuotaSection = field(default_factory=QuotaSection)
    redis: RedisSection = field(default_factory=RedisSection)
    router: RouterSection = field(default_factory=RouterSection)
    admission: AdmissionSection = field(default_factory=AdmissionSection)
    ports: Ports = field(default_factory=Ports)
    prefill: PrefillSection = field(default_factory=PrefillSection)
    engine: EngineSection = field(default_factory=EngineSection)
    whatif: WhatIfSection = field(default_factory=WhatIfSection)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVServeConfig:
        built: dict[str, Any] = {}
        problems: list[str] = []        # every bad field, not just the first
        unknown = set(data) - set(_SECTIONS)
        if unknown:
            problems.append(f"unknown config section(s) {sorted(unknown)}; "
                            f"known: {sorted(_SECTIONS)}")
        for name, section_cls in _SECTIONS.items():
            raw = data.get(name, {})
            if not isinstance(raw, dict):
                problems.append(f"[{name}] must be a table, got {type(raw).__name__}")
                continue
            types = {f.name: str(f.type) for f in fields(section_cls)}
            extra = set(raw) - set(types)
            if extra:
                problems.append(f"[{name}] has unknown key(s) {sorted(extra)}; "
                                f"known: {sorted(types)}")
            bad = [p for k, v in raw.items() if k in types
                   if (p := _type_problem(name, k, types[k], v))]
            problems.extend(bad)
            if extra or bad:
                continue
            try:
                built[name] = section_cls(**raw)
            except ConfigError as exc:
                problems.append(str(exc))
        if problems:
            head = "1 problem" if len(problems) == 1 else f"{len(problems)} problems"
            raise ConfigError(f"{head} in the config:\n  " + "\n  ".join(problems),
                              tuple(problems))
        return cls(**built)

    @classmethod
    def load(cls, path: str | Path) -> KVServeConfig:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError as exc:
            raise ConfigError(f"config file {p} does not exist") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {p} is not valid TOML: {exc}") from exc
        return cls.from_dict(data)
