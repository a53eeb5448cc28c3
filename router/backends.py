"""The one seam between the router's fronts and the engines behind it.

Both fronts (HTTP ``router.front``, gRPC ``router.service``) call a
``Backend``: ``generate(RouteRequest) -> GenEvent...`` and ``live_counts()``.
Everything the two engine kinds share stays on the front side of the seam:
parsing, auth, tenant and class, the OpenAI response shapes, the usage block,
streaming, error bodies and metrics. Behind it:

* ``engine``: kvserve's own prefill/decode services over gRPC
  (``router.core.RouterCore``, unchanged);
* ``vllm``: vLLM OpenAI servers running ``connectors.vllm.KVServeConnector``
  (``router.backends_vllm``), placed by the same live view and policies.

Backends are registered by name; ``make_backend`` lists the known ones when
asked for another.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Protocol

from router.core import RouterCore
from router.generation import GenEvent, RouteRequest


class Backend(Protocol):
    def generate(self, req: RouteRequest) -> AsyncGenerator[GenEvent, None]: ...

    def live_counts(self) -> dict[str, int]: ...


BackendFactory = Callable[[RouterCore], Backend]


def _engine(core: RouterCore) -> Backend:
    return core


def _vllm(core: RouterCore) -> Backend:
    from router.backends_vllm import VLLMBackend

    return VLLMBackend(core)


BACKENDS: dict[str, BackendFactory] = {"engine": _engine, "vllm": _vllm}


def make_backend(name: str, core: RouterCore) -> Backend:
    try:
        factory = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown router backend {name!r}; known: {sorted(BACKENDS)}") from None
    return factory(core)
