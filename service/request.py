"""Turning wire requests into validated, typed values (both services).

Every check that can reject a request lives here, before any engine or
warehouse work, and each raises an error naming the problem: the error
mapping (service.errors) turns it into INVALID_ARGUMENT or
FAILED_PRECONDITION.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from common.config import TrafficClasses
from kvstore.keys import validate_tenant
from kvstore.types import RequestCtx
from proto import common_pb2, prefill_pb2
from service.errors import InvalidRequest, PreconditionFailed

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """What a request's expectations are checked against."""

    name: str
    fingerprint_hex: str
    layout: str
    vocab_size: int
    max_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class PrefillInput:
    ctx: RequestCtx                 # request id assigned, tenant and class resolved
    tokens: list[int]
    sampling: Any                   # engine.SamplingParams


def resolve_ctx(ctx: common_pb2.RequestContext, model: ModelIdentity, *,
                classes: TrafficClasses, default_tenant: str) -> RequestCtx:
    if ctx.model_fingerprint and ctx.model_fingerprint != model.fingerprint_hex:
        raise PreconditionFailed(
            f"model fingerprint {ctx.model_fingerprint[:64]!r} does not match this instance "
            f"({model.name}, fingerprint {model.fingerprint_hex})")
    tenant = validate_tenant(ctx.tenant or default_tenant)
    # The id keys this request's KV buffer (PullKV/Release) and its engine sequence,
    # so it is always ours and unguessable: a caller's id could collide with another
    # request's or name one it should not reach. The caller's id is only logged.
    request_id = secrets.token_hex(16)
    if ctx.request_id:
        log.debug("prefill %s is the caller's request %r", request_id, ctx.request_id[:128])
    return RequestCtx(request_id=request_id, tenant=tenant,
                      traffic_class=classes.resolve(ctx.traffic_class),
                      model_fingerprint=model.fingerprint_hex)


def sampling_from_proto(p: common_pb2.SamplingParams, *, require_max_tokens: bool) -> Any:
    """Engine sampling parameters; ``top_p`` 0 means disabled. ``max_tokens``
    0 is an error where the caller needs it (decode) and 1 otherwise."""
    from engine import SamplingParams
    from engine.constrained import GrammarSpec

    if p.max_tokens == 0 and require_max_tokens:
        raise InvalidRequest("sampling.max_tokens must be >= 1, got 0")
    grammar = GrammarSpec(p.grammar.kind, p.grammar.source) if p.HasField("grammar") else None
    return SamplingParams(temperature=float(p.temperature),
                          top_p=float(p.top_p) if 0.0 < p.top_p < 1.0 else 1.0,
                          seed=int(p.seed), max_tokens=max(1, int(p.max_tokens)),
                          stop=tuple(p.stop), ignore_eos=bool(p.ignore_eos),
                          presence_penalty=float(p.presence_penalty),
                          frequency_penalty=float(p.frequency_penalty),
                          logit_bias=tuple(p.logit_bias.items()), grammar=grammar)


def check_tokens(tokens: Sequence[int], model: ModelIdentity) -> None:
    if not tokens:
        raise InvalidRequest("the prompt is empty: send token_ids, messages or prompt text")
    if len(tokens) > model.max_prompt_tokens:
        raise InvalidRequest(f"prompt has {len(tokens)} tokens; {model.name} on this instance "
                             f"accepts at most {model.max_prompt_tokens}")
    bad = next((t for t in tokens if t >= model.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is outside the vocabulary (size {model.vocab_size})")


def prefill_input(req: prefill_pb2.PrefillRequest, model: ModelIdentity, tokenizer: Any, *,
                  classes: TrafficClasses, default_tenant: str) -> PrefillInput:
    given = [name for name, present in (("token_ids", len(req.token_ids) > 0),
                                        ("messages", len(req.messages) > 0),
                                        ("prompt", bool(req.prompt))) if present]
    if len(given) > 1:
        raise InvalidRequest(f"send exactly one of token_ids, messages, prompt (got {given})")
    ctx = resolve_ctx(req.ctx, model, classes=classes, default_tenant=default_tenant)
    if req.token_ids:
        tokens = list(req.token_ids)
    elif req.messages:
        tokens = tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in req.messages])
    elif req.prompt:
        tokens = tokenizer.encode(req.prompt)
    else:
        tokens = []
    check_tokens(tokens, model)
    sampling = sampling_from_proto(req.sampling, require_max_tokens=req.HasField("sampling"))
    return PrefillInput(ctx, tokens, sampling)

