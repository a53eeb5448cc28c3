"""``kvserve chat``: a client of a running deployment.

Through the router's gRPC ``Generate`` when a router is up, else straight to
a prefill instance then a decode instance (the disaggregated path the router
would take). Interactive by default; ``--prompt`` asks once. Each turn
resends the whole conversation, so from the second turn on the warehouse
should serve the previous context (shown with ``--stats``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from kvserve.cli import UsageError
from proto import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from security.config import SecurityConfig
from security.flags import add_redis_flags, redis_url_from
from security.redact import redact_url
from security.secret_files import SecretFileError, read_secret_text


@dataclass(frozen=True, slots=True)
class Target:
    router: str = ""
    prefill: str = ""
    decode: str = ""
    security: SecurityConfig | None = None   # None: from the environment (KVSERVE_TLS_DIR)

    def describe(self) -> str:
        return f"router {self.router}" if self.router else (
            f"prefill {self.prefill} -> decode {self.decode}")


@dataclass(frozen=True, slots=True)
class Reply:
    text: str
    cached_tokens: int
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    total_s: float


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default=None, help="ask once and exit")
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--tenant", default="")
    p.add_argument("--traffic-class", default="chat")
    p.add_argument("--router", default=None, help="router gRPC host:port")
    p.add_argument("--prefill", default=None, help="prefill host:port (with --decode)")
    p.add_argument("--decode", default=None, help="decode host:port (with --prefill)")
    add_redis_flags(p, default="the running `kvserve up`")
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="file (0600) holding the key for a router started with --api-key-file "
                        "(default $KVSERVE_API_KEY; never a key on the command line)")
    p.add_argument("--timeout", type=float, default=300.0, help="deadline per turn, seconds")
    p.add_argument("--stats", action="store_true",
                   help="print cached tokens and timings of each turn to stderr")


def run(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        raise UsageError("--max-tokens must be >= 1")
    try:
        args.api_key = (read_secret_text(args.api_key_file, "--api-key-file")
                        if args.api_key_file else os.environ.get("KVSERVE_API_KEY", ""))
    except SecretFileError as exc:
        raise UsageError(str(exc)) from exc
    target = asyncio.run(find_target(args))
    print(f"[{target.describe()}]", file=sys.stderr)
    return asyncio.run(_session(args, target))


async def find_target(args: argparse.Namespace) -> Target:
    """Explicit addresses, else the state of ``kvserve up``, else the registry."""
    if args.router:
        return Target(router=args.router)
    if args.prefill or args.decode:
        if not (args.prefill and args.decode):
            raise UsageError("--prefill and --decode go together")
        return Target(prefill=args.prefill, decode=args.decode)
    from kvserve.launcher import UpState

    state = UpState.load()
    try:
        explicit = redis_url_from(args, env=False)
    except SecretFileError as exc:
        raise UsageError(str(exc)) from exc
    url = explicit
    if state and not explicit:
        return Target(router=state.router_grpc, prefill=state.prefill, decode=state.decode,
                      security=state.security())
    if not url:
        raise UsageError("no deployment found: run `kvserve up`, or pass --router, "
                         "--prefill/--decode or --redis-url")
    from kvstore.registry import InstanceRegistry

    async with InstanceRegistry(url) as reg:
        live = await reg.list_instances()
    by_role: dict[str, str] = {}
    for inst in sorted(live, key=lambda i: (i.load, i.queue)):
        by_role.setdefault(inst.role, inst.address)
    if "router" in by_role:
        return Target(router=by_role["router"])
    if "prefill" in by_role and "decode" in by_role:
        return Target(prefill=by_role["prefill"], decode=by_role["decode"])
    raise UsageError(f"the registry at {redact_url(url)} has no router and no prefill+decode pair "
                     f"(roles present: {sorted(by_role)})")


async def _session(args: argparse.Namespace, target: Target) -> int:
    messages: list[tuple[str, str]] = []
    if args.system:
        messages.append(("system", args.system))
    async with _Client(target, args) as client:
        while True:
            if args.prompt is not None:
                user = args.prompt
            else:
                try:
                    user = await asyncio.to_thread(input, "you> ")
                except EOFError:
                    print(file=sys.stderr)
                    return 0
                if not user.strip():
                    continue
            messages.append(("user", user))
            reply = await _turn_with_retry(client, messages)
            messages.append(("assistant", reply.text))
            if args.stats:
                print(f"[prompt {reply.prompt_tokens} tokens, cached {reply.cached_tokens}, "
                      f"output {reply.completion_tokens}, TTFT {reply.ttft_s * 1000:.0f} ms, "
                      f"total {reply.total_s:.2f} s]", file=sys.stderr)
            if args.prompt is not None:
                return 0


async def _turn_with_retry(client: _Client, messages: list[tuple[str, str]],
                           attempts: int = 3) -> Reply:
    """A deployment that just started may not list its instances yet: retry an
    UNAVAILABLE that came before any text, then give up with the reason."""
    for attempt in range(attempts):
        try:
            return await client.turn(messages)
        except grpc.aio.AioRpcError as exc:
            again = (exc.code() == grpc.StatusCode.UNAVAILABLE and not client.printed
                     and attempt + 1 < attempts)
            if not again:
                raise UsageError(f"{exc.code().name}: {exc.details()}") from exc
            await asyncio.sleep(1.0)
    raise AssertionError("unreachable")


class _Client:
    def __init__(self, target: Target, args: argparse.Namespace) -> None:
        self._target = target
        self._args = args
        self._channels: list[grpc.aio.Channel] = []
        self.printed = False                 # text of the current turn reached the user

    async def __aenter__(self) -> _Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for ch in self._channels:
            await ch.close()

    def _channel(self, address: str) -> grpc.aio.Channel:
        sec = self._target.security or SecurityConfig.from_env("operator")
        ch = sec.aio_channel(address, "", options=[
            ("grpc.max_receive_message_length", 256 * 2**20)])
        self._channels.append(ch)
        return ch

    def _ctx(self) -> common_pb2.RequestContext:
        return common_pb2.RequestContext(request_id=uuid.uuid4().hex, tenant=self._args.tenant,
                                         traffic_class=self._args.traffic_class)

    def _sampling(self) -> common_pb2.SamplingParams:
        return common_pb2.SamplingParams(max_tokens=self._args.max_tokens,
                                         temperature=self._args.temperature)

    async def turn(self, messages: list[tuple[str, str]]) -> Reply:
        msgs = [common_pb2.ChatMessage(role=r, content=c) for r, c in messages]
        stream = (self._via_router(msgs) if self._target.router else self._disaggregated(msgs))
        t0 = time.perf_counter()
        ttft = 0.0
        parts: list[str] = []
        usage = (0, 0, 0)
        self.printed = False
        async for text, first, final_usage in stream:
            if first and not ttft:
                ttft = time.perf_counter() - t0
            parts.append(text)
            if text:
                self.printed = True
                print(text, end="", flush=True)
            if final_usage is not None:
                usage = final_usage
        print(flush=True)
        return Reply("".join(parts), usage[2], usage[0], usage[1], ttft,
                     time.perf_counter() - t0)

    async def _disaggregated(self, msgs: list[common_pb2.ChatMessage]
                             ) -> AsyncIterator[tuple[str, bool, tuple[int, int, int] | None]]:
        timeout = self._args.timeout
        pre = prefill_pb2_grpc.PrefillStub(self._channel(self._target.prefill))
        dec = decode_pb2_grpc.DecodeStub(self._channel(self._target.decode))
        handle = await pre.Prefill(prefill_pb2.PrefillRequest(ctx=self._ctx(), messages=msgs,
                                                              sampling=self._sampling()),
                                   timeout=timeout)
        yield "", True, None
        async for ev in dec.Decode(decode_pb2.DecodeRequest(handle=handle,
                                                            sampling=self._sampling()),
                                   timeout=timeout):
            usage = ((ev.usage.prompt_tokens, ev.usage.completion_tokens,
                      ev.usage.cached_tokens) if ev.finished else None)
            yield ev.text, False, usage

    async def _via_router(self, msgs: list[common_pb2.ChatMessage]
                          ) -> AsyncIterator[tuple[str, bool, tuple[int, int, int] | None]]:
        from proto import router_pb2, router_pb2_grpc

        stub = router_pb2_grpc.RouterStub(self._channel(self._target.router))
        req = router_pb2.GenerateRequest(ctx=self._ctx(), messages=msgs,
                                         sampling=self._sampling())
        first = True
        auth = ([("authorization", f"Bearer {self._args.api_key}")] if self._args.api_key
                else None)
        async for ev in stub.Generate(req, timeout=self._args.timeout, metadata=auth):
            usage = ((ev.usage.prompt_tokens, ev.usage.completion_tokens,
                      ev.usage.cached_tokens) if ev.finished else None)
            yield ev.text, first, usage
            first = False
