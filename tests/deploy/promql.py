"""Shared by the deploy tests: the dashboard's and rules' PromQL, and the metric names Tandem declares."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "tandem.json"
RULES = REPO / "deploy" / "prometheus" / "rules.yml"
# Series Prometheus itself makes for every target (not declared by Tandem).
BUILTIN = {"up"}


def dashboard_panels() -> list[dict]:
    """Every panel that draws data (rows skipped)."""
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def panel_queries(rate_interval: str = "1m") -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target, Grafana variables replaced as Grafana would with
    "All" selected (model_name allValue ".*") and ``rate_interval`` for ``$__rate_interval``."""
    out = []
    for panel in dashboard_panels():
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", rate_interval).replace("$model_name", ".*")
            assert "$" not in expr, f"panel {panel['title']!r}: unknown variable in {expr}"
            out.append((panel["title"], expr))
    return out


def rule_exprs() -> list[tuple[str, str]]:
    rules = yaml.safe_load(RULES.read_text())
    return [(r["alert"], r["expr"]) for g in rules["groups"] for r in g["rules"]]


def metric_names(expr: str) -> set[str]:
    """Metric names used in a PromQL expression (identifiers followed by { or [ or standing alone)."""
    names = set(re.findall(r"\b(tandem_[a-z0-9_]+)", expr))
    names |= {n for n in BUILTIN if re.search(rf"\b{n}\b\s*[{{\[]", expr) or re.search(rf"\b{n}\b\s*==", expr)}
    return names


def declared_metric_names() -> set[str]:
    """Every series name the three metrics modules can export (counters with _total, histograms with
    _bucket/_sum/_count), plus the worker's scrape-time profile gauges."""
    from prometheus_client import REGISTRY

    import services.engine.metrics  # noqa: F401  (import declares the metrics)
    import services.gateway.metrics  # noqa: F401
    from services.profiler.metrics import ProfileCollector

    names: set[str] = set()
    families = list(REGISTRY.collect()) + list(ProfileCollector(lambda: REPO / "no-such-dir", list).collect())
    for family in families:
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names |= {family.name + s for s in ("_bucket", "_sum", "_count")}
        else:
            names.add(family.name)
    return names
