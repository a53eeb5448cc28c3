"""Issues 11, 19, 20: our router in front of two vLLM servers (backend "vllm",
``cache_aware``).

* With the connector: a repeat goes to the instance that holds the prefix in
  its own cache, which the router learns from the connectors' G1 KV events
  (both servers share one kvstore, so the warehouse's G2 events credit both
  equally); answers are OpenAI bodies with the usage block, also streamed; the
  hop is HTTPS with the API key, and a server refuses a client without either.
* Plain vLLM servers (no connector) registered by ``kvserve vllm-attach``: the
  router learns where a prefix is from the servers' own KV events (vLLM's
  msgpack/ZMQ schema) and sends the repeat there.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from tests.connectors.conftest import two_servers_fit
from tests.connectors.stack import router_keys, security, until_router_places, vllm_router

pytestmark = pytest.mark.timeout(1500)
N = 4


def _messages(run: str, i: int) -> list[dict[str, str]]:
    words = " ".join(f"fact{i}-{k}" for k in range(150))
    return [{"role": "user", "content": f"Session {run} note {i}. Summarise: {words}"}]


async def _ask(http: aiohttp.ClientSession, base: str, messages: list[dict[str, str]], *,
               stream: bool = False) -> tuple[str, dict, str]:  # type: ignore[type-arg]
    body = {"model": "smollm2", "temperature": 0, "max_tokens": 8, "messages": messages,
            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
    async with http.post(base + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        where = resp.headers["X-KV-Prefill-Instance"]
        if not stream:
            return where, await resp.json(), ""
        events = [json.loads(line[6:]) for line in (await resp.text()).splitlines()
                  if line.startswith("data: {")]
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events
                       if e.get("choices"))
        return where, events[-1], text


def test_cache_aware_repeat_goes_to_the_instance_holding_the_prefix(vllm_stack, vllm_servers):
    if not two_servers_fit():
        pytest.skip("less than 5 GiB of memory available: two vLLM servers do not fit")
    a, _ = vllm_servers.get_many("vllm-a", "vllm-b")
    _, insecure = security()
    if not insecure:
        _refuses_clients_without_tls_or_key(a)

    async def body() -> None:
        async with vllm_router(vllm_stack.redis_url) as (r, base), \
                aiohttp.ClientSession() as http:
            async with http.get(base + "/health") as resp:
                assert resp.status == 200
                assert (await resp.json())["instances"]["prefill"] == 2
            first = [await _ask(http, base, _messages(vllm_stack.run, i)) for i in range(N)]
            placed = [w for w, _, _ in first]
            assert set(placed) == {"vllm-a", "vllm-b"}, placed   # ties spread the cold ones
            for i, (w, out, _) in enumerate(first):
                keys = router_keys(r, _messages(vllm_stack.run, i))
                await until_router_places(r, keys, w, 20.0)
                g1 = r.view.prefixes.match(keys)[w]
                assert g1.by_tier[0] >= len(keys) - 1      # G1: from the connector's events
                assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            for i, (w, out, _) in enumerate(first):
                again, out2, _ = await _ask(http, base, _messages(vllm_stack.run, i))
                assert again == w, f"repeat {i} went to {again}, prefix is on {w}"
                assert out2["choices"][0]["message"] == out["choices"][0]["message"]
                assert out2["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            where, last, text = await _ask(http, base, _messages(vllm_stack.run, 0),
                                           stream=True)
            assert where == placed[0]
            assert text == first[0][1]["choices"][0]["message"]["content"]
            assert last["usage"]["completion_tokens"] == 8
            async with http.post(base + "/v1/chat/completions",
                                 json={"model": "smollm2", "messages": []}) as resp:
                assert resp.status == 400
                assert (await resp.json())["error"]["type"] == "invalid_request_error"

    asyncio.run(body())


def _refuses_clients_without_tls_or_key(server) -> None:  # type: ignore[no-untyped-def]
    """The router<->vLLM hop: plain HTTP, TLS without a client certificate, and a
    client certificate without the API key are all refused."""
    import ssl
    import urllib.error
    import urllib.request

    from kvserve.launch_vllm import client_ssl

    spec = server.spec
    body = json.dumps({"model": "smollm2", "prompt": [1, 2, 3], "max_tokens": 1}).encode()
    key = {"authorization": f"Bearer {spec.api_key()}", "content-type": "application/json"}

    def call(url: str, ctx: ssl.SSLContext | None, headers: dict[str, str]) -> int:
        req = urllib.request.Request(url + "/v1/completions", data=body, headers=headers)
        with urllib.request.urlopen(req, timeout=60, context=ctx) as resp:
            return resp.status

    plain = f"http://{spec.host}:{spec.port}"
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        call(plain, None, key)                                 # plain text: no answer
    no_cert = ssl.create_default_context(cadata=spec.security().ca_pem.decode())
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError, OSError)):
        call(spec.base_url, no_cert, key)                      # no client certificate
    with pytest.raises(urllib.error.HTTPError) as err:
        call(spec.base_url, client_ssl(spec), {"content-type": "application/json"})
    assert err.value.code == 401                               # certificate, no key
    assert call(spec.base_url, client_ssl(spec), key) == 200
