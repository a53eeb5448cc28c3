"""One real stack for the vLLM connector tests (this package's, torn down after its
last test so its servers hold no memory or CPU through the rest of the suite): an embedded
Redis of its own (other tests flush theirs), one kvstore process, and vLLM
OpenAI servers (SmolLM2 fp32 from our GGUF importer, ``--enforce-eager``, a
small KV cache) with ``connectors.vllm.KVServeConnector``, started by name
when a test asks (``vllm_servers``), one at a time except for the router test. Skipped as a
whole when vLLM (the ``[vllm]`` extra) is not installed."""

from __future__ import annotations

import importlib.util
import os
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

    def spec(self, name: str, **kw: object):  # type: ignore[no-untyped-def]
        """A server as kvserve runs one: HTTPS with its own engine identity, the
        deployment's API key, no dev mode (plain text only without a deployment)."""
        from kvserve.launch_vllm import VLLMSpec, engine_identity

        tls, insecure = security()
        ident = "" if insecure else str(engine_identity(tls, name))
        secret = "" if insecure else str(Path(tls) / "secret")
        extra = {"retry_after_s": 0.5, **kw.pop("extra_config", {})}  # type: ignore[dict-item]
        return VLLMSpec(model_dir=self.model_dir, port=free_port(), store=self.store.address,
                        redis_url=self.redis_url, instance_id=name, kv_cache_mib=320,
                        max_model_len=2048, max_num_seqs=16, tls_dir=ident,
                        insecure=insecure, secret_file=secret, extra_config=extra,
                        **kw)  # type: ignore[arg-type]

    def server(self, name: str, **kw: object):  # type: ignore[no-untyped-def]
        from kvserve.launch_vllm import VLLMProcess

        return VLLMProcess(self.spec(name, **kw), self.root / f"{name}.log").start()


@pytest.fixture(scope="package")
def vllm_stack(smollm2_dir: str, tmp_path_factory: pytest.TempPathFactory,
               ) -> Iterator[VLLMStack]:
    if VLLM_MISSING:
        pytest.skip("vLLM not installed")
    logs = os.environ.get("KVSERVE_VLLM_TEST_LOGS")       # keep the servers' logs there
    root = Path(logs) if logs else tmp_path_factory.mktemp("vllm-stack")
    root.mkdir(parents=True, exist_ok=True)
    with EmbeddedRedis() as redis:
        store = new_store(redis.url, root).start()
        try:
            yield VLLMStack(redis.url, store, smollm2_dir, root, uuid.uuid4().hex[:8])
        finally:
            store.stop()


class Servers:
    """vLLM servers by name, at most one alive unless a test asks for two: a vLLM
    CPU server holds ~1.5-2 GB, and a shared CI box runs out of memory with more.
    A server outlives its test, since starting one costs 40-80 s: test_affinity.py
    (two servers) runs first by name, test_identity.py then reuses both, and
    test_isolation.py and test_store_down.py keep B; test_vllm_attach.py, which
    needs plain servers and stops these, sorts after them."""

    def __init__(self, stack: VLLMStack) -> None:
        self.stack = stack
        self.live: dict[str, object] = {}

    def only(self, name: str, **kw: object):  # type: ignore[no-untyped-def]
        for other in [n for n in self.live if n != name]:
            self.live.pop(other).stop()  # type: ignore[attr-defined]
        return self.get(name, **kw)

    def get(self, name: str, **kw: object):  # type: ignore[no-untyped-def]
        return self.get_many(name, **kw)[0]

    def get_many(self, *names: str, **kw: object) -> list:  # type: ignore[type-arg]
        """The servers by name, the missing ones started together: most of a start
        is process spawns and imports, which overlap (two took 68 s, one 55 s)."""
        started = [n for n in names
                   if n not in self.live or not self.live[n].alive()]  # type: ignore[attr-defined]
        for n in started:
            self.live[n] = self.stack.server(n, **kw)
        for n in started:
            self.live[n].wait_ready()  # type: ignore[attr-defined]
        return [self.live[n] for n in names]

    def stop(self, name: str) -> None:
        proc = self.live.pop(name, None)
        if proc is not None:
            proc.stop()  # type: ignore[attr-defined]

    def stop_all(self) -> None:
        for proc in self.live.values():
            proc.stop()  # type: ignore[attr-defined]
        self.live.clear()


@pytest.fixture(scope="package")
def vllm_servers(vllm_stack: VLLMStack) -> Iterator[Servers]:
    servers = Servers(vllm_stack)
    try:
        yield servers
    finally:
        servers.stop_all()


def two_servers_fit() -> bool:
    """Whether this machine has memory for two vLLM servers at once."""
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) for line in f}
    return info.get("MemAvailable", 0) >= 5 * 2**20           # KiB
