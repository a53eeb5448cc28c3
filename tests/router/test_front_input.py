"""Hostile input to the HTTP front, against real processes: every malformed
body, header or encoding class gets a 4xx with an OpenAI error body and the
router keeps serving; wrong types in every field never give a 5xx; /health
stays fast while 16-MiB bodies are being refused or tokenized; request ids
are the server's own."""

from __future__ import annotations

import contextlib
import gzip
import json
import socket
import threading
import time
import zlib
from collections.abc import Iterator

import pytest

from kvstore.redis_server import EmbeddedRedis
from tests.prefill_svc.procs import write_config
from tests.router.front_stack import (
    TINY_BLOCK,
    TINY_MODEL,
    RouterProc,
    SplitStack,
    http,
    metric_sum,
    router_proc,
)

MODEL, BLOCK = TINY_MODEL, TINY_BLOCK
CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"
OK = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
      "temperature": 0}
OK_BYTES = json.dumps(OK).encode()
MIB = 2**20


@pytest.fixture(scope="module")
def router(tiny: SplitStack) -> RouterProc:
    """The package's tiny-dense stack's router (tests/router/conftest.py), which
    test_front.py shares."""
    return tiny.router


# -- a raw HTTP/1.1 client: the malformed requests urllib would refuse to send --------------


Reply = tuple[int, dict[str, str], bytes]


def _read_reply(s: socket.socket) -> Reply:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        assert chunk, f"connection closed without a reply: {buf!r}"
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in
               (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split()[1]), headers, body


def _raw(base: str, request: bytes, timeout: float = 30.0) -> Reply:
    """Send ``request`` and read the reply at the same time: a server may answer
    (413) and close before the whole body is sent."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        def send() -> None:
            with contextlib.suppress(OSError):
                s.sendall(request)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        try:
            return _read_reply(s)
        finally:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            sender.join(timeout=timeout)


def _post(body: bytes, headers: dict[str, str] | None = None, path: str = CHAT,
          content_length: bool = True) -> bytes:
    hdrs = {"Host": "x", "Content-Type": "application/json", "Connection": "close",
            **(headers or {})}
    if content_length:
        hdrs["Content-Length"] = str(len(body))
    head = "".join(f"{k}: {v}\r\n" for k, v in hdrs.items() if v)
    return f"POST {path} HTTP/1.1\r\n{head}\r\n".encode() + body


def _assert_error(status: int, headers: dict[str, str], body: bytes, want: int | None) -> dict:  # type: ignore[type-arg]
    assert 400 <= status < 500, (status, body[:300])
    if want is not None:
        assert status == want, (status, body[:300])
    assert headers["content-type"].startswith("application/json"), headers
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == "invalid_request_error", err
    return err  # type: ignore[no-any-return]


def _with(field: str, raw_value: bytes) -> bytes:
    """OK's body with one more field written verbatim (JSON Python cannot produce)."""
    return OK_BYTES[:-1] + b', "' + field.encode() + b'": ' + raw_value + b"}"


