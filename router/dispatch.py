"""Running one admitted request on the instances: Prefill, then the Decode
stream up to its first event, with retries, under one end-to-end budget.

What an instance's answer means here (docs/services.md, "Busy"):

* busy (RESOURCE_EXHAUSTED, refused before any work, ``retry-after-ms``):
  try another instance of the role; when every one is busy, wait for the
  earliest retry-after and try again. Before prefill this wait is bounded by
  the admission wait (then 429, still before any work); once prefill has run
  the request waits up to its deadline, since its work is done and its KV
  stays in the prefill buffer until decode takes it;
* failed (UNAVAILABLE, ...) before the first token: quarantine the instance
  in the live view and try another, up to ``max_attempts`` failures. A
  decode failure keeps the handle (another decode instance pulls it, or
  rebuilds it); only a failure decode relays from the prefill instance sends
  the request back to prefill;
* the request's fault (INVALID_ARGUMENT, ...): answered at once.

A short tail goes to decode alone: a prompt whose prefix was decoded on a
decode instance that still holds it (a returning agent turn: the previous
prompt, its answer and a new message) and that leaves at most
``local_tail_tokens`` to compute is sent there with no Prefill call; that
instance computes the tail between its decode steps and samples the first
token itself (Dynamo's "conditional disaggregation"). No hand-off, no
prefill queue: on a returning turn these were most of the first token's
wait. An instance that no longer holds enough declines before any work
(FAILED_PRECONDITION), as does a busy one: the request then takes the usual
path. docs/services.md, "A short tail on decode". A short cold prompt (at
most ``local_cold_tokens``, held by no decode instance) goes the same way to
the least loaded decode instance: there it costs about one batched step,
where the hop costs a prefill queue and a hand-off ("A short prompt on
decode").

Every call carries what is left of the budget as its gRPC deadline; when it
runs out the answer is a 504, whatever the instance was doing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from proto import common_pb2, decode_pb2, prefill_pb2
from router.admission_limits import retry_after_s
from router.errors import (
    DeadlineError,
    NoInstanceError,
    RateLimitedError,
    RouterError,
    UpstreamError,
    upstream_error,
)
from router.live_view import Choice, LiveView
from router.metrics import RouterMetrics
from router.upstream import DecodeCall, Upstreams
from telemetry import tracing

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Budget:
    """One request's end-to-end deadline (monotonic seconds)."""

    deadline: float

    @classmethod
    def of(cls, seconds: float) -> Budget:
        return cls(time.monotonic() + seconds)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def check(self, what: str) -> None:
        if self.left() <= 0:
            raise DeadlineError(f"the request's time budget ran out during {what}")


@dataclass(slots=True)
class Started:
    handle: prefill_pb2.KVHandle
    call: DecodeCall
    first: decode_pb2.DecodeEvent
    prefill: Choice | None          # None: computed on the decode instance alone
    decode: Choice
    sent_at: float = 0.0            # monotonic time the Decode call that answered was made


@dataclass(slots=True)
class _Attempts:
    """Instances abandoned so far in one request, and why."""

    excluded: dict[str, set[str]] = field(
        default_factory=lambda: {"prefill": set(), "decode": set()})
    errors: list[str] = field(default_factory=list)
    last: RouterError | None = None


