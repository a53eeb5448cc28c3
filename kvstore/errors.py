"""Errors the warehouse raises; the service maps each class to one gRPC
status code in one table (kvstore/service.py)."""

from __future__ import annotations


class KVStoreError(Exception):
    """Base of every warehouse error."""


class InvalidRequest(KVStoreError, ValueError):
    """The caller sent something malformed; the message names the problem."""


class PayloadTooLarge(InvalidRequest):
    """A block or a request exceeds the configured limits."""


class ResourceExhausted(KVStoreError):
    """A bounded resource is used up right now (the Put byte budget, a caller's
    share of the staging pool, the tenant-name table): RESOURCE_EXHAUSTED, with
    ``retry_after_s`` when waiting may help (0: it will not, change the request)."""

    def __init__(self, message: str, retry_after_s: float = 0.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class StoreUnavailable(KVStoreError):
    """A backing service (Redis, a tier) cannot be reached right now."""


class StoreDraining(KVStoreError):
    """The store is shutting down and refuses new work."""


class ShmUnavailable(KVStoreError):
    """The shared-memory path cannot be used (segment not attachable here);
    the client falls back to streaming bytes."""


class AccessDenied(KVStoreError):
    """The store refused the caller (UNAUTHENTICATED / PERMISSION_DENIED):
    e.g. a tenant-scoped identity asking for another tenant's blocks."""