MALFORMED: list[tuple[str, bytes, int | None, str | None]] = [
    # (id, raw request, status (None: any 4xx), param)
    ("nesting-5000", _post(b"[" * 5000 + b"]" * 5000), 400, "body"),
    ("nesting-5000-in-field", _post(_with("metadata", b'{"a":' * 5000 + b"1" + b"}" * 5000)),
     400, "body"),
    ("nesting-65", _post(_with("x", b"[" * 65 + b"]" * 65)), 400, "body"),
    ("int-4301-digits", _post(_with("max_tokens", b"7" * 4301)), 400, "body"),
    ("int-5000-digits-unknown-field", _post(_with("x", b"-" + b"9" * 5000)), 400, "body"),
    ("1e400-as-int", _post(_with("max_tokens", b"1e400")), 400, "body"),
    ("1e400-as-float", _post(_with("temperature", b"1e400")), 400, "body"),
    ("minus-1e400", _post(_with("seed", b"-1e400")), 400, "body"),
    ("nan", _post(_with("temperature", b"NaN")), 400, "body"),
    ("infinity", _post(_with("top_p", b"-Infinity")), 400, "body"),
    ("lone-surrogate-content", _post(b'{"model": "tiny-dense", "messages": [{"role": "user", '
                                     b'"content": "a\\ud800b"}]}'), 400,
     "messages[0].content"),
    ("lone-surrogate-key", _post(_with("\\udfff", b"1")), 400, "body"),
    ("low-surrogate-model", _post(b'{"model": "\\udc00", "messages": []}'), 400, "model"),
    ("not-utf8", _post(b'{"model": "\xff\xfe"}'), 400, "body"),
    ("utf8-bom", _post(b"\xef\xbb\xbf" + OK_BYTES), 400, "body"),
    ("truncated-json", _post(OK_BYTES[:-3]), 400, "body"),
    ("trailing-garbage", _post(OK_BYTES + b"}"), 400, "body"),
    ("empty-body", _post(b""), 400, "body"),
    ("whitespace-body", _post(b"  \n "), 400, "body"),
    ("null-body", _post(b"null"), 400, "body"),
    ("string-body", _post(b'"hi"'), 400, "body"),
    ("number-body", _post(b"12"), 400, "body"),
    ("array-body", _post(b"[{}]"), 400, "body"),
    ("gzip-header-plain-body", _post(OK_BYTES, {"Content-Encoding": "gzip"}), 400, "body"),
    ("deflate-header-plain-body", _post(OK_BYTES, {"Content-Encoding": "deflate"}), 400,
     "body"),
    ("gzip-truncated", _post(gzip.compress(OK_BYTES)[:-9], {"Content-Encoding": "gzip"}), 400,
     "body"),
    ("gzip-trailing-bytes", _post(gzip.compress(OK_BYTES) + b"xx",
                                  {"Content-Encoding": "gzip"}), 400, "body"),
    ("gzip-bomb", _post(gzip.compress(b" " * (40 * MIB)), {"Content-Encoding": "gzip"}), 413,
     "body"),
    ("gzip-of-bad-json", _post(gzip.compress(b"[" * 5000), {"Content-Encoding": "gzip"}), 400,
     "body"),
    ("br", _post(OK_BYTES, {"Content-Encoding": "br"}), 415, "Content-Encoding"),
    ("zstd", _post(OK_BYTES, {"Content-Encoding": "zstd"}), 415, "Content-Encoding"),
    ("anything-encoding", _post(OK_BYTES, {"Content-Encoding": "anything"}), 415,
     "Content-Encoding"),
    ("triple-gzip", _post(OK_BYTES, {"Content-Encoding": "gzip, gzip, gzip"}), 415,
     "Content-Encoding"),
    ("text-plain", _post(OK_BYTES, {"Content-Type": "text/plain"}), 415, "Content-Type"),
    ("form", _post(OK_BYTES, {"Content-Type": "application/x-www-form-urlencoded"}), 415,
     "Content-Type"),
    ("multipart", _post(OK_BYTES, {"Content-Type": "multipart/form-data; boundary=x"}), 415,
     "Content-Type"),
    ("latin1-charset", _post(OK_BYTES, {"Content-Type": "application/json; charset=latin-1"}),
     415, "Content-Type"),
    ("content-length-over-limit", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
     b"Content-Type: application/json\r\nContent-Length: 99999999999\r\n\r\n{", 413, "body"),
    ("chunked-over-limit", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
     b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
     + (b"100000\r\n" + b" " * 0x100000 + b"\r\n") * 17 + b"0\r\n\r\n", 413, "body"),
    ("chunked-bad-size", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close"
     b"\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n", 400, None),
    ("content-length-not-a-number", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
     b"Content-Length: ten\r\n\r\n", 400, None),
    ("header-line-20k", _post(OK_BYTES, {"X-Long": "a" * 20_000}), None, None),
    ("header-name-20k", _post(OK_BYTES, {"X" * 20_000: "a"}), None, None),
    ("too-many-headers", _post(OK_BYTES, {f"X-H{i}": "v" for i in range(300)}), None, None),
    ("url-20k", b"GET /v1/models?" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", None,
     None),
    ("bad-request-line", b"GARBAGE\r\n\r\n", 400, None),
    ("expect-bogus", _post(OK_BYTES, {"Expect": "bogus"}), 417, "headers"),
    ("nul-in-header", _post(OK_BYTES, {"X-A": "a\x00b"}), 400, "headers"),
    ("binary-request-id", _post(OK_BYTES, {"X-Request-Id": "\x7f\x01"}), 400, "headers"),
    ("two-content-lengths", _post(OK_BYTES, {"content-length": "5"}), 400, "headers"),
    ("chunked-and-length", _post(OK_BYTES, {"Transfer-Encoding": "chunked"}), 400, "headers"),
    ("binary-traffic-class", _post(OK_BYTES, {"X-KV-Class": "\xff"}), 400, "X-KV-Class"),
    ("bad-http-version", b"GET / HTTP/9.9\r\nHost: x\r\n\r\n", None, None),
    ("wrong-method", b"DELETE /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
     b"Connection: close\r\n\r\n", 405, None),
    ("unknown-path", _post(OK_BYTES, path="/v1/nothing"), 404, None),
]