class Dispatcher:
    def __init__(self, view: LiveView, upstreams: Upstreams, metrics: RouterMetrics, *,
                 max_attempts: int, local_tail_tokens: int = 0,
                 local_cold_tokens: int = 0) -> None:
        self.view = view
        self.upstreams = upstreams
        self.metrics = metrics
        self.max_attempts = max_attempts
        self.local_tail_tokens = local_tail_tokens
        self.local_cold_tokens = local_cold_tokens

    async def start(self, preq: prefill_pb2.PrefillRequest, keys: Sequence[bytes],
                    n_tokens: int, sampling: common_pb2.SamplingParams, budget: Budget, *,
                    busy_until: float, prefilled: Callable[[], None], tenant: str = "",
                    session: str = "") -> Started:
        """Prefill, then open the Decode stream and read its first event.
        ``busy_until``: until when (monotonic) a request nobody could prefill yet
        may wait for busy instances; ``prefilled`` is told when prefill is done."""
        tries = _Attempts()
        local = await self._local(preq, keys, n_tokens, sampling, tries, budget)
        if local is not None:
            prefilled()
            return local
        while True:
            pchoice, handle = await self._prefill(preq, keys, n_tokens, tries, budget,
                                                  busy_until, tenant, session)
            prefilled()
            started = await self._decode(pchoice, handle, keys, n_tokens, sampling, tries,
                                         budget)
            if started is not None:
                return started

    async def _local(self, preq: prefill_pb2.PrefillRequest, keys: Sequence[bytes],
                     n_tokens: int, sampling: common_pb2.SamplingParams, tries: _Attempts,
                     budget: Budget) -> Started | None:
        """The decode stream's first event from the instance holding the prompt's
        prefix, computed there with no prefill; None: take the usual path (no
        such instance, or it declined, was busy or failed before any token)."""
        choice = self.view.choose_local(keys, n_tokens, kv_tokens=n_tokens + sampling.max_tokens,
                                        max_tail_tokens=self.local_tail_tokens,
                                        max_cold_tokens=self.local_cold_tokens)
        if choice is None:
            return None
        self._count(choice, "decode")
        inst = choice.instance
        handle = prefill_pb2.KVHandle(ctx=preq.ctx, prompt_ids=preq.token_ids)
        sent_at = time.monotonic()
        call = self.upstreams.decode(inst.address, handle, sampling, budget_s=budget.left(),
                                     local_tail_tokens=max(self.local_tail_tokens,
                                                           self.local_cold_tokens))
        declined = False
        try:
            first = await call.first()
        except grpc.aio.AioRpcError as exc:
            call.cancel()
            budget.check("decode")
            declined = exc.code() == grpc.StatusCode.FAILED_PRECONDITION
            err = upstream_error(exc, role="decode", instance=inst.instance_id)
        except BaseException:
            call.cancel()
            raise
        else:
            if first is not None:
                self._count_local(choice, "served")
                return Started(handle, call, first, None, choice, sent_at)
            call.cancel()
            err = UpstreamError(f"decode instance {inst.instance_id} closed the stream "
                                "without a token", retryable=True, instance=inst.instance_id)
        if not isinstance(err, UpstreamError):
            raise err                    # the request's own fault: prefill would say the same
        if declined:
            outcome = "declined"         # it no longer holds enough of the prompt
        elif err.busy_s is not None:
            outcome = "busy"
        else:
            # Quarantined and left out like any failure before the first token, but
            # never the request's end: the usual path has not been tried yet.
            outcome = "failed"
            log.warning("decode instance %s failed a prompt sent with no prefill (%s), "
                        "prefilling instead: %s", inst.instance_id, choice.reason, err.message)
            self.view.mark_failed(inst.instance_id)
            tries.excluded["decode"].add(inst.instance_id)
        self._count_local(choice, outcome)
        self.view.finished(choice)       # its pending work is not there: placement sees it now
        log.debug("%s on decode %s not served (%s): %s", choice.reason, inst.instance_id,
                  outcome, err.message)
        return None

    async def _prefill(self, preq: prefill_pb2.PrefillRequest, keys: Sequence[bytes],
                       n_tokens: int, tries: _Attempts, budget: Budget, busy_until: float,
                       tenant: str, session: str) -> tuple[Choice, prefill_pb2.KVHandle]:
        busy: dict[str, float] = {}
        while True:
            try:
                choice = self.view.choose_prefill(
                    keys, n_tokens, exclude=tries.excluded["prefill"] | busy.keys(),
                    tenant=tenant, session=session)
            except NoInstanceError:
                if not busy:
                    if tries.last is None:
                        raise
                    raise self._exhausted(tries) from None
                await self._wait_busy(busy, "prefill", min(busy_until, budget.deadline),
                                      before_work=True)
                continue
            self._count(choice, "prefill")
            inst = choice.instance
            try:
                return choice, await self.upstreams.prefill(inst.address, preq,
                                                            budget_s=budget.left())
            except grpc.aio.AioRpcError as exc:
                budget.check("prefill")
                err = upstream_error(exc, role="prefill", instance=inst.instance_id)
            finally:
                self.view.finished(choice)
            if isinstance(err, UpstreamError) and err.busy_s is not None:
                self._busy(busy, inst.instance_id, err.busy_s, "prefill")
                continue
            self._failed(err, "prefill", inst.instance_id, tries)

    async def _decode(self, pchoice: Choice, handle: prefill_pb2.KVHandle,
                      keys: Sequence[bytes], n_tokens: int,
                      sampling: common_pb2.SamplingParams, tries: _Attempts,
                      budget: Budget) -> Started | None:
        """The decode stream's first event; None: prefill again (the handle's KV
        was the problem). Any error raised here has released the handle."""
        busy: dict[str, float] = {}
        try:
            while True:
                try:
                    dchoice = self.view.choose_decode(
                        n_tokens, exclude=tries.excluded["decode"] | busy.keys(),
                        kv_tokens=n_tokens + sampling.max_tokens, keys=keys)
                except NoInstanceError:
                    if not busy:
                        if tries.last is None:
                            raise
                        raise self._exhausted(tries) from None
                    # The work is done and its KV waits in the prefill buffer: hold on
                    # for as long as the request's own budget allows.
                    await self._wait_busy(busy, "decode", budget.deadline, before_work=False)
                    continue
                self._count(dchoice, "decode")
                inst = dchoice.instance
                sent_at = time.monotonic()
                call = self.upstreams.decode(inst.address, handle, sampling,
                                             budget_s=budget.left())
                try:
                    first = await call.first()
                except grpc.aio.AioRpcError as exc:
                    call.cancel()
                    budget.check("decode")
                    err = upstream_error(exc, role="decode", instance=inst.instance_id)
                except BaseException:
                    call.cancel()         # cancelled meanwhile: do not leave decode running
                    raise
                else:
                    if first is not None:
                        return Started(handle, call, first, pchoice, dchoice, sent_at)
                    call.cancel()
                    err = UpstreamError(f"decode instance {inst.instance_id} closed the stream "
                                        "without a token", retryable=True,
                                        instance=inst.instance_id)
                if isinstance(err, UpstreamError) and err.busy_s is not None:
                    self._busy(busy, inst.instance_id, err.busy_s, "decode")
                    continue
                if isinstance(err, UpstreamError) and err.relayed:
                    # Decode could not use the prefill instance's KV: prefill again.
                    self._failed(err, "prefill", pchoice.instance.instance_id, tries)
                    await asyncio.shield(self.upstreams.release(handle))
                    return None
                self._failed(err, "decode", inst.instance_id, tries)
        except BaseException:
            await asyncio.shield(self.upstreams.release(handle))
            raise

    async def _wait_busy(self, busy: dict[str, float], role: str, until: float, *,
                         before_work: bool) -> None:
        """Every candidate of ``role`` is busy: sleep to the earliest retry-after,
        then try them all again; past ``until``, give up."""
        delay = min(busy.values())
        now = time.monotonic()
        if now + delay > until:
            if before_work:
                self.metrics.rejected.labels(reason="busy").inc()
                raise RateLimitedError(f"every {role} instance is busy",
                                       reason="instances_busy",
                                       retry_after_s=retry_after_s(delay))
            raise DeadlineError(f"every {role} instance stayed busy until the request's "
                                "time budget ran out")
        await asyncio.sleep(delay)
        busy.clear()

    def _busy(self, busy: dict[str, float], instance_id: str, seconds: float,
              role: str) -> None:
        log.debug("%s instance %s busy for %.3fs", role, instance_id, seconds)
        self.metrics.retries.labels(role=role, reason="busy").inc()
        busy[instance_id] = seconds

    def _failed(self, err: RouterError, role: str, instance_id: str, tries: _Attempts) -> None:
        """Note a failure before the first token; raise when retrying cannot help."""
        if not (isinstance(err, UpstreamError) and err.retryable):
            raise err
        log.warning("%s instance %s failed before the first token, trying another: %s",
                    role, instance_id, err.message)
        self.metrics.retries.labels(role=role, reason=err.grpc_code.name.lower()).inc()
        self.view.mark_failed(instance_id)
        tries.excluded[role].add(instance_id)
        tries.errors.append(err.message)
        tries.last = err
        if len(tries.errors) >= self.max_attempts:
            raise self._exhausted(tries)

    @staticmethod
    def _exhausted(tries: _Attempts) -> RouterError:
        last = tries.last
        assert last is not None
        summary = "; ".join(tries.errors)
        if isinstance(last, UpstreamError):
            return UpstreamError(f"every instance tried failed before the first token: {summary}",
                                 retryable=False, instance=last.instance,
                                 http_status=last.http_status, grpc_code=last.grpc_code)
        return last

    def _count_local(self, choice: Choice, outcome: str) -> None:
        counter = (self.metrics.local_colds if choice.reason == "local_cold"
                   else self.metrics.local_tails)
        counter.labels(outcome=outcome).inc()

    def _count(self, choice: Choice, role: str) -> None:
        inst = choice.instance.instance_id
        log.debug("place %s on %s: %s", role, inst, choice.detail or choice.reason)
        self.metrics.placements.labels(role=role, policy=choice.policy, instance=inst,
                                       reason=choice.reason).inc()
        self.metrics.placement_score.labels(role=role, policy=choice.policy).observe(choice.score)
        # A placement is a decision, not a wait: a span of no length carrying its why
        # (instance ids and scores, nothing of the prompt).
        t = tracing.now()
        tracing.record("placement", t, t, role=role, instance=inst, policy=choice.policy,
                       reason=choice.reason, score=float(choice.score))
