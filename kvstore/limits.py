"""The kvstore server's limits (docs/security.md, "Integrity at rest and quotas"):
message and request sizes, concurrent RPCs, and the Put byte budget.

- Sizes a request *announces* that are simply too large for any store are the
  caller's error (INVALID_ARGUMENT, ``max_*``).
- Resources shared by every caller answer RESOURCE_EXHAUSTED when used up,
  decided before any work: gRPC refuses calls beyond ``max_concurrent_rpcs``;
  a Put reserves its announced bytes from ``put_budget_bytes`` when its header
  arrives, before one payload byte is received or allocated, and is refused
  when they do not fit (with ``retry-after-ms`` when waiting can help); a
  caller's staging segments are held to its share of the staging pool
  (kvstore.segments).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from common.config import ConfigError
from common.grpc_keepalive import server_keepalive
from kvstore.errors import ResourceExhausted

# A Put's budget share frees in about one store round (a 128 MiB put takes ~0.1 s).
PUT_RETRY_AFTER_S = 0.1


@dataclass(frozen=True, slots=True)
class ServiceLimits:
    """Application limits. gRPC's own message limit is set to twice
    ``max_message_bytes`` so that a merely oversized message gets our explanation
    (INVALID_ARGUMENT) rather than gRPC's RESOURCE_EXHAUSTED."""

    max_message_bytes: int = 64 * 2**20
    max_block_bytes: int = 256 * 2**20
    max_put_bytes: int = 4 * 2**30
    max_keys: int = 1 << 17
    get_chunk_bytes: int = 4 * 2**20
    max_staging_bytes: int = 8 * 2**30      # all same-host Put staging segments together
    staging_share: float = 0.25             # of max_staging_bytes, per calling identity
    put_budget_bytes: int = 2**30           # Put payload bytes in flight, all callers
    max_concurrent_rpcs: int = 1024

    def __post_init__(self) -> None:
        if min(self.max_message_bytes, self.max_block_bytes, self.max_put_bytes,
               self.max_keys, self.get_chunk_bytes, self.max_staging_bytes,
               self.put_budget_bytes, self.max_concurrent_rpcs) < 1:
            raise ConfigError("service limits must be positive")
        if self.get_chunk_bytes > self.max_message_bytes - 4096:
            raise ConfigError("get_chunk_bytes must leave room for a header in max_message_bytes")
        if not 0 < self.staging_share <= 1:
            raise ConfigError(f"staging_share must be in (0, 1], got {self.staging_share}")

    def grpc_options(self) -> list[tuple[str, int]]:
        transport = min(2 * self.max_message_bytes, 2**31 - 1)
        return [("grpc.max_receive_message_length", transport),
                ("grpc.max_send_message_length", transport),
                ("grpc.so_reuseport", 0),       # a taken port fails the bind, never shares it
                *server_keepalive()]


class PutBudget:
    """Payload bytes of the Puts being received and stored right now. Used from the
    event loop only (the service's handlers), so it needs no lock."""

    __slots__ = ("in_flight", "limit", "refused")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0
        self.refused = 0

    @contextlib.contextmanager
    def hold(self, nbytes: int) -> Iterator[None]:
        """Reserve ``nbytes`` for the duration of a Put, or raise ResourceExhausted."""
        if nbytes > self.limit:
            self.refused += 1
            raise ResourceExhausted(f"a Put of {nbytes} bytes exceeds this store's Put budget "
                                    f"of {self.limit} bytes; split it into smaller Puts")
        if self.in_flight + nbytes > self.limit:
            self.refused += 1
            raise ResourceExhausted(
                f"{self.in_flight} bytes of Puts are in flight; {nbytes} more exceed this "
                f"store's Put budget of {self.limit} bytes; retry shortly",
                retry_after_s=PUT_RETRY_AFTER_S)
        self.in_flight += nbytes
        try:
            yield
        finally:
            self.in_flight -= nbytes


__all__ = ["PUT_RETRY_AFTER_S", "PutBudget", "ServiceLimits"]
