"""PromQL of the dashboard and the alert rules in k8s/, parsed with a real
PromQL parser (``promql-parser``, the Rust crate Prometheus-compatible
projects use), and the series names a running stack exports."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import promql_parser
import yaml

OBSERVE = "components/observability"
# Grafana's own variables, as Grafana substitutes them before querying.
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "30s", "$__range": "6h"}


def expressions(k8s: Path) -> list[tuple[str, str]]:
    """(where, expr) of every dashboard panel target and every rule."""
    out: list[tuple[str, str]] = []
    comp = k8s / OBSERVE
    for dash in sorted(comp.glob("dashboards/*.json")):
        for panel in _panels(json.loads(dash.read_text())):
            for t in panel.get("targets", []):
                expr = t["expr"]
                for var, value in GRAFANA_VARS.items():
                    expr = expr.replace(var, value)
                out.append((f"{dash.name}: {panel['title']}", expr))
    for doc in yaml.safe_load_all((comp / "prometheusrule.yaml").read_text()):
        for group in doc["spec"]["groups"]:
            for rule in group["rules"]:
                out.append((f"rule {rule.get('alert') or rule.get('record')}", rule["expr"]))
    return out


def _panels(dash: dict[str, Any]) -> Iterable[dict[str, Any]]:
    for p in dash.get("panels", []):
        yield p
        yield from p.get("panels", [])


def metric_names(expr: str) -> set[str]:
    """Every series name ``expr`` selects; raises if ``expr`` does not parse."""
    names: set[str] = set()
    _walk(promql_parser.parse(expr), names)
    return names


def _walk(node: Any, names: set[str]) -> None:
    if isinstance(node, promql_parser.VectorSelector):
        if node.name:
            names.add(node.name)
        return
    if isinstance(node, promql_parser.MatrixSelector):
        _walk(node.vector_selector, names)
        return
    for attr in ("expr", "lhs", "rhs", "param"):
        child = getattr(node, attr, None)
        if child is not None and not isinstance(child, str | int | float):
            _walk(child, names)
    for child in getattr(node, "args", None) or ():
        _walk(child, names)


def scrape_names(urls: Iterable[str]) -> set[str]:
    """Series names the /metrics pages declare (``# TYPE`` lines, expanded to
    the sample names Prometheus stores: ``_total``, ``_bucket``/``_sum``/``_count``)
    and every sample name they carry."""
    out: set[str] = set()
    for url in urls:
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split(maxsplit=3)
                out |= _expand(name, kind)
            elif line and not line.startswith("#"):
                out.add(line.split("{", 1)[0].split(" ", 1)[0])
    return out


def _expand(name: str, kind: str) -> set[str]:
    if kind == "counter":
        return {name, f"{name}_total", f"{name}_created"}
    if kind == "histogram":
        return {f"{name}_bucket", f"{name}_sum", f"{name}_count", f"{name}_created"}
    if kind == "summary":
        return {name, f"{name}_sum", f"{name}_count"}
    return {name}