@pytest.mark.parametrize(("request_bytes", "status", "param"), [c[1:] for c in MALFORMED],
                         ids=[c[0] for c in MALFORMED])
def test_malformed_input_is_4xx_with_openai_error(router: RouterProc, request_bytes: bytes,
                                                  status: int | None,
                                                  param: str | None) -> None:
    got, headers, body = _raw(router.http, request_bytes)
    err = _assert_error(got, headers, body, status)
    if param is not None:
        assert err["param"] == param, err


def test_valid_gzip_and_deflate_bodies_are_decoded(router: RouterProc) -> None:
    for enc, data in (("gzip", gzip.compress(OK_BYTES)), ("deflate", zlib.compress(OK_BYTES)),
                      ("identity", OK_BYTES)):
        status, _, body = _raw(router.http, _post(data, {"Content-Encoding": enc}))
        assert status == 200, (enc, body[:300])
        assert json.loads(body)["usage"]["completion_tokens"] >= 1
    # No Content-Type at all is JSON too (curl --data-binary without -H).
    status, _, body = _raw(router.http, _post(OK_BYTES, {"Content-Type": ""}))
    assert status == 200, body[:300]


# Every JSON type, plus values at the edges of the ones a field takes.
_VALUES: list[object] = [None, True, 0, -1, 2**63, -(2**63) - 1, 10**60, 0.5, -1e308, "",
                         "\u0000x", [], ["a"], {}, {"a": 1}, {"type": "text"}]
_CHAT_FIELDS = ["model", "messages", "max_tokens", "max_completion_tokens", "temperature",
                "top_p", "seed", "stop", "stream", "stream_options", "n", "logprobs",
                "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "user",
                "ignore_eos", "tools", "tool_choice", "response_format", "parallel_tool_calls"]
_COMPLETION_FIELDS = ["prompt", "max_tokens", "echo", "best_of", "suffix", "logprobs"]
_MESSAGE_FIELDS = ["role", "content", "name", "tool_calls", "tool_call_id"]


def _cases() -> Iterator[tuple[str, dict]]:  # type: ignore[type-arg]
    base_c = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for v in _VALUES:
        for f in _CHAT_FIELDS:
            yield CHAT, {**OK, f: v}
        for f in _COMPLETION_FIELDS:
            yield COMPL, {**base_c, f: v}
        for f in _MESSAGE_FIELDS:
            yield CHAT, {**OK, "messages": [{"role": "user", "content": "hi", f: v}]}
        yield CHAT, {**OK, "messages": [{"role": "user", "content": [{"type": "text",
                                                                       "text": v}]}]}
        yield CHAT, {**OK, "messages": [v]}


def test_wrong_types_in_every_field_never_5xx(router: RouterProc) -> None:
    seen: dict[int, int] = {}
    for path, body in _cases():
        r = http("POST", router.http + path, json.dumps(body).encode(), timeout=60)
        seen[r.status] = seen.get(r.status, 0) + 1
        assert r.status < 500, (path, body, r.body[:300])
        if r.status >= 400:
            _assert_error(r.status, {"content-type": r.headers["Content-Type"]}, r.body, None)
    assert seen.get(200, 0) > 0 and seen.get(400, 0) > 100, seen


