"""``ConnectorConfig``: what ``--kv-transfer-config``'s ``kv_connector_extra_config``
may say to ``connectors.vllm.KVServeConnector`` (docs/vllm.md lists every field).

Built once per connector instance (scheduler and each worker read the same
dict), validated at construction; an unknown key is an error naming the known
ones, so a typo does not silently fall back to a default.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any

from common.config import ConfigError, HitRule, TrafficClasses
from security.redact import has_credentials
from security.secret_files import check_url_secret, read_secret_text

_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    store: str = "127.0.0.1:50051"       # kvstore gRPC address
    redis_url: str = ""                  # registry + KV events; "" = no registration
    redis_url_file: str = ""             # ... or a 0600 file with it (and its password),
                                         # which keeps the password out of vLLM's argv
    instance_id: str = ""                # "" = vllm-<host>-<vLLM engine id>
    advertise: str = ""                  # this vLLM's OpenAI base URL, for the router
    node: str = "node-0"                 # the node its kvstore serves (G2/G3 locality)
    block_tokens: int = 64               # must equal vLLM's --block-size and the store's
    window: int = 0                      # hybrid SWA: the hit rule's reserve ...
    backtrack: int = 0                   # ... is window + backtrack (at least 1)
    default_class: str = "chat"
    classes: tuple[str, ...] = ("agent", "chat")
    lookup_timeout_s: float = 0.5        # on the scheduler's critical path
    get_timeout_s: float = 10.0
    put_timeout_s: float = 30.0
    retry_after_s: float = 1.0           # after a store failure, skip it this long
    use_shm: bool = True                 # same-host shared-memory fast path
    load: bool = True                    # restore from the warehouse
    load_async: bool = True              # vLLM's load_kv_async: others run while blocks move
    save: bool = True                    # write computed prompt blocks to it
    secret_file: str = ""                # deployment secret (keys tenant salts); see security/
    tls_dir: str = ""                    # mTLS identity (role "engine"); "" = KVSERVE_TLS_DIR
    insecure: bool = False               # plain text to the kvstore (says so in the log)
    heartbeat_s: float = 1.0
    instance_ttl_s: float = 5.0
    local_blocks: int = 0                # G1 events: 0 = vLLM's block count
    hit_rule: HitRule = field(init=False)

    def __post_init__(self) -> None:
        if self.redis_url and self.redis_url_file:
            raise ConfigError("set redis_url or redis_url_file, not both")
        if self.block_tokens < 1:
            raise ConfigError(f"block_tokens must be >= 1, got {self.block_tokens}")
        object.__setattr__(self, "hit_rule", HitRule(
            block_tokens=self.block_tokens, window=self.window, backtrack=self.backtrack,
            replay_keep_tokens=max(140, self.window + self.backtrack)))
        if self.instance_id and not _ID.match(self.instance_id):
            raise ConfigError(f"instance_id {self.instance_id!r} must match {_ID.pattern}")
        if not self.classes or self.default_class not in self.classes:
            raise ConfigError(f"default_class {self.default_class!r} must be one of the "
                              f"classes {list(self.classes)}")
        for name in ("lookup_timeout_s", "get_timeout_s", "put_timeout_s", "heartbeat_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.instance_ttl_s <= self.heartbeat_s:
            raise ConfigError("instance_ttl_s must exceed heartbeat_s")
        if self.retry_after_s < 0 or self.local_blocks < 0:
            raise ConfigError("retry_after_s and local_blocks must be >= 0")
        if has_credentials(self.redis_url):
            # vLLM's --kv-transfer-config is on its command line (world-readable).
            raise ConfigError("redis_url carries a password; vLLM's command line is readable "
                              "by every local user: name a 0600 file in redis_url_file")

    def registry_url(self) -> str:
        """The Redis URL (from ``redis_url_file`` when given); "" = no registration."""
        if self.redis_url_file:
            return check_url_secret(read_secret_text(self.redis_url_file, "redis_url_file"),
                                    "redis_url_file")
        return self.redis_url

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        raw = dict(extra or {})
        known = {f.name for f in fields(cls) if f.init}
        unknown = set(raw) - known
        if unknown:
            raise ConfigError(f"kv_connector_extra_config has unknown key(s) {sorted(unknown)}; "
                              f"known: {sorted(known)}")
        if "classes" in raw:
            raw["classes"] = tuple(raw["classes"])
        try:
            return cls(**raw)
        except TypeError as exc:
            raise ConfigError(f"kv_connector_extra_config: {exc}") from exc

    def security(self) -> Any:
        """The kvstore client's credentials (security.config.SecurityConfig)."""
        from security.config import SecurityConfig

        return SecurityConfig.from_flags(tls_dir=self.tls_dir, insecure=self.insecure,
                                         role="engine", secret_file=self.secret_file)

    def traffic_classes(self) -> TrafficClasses:
        # TTLs live in the store; here only the names matter.
        return TrafficClasses(ttl_s=dict.fromkeys(self.classes, 1), default=self.default_class)
