"""The HTTP fronts' settings and what they need from the request flow, shared
by the OpenAI front (``router.front``) and the Messages API
(``router.messages_api``), which the OpenAI front mounts."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Protocol

from common.config import TrafficClasses
from router.auth import ApiKeys
from router.body import BodyLimits
from router.generation import GenEvent, RouteRequest


class Generator(Protocol):
    """What the front needs from the request flow (router.core.RouterCore)."""

    def generate(self, req: RouteRequest) -> AsyncGenerator[GenEvent, None]: ...

    def live_counts(self) -> dict[str, int]: ...


@dataclass(frozen=True, slots=True)
class FrontConfig:
    model_name: str
    max_context: int
    vocab_size: int
    classes: TrafficClasses = field(default_factory=TrafficClasses)
    api_keys: ApiKeys = field(default_factory=ApiKeys)
    max_body_bytes: int = 16 * 2**20
    created: int = field(default_factory=lambda: int(time.time()))
    body: BodyLimits | None = None   # None: the defaults, with max_body_bytes as the size cap
    # Operator endpoints (router.operator_http): the bearer key they need; "" with
    # operator_open (an --insecure deployment) lets anyone call them, else no one.
    operator_key: str = field(default="", repr=False)
    operator_open: bool = False

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("FrontConfig.model_name must not be empty")
        if self.max_context < 2 or self.vocab_size < 1:
            raise ValueError("FrontConfig.max_context must be >= 2 and vocab_size >= 1")
        if self.max_body_bytes < 1024:
            raise ValueError("FrontConfig.max_body_bytes must be >= 1024")

    def body_limits(self) -> BodyLimits:
        if self.body is not None:
            return self.body
        from router.body_decode import DecodeLimits

        return BodyLimits(decode=DecodeLimits(max_bytes=self.max_body_bytes))


__all__ = ["FrontConfig", "Generator"]
