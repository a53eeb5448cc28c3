"""One real stack per test session for the vLLM connector tests: an embedded
Redis of its own (other tests flush theirs), one kvstore process, and vLLM
OpenAI servers (SmolLM2 fp32 from our GGUF importer, ``--enforce-eager``, a
small KV cache) with ``connectors.vllm.KVServeConnector``. Server A starts
first; B (a second, fresh process) only when a test asks for it. Skipped as a
whole when vLLM (the ``[vllm]`` extra) is not installed."""

from __future__ import annotations

import importlib.util
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvstore.redis_server import EmbeddedRedis, free_port
from tests.connectors.stack import Store, new_store, security

VLLM_MISSING = importlib.util.find_spec("vllm") is None
pytestmark = pytest.mark.skipif(VLLM_MISSING, reason="vLLM not installed: pip install -e "
                                "'.[vllm]' && kvserve vllm-setup (docs/vllm.md)")


@dataclass
class VLLMStack:
    redis_url: str
    store: Store
    model_dir: str
    root: Path
    run: str                       # unique per session: tenants/salts never collide

    def server(self, name: str, **kw: object):  # type: ignore[no-untyped-def]
        from kvserve.launch_vllm import VLLMProcess, VLLMSpec

        tls, insecure = security()
        spec = VLLMSpec(model_dir=self.model_dir, port=free_port(), store=self.store.address,
                        redis_url=self.redis_url, instance_id=name, kvcache_gib=1,
                        max_model_len=2048, tls_dir=tls, insecure=insecure,
                        extra_config={"retry_after_s": 0.5}, **kw)  # type: ignore[arg-type]
        return VLLMProcess(spec, self.root / f"{name}.log").start()


@pytest.fixture(scope="session")
def vllm_stack(smollm2_dir: str, tmp_path_factory: pytest.TempPathFactory,
               ) -> Iterator[VLLMStack]:
    if VLLM_MISSING:
        pytest.skip("vLLM not installed")
    root = tmp_path_factory.mktemp("vllm-stack")
    with EmbeddedRedis() as redis:
        store = new_store(redis.url, root).start()
        try:
            yield VLLMStack(redis.url, store, smollm2_dir, root, uuid.uuid4().hex[:8])
        finally:
            store.stop()


@pytest.fixture(scope="session")
def vllm_a(vllm_stack: VLLMStack):  # type: ignore[no-untyped-def]
    proc = vllm_stack.server("vllm-a")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def vllm_b(vllm_stack: VLLMStack, vllm_a):  # type: ignore[no-untyped-def]
    """A second server, started after A is up (one vLLM start at a time on 2 cores)."""
    proc = vllm_stack.server("vllm-b")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()
