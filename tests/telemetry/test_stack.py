"""A real ``kvserve up`` stack (router, prefill, decode, kvstore processes)
with tracing on: one chat request makes one trace, joined to the client's
``traceparent``, whose spans come from all four services and reach a real
OTLP receiver process over loopback; and every PromQL expression of the
dashboard and the alert rules names only series this stack exports."""

from __future__ import annotations

import json
import secrets
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.telemetry.promql import expressions, metric_names, scrape_names
from tests.telemetry.stack import API_KEY, TENANT, Stack, traced_stack

pytestmark = pytest.mark.slow

SERVICES = {"kvserve-router", "kvserve-prefill", "kvserve-decode", "kvserve-kvstore"}
MARKER = "zebra-quartz-marker"          # prompt text: must never reach a span


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with traced_stack(tmp_path_factory.mktemp("observe")) as s:
        yield s


def _chat(stack: Stack, traceparent: str) -> tuple[dict, dict[str, str]]:
    body = json.dumps({"model": stack.state["model"], "max_tokens": 4, "temperature": 0,
                       "messages": [{"role": "user", "content": f"{MARKER} " * 40}]}).encode()
    req = urllib.request.Request(
        f"{stack.http}/v1/chat/completions", data=body, method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}",
                 "traceparent": traceparent, "X-KV-Class": "agent"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read()), dict(resp.headers)


def _trace(stack: Stack, trace_id: str, timeout_s: float = 30.0) -> list[dict]:
    """The trace's spans once every service's have arrived (the exporters
    batch every 100 ms here), or what came by the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = [s for s in stack.spans() if s["trace_id"] == trace_id]
        if {s["service"] for s in spans} >= SERVICES or time.monotonic() > deadline:
            return spans
        time.sleep(0.1)


def test_one_request_is_one_trace_across_the_four_services(stack: Stack) -> None:
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    answer, headers = _chat(stack, f"00-{trace_id}-{client_span}-01")
    assert answer["usage"]["completion_tokens"] == 4
    assert headers["traceresponse"].split("-")[1] == trace_id

    spans = _trace(stack, trace_id)
    assert {s["service"] for s in spans} == SERVICES
    by_id = {s["span_id"]: s for s in spans}
    # One tree: the router's request span is the client's child, every other
    # span's parent is in the trace.
    (root,) = [s for s in spans if s["parent_span_id"] == client_span]
    assert root["service"] == "kvserve-router" and root["name"] == "POST /v1/chat/completions"
    assert root["attributes"]["http.response.status_code"] == 200
    assert root["attributes"]["kvserve.traffic_class"] == "agent"
    assert all(s["parent_span_id"] in by_id for s in spans if s is not root)

    names = {(s["service"], s["name"]) for s in spans}
    assert {("kvserve-router", "placement"), ("kvserve-router", "kvserve.v1.Prefill/Prefill"),
            ("kvserve-router", "kvserve.v1.Decode/Decode"),
            ("kvserve-prefill", "kvserve.v1.Prefill/Prefill"), ("kvserve-prefill", "restore"),
            ("kvserve-prefill", "lookup"), ("kvserve-prefill", "queue"),
            ("kvserve-prefill", "compute"), ("kvserve-kvstore", "kvserve.v1.KVStore/Lookup"),
            ("kvserve-decode", "kvserve.v1.Decode/Decode"), ("kvserve-decode", "handoff"),
            ("kvserve-decode", "queue"), ("kvserve-decode", "decode"),
            ("kvserve-prefill", "kvserve.v1.Prefill/PullKV")} <= names, sorted(names)

    def one(service: str, name: str) -> dict:
        (found,) = [s for s in spans if (s["service"], s["name"]) == (service, name)]
        return found

    # The kvstore's Lookup hangs under prefill's lookup span, under restore.
    store = one("kvserve-kvstore", "kvserve.v1.KVStore/Lookup")
    client = by_id[store["parent_span_id"]]
    assert client["service"] == "kvserve-prefill"
    assert by_id[client["parent_span_id"]]["name"] == "lookup"
    assert store["attributes"]["kvserve.traffic_class"] == "agent"
    assert store["attributes"]["kvserve.blocks"] >= 1
    compute = one("kvserve-prefill", "compute")
    assert compute["attributes"]["kvserve.computed_tokens"] > 0
    decode = one("kvserve-decode", "decode")
    assert decode["attributes"]["kvserve.completion_tokens"] == 4
    assert one("kvserve-decode", "handoff")["attributes"]["kvserve.path"] in ("shm", "stream")
    assert {p["attributes"]["kvserve.role"] for p in spans if p["name"] == "placement"} == {
        "prefill", "decode"}

    # No prompt text, tenant name or key anywhere in what was exported.
    raw = stack.spans_file.read_text()
    assert MARKER not in raw and TENANT not in raw and API_KEY not in raw


def test_requests_without_a_client_trace_start_their_own(stack: Stack) -> None:
    body = json.dumps({"model": stack.state["model"], "max_tokens": 2,
                       "messages": [{"role": "user", "content": "hello"}]}).encode()
    req = urllib.request.Request(f"{stack.http}/v1/chat/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {API_KEY}",
                                          "traceparent": "00-zz-not-a-traceparent-01"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        trace_id = resp.headers["traceresponse"].split("-")[1]
    spans = _trace(stack, trace_id)
    assert {s["service"] for s in spans} == SERVICES
    (root,) = [s for s in spans if not s["parent_span_id"]]
    assert root["service"] == "kvserve-router"


def test_dashboard_and_alerts_name_only_exported_series(stack: Stack) -> None:
    _chat(stack, f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01")
    exported = scrape_names(stack.state["metrics"].values())
    exprs = expressions(Path(__file__).resolve().parents[2] / "k8s")
    assert len(exprs) >= 20
    missing = {(where, name) for where, expr in exprs for name in metric_names(expr)
               if name not in exported}
    assert missing == set()
