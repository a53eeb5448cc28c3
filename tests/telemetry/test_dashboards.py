"""The dashboard and the alert rules, statically: every PromQL expression
parses with a real PromQL parser, every alert the operators' list asks for is
there, and the dashboard is a Grafana document a sidecar can provision.
(tests/telemetry/test_stack.py checks the names against a running stack.)"""

from __future__ import annotations

import json
from pathlib import Path

import promql_parser
import pytest
import yaml

from tests.telemetry.promql import OBSERVE, expressions, metric_names

K8S = Path(__file__).resolve().parents[2] / "k8s"


def test_every_expression_parses_and_selects_kvserve_series() -> None:
    exprs = expressions(K8S)
    assert len(exprs) >= 30
    for where, expr in exprs:
        names = metric_names(expr)
        assert names, where
        assert all(n.startswith(("kvserve_", "kvstore_", "vllm:")) for n in names), (where, names)


def test_a_broken_expression_is_refused() -> None:
    with pytest.raises(ValueError):
        metric_names("sum(rate(kvstore_hits_total[5m])")
    with pytest.raises(ValueError):
        promql_parser.parse("rate(kvstore_hits_total)")        # a range vector is required


def test_the_alerts_operators_asked_for() -> None:
    (doc,) = yaml.safe_load_all((K8S / OBSERVE / "prometheusrule.yaml").read_text())
    rules = {r["alert"]: r for g in doc["spec"]["groups"] for r in g["rules"]}
    wanted = {"KVServeTTFTOverSLO": "vllm:time_to_first_token_seconds_bucket",
              "KVServeHitRateDrop": "kvserve_router_tokens_total",
              "KVServeCorruptBlock": "kvstore_checksum_failures_total",
              "KVServeTierNearlyFull": "kvstore_tier_used_bytes",
              "KVServeRedisUnavailable": "kvstore_redis_up",
              "KVServeInstanceMissingHeartbeats": "kvserve_router_live_instances"}
    for alert, series in wanted.items():
        assert series in metric_names(rules[alert]["expr"]), alert
        assert rules[alert]["labels"]["severity"] in ("info", "warning", "critical")
        assert rules[alert]["annotations"]["summary"]


def test_dashboard_is_provisionable() -> None:
    dash = json.loads((K8S / OBSERVE / "dashboards" / "kvserve.json").read_text())
    assert dash["uid"] == "kvserve-overview" and dash["title"] == "kvserve"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    graphs = [p for p in dash["panels"] if p["type"] != "row"]
    assert all(p["datasource"]["uid"] == "${datasource}" and p["targets"] for p in graphs)
    kust = yaml.safe_load((K8S / OBSERVE / "kustomization.yaml").read_text())
    (gen,) = kust["configMapGenerator"]
    assert gen["options"]["labels"]["grafana_dashboard"] == "1"
