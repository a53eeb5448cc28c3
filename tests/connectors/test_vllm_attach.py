"""Issue 20: KV events in vLLM's own schema, the vLLM ecosystem -> kvserve: two
plain vLLM servers (no connector) registered by ``kvserve vllm-attach``;
kvserve's router learns where a prompt's prefix is from the servers' own KV
events and sends the repeat there. Its own file, named to sort after every
test that uses the connector servers: it stops them for its plain ones, and a
connector server started again would cost another 50-70 s.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from tests.connectors.conftest import two_servers_fit
from tests.connectors.stack import router_keys, until_router_places, vllm_router

pytestmark = pytest.mark.timeout(1500)


def _messages(run: str, i: int) -> list[dict[str, str]]:
    words = " ".join(f"native{i}-{k}" for k in range(150))
    return [{"role": "user", "content": f"Plain fleet {run}, note {i}: {words}"}]


def test_router_places_a_repeat_on_a_plain_vllm_from_its_own_events(vllm_stack, vllm_servers,
                                                                    tmp_path):
    if not two_servers_fit():
        pytest.skip("less than 5 GiB of memory available: two vLLM servers do not fit")
    from connectors.vllm_identity import vllm_fingerprint
    from kvserve.launch_vllm import VLLMProcess
    from kvserve.launch_vllm_attach import AttachConfig, run_attach

    tmp_dirs = [p.tmp_dir for p in vllm_servers.live.values()]
    vllm_servers.stop_all()
    assert tmp_dirs and not any(d is None or d.exists() for d in tmp_dirs), tmp_dirs
    names = ["plain-0", "plain-1"]
    specs = [vllm_stack.spec(n, connector=False, kv_events=f"ipc://{tmp_path}/{n}.ev")
             for n in names]
    procs = [VLLMProcess(s, vllm_stack.root / f"{s.instance_id}.log").start() for s in specs]
    fp = vllm_fingerprint(vllm_stack.model_dir).hex()

    async def body() -> None:
        stop = asyncio.Event()
        attach = [asyncio.get_running_loop().create_task(run_attach(
            AttachConfig(url=s.base_url, instance_id=s.instance_id,
                         redis_url=vllm_stack.redis_url, model_fingerprint=fp,
                         kv_events=s.kv_events), s.security(), stop)) for s in specs]
        try:
            async with vllm_router(vllm_stack.redis_url) as (r, base), \
                    aiohttp.ClientSession() as http:
                for _ in range(600):
                    async with http.get(base + "/health") as resp:
                        if (await resp.json())["instances"].get("prefill") == 2:
                            break
                    await asyncio.sleep(0.2)
                first = []
                for i in range(4):
                    first.append(await _ask(http, base, _messages(vllm_stack.run, i)))
                assert {w for w, _ in first} == set(names), first   # cold ones spread
                for i, (w, out) in enumerate(first):
                    keys = router_keys(r, _messages(vllm_stack.run, i))
                    # Nothing but the server's own events can tell the router this:
                    # no connector, no warehouse.
                    await until_router_places(r, keys, w, 30.0)
                    assert r.view.prefixes.match(keys)[w].by_tier[0] >= len(keys) - 1
                    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
                for i, (w, out) in enumerate(first):
                    again, out2 = await _ask(http, base, _messages(vllm_stack.run, i))
                    assert again == w, f"repeat {i} went to {again}, prefix is on {w}"
                    assert out2["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
                    assert out2["choices"][0]["message"] == out["choices"][0]["message"]
        finally:
            stop.set()
            await asyncio.gather(*attach)

    try:
        for p in procs:
            p.wait_ready()
        asyncio.run(body())
    finally:
        for p in procs:
            p.stop()


async def _ask(http: aiohttp.ClientSession, base: str,
               messages: list[dict[str, str]]) -> tuple[str, dict]:  # type: ignore[type-arg]
    body = {"model": "smollm2", "temperature": 0, "max_tokens": 8, "messages": messages}
    async with http.post(base + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers["X-KV-Prefill-Instance"], json.loads(await resp.text())
