"""A real ``kvserve up`` stack (router, prefill, decode, kvstore processes)
with tracing on: one chat request makes one trace, joined to the client's
``traceparent``, whose spans come from all four services and reach a real
OTLP receiver process over loopback; and every PromQL expression of the
dashboard and the alert rules names only series this stack exports.

The requests run, /metrics is scraped, then the stack stops: every process
flushes its spans as it exits, so the trace is complete when it is read (no
waiting for batches in flight)."""

from __future__ import annotations

import json
import secrets
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.telemetry.promql import expressions, metric_names, scrape_names
from tests.telemetry.stack import API_KEY, TENANT, Stack, traced_stack

pytestmark = pytest.mark.slow

SERVICES = {"kvserve-router", "kvserve-prefill", "kvserve-decode", "kvserve-kvstore"}
MARKER = "zebra-quartz-marker"          # prompt text: must never reach a span


@dataclass
class Observed:
    answer: dict[str, Any]
    headers: dict[str, str]
    trace_id: str
    client_span: str
    own_trace_id: str                   # a request whose traceparent was malformed
    exported: set[str]                  # series names the four /metrics pages declare
    spans: list[dict[str, Any]]
    raw: str


def _chat(stack: Stack, traceparent: str, content: str,
          max_tokens: int = 4) -> tuple[dict[str, Any], dict[str, str]]:
    body = json.dumps({"model": stack.state["model"], "max_tokens": max_tokens,
                       "temperature": 0,
                       "messages": [{"role": "user", "content": content}]}).encode()
    req = urllib.request.Request(
        f"{stack.http}/v1/chat/completions", data=body, method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}",
                 "traceparent": traceparent, "X-KV-Class": "agent"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read()), dict(resp.headers)


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory) -> Observed:
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    with traced_stack(tmp_path_factory.mktemp("observe")) as stack:
        answer, headers = _chat(stack, f"00-{trace_id}-{client_span}-01", f"{MARKER} " * 40)
        _, own = _chat(stack, "00-zz-not-a-traceparent-01", "hello", max_tokens=2)
        exported = scrape_names(stack.state["metrics"].values())
    raw = stack.spans_file.read_text()
    return Observed(answer, headers, trace_id, client_span, own["traceresponse"].split("-")[1],
                    exported, stack.spans(), raw)


def test_one_request_is_one_trace_across_the_four_services(seen: Observed) -> None:
    assert seen.answer["usage"]["completion_tokens"] == 4
    assert seen.headers["traceresponse"].split("-")[1] == seen.trace_id
    spans = [s for s in seen.spans if s["trace_id"] == seen.trace_id]
    assert {s["service"] for s in spans} == SERVICES
    by_id = {s["span_id"]: s for s in spans}
    # One tree: the router's request span is the client's child, every other
    # span's parent is in the trace.
    (root,) = [s for s in spans if s["parent_span_id"] == seen.client_span]
    assert root["service"] == "kvserve-router" and root["name"] == "POST /v1/chat/completions"
    assert root["attributes"]["http.response.status_code"] == 200
    assert root["attributes"]["kvserve.traffic_class"] == "agent"
    assert root["attributes"]["kvserve.prompt_tokens"] > 64
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

    def one(service: str, name: str) -> dict[str, Any]:
        (found,) = [s for s in spans if (s["service"], s["name"]) == (service, name)]
        return found

    # The kvstore's Lookup hangs under prefill's lookup span, under restore.
    store = one("kvserve-kvstore", "kvserve.v1.KVStore/Lookup")
    client = by_id[store["parent_span_id"]]
    assert client["service"] == "kvserve-prefill"
    assert by_id[client["parent_span_id"]]["name"] == "lookup"
    assert by_id[by_id[client["parent_span_id"]]["parent_span_id"]]["name"] == "restore"
    assert store["attributes"]["kvserve.traffic_class"] == "agent"
    assert store["attributes"]["kvserve.blocks"] >= 1
    compute = one("kvserve-prefill", "compute")
    assert compute["attributes"]["kvserve.computed_tokens"] > 0
    assert one("kvserve-decode", "decode")["attributes"]["kvserve.completion_tokens"] == 4
    assert one("kvserve-decode", "handoff")["attributes"]["kvserve.path"] in ("shm", "stream")
    assert {p["attributes"]["kvserve.role"] for p in spans if p["name"] == "placement"} == {
        "prefill", "decode"}


def test_nothing_secret_or_private_is_exported(seen: Observed) -> None:
    assert seen.raw
    assert MARKER not in seen.raw and TENANT not in seen.raw and API_KEY not in seen.raw


def test_a_malformed_client_traceparent_starts_a_new_trace(seen: Observed) -> None:
    spans = [s for s in seen.spans if s["trace_id"] == seen.own_trace_id]
    assert {s["service"] for s in spans} == SERVICES
    (root,) = [s for s in spans if not s["parent_span_id"]]
    assert root["service"] == "kvserve-router"
    # Health probes and background work made no traces of their own.
    roots = [s for s in seen.spans if not s["parent_span_id"]]
    assert {r["trace_id"] for r in roots} == {seen.own_trace_id}


def test_dashboard_and_alerts_name_only_exported_series(seen: Observed) -> None:
    exprs = expressions(Path(__file__).resolve().parents[2] / "k8s")
    assert len(exprs) >= 30
    missing = {(where, name) for where, expr in exprs for name in metric_names(expr)
               if name not in seen.exported}
    assert missing == set()
