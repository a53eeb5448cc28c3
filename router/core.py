"""The request flow: tokenize, key, place, prefill, stream decode.

``RouterCore.generate`` is the one generation call both fronts use. It

1. tokenizes (the chat template for messages) and checks the context length;
2. computes the prompt's block keys (tenant + model fingerprint,
   docs/architecture.md#block-identity);
3. passes the admission layer (router.admission): room now, a wait in its
   tenant's fair queue, or a 429 / 503 before any instance did work for it;
4. runs it on the instances (router.dispatch): Prefill on the instance the
   live view picks (affinity and queue), then the Decode stream on one picked
   by load x expert imbalance, retrying busy and failed instances before the
   first token, all under one end-to-end budget sent as gRPC deadlines;
5. yields ``GenEvent``s as decode streams tokens.

After the first token has gone to the client a failure ends the stream with a
clear error, since the client already holds part of an answer.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import grpc

from engine.encode_memo import EncodeMemo, EncodeMemoConfig
from engine.errors import EngineInputError
from kvstore.keys import chain_keys
from kvstore.types import RequestCtx
from proto import common_pb2, decode_pb2, prefill_pb2
from router.admission import Admission
from router.admission_cost import InflightPrefixes, admission_cost
from router.dispatch import Budget, Dispatcher
from router.errors import (
    ContextLengthError,
    InvalidRequestError,
    NoInstanceError,
    UpstreamError,
    upstream_error,
)
from router.generation import GenEvent, RouteRequest, Usage
from router.live_view import LiveView
from router.metrics import RouterMetrics
from router.model_meta import ModelMeta
from router.openai_schema import Sampling, messages_as_dicts
from router.serving_metrics import ServingMetrics
from router.tokenize import tokenize_off_loop
from router.upstream import Upstreams
from telemetry import tracing

log = logging.getLogger(__name__)

_U64 = 2**64 - 1


@dataclass(frozen=True, slots=True)
class CoreConfig:
    block_tokens: int = 64
    max_attempts: int = 3            # instances tried per request before giving up
    default_max_tokens: int = 256    # when the client gives none (OpenAI's "until the end"
                                     # is minutes of CPU decode for a small prompt)
    secret: bytes = field(default=b"", repr=False)  # deployment secret: keys tenant salts
    local_tail_tokens: int = 512     # router.dispatch: short tails computed on decode alone
    local_cold_tokens: int = 256     # router.dispatch: short cold prompts, likewise
    # Characters of chat segments remembered encoded, per tenant (engine/encode_memo.py):
    # a returning conversation encodes only its new messages. 0: off.
    encode_memo_chars: int = 8 * 2**20

    def __post_init__(self) -> None:
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {self.block_tokens}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.local_tail_tokens < 0:
            raise ValueError(f"local_tail_tokens must be >= 0, got {self.local_tail_tokens}")
        if self.local_cold_tokens < 0:
            raise ValueError(f"local_cold_tokens must be >= 0, got {self.local_cold_tokens}")
        if self.encode_memo_chars < 0:
            raise ValueError(f"encode_memo_chars must be >= 0, got {self.encode_memo_chars}")


class RouterCore:
    def __init__(self, cfg: CoreConfig, meta: ModelMeta, view: LiveView, upstreams: Upstreams,
                 metrics: RouterMetrics, admission: Admission) -> None:
        self.cfg = cfg
        self.meta = meta
        self.view = view
        self.upstreams = upstreams
        self.metrics = metrics
        self.admission = admission
        self.inflight = InflightPrefixes()   # router.admission_cost
        self.dispatch = Dispatcher(view, upstreams, metrics, max_attempts=cfg.max_attempts,
                                   local_tail_tokens=cfg.local_tail_tokens,
                                   local_cold_tokens=cfg.local_cold_tokens)
        self.ops: Any = None        # router.cluster_ops.ClusterOps: warm-up on arrival
        self.serving = ServingMetrics.on(metrics.registry, meta.served_name)
        self.memo = EncodeMemo(EncodeMemoConfig(max_chars=cfg.encode_memo_chars))

    def live_counts(self) -> dict[str, int]:
        return self.view.live_counts()

    # -- input --------------------------------------------------------------------

    def tokenize(self, req: RouteRequest) -> list[int]:
        tok = self.meta.tokenizer
        try:
            if req.messages:
                tokens = tok.apply_chat_template(messages_as_dicts(req.messages),
                                                 memo=self.memo.for_scope(req.tenant))
            elif req.prompt:
                tokens = tok.encode(req.prompt)
            else:
                tokens = list(req.token_ids)
        except EngineInputError as exc:
            raise InvalidRequestError(str(exc),
                                      param="messages" if req.messages else "prompt") from exc
        if not tokens:
            raise InvalidRequestError("the prompt is empty after tokenization", param="prompt")
        return tokens

    def sampling(self, s: Sampling, prompt_tokens: int, *,
                 prompt_param: str = "messages") -> common_pb2.SamplingParams:
        room = self.meta.max_context - prompt_tokens
        if room < 1:
            raise ContextLengthError(
                f"this model's maximum context length is {self.meta.max_context} tokens; the "
                f"prompt has {prompt_tokens}, leaving no room to generate", param=prompt_param)
        if s.max_tokens is not None and s.max_tokens > room:
            raise ContextLengthError(
                f"this model's maximum context length is {self.meta.max_context} tokens; the "
                f"prompt has {prompt_tokens} and max_tokens asks for {s.max_tokens} more")
        max_tokens = s.max_tokens if s.max_tokens is not None else min(
            self.cfg.default_max_tokens, room)
        # Unseeded sampling still needs some seed; greedy ignores it.
        seed = s.seed if s.seed is not None else secrets.randbits(63)
        out = common_pb2.SamplingParams(
            temperature=s.temperature, top_p=s.top_p, seed=seed & _U64, max_tokens=max_tokens,
            stop=list(s.stop), ignore_eos=s.ignore_eos, presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty, logit_bias=dict(s.logit_bias))
        if s.grammar is not None:   # constrained decoding, enforced by the engines
            out.grammar.CopyFrom(common_pb2.Grammar(kind=s.grammar.kind, source=s.grammar.source))
        return out

    # -- the flow ---------------------------------------------------------------------

    async def generate(self, req: RouteRequest) -> AsyncGenerator[GenEvent, None]:
        budget = Budget.of(self.admission.cfg.request_timeout_s)
        t_arrived = time.monotonic()
        clock = self.serving.clock()
        # Off the event loop (router.tokenize): a long prompt must not stall the front.
        tokens = await tokenize_off_loop(self.tokenize, self.meta.tokenizer, req,
                                         self.meta.max_context)
        t_tokenized = time.monotonic()
        sampling = self.sampling(req.sampling, len(tokens),
                                 prompt_param="messages" if req.messages else "prompt")
        try:
            fingerprint = self.view.fingerprint()
        except NoInstanceError:           # no prefill at all: a 503, counted like admission's
            self.metrics.rejected.labels(reason="no_instance").inc()
            raise
        self.view.check_decode_room(len(tokens) + sampling.max_tokens)
        keys = chain_keys(tokens, block_tokens=self.cfg.block_tokens, tenant=req.tenant,
                          fingerprint=bytes.fromhex(fingerprint), secret=self.cfg.secret)
        ctx = common_pb2.RequestContext(request_id=req.request_id, tenant=req.tenant,
                                        traffic_class=req.traffic_class,
                                        model_fingerprint=fingerprint)
        preq = prefill_pb2.PrefillRequest(ctx=ctx, token_ids=tokens, sampling=sampling)
        if self.ops is not None:      # blocks start up the tiers before any queue (issue 18)
            self.ops.warm(keys, len(tokens), RequestCtx(req.request_id, req.tenant,
                                                        req.traffic_class, fingerprint),
                          req.session_id)
        held = max(self.view.known_blocks(keys), self.inflight.leading(keys))
        claim = self.inflight.claim(keys)
        try:
            ticket = await self.admission.admit(
                req.api_key_id, req.tenant,
                admission_cost(len(tokens), self.cfg.block_tokens, held), wait_s=budget.left())
        except BaseException:
            claim.release()
            raise

        def prefilled() -> None:
            claim.release()
            self.admission.prefilled(ticket)

        try:
            started = await self.dispatch.start(
                preq, keys, len(tokens), sampling, budget,
                busy_until=ticket.arrived + self.admission.cfg.max_queue_wait_s,
                prefilled=prefilled, tenant=req.tenant, session=req.session_id)
            p_id = started.prefill.instance.instance_id if started.prefill else ""
            d_id = started.decode.instance.instance_id
            t = started.handle.timings
            clock.first(t.queue_s, t.compute_s)
            # Where a slow first token went, per request, for the operator (and for
            # finding which stage holds short turns behind long prompts).
            if started.prefill is None:
                # Where a returning turn's first token went: tokenizing, what came
                # before the Decode call (keys, admission, placement), decode's own
                # time (its event's t_s) and the two hops with the stream's first read.
                now = time.monotonic()
                log.info("request %s: %d prompt tokens, a short tail computed on decode %s "
                         "(no prefill); admission wait %.2fs; first token at %.3fs "
                         "(tokenize %.3fs, to the call %.3fs, decode %.3fs, hops %.3fs)",
                         req.request_id, len(tokens), d_id, ticket.waited_s, now - t_arrived,
                         t_tokenized - t_arrived, started.sent_at - t_tokenized,
                         started.first.t_s, now - started.sent_at - started.first.t_s)
            else:
                log.info("request %s: %d prompt tokens, %d cached; admission wait %.2fs, "
                         "prefill %s queue %.2fs (lookup %.2fs, fetch %.2fs) compute %.2fs; "
                         "first token from decode %s at %.2fs", req.request_id, len(tokens),
                         started.handle.cached_tokens, ticket.waited_s, p_id, t.queue_s,
                         t.lookup_s, t.fetch_s, t.compute_s, d_id, time.monotonic() - t_arrived)
            tracing.annotate(prompt_tokens=len(tokens),
                             cached_tokens=started.handle.cached_tokens,
                             traffic_class=req.traffic_class, local_tail=started.prefill is None)
            try:
                if started.first.finished:
                    clock.done(started.first.usage.completion_tokens)
                yield self._event(started.first, started.handle, p_id, d_id)
                if started.first.finished:
                    return
                async for ev in started.call.rest():
                    if ev.finished:
                        clock.done(ev.usage.completion_tokens)
                    yield self._event(ev, started.handle, p_id, d_id)
                    if ev.finished:
                        return
                raise UpstreamError(f"decode instance {d_id} ended the stream before finishing",
                                    retryable=False, instance=d_id)
            except grpc.aio.AioRpcError as exc:
                err = upstream_error(exc, role="decode", instance=d_id)
                if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    self.view.mark_failed(d_id)
                raise UpstreamError(f"{err.message} (after the first token; not retried)",
                                    retryable=False, instance=d_id) from exc
            finally:
                started.call.cancel()
        finally:
            claim.release()
            self.admission.done(ticket)

    @staticmethod
    def _event(ev: decode_pb2.DecodeEvent, handle: prefill_pb2.KVHandle, p_id: str,
               d_id: str) -> GenEvent:
        usage = None
        if ev.finished:
            # Decode reports what was reused: the handle's figure after a prefill,
            # its own G1 hit for a short tail it computed alone.
            usage = Usage(prompt_tokens=ev.usage.prompt_tokens or len(handle.prompt_ids),
                          completion_tokens=ev.usage.completion_tokens,
                          cached_tokens=(ev.usage.cached_tokens if ev.HasField("usage")
                                         else handle.cached_tokens))
        return GenEvent(text=ev.text, token_ids=tuple(ev.token_ids), finished=ev.finished,
                        finish_reason=ev.finish_reason, usage=usage, prefill_instance=p_id,
                        decode_instance=d_id)
