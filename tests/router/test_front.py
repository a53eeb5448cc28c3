"""The HTTP front and the gRPC Router service against a real
stack (tiny-dense model, real Redis, kvstore, prefill, decode, router
processes): validation never answers 500, streaming is well-formed SSE,
cached_tokens grows on a repeat, API keys gate requests and pick the tenant."""

from __future__ import annotations

import json
import math
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from proto import common_pb2, router_pb2, router_pb2_grpc
from tests.router.front_stack import (
    TINY_BLOCK,
    TINY_MODEL,
    RouterProc,
    SplitStack,
    http,
    live_counts,
    metric_sum,
    router_proc,
    wait_until,
)
from tests.tls import channel

MODEL, BLOCK = TINY_MODEL, TINY_BLOCK       # byte-level tokenizer, 1024-token context


Stack = SplitStack


@pytest.fixture(scope="module")
def stack(tiny: SplitStack) -> SplitStack:
    """The package's tiny-dense stack (tests/router/conftest.py), which
    test_front_input.py shares."""
    return tiny


@pytest.fixture(scope="module")
def keyed_router(stack: Stack, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[RouterProc]:
    """A second router on the same cluster, with API keys for two tenants."""
    d = tmp_path_factory.mktemp("keyed")
    keys = d / "keys.txt"
    keys.write_text("# key tenant\nsk-alice-0123456789 alice\nsk-bob-0123456789 bob\n")
    keys.chmod(0o600)                       # a key file readable by others is refused
    r = router_proc(stack.config, stack.redis_url, d, extra=("--api-key-file", str(keys)))
    r.proc.start().wait_ready(60)
    try:
        wait_until(lambda: live_counts(r.http) == {"prefill": 1, "decode": 1}, 30,
                   "keyed router")
        yield r
    finally:
        r.proc.kill()


def _chat(content: str, **extra: object) -> dict:  # type: ignore[type-arg]
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": 6, "temperature": 0, **extra}


def _unique(n_chars: int = 80) -> str:
    base = f"request {uuid.uuid4().hex} "
    return (base * (n_chars // len(base) + 1))[:n_chars]


# -- bad input: always 4xx with an OpenAI error body ------------------------------------

CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"
OK_MSG = [{"role": "user", "content": "hi"}]
BAD_INPUTS: list[tuple[str, str, bytes | dict, int, str | None, str | None]] = [  # type: ignore[type-arg]
    # (id, path, body, status, param, code)
    ("invalid-json", CHAT, b'{"model": "tiny-dense", "messages": [', 400, "body", "invalid_json"),
    ("not-utf8", CHAT, b"\xff\xfe{}", 400, "body", "invalid_encoding"),
    ("empty-body", CHAT, b"", 400, "body", None),
    ("array-body", CHAT, b"[1, 2]", 400, "body", None),
    ("missing-messages", CHAT, {"model": MODEL}, 400, "messages", None),
    ("messages-null", CHAT, {"model": MODEL, "messages": None}, 400, "messages", None),
    ("messages-string", CHAT, {"model": MODEL, "messages": "hi"}, 400, "messages", None),
    ("messages-empty", CHAT, {"model": MODEL, "messages": []}, 400, "messages", None),
    ("message-not-object", CHAT, {"model": MODEL, "messages": ["hi"]}, 400, "messages[0]", None),
    ("role-missing", CHAT, {"model": MODEL, "messages": [{"content": "hi"}]}, 400,
     "messages[0].role", None),
    ("role-unknown", CHAT, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
     400, "messages[0].role", None),
    ("content-int", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content", None),
    ("content-image", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400,
     "messages[0].content[0].type", None),
    ("model-missing", CHAT, {"messages": OK_MSG}, 400, "model", None),
    ("model-int", CHAT, {"model": 7, "messages": OK_MSG}, 400, "model", None),
    ("model-unknown", CHAT, {"model": "gpt-9", "messages": OK_MSG}, 404, "model",
     "model_not_found"),
    ("max-tokens-string", CHAT, {"model": MODEL, "messages": OK_MSG, "max_tokens": "ten"}, 400,
     "max_tokens", None),
    ("max-tokens-bool", CHAT, {"model": MODEL, "messages": OK_MSG, "max_tokens": True}, 400,
     "max_tokens", None),
    ("max-tokens-float", CHAT, {"model": MODEL, "messages": OK_MSG, "max_tokens": 2.5}, 400,
     "max_tokens", None),
    ("max-tokens-zero", CHAT, {"model": MODEL, "messages": OK_MSG, "max_tokens": 0}, 400,
     "max_tokens", None),
    ("max-tokens-huge", CHAT, {"model": MODEL, "messages": OK_MSG, "max_tokens": 10**15}, 400,
     "max_tokens", "context_length_exceeded"),
    ("max-completion-tokens-huge", CHAT, {"model": MODEL, "messages": OK_MSG,
                                          "max_completion_tokens": 2**40}, 400,
     "max_completion_tokens", "context_length_exceeded"),
    ("prompt-plus-max-tokens", CHAT, {"model": MODEL, "messages": [
        {"role": "user", "content": "x" * 600}], "max_tokens": 600}, 400, "max_tokens",
     "context_length_exceeded"),
    ("prompt-longer-than-context", COMPL, {"model": MODEL, "prompt": "y" * 5000}, 400,
     "prompt", "context_length_exceeded"),
    ("temperature-string", CHAT, {"model": MODEL, "messages": OK_MSG, "temperature": "hot"},
     400, "temperature", None),
    ("temperature-high", CHAT, {"model": MODEL, "messages": OK_MSG, "temperature": 3}, 400,
     "temperature", None),
    ("top-p-zero", CHAT, {"model": MODEL, "messages": OK_MSG, "top_p": 0}, 400, "top_p", None),
    ("n-two", CHAT, {"model": MODEL, "messages": OK_MSG, "n": 2}, 400, "n", None),
    ("n-string", CHAT, {"model": MODEL, "messages": OK_MSG, "n": "one"}, 400, "n", None),
    ("logprobs", CHAT, {"model": MODEL, "messages": OK_MSG, "logprobs": True}, 400, "logprobs",
     None),
    ("stream-string", CHAT, {"model": MODEL, "messages": OK_MSG, "stream": "yes"}, 400, "stream",
     None),
    ("stream-options-without-stream", CHAT, {"model": MODEL, "messages": OK_MSG,
                                             "stream_options": {"include_usage": True}}, 400,
     "stream_options", None),
    ("stop-too-many", CHAT, {"model": MODEL, "messages": OK_MSG, "stop": list("abcde")}, 400,
     "stop", None),
    ("stop-int", CHAT, {"model": MODEL, "messages": OK_MSG, "stop": 3}, 400, "stop", None),
    ("seed-string", CHAT, {"model": MODEL, "messages": OK_MSG, "seed": "s"}, 400, "seed", None),
    ("penalty-range", CHAT, {"model": MODEL, "messages": OK_MSG, "presence_penalty": 9}, 400,
     "presence_penalty", None),
    ("prompt-missing", COMPL, {"model": MODEL}, 400, "prompt", None),
    ("prompt-int", COMPL, {"model": MODEL, "prompt": 12}, 400, "prompt", None),
    ("prompt-empty", COMPL, {"model": MODEL, "prompt": ""}, 400, "prompt", None),
    ("prompt-batch", COMPL, {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt", None),
    ("prompt-token-out-of-vocab", COMPL, {"model": MODEL, "prompt": [1, 2, 10**6]}, 400,
     "prompt[2]", None),
    ("prompt-token-negative", COMPL, {"model": MODEL, "prompt": [1, -2]}, 400, "prompt[1]",
     None),
    ("echo", COMPL, {"model": MODEL, "prompt": "a", "echo": True}, 400, "echo", None),
]


def _assert_openai_error(reply_body: bytes, param: str | None, code: str | None) -> dict:  # type: ignore[type-arg]
    body = json.loads(reply_body)
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, body
    assert isinstance(err["message"], str) and len(err["message"]) > 5
    assert err["type"] in ("invalid_request_error", "service_unavailable", "server_error")
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


@pytest.mark.parametrize(("path", "body", "status", "param", "code"),
                         [case[1:] for case in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_4xx_with_openai_error(stack: Stack, path: str, body: bytes | dict,  # type: ignore[type-arg]
                                            status: int, param: str | None,
                                            code: str | None) -> None:
    r = http("POST", stack.http + path, body)
    assert r.status == status, r.body
    assert r.headers["Content-Type"].startswith("application/json")
    _assert_openai_error(r.body, param, code)


def test_nan_and_routing_errors_are_4xx(stack: Stack) -> None:
    # Python's json accepts NaN; the API must not (strict JSON: refused while parsing).
    r = http("POST", stack.http + CHAT,
             b'{"model": "tiny-dense", "messages": [{"role": "user", "content": "a"}], '
             b'"temperature": NaN}')
    assert r.status == 400 and _assert_openai_error(r.body, "body", "invalid_json")
    r = http("GET", stack.http + "/v1/nothing")
    assert r.status == 404 and _assert_openai_error(r.body, None, None)
    r = http("GET", stack.http + CHAT)
    assert r.status == 405 and _assert_openai_error(r.body, None, None)
    r = http("POST", stack.http + CHAT, b"{" + b" " * (17 * 2**20) + b"}")
    assert r.status == 413 and _assert_openai_error(r.body, "body", None)
    r = http("POST", stack.http + CHAT, _chat("hi"), headers={"X-KV-Class": "batch"})
    assert r.status == 400 and _assert_openai_error(r.body, "X-KV-Class",
                                                    "unknown_traffic_class")
    # Still serving after all of that, and no request ever answered 500.
    assert http("POST", stack.http + CHAT, _chat("still alive?")).status == 200
    assert metric_sum(stack.http, "kvserve_router_requests_total", status="500") == 0


# -- good input ---------------------------------------------------------------------------


def test_unknown_fields_are_ignored_and_usage_is_complete(stack: Stack) -> None:
    # Longer than [router] local_cold_tokens: the prefill path, whose headers this checks.
    body = _chat(_unique(300), user="u1", logit_bias={}, metadata={"a": "b"}, frobnicate=[1, 2],
                 parallel_tool_calls=False, presence_penalty=0, seed=3)
    # An empty tools array is refused, as OpenAI's API does, naming the field.
    bad = http("POST", stack.http + CHAT, {**body, "tools": []})
    assert bad.status == 400 and bad.json()["error"]["param"] == "tools", bad.body
    r = http("POST", stack.http + CHAT, body, headers={"X-KV-Class": "agent"})
    assert r.status == 200, r.body
    out = r.json()
    assert out["object"] == "chat.completion" and out["model"] == MODEL
    assert out["id"].startswith("chatcmpl-")
    choice = out["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length")
    u = out["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert 1 <= u["completion_tokens"] <= 6
    assert u["prompt_tokens_details"]["cached_tokens"] == 0
    assert r.headers["X-KV-Prefill-Instance"].startswith("prefill-")
    assert r.headers["X-KV-Decode-Instance"].startswith("decode-")


def test_second_identical_request_reports_cached_tokens(stack: Stack) -> None:
    body = _chat(_unique(200))
    first = http("POST", stack.http + CHAT, body).json()
    second = http("POST", stack.http + CHAT, body).json()
    p = first["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    # Every full block but the one holding the last token (the hit rule keeps >= 1).
    assert cached == (p - 1) // BLOCK * BLOCK and cached > 0
    # Restoring is lossless: greedy output is identical.
    assert second["choices"][0]["message"] == first["choices"][0]["message"]


def test_streaming_chat_is_well_formed_and_matches_non_streaming(stack: Stack) -> None:
    body = _chat(_unique(), max_tokens=12)
    whole = http("POST", stack.http + CHAT, body).json()
    r = http("POST", stack.http + CHAT,
             {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    events = r.events()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = [c for c in chunks if c["choices"]]
    assert [c["choices"][0]["finish_reason"] for c in content][:-1] == [None] * (len(content) - 1)
    assert content[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert all(c["usage"] is None for c in content)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in content)
    assert text == whole["choices"][0]["message"]["content"]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == \
        whole["usage"]["completion_tokens"]
    assert usage["usage"]["prompt_tokens_details"]["cached_tokens"] > 0   # same prompt again


def test_streaming_completion_without_usage_and_token_prompt(stack: Stack) -> None:
    tokens = [ord(c) for c in _unique(40)]
    r = http("POST", stack.http + COMPL, {"model": MODEL, "prompt": tokens, "max_tokens": 5,
                                          "temperature": 0, "ignore_eos": True,
                                          "stream": True})
    events = r.events()
    assert r.status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["choices"] for c in chunks)
    assert all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    whole = http("POST", stack.http + COMPL, {"model": MODEL, "prompt": tokens, "max_tokens": 5,
                                              "temperature": 0, "ignore_eos": True}).json()
    assert whole["usage"]["prompt_tokens"] == len(tokens)
    assert whole["choices"][0]["text"] == "".join(c["choices"][0]["text"] for c in chunks)


def test_models_health_metrics(stack: Stack) -> None:
    models = http("GET", stack.http + "/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    one = http("GET", stack.http + f"/v1/models/{MODEL}")
    assert one.status == 200 and one.json() == models["data"][0]
    missing = http("GET", stack.http + "/v1/models/no-such-model")
    assert missing.status == 404
    assert missing.json()["error"]["code"] == "model_not_found"
    health = http("GET", stack.http + "/health")
    assert health.status == 200 and health.json()["instances"] == {"prefill": 1, "decode": 1}
    http("POST", stack.http + CHAT, _chat(_unique(300)))   # past local_cold_tokens: prefill
    assert metric_sum(stack.http, "kvserve_router_placements_total", role="prefill") >= 1
    assert metric_sum(stack.http, "kvserve_router_placements_total", role="decode") >= 1
    assert metric_sum(stack.http, "kvserve_router_hit_rule", field="block_tokens") == BLOCK
    assert metric_sum(stack.http, "kvserve_router_tokens_total", kind="cached") > 0
    assert metric_sum(stack.http, "kvserve_router_kv_events_total", kind="stored") > 0


def test_client_disconnect_cancels_the_decode(stack: Stack) -> None:
    """A client that hangs up mid-stream stops its generation on the decode instance."""
    cancelled = stack.decode.metrics().get("kvserve_decode_batch_cancelled_total", 0.0)
    body = json.dumps({"model": MODEL, "prompt": "go on", "max_tokens": 1000,
                       "ignore_eos": True, "stream": True}).encode()
    host, port = stack.http.removeprefix("http://").split(":")
    t0 = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Type: application/json\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
        buf = b""
        while b"data: " not in buf:
            chunk = s.recv(65536)
            assert chunk, buf
            buf += chunk
    # 1,000 tokens take seconds here; the cancel must land well before they would end.
    wait_until(lambda: stack.decode.metrics()["kvserve_decode_batch_cancelled_total"]
               > cancelled, 5.0, "the decode to be cancelled")
    assert stack.decode.metrics()["kvserve_decode_batch_active"] == 0
    assert metric_sum(stack.http, "kvserve_router_in_flight") == 0
    assert time.monotonic() - t0 < 5.0


# -- API keys and tenants -------------------------------------------------------------------


def test_api_keys_gate_requests_and_pick_the_tenant(keyed_router: RouterProc) -> None:
    base = keyed_router.http
    body = _chat(_unique(120))
    for headers in ({}, {"Authorization": "Bearer sk-nobody-000000000"},
                    {"Authorization": "Basic sk-alice-0123456789"}):
        r = http("POST", base + CHAT, body, headers=headers)
        assert r.status == 401, r.body
        _assert_openai_error(r.body, None, "invalid_api_key")
    assert http("GET", base + "/v1/models").status == 401
    assert http("GET", base + "/health").status == 200       # probes need no key
    alice = {"Authorization": "Bearer sk-alice-0123456789"}
    bob = {"Authorization": "Bearer sk-bob-0123456789"}
    a1 = http("POST", base + CHAT, body, headers=alice).json()["usage"]
    a2 = http("POST", base + CHAT, body, headers=alice).json()["usage"]
    b1 = http("POST", base + CHAT, body, headers=bob).json()["usage"]
    assert a1["prompt_tokens_details"]["cached_tokens"] == 0
    assert a2["prompt_tokens_details"]["cached_tokens"] > 0
    # Same prompt, other tenant: its keys are salted differently, so no hit.
    assert b1["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_returning_prompt_with_a_short_tail_skips_prefill(stack: Stack,
                                                            keyed_router: RouterProc) -> None:
    """A prompt that extends one decoded on the decode instance by a short tail
    goes there alone (router.dispatch): no prefill placement, the prefix from
    decode's G1, and the same tokens as a cold run through prefill (another
    router and tenant, so nothing is cached there)."""
    first = [ord(c) for c in _unique(100)]
    turn = first + [ord(c) for c in _unique(30)]

    def body(tokens: list[int]) -> dict:  # type: ignore[type-arg]
        return {"model": MODEL, "prompt": tokens, "max_tokens": 6, "temperature": 0,
                "ignore_eos": True}

    def count(name: str, **labels: str) -> float:
        return metric_sum(stack.http, name, **labels)

    assert http("POST", stack.http + COMPL, body(first)).status == 200
    served = count("kvserve_router_local_tails_total", outcome="served")
    prefills = count("kvserve_router_placements_total", role="prefill")
    warm = http("POST", stack.http + COMPL, body(turn)).json()
    assert count("kvserve_router_local_tails_total", outcome="served") == served + 1
    assert count("kvserve_router_placements_total", role="prefill") == prefills
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == len(first) // BLOCK * BLOCK
    alice = {"Authorization": "Bearer sk-alice-0123456789"}
    cold = http("POST", keyed_router.http + COMPL, body(turn), headers=alice).json()
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    # A tail longer than [router] local_tail_tokens (512) takes the usual path.
    long_turn = turn + [ord(c) for c in _unique(600)]
    assert http("POST", stack.http + COMPL, body(long_turn)).status == 200
    assert count("kvserve_router_placements_total", role="prefill") == prefills + 1
    assert count("kvserve_router_local_tails_total", outcome="served") == served + 1


def test_a_short_cold_prompt_skips_prefill(stack: Stack) -> None:
    """A prompt nobody holds, of at most [router] local_cold_tokens (256), is
    computed on a decode instance with no prefill placement; a longer one
    takes the usual path."""
    def body(tokens: list[int]) -> dict:  # type: ignore[type-arg]
        return {"model": MODEL, "prompt": tokens, "max_tokens": 4, "temperature": 0,
                "ignore_eos": True}

    def count(name: str, **labels: str) -> float:
        return metric_sum(stack.http, name, **labels)

    served = count("kvserve_router_local_colds_total", outcome="served")
    prefills = count("kvserve_router_placements_total", role="prefill")
    short = http("POST", stack.http + COMPL, body([ord(c) for c in _unique(40)])).json()
    assert short["usage"]["completion_tokens"] == 4
    assert count("kvserve_router_local_colds_total", outcome="served") == served + 1
    assert count("kvserve_router_placements_total", role="prefill") == prefills
    assert count("kvserve_router_placements_total", role="decode", reason="local_cold") >= 1
    assert http("POST", stack.http + COMPL, body([ord(c) for c in _unique(300)])).status == 200
    assert count("kvserve_router_placements_total", role="prefill") == prefills + 1
    assert count("kvserve_router_local_colds_total", outcome="served") == served + 1


# -- gRPC Router service ---------------------------------------------------------------------


def test_grpc_router_generate(stack: Stack) -> None:
    with channel(stack.grpc) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        req = router_pb2.GenerateRequest(
            ctx=common_pb2.RequestContext(request_id="grpc-1", traffic_class="chat"),
            prompt=_unique(300), sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True))
        events = list(stub.Generate(req, timeout=30))
        assert events[-1].finished and events[-1].finish_reason == "length"
        assert not any(e.finished for e in events[:-1])
        assert sum(len(e.token_ids) for e in events) == 4
        assert events[-1].usage.prompt_tokens == 300 and events[-1].usage.completion_tokens == 4
        assert events[0].prefill_instance.startswith("prefill-")
        bad = [router_pb2.GenerateRequest(prompt="x", messages=[common_pb2.ChatMessage(
                   role="user", content="y")]),
               router_pb2.GenerateRequest(prompt="x", sampling=common_pb2.SamplingParams(
                   temperature=math.inf)),
               router_pb2.GenerateRequest(prompt="x", ctx=common_pb2.RequestContext(
                   traffic_class="nope")),
               router_pb2.GenerateRequest(prompt="x", ctx=common_pb2.RequestContext(
                   tenant="no spaces allowed")),
               router_pb2.GenerateRequest(prompt="x", sampling=common_pb2.SamplingParams(
                   max_tokens=10**6))]
        for b in bad:
            with pytest.raises(grpc.RpcError) as exc:
                list(stub.Generate(b, timeout=10))
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.value.details()


def test_router_serve_rejects_bad_configuration(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from kvserve.cli import main

    keys = tmp_path / "keys.txt"
    keys.write_text("only-one-field\n")
    keys.chmod(0o600)
    for extra, why in ((["--api-key-file", str(keys)], "want 'KEY TENANT'"),
                       (["--api-key-file", str(tmp_path / "missing")], "cannot read"),
                       (["--policy", "fastest"], "unknown router policy 'fastest'")):
        code = main(["router", "serve", "--redis-url", "redis://127.0.0.1:1/0",
                     "--model", MODEL, *extra])
        err = capsys.readouterr().err
        assert code == 2 and "kvserve: error:" in err and why in err, err
