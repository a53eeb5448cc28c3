"""The typed boundary between the fronts (HTTP, gRPC) and the request flow.

A front turns its wire format into one ``RouteRequest`` and reads
``GenEvent``s back; neither front knows about instances or placement, and the
flow knows nothing of JSON or protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.openai_schema import Message, Sampling


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """One generation. Exactly one of ``messages``, ``prompt`` or ``token_ids`` is set."""

    request_id: str
    tenant: str
    traffic_class: str
    sampling: Sampling
    messages: tuple[Message, ...] = ()
    prompt: str = ""
    token_ids: tuple[int, ...] = ()
    api_key_id: str = ""            # the caller's API key (router.auth), for per-key limits
    session_id: str = ""            # the client's session (router.session): placement only

    def __post_init__(self) -> None:
        given = sum(bool(x) for x in (self.messages, self.prompt, self.token_ids))
        if given != 1:
            raise ValueError("RouteRequest needs exactly one of messages, prompt, token_ids "
                             f"(got {given})")


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class GenEvent:
    """New text since the previous event; the last one has ``finished`` and ``usage``."""

    text: str
    token_ids: tuple[int, ...] = ()
    finished: bool = False
    finish_reason: str = ""
    usage: Usage | None = None
    prefill_instance: str = ""
    decode_instance: str = ""
