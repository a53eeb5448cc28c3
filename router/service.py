"""The gRPC ``Router`` service: the HTTP front's generate call for internal clients.

Same flow (``RouterCore.generate``), same validation rules, same error
mapping (``errors.grpc_status``).

The tenant comes from authentication only (``tenant_of``): the API key in the
``authorization`` metadata when keys are configured, else the caller's
certificate: a tenant certificate acts for its own tenant, and only an
operator (or ``--insecure``) may name one in ``ctx.tenant`` /
``x-kvserve-tenant``. Any claim that disagrees with what authentication says
is refused (PERMISSION_DENIED), never silently followed.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import AsyncIterator

import grpc

from common.config import TrafficClasses
from engine.errors import EngineInputError
from engine.grammar import GrammarSpec, validate
from kvstore.keys import KeyInputError, validate_tenant
from proto import common_pb2, decode_pb2, router_pb2, router_pb2_grpc
from router.auth import DEFAULT_TENANT, ApiKeys, traffic_class
from router.core import RouterCore
from router.errors import InvalidRequestError, PermissionDeniedError, grpc_status
from router.generation import GenEvent, RouteRequest, Usage
from router.openai_schema import MAX_STOP, Message, Sampling
from security.authz import AuthError, acting_tenant, current_identity

log = logging.getLogger(__name__)

SERVICE_NAME = "kvserve.v1.Router"
_ROLES = frozenset({"system", "user", "assistant", "tool"})


def _sampling(p: common_pb2.SamplingParams, max_context: int) -> Sampling:
    if not (math.isfinite(p.temperature) and 0.0 <= p.temperature <= 2.0):
        raise InvalidRequestError(f"temperature must be in [0, 2], got {p.temperature}",
                                  param="sampling.temperature")
    if not (math.isfinite(p.top_p) and 0.0 <= p.top_p <= 1.0):
        raise InvalidRequestError(f"top_p must be in [0, 1] (0 = off), got {p.top_p}",
                                  param="sampling.top_p")
    if p.max_tokens > max_context:
        raise InvalidRequestError(f"max_tokens is {p.max_tokens}, but this model's maximum "
                                  f"context length is {max_context} tokens",
                                  param="sampling.max_tokens", code="context_length_exceeded")
    if len(p.stop) > MAX_STOP or any(not s for s in p.stop):
        raise InvalidRequestError(f"stop takes at most {MAX_STOP} non-empty strings",
                                  param="sampling.stop")
    # Proto zeros mean "unset": greedy, no top-p, the router's default length.
    grammar = None
    if p.HasField("grammar"):
        try:
            grammar = GrammarSpec(p.grammar.kind, p.grammar.source)
            validate(grammar)
        except EngineInputError as exc:
            raise InvalidRequestError(str(exc), param="sampling.grammar") from exc
    for name in ("presence_penalty", "frequency_penalty"):
        if not (math.isfinite(getattr(p, name)) and -2.0 <= getattr(p, name) <= 2.0):
            raise InvalidRequestError(f"{name} must be in [-2, 2]", param=f"sampling.{name}")
    if any(not (math.isfinite(b) and -100.0 <= b <= 100.0) for b in p.logit_bias.values()):
        raise InvalidRequestError("logit_bias values must be in [-100, 100]",
                                  param="sampling.logit_bias")
    return Sampling(temperature=p.temperature, top_p=p.top_p or 1.0, seed=p.seed,
                    max_tokens=p.max_tokens or None, stop=tuple(p.stop),
                    ignore_eos=p.ignore_eos, presence_penalty=p.presence_penalty,
                    frequency_penalty=p.frequency_penalty,
                    logit_bias=tuple(sorted(p.logit_bias.items())), grammar=grammar)


def route_request(req: router_pb2.GenerateRequest, *, tenant: str, classes: TrafficClasses,
                  max_context: int) -> RouteRequest:
    given = [n for n, ok in (("messages", bool(req.messages)), ("prompt", bool(req.prompt)),
                             ("token_ids", bool(req.token_ids))) if ok]
    if len(given) != 1:
        raise InvalidRequestError("send exactly one of messages, prompt or token_ids (got "
                                  f"{given or 'none'})", param="messages")
    for i, m in enumerate(req.messages):
        if m.role not in _ROLES:
            raise InvalidRequestError(f"messages[{i}].role {m.role!r} is not one of "
                                      f"{sorted(_ROLES)}", param=f"messages[{i}].role")
    return RouteRequest(
        # Ours: internal keys derive from it (a caller's ctx.request_id is only logged).
        request_id=secrets.token_hex(16), tenant=tenant,
        traffic_class=traffic_class(req.ctx.traffic_class, classes),
        sampling=_sampling(req.sampling, max_context),
        messages=tuple(Message(m.role, m.content) for m in req.messages),
        prompt=req.prompt, token_ids=tuple(req.token_ids))


def _event(ev: GenEvent) -> router_pb2.GenerateEvent:
    out = router_pb2.GenerateEvent(text=ev.text, token_ids=list(ev.token_ids),
                                   finished=ev.finished, finish_reason=ev.finish_reason,
                                   prefill_instance=ev.prefill_instance,
                                   decode_instance=ev.decode_instance)
    if ev.usage is not None:
        out.usage.CopyFrom(decode_pb2.Usage(prompt_tokens=ev.usage.prompt_tokens,
                                            completion_tokens=ev.usage.completion_tokens,
                                            cached_tokens=ev.usage.cached_tokens))
    return out


def tenant_of(claimed: str, api_keys: ApiKeys, authorization: str | None) -> str:
    """The tenant a Router call acts for, from authentication only.

    - API keys configured: the key's tenant (a missing or unknown key is
      UNAUTHENTICATED); a tenant certificate or a ``ctx.tenant`` naming another
      tenant is refused.
    - No API keys: the certificate's tenant (security.authz.acting_tenant: a
      tenant identity gets its own and is refused if it names another; an
      operator, or ``--insecure``, may name any; the default otherwise).
    """
    try:
        ident = current_identity()
        if api_keys.enabled:
            tenant = api_keys.tenant_for(authorization)
            for claim, what in ((ident.tenant, "your certificate"), (claimed, "ctx.tenant")):
                if claim and claim != tenant:
                    raise PermissionDeniedError(f"{what} names tenant {claim[:64]!r}, but the "
                                                "API key belongs to another tenant")
            if acting_tenant(tenant) != tenant:     # x-kvserve-tenant must agree too
                raise PermissionDeniedError("x-kvserve-tenant names another tenant than the "
                                            "API key's")
            return tenant
        tenant = acting_tenant(claimed)
    except AuthError as exc:
        raise PermissionDeniedError(str(exc)) from exc
    try:
        return validate_tenant(tenant or DEFAULT_TENANT)
    except KeyInputError as exc:
        raise InvalidRequestError(str(exc), param="ctx.tenant") from exc


class RouterService(router_pb2_grpc.RouterServicer):
    def __init__(self, core: RouterCore, *, classes: TrafficClasses, api_keys: ApiKeys) -> None:
        self.core = core
        self.classes = classes
        self.api_keys = api_keys

    def _tenant(self, req: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> str:
        meta = {k.lower(): v for k, v in (context.invocation_metadata() or ())
                if isinstance(v, str)}
        return tenant_of(req.ctx.tenant, self.api_keys,
                         meta.get("authorization") if self.api_keys.enabled else None)

    def _count(self, usage: Usage) -> None:
        """The same token counters as the HTTP front, so /metrics covers both APIs."""
        tokens = self.core.metrics.tokens
        tokens.labels(kind="prompt").inc(usage.prompt_tokens)
        tokens.labels(kind="cached").inc(usage.cached_tokens)
        tokens.labels(kind="completion").inc(usage.completion_tokens)

    async def Generate(self, request: router_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[router_pb2.GenerateEvent]:
        try:
            route = route_request(request, tenant=self._tenant(request, context),
                                  classes=self.classes, max_context=self.core.meta.max_context)
            async for ev in self.core.generate(route):
                if ev.finished and ev.usage is not None:
                    self._count(ev.usage)
                yield _event(ev)
        except Exception as exc:  # every failure leaves as a status code
            status = grpc_status(exc)
            if status.code == grpc.StatusCode.INTERNAL:
                log.exception("Router.Generate failed")
            if status.trailing:              # retry-after-ms of a 429-like refusal
                context.set_trailing_metadata(status.trailing)
            await context.abort(status.code, status.message)
