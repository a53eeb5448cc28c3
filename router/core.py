"""The request flow: tokenize, key, place, prefill, stream decode.

``RouterCore.generate`` is the one generation call both fronts use. It

1. tokenizes (the chat template for messages) and checks the context length;
2. computes the prompt's block keys (tenant + model fingerprint,
   docs/architecture.md#block-identity);
3. asks the live view for a prefill instance (affinity and queue) and runs
   Prefill, then for a decode instance (load x expert imbalance) and opens
   the Decode stream;
4. yields ``GenEvent``s as decode streams tokens.

An instance that fails before the first token is quarantined in the view and
the request tries another (up to ``max_attempts`` in all); after the first
token has gone to the client a failure ends the stream with a clear error,
since the client already holds part of an answer.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field

import grpc

from engine.errors import EngineInputError
from kvstore.keys import chain_keys
from proto import common_pb2, decode_pb2, prefill_pb2
from router.errors import (
    ContextLengthError,
    InvalidRequestError,
    NoInstanceError,
    RouterError,
    UpstreamError,
    upstream_error,
)
from router.generation import GenEvent, RouteRequest, Usage
from router.live_view import Choice, LiveView
from router.metrics import RouterMetrics
from router.model_meta import ModelMeta
from router.openai_schema import Sampling, messages_as_dicts
from router.serving_metrics import ServingMetrics
from router.tokenize import tokenize_off_loop
from router.upstream import DecodeCall, Upstreams
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

    def __post_init__(self) -> None:
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {self.block_tokens}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")


@dataclass(slots=True)
class _Started:
    handle: prefill_pb2.KVHandle
    call: DecodeCall
    first: decode_pb2.DecodeEvent
    prefill: Choice
    decode: Choice


@dataclass(slots=True)
class _Attempts:
    """Instances abandoned so far in one request, and why."""

    excluded: dict[str, set[str]] = field(
        default_factory=lambda: {"prefill": set(), "decode": set()})
    errors: list[str] = field(default_factory=list)
    last: RouterError | None = None


class RouterCore:
    def __init__(self, cfg: CoreConfig, meta: ModelMeta, view: LiveView, upstreams: Upstreams,
                 metrics: RouterMetrics) -> None:
        self.cfg = cfg
        self.meta = meta
        self.view = view
        self.upstreams = upstreams
        self.metrics = metrics
        self.serving = ServingMetrics.on(metrics.registry, meta.served_name)

    def live_counts(self) -> dict[str, int]:
        return self.view.live_counts()

    # -- input --------------------------------------------------------------------

    def tokenize(self, req: RouteRequest) -> list[int]:
        tok = self.meta.tokenizer
        try:
            if req.messages:
                tokens = tok.apply_chat_template(messages_as_dicts(req.messages))
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
        clock = self.serving.clock()
        # Off the event loop (router.tokenize): a long prompt must not stall the front.
        tokens = await tokenize_off_loop(self.tokenize, self.meta.tokenizer, req,
                                         self.meta.max_context)
        sampling = self.sampling(req.sampling, len(tokens),
                                 prompt_param="messages" if req.messages else "prompt")
        fingerprint = self.view.fingerprint()
        keys = chain_keys(tokens, block_tokens=self.cfg.block_tokens, tenant=req.tenant,
                          fingerprint=bytes.fromhex(fingerprint), secret=self.cfg.secret)
        ctx = common_pb2.RequestContext(request_id=req.request_id, tenant=req.tenant,
                                        traffic_class=req.traffic_class,
                                        model_fingerprint=fingerprint)
        preq = prefill_pb2.PrefillRequest(ctx=ctx, token_ids=tokens, sampling=sampling)
        started = await self._start(preq, keys, len(tokens), sampling)
        p_id, d_id = started.prefill.instance.instance_id, started.decode.instance.instance_id
        clock.first(started.handle.timings.queue_s, started.handle.timings.compute_s)
        tracing.annotate(prompt_tokens=len(tokens), cached_tokens=started.handle.cached_tokens,
                         traffic_class=req.traffic_class)
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
            self.view.mark_failed(d_id)
            raise UpstreamError(f"{err.message} (after the first token; not retried)",
                                retryable=False, instance=d_id) from exc
        finally:
            started.call.cancel()

    @staticmethod
    def _event(ev: decode_pb2.DecodeEvent, handle: prefill_pb2.KVHandle, p_id: str,
               d_id: str) -> GenEvent:
        usage = None
        if ev.finished:
            usage = Usage(prompt_tokens=ev.usage.prompt_tokens or len(handle.prompt_ids),
                          completion_tokens=ev.usage.completion_tokens,
                          cached_tokens=handle.cached_tokens)
        return GenEvent(text=ev.text, token_ids=tuple(ev.token_ids), finished=ev.finished,
                        finish_reason=ev.finish_reason, usage=usage, prefill_instance=p_id,
                        decode_instance=d_id)

    async def _start(self, preq: prefill_pb2.PrefillRequest, keys: Sequence[bytes],
                     n_tokens: int, sampling: common_pb2.SamplingParams) -> _Started:
        tries = _Attempts()
        for _ in range(self.cfg.max_attempts):
            try:
                with tracing.span("placement", role="prefill") as s:
                    pchoice = self.view.choose_prefill(keys, n_tokens,
                                                       exclude=tries.excluded["prefill"])
                    s.set(**_placed(pchoice))
            except NoInstanceError:
                if tries.last is None:
                    raise
                break
            self._count(pchoice, "prefill")
            handle = await self._prefill(pchoice, preq, tries)
            if handle is None:
                continue
            try:
                with tracing.span("placement", role="decode") as s:
                    dchoice = self.view.choose_decode(n_tokens, exclude=tries.excluded["decode"])
                    s.set(**_placed(dchoice))
            except NoInstanceError:
                await self.upstreams.release(handle)
                if tries.last is None:
                    raise
                break
            self._count(dchoice, "decode")
            started = await self._decode(pchoice, dchoice, handle, sampling, tries)
            if started is not None:
                return started
        raise self._exhausted(tries)

    def _exhausted(self, tries: _Attempts) -> RouterError:
        last = tries.last
        assert last is not None
        summary = "; ".join(tries.errors)
        if isinstance(last, UpstreamError):
            return UpstreamError(f"every instance tried failed before the first token: {summary}",
                                 retryable=False, instance=last.instance,
                                 http_status=last.http_status, grpc_code=last.grpc_code)
        return last

    async def _prefill(self, choice: Choice, preq: prefill_pb2.PrefillRequest,
                       tries: _Attempts) -> prefill_pb2.KVHandle | None:
        inst = choice.instance
        try:
            return await self.upstreams.prefill(inst.address, preq)
        except grpc.aio.AioRpcError as exc:
            self._failed(upstream_error(exc, role="prefill", instance=inst.instance_id),
                         "prefill", inst.instance_id, tries)
            return None

    async def _decode(self, pchoice: Choice, dchoice: Choice, handle: prefill_pb2.KVHandle,
                      sampling: common_pb2.SamplingParams, tries: _Attempts) -> _Started | None:
        inst = dchoice.instance
        call = self.upstreams.decode(inst.address, handle, sampling)
        try:
            first = await call.first()
            if first is not None:
                return _Started(handle, call, first, pchoice, dchoice)
            err: RouterError = UpstreamError(
                f"decode instance {inst.instance_id} closed the stream without a token",
                retryable=True, instance=inst.instance_id)
        except grpc.aio.AioRpcError as exc:
            err = upstream_error(exc, role="decode", instance=inst.instance_id)
        except TimeoutError:
            err = UpstreamError(f"decode instance {inst.instance_id} sent no token within "
                                f"{call.first_timeout_s:.0f}s", retryable=True,
                                instance=inst.instance_id, http_status=504,
                                grpc_code=grpc.StatusCode.DEADLINE_EXCEEDED)
        except BaseException:
            call.cancel()             # cancelled meanwhile: do not leave decode running
            raise
        call.cancel()
        # The handle's KV may be unusable now; the next attempt prefills again
        # (cheaply: its blocks were written through to the warehouse).
        await asyncio.shield(self.upstreams.release(handle))
        if isinstance(err, UpstreamError) and err.relayed:
            # Decode could not pull the KV: the prefill instance is the one to avoid.
            self._failed(err, "prefill", pchoice.instance.instance_id, tries)
        else:
            self._failed(err, "decode", inst.instance_id, tries)
        return None

    def _failed(self, err: RouterError, role: str, instance_id: str, tries: _Attempts) -> None:
        if not (isinstance(err, UpstreamError) and err.retryable):
            raise err
        log.warning("%s instance %s failed before the first token, trying another: %s",
                    role, instance_id, err.message)
        self.metrics.retries.labels(role=role, reason=err.grpc_code.name.lower()).inc()
        self.view.mark_failed(instance_id)
        tries.excluded[role].add(instance_id)
        tries.errors.append(err.message)
        tries.last = err

    def _count(self, choice: Choice, role: str) -> None:
        inst = choice.instance.instance_id
        log.debug("place %s on %s: %s", role, inst, choice.detail or choice.reason)
        self.metrics.placements.labels(role=role, policy=choice.policy, instance=inst,
                                       reason=choice.reason).inc()
        self.metrics.placement_score.labels(role=role, policy=choice.policy).observe(choice.score)


def _placed(choice: Choice) -> dict[str, str | float]:
    """A placement's trace attributes (instance ids and scores, nothing of the prompt)."""
    return {"instance": choice.instance.instance_id, "policy": choice.policy,
            "reason": choice.reason, "score": float(choice.score)}