def test_still_serving_and_never_500_after_all_of_it(router: RouterProc) -> None:
    for _ in range(3):
        r = http("POST", router.http + CHAT, OK)
        assert r.status == 200, r.body
    assert metric_sum(router.http, "kvserve_router_requests_total", status="500") == 0
    assert http("GET", router.http + "/health").status == 200


def test_request_ids_are_the_servers_and_the_clients_is_echoed(router: RouterProc) -> None:
    mine = "client-id-42"
    a = http("POST", router.http + CHAT, OK, headers={"X-Request-Id": mine})
    b = http("POST", router.http + CHAT, OK, headers={"X-Request-Id": mine})
    assert a.status == b.status == 200
    ours = [a.headers["X-Request-Id"], b.headers["X-Request-Id"]]
    assert mine not in ours and ours[0] != ours[1]
    assert all(len(x) == 32 and int(x, 16) >= 0 for x in ours)       # 128 random bits
    assert a.headers["X-Client-Request-Id"] == mine
    err = http("POST", router.http + CHAT, b"{", headers={"X-Client-Request-Id": mine})
    assert err.status == 400 and err.headers["X-Client-Request-Id"] == mine


# -- /health while big bodies are refused or tokenized -------------------------------------


@pytest.fixture(scope="module")
def smollm2_router(smollm2_dir: str, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[RouterProc]:
    """A router with SmolLM2's real tokenizer (its BPE is what makes big prompts slow);
    no instances: everything here is refused before placement."""
    d = tmp_path_factory.mktemp("front_big")
    config = write_config(d / "kvserve.toml", model=smollm2_dir, block_tokens=64)
    with EmbeddedRedis() as redis:
        r = router_proc(config, redis.url, d)
        try:
            r.proc.start().wait_ready(90)
            yield r
        finally:
            r.proc.kill()


def _big_bodies(model: str) -> list[tuple[str, bytes, int]]:
    """Eight bodies of about 16 MiB (the limit), each refused a different way."""
    limit = 16 * MIB
    pad = limit - 200

    def chat(content: str) -> bytes:
        return json.dumps({"model": model, "messages": [{"role": "user", "content": content}],
                           "max_tokens": 4}).encode()

    def prompt(text: str) -> bytes:
        return json.dumps({"model": model, "prompt": text, "max_tokens": 4}).encode()

    words = "lorem ipsum dolor sit amet, consectetur "
    return [
        ("over-limit", b"{" + b" " * limit + b"}", 413),
        ("empty-lists", b"[" + b"[]," * (pad // 3) + b"[]]", 400),           # slow json.loads
        ("ints", b"[" + b"1," * (pad // 2) + b"1]", 400),
        ("huge-content", chat("a" * pad), 400),                              # surely too long
        ("huge-prompt", prompt(words * (pad // len(words))), 400),
        # Under the length bound: really tokenized (about a second of BPE each), then
        # refused for the context.
        ("tokenized-chat", chat(words * (1_000_000 // len(words))), 400),
        ("tokenized-prompt", prompt(words * (1_000_000 // len(words))), 400),
        ("gzip-16mib", gzip.compress(b"[" + b"0," * (pad // 2) + b"0]"), 400),
    ]


def test_health_p99_under_100ms_during_8_concurrent_16mib_bodies(
        smollm2_router: RouterProc) -> None:
    base = smollm2_router.http
    model = http("GET", base + "/v1/models").json()["data"][0]["id"]
    bodies = _big_bodies(model)
    results: dict[str, int] = {}
    done = threading.Event()

    def request(name: str, body: bytes) -> bytes:
        headers = {"Content-Encoding": "gzip"} if name.startswith("gzip") else {}
        return _post(body, headers, path=COMPL if "prompt" in name else CHAT)

    # Built before probing starts: copying 16 MiB here would hold this process's GIL
    # and delay the prober, which measures the round trip from this process.
    requests = {name: request(name, body) for name, body, _ in bodies}

    def send(name: str, raw: bytes) -> None:
        try:
            status, hdrs, reply = _raw(base, raw, timeout=300)
            _assert_error(status, hdrs, reply, None)
            results[name] = status
        except Exception as exc:  # recorded; asserted below
            results[name] = -1
            raise AssertionError(f"{name}: {exc}") from exc

    latencies: list[float] = []

    def probe() -> None:
        host, port = base.removeprefix("http://").split(":")
        req = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        with socket.create_connection((host, int(port)), timeout=10) as s:
            while not done.is_set():
                t0 = time.perf_counter()
                s.sendall(req)
                status, _, _ = _read_reply(s)
                latencies.append(time.perf_counter() - t0)
                assert status == 503        # answered (no instances here), not stalled
                time.sleep(0.01)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    time.sleep(0.3)
    senders = [threading.Thread(target=send, args=item, daemon=True)
               for item in requests.items()]
    t0 = time.monotonic()
    for t in senders:
        t.start()
    for t in senders:
        t.join(timeout=320)
    elapsed = time.monotonic() - t0
    done.set()
    prober.join(timeout=10)
    latencies.sort()
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    # The figure docs/BENCHMARKS.md records (pytest -s shows it).
    print(f"\n/health under 8 concurrent ~16 MiB bodies: {len(latencies)} probes over "
          f"{elapsed:.1f} s, p50 {latencies[len(latencies) // 2] * 1000:.1f} ms, "
          f"p99 {p99 * 1000:.1f} ms, max {latencies[-1] * 1000:.1f} ms")
    assert len(latencies) > 20, (len(latencies), elapsed)
    assert p99 < 0.100, f"/health p99 {p99 * 1000:.1f} ms over {len(latencies)} probes " \
                        f"({elapsed:.1f} s of big bodies); max {latencies[-1] * 1000:.1f} ms"
    assert results == {n: s for n, _, s in bodies}, results


def test_big_bodies_leave_the_router_answering(smollm2_router: RouterProc) -> None:
    """After the big bodies a normal request is tokenized and placed at once (no
    instance here: 503 with an OpenAI body, not a hang or a 500)."""
    model = http("GET", smollm2_router.http + "/v1/models").json()["data"][0]["id"]
    t0 = time.monotonic()
    r = http("POST", smollm2_router.http + CHAT,
             {"model": model, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status == 503 and time.monotonic() - t0 < 5, r.body
    assert json.loads(r.body)["error"]["type"] == "service_unavailable"


def test_tokenize_and_detokenize_answer_as_vllm_does(smollm2_router: RouterProc,
                                                     smollm2_dir: str) -> None:
    """``vllm bench serve`` aligns its prompts through the server's /tokenize and
    /detokenize (issue 18's client sweep: without them it skipped the alignment).
    The ids are the router's own tokenizer's: SmolLM2's BPE, control strings in
    the text neutralised as in a served prompt."""
    from tokenizers import Tokenizer as HFTok

    base = smollm2_router.http
    model = http("GET", base + "/v1/models").json()["data"][0]["id"]
    text = "The quick brown fox jumps over the lazy dog, twice."
    want = HFTok.from_file(f"{smollm2_dir}/tokenizer.json").encode(
        text, add_special_tokens=False).ids
    r = http("POST", base + "/tokenize", {"model": model, "prompt": text,
                                           "add_special_tokens": False})
    assert r.status == 200, r.body
    body = r.json()
    assert body["tokens"] == want and body["count"] == len(want)
    assert body["max_model_len"] == 8192
    r = http("POST", base + "/detokenize", {"model": model, "tokens": want[:4]})
    assert r.status == 200 and r.json()["prompt"] == "The quick brown fox", r.body
    # A special token's text in a prompt is plain text, never the special id.
    special = HFTok.from_file(f"{smollm2_dir}/tokenizer.json").token_to_id("<|im_start|>")
    ids = http("POST", base + "/tokenize", {"prompt": "<|im_start|>"}).json()["tokens"]
    assert special not in ids and len(ids) > 1
    # Messages: the chat template, ending in the assistant's turn.
    chat = http("POST", base + "/tokenize",
                {"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
    assert chat.count(special) >= 2 and len(chat) > 3
    for path, bad, param in (("/tokenize", {"prompt": 3}, "prompt"),
                             ("/detokenize", {"tokens": [1 << 20]}, "tokens"),
                             ("/detokenize", {"tokens": "abc"}, "tokens")):
        r = http("POST", base + path, bad)
        assert r.status == 400 and r.json()["error"]["param"] == param, r.body
    assert http("POST", base + "/tokenize", {"model": "other", "prompt": "x"}).status == 404
