"""The Grafana dashboard and its provisioning: valid JSON, every panel has a datasource and queries,
the panels the issue asks for exist, and provisioning points where compose mounts the files."""

from __future__ import annotations

import json

import yaml

from tests.deploy.promql import DASHBOARD, REPO, dashboard_panels

PROVISIONING = REPO / "deploy" / "grafana" / "provisioning"


def datasource_uid() -> str:
    (ds,) = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    return ds["uid"]


def test_dashboard_is_valid_and_every_panel_queries_the_datasource():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "tandem" and dash["title"] == "Tandem"
    uid = datasource_uid()
    panels = dashboard_panels()
    assert len(panels) >= 12
    for panel in panels:
        title = panel["title"]
        assert panel["datasource"]["uid"] == uid, title
        assert panel["targets"], f"panel {title!r} has no targets"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(set(ref_ids)) == len(ref_ids), title
        for target in panel["targets"]:
            assert target["expr"].strip(), title
            assert target["datasource"]["uid"] == uid, title
    ids = [p["id"] for p in dash["panels"]]
    assert len(set(ids)) == len(ids)


def test_panels_do_not_overlap():
    cells = set()
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        g = panel["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panel {panel['title']!r} overlaps another at {(x, y)}"
                cells.add((x, y))
        assert g["x"] + g["w"] <= 24


def test_the_panels_the_issue_asks_for():
    exprs = " ".join(t["expr"] for p in dashboard_panels() for t in p["targets"])
    for needle in ("rate(tandem_generation_tokens_total", "tandem_time_to_first_token_seconds_bucket",
                   "histogram_quantile(0.5, sum by (le, model_name) (rate(tandem_inter_token_latency_seconds",
                   "histogram_quantile(0.99, sum by (le, model_name) (rate(tandem_inter_token_latency_seconds",
                   "sum by (layer) (rate(tandem_expert_misses_total", "tandem_expert_cpu_computed_total",
                   "tandem_expert_fetched_total", "tandem_bandwidth_bytes_per_second",
                   "tandem_num_requests_running", "tandem_num_requests_waiting", "tandem_kv_cache_usage_ratio",
                   "tandem_profiler_jobs_total", "tandem_profile_age_seconds"):
        assert needle in exprs, f"no panel queries {needle}"


def test_provisioning_matches_the_compose_mounts():
    providers = yaml.safe_load((PROVISIONING / "dashboards" / "tandem.yml").read_text())["providers"]
    path = providers[0]["options"]["path"]
    grafana = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]["grafana"]
    assert f"./deploy/grafana/dashboards:{path}:ro" in grafana["volumes"]
    assert "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in grafana["volumes"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{path}/{DASHBOARD.name}"
