"""Who may call what: one server interceptor per gRPC server.

``AuthInterceptor`` reads the caller's identity from its verified client
certificate (the TLS handshake already refused anyone without a certificate
of this deployment's CA), answers UNAUTHENTICATED when the certificate names
no kvserve identity and PERMISSION_DENIED when the identity's role may not call
the method (the per-role table in security.methods; unlisted methods are for
operators), in this one place. Handlers then read ``current_identity()`` and
ask ``acting_tenant`` which tenant the call may touch.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Awaitable, Callable
from functools import lru_cache
from typing import Any

import grpc

from security.identity import INSECURE, TENANT_METADATA, Identity, identity_from_uris
from security.methods import HEALTH_METHODS, callers_of, may_call

DEFAULT_TENANT = "default"


class AuthError(Exception):
    """Base of the two refusals below; servers map them with ``auth_status``."""


class Unauthenticated(AuthError):
    pass


class PermissionDenied(AuthError):
    pass


def auth_status(exc: BaseException) -> grpc.StatusCode | None:
    if isinstance(exc, Unauthenticated):
        return grpc.StatusCode.UNAUTHENTICATED
    if isinstance(exc, PermissionDenied):
        return grpc.StatusCode.PERMISSION_DENIED
    return None


_CURRENT: contextvars.ContextVar[Identity | None] = contextvars.ContextVar(
    "kvserve_identity", default=None)
_TENANT_OVERRIDE: contextvars.ContextVar[str] = contextvars.ContextVar(
    "kvserve_acting_tenant", default="")


def current_identity() -> Identity:
    """The caller of the RPC being handled (set by ``AuthInterceptor``)."""
    ident = _CURRENT.get()
    if ident is None:
        raise Unauthenticated("no authenticated caller (server built without AuthInterceptor)")
    return ident


def acting_tenant(requested: str) -> str:
    """The tenant this call may touch. A tenant-scoped identity always gets its
    own tenant and is refused if it names another; a service gets what it
    names (the request's tenant, or the ``x-kvserve-tenant`` metadata it sent)."""
    ident = current_identity()
    override = _TENANT_OVERRIDE.get()
    if ident.tenant:
        for claim in (override, requested):
            if claim and claim != ident.tenant:
                raise PermissionDenied(f"{ident.describe()} may not act for tenant {claim!r}")
        return ident.tenant
    if ident.is_service or ident.is_operator or ident.insecure:
        return override or requested or DEFAULT_TENANT
    raise PermissionDenied(f"{ident.describe()} may not act for tenants")


@lru_cache(maxsize=4096)
def _identity_of(uris: tuple[bytes, ...], cn: bytes) -> Identity | None:
    return identity_from_uris([u.decode(errors="replace") for u in uris],
                              cn.decode(errors="replace"))


def peer_identity(context: Any) -> Identity:
    """The identity in the verified peer certificate; Unauthenticated if none."""
    auth = context.auth_context() or {}
    uris = tuple(auth.get("x509_subject_alternative_name", ()))
    cn = (auth.get("x509_common_name") or [b""])[0]
    ident = _identity_of(uris, cn) if uris else None
    if ident is None:
        raise Unauthenticated("the caller presented no kvserve identity (a client certificate "
                              "issued by this deployment's CA with a urn:kvserve:role: SAN)")
    return ident


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks every call against the per-role method table (security.methods).
    ``insecure``: every caller is ``INSECURE`` (plain-text mode)."""

    def __init__(self, *, insecure: bool = False) -> None:
        self.insecure = insecure

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        tenant = ""
        for key, value in details.invocation_metadata or ():
            if key == TENANT_METADATA:
                tenant = value if isinstance(value, str) else value.decode(errors="replace")
        return _wrap(handler, lambda ctx: self._admit(ctx, details.method), tenant)

    def _admit(self, context: Any, method: str) -> Identity:
        ident = INSECURE if self.insecure else peer_identity(context)
        if not (ident.insecure or may_call(ident.role, method, scoped=bool(ident.tenant))):
            scope = " (tenant-scoped identities: only their tenant's calls)" if ident.tenant \
                else ""
            raise PermissionDenied(f"{ident.describe()} may not call {method[:120]} (allowed: "
                                   f"{', '.join(callers_of(method))}){scope}")
        return ident


def _wrap(handler: grpc.RpcMethodHandler, admit: Callable[[Any], Identity],
          tenant: str) -> grpc.RpcMethodHandler:
    async def enter(context: Any) -> list[contextvars.Token[Any]] | None:
        try:
            ident = admit(context)
        except AuthError as exc:
            await context.abort(auth_status(exc), str(exc))
            return None
        return [_CURRENT.set(ident), _TENANT_OVERRIDE.set(tenant)]

    def leave(tokens: list[contextvars.Token[Any]]) -> None:
        # A cancelled stream's generator is closed by grpc from another task, whose
        # Context never held these values: nothing to undo there (reset would raise).
        with contextlib.suppress(ValueError):
            _TENANT_OVERRIDE.reset(tokens[1])
            _CURRENT.reset(tokens[0])

    def unary_response(behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def call(request: Any, context: Any) -> Any:
            tokens = await enter(context)
            try:
                res = behavior(request, context)
                return await res if inspect.isawaitable(res) else res
            finally:
                if tokens:
                    leave(tokens)
        return call

    def stream_response(behavior: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(behavior):
            async def gen(request: Any, context: Any) -> Any:
                tokens = await enter(context)
                try:
                    async for item in behavior(request, context):
                        yield item
                finally:
                    if tokens:
                        leave(tokens)
            return gen
        return unary_response(behavior)  # writes through context.write()

    kinds = (("unary_unary", grpc.unary_unary_rpc_method_handler, unary_response),
             ("unary_stream", grpc.unary_stream_rpc_method_handler, stream_response),
             ("stream_unary", grpc.stream_unary_rpc_method_handler, unary_response),
             ("stream_stream", grpc.stream_stream_rpc_method_handler, stream_response))
    for attr, make, wrap in kinds:
        behavior = getattr(handler, attr)
        if behavior is not None:
            return make(wrap(behavior), request_deserializer=handler.request_deserializer,
                        response_serializer=handler.response_serializer)
    return handler


__all__ = ["HEALTH_METHODS", "AuthError", "AuthInterceptor", "PermissionDenied",
           "Unauthenticated", "acting_tenant", "auth_status", "current_identity",
           "peer_identity"]
