"""Prometheus config and alert rules pass promtool (Debian's prometheus package ships it): syntax,
the rules' own unit tests, and names that exist in the metrics modules."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.deploy.promql import BUILTIN, REPO, declared_metric_names, metric_names, panel_queries, rule_exprs

PROM_DIR = REPO / "deploy" / "prometheus"


def promtool(*args: str, cwd: Path = PROM_DIR) -> subprocess.CompletedProcess:
    assert shutil.which("promtool"), "promtool missing: apt-get install prometheus (scripts/setup-system.sh)"
    return subprocess.run(["promtool", *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def test_compose_config(tmp_path):
    # As compose mounts it: the config, the rules, and the compose targets as targets.json.
    for name in ("prometheus.yml", "rules.yml"):
        shutil.copy(PROM_DIR / name, tmp_path / name)
    shutil.copy(PROM_DIR / "targets" / "compose.json", tmp_path / "targets.json")
    result = promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stdout + result.stderr  # e.g. a missing targets file


def test_local_config_from_the_same_source(tmp_path):
    from services.local_stack import write_prometheus_config

    config = write_prometheus_config(tmp_path, {"engine": 18001, "gateway": 18000, "worker": 19101},
                                     scrape_interval="2s")
    result = promtool("check", "config", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    text = config.read_text()
    assert "scrape_interval: 2s" in text and "127.0.0.1:18001" in (tmp_path / "targets.json").read_text()


def test_rules_check_and_unit_tests():
    result = promtool("check", "rules", "rules.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    result = promtool("test", "rules", "rules_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_can_fail(tmp_path):
    bad = tmp_path / "rules.yml"
    bad.write_text("groups:\n  - name: x\n    rules:\n      - alert: Bad\n        expr: rate(x[5m]\n")
    assert promtool("check", "rules", str(bad)).returncode != 0


def test_dashboard_promql_parses(tmp_path):
    # promtool parses every expression of a rules file: wrap each panel query as a recording rule.
    rules = [f"      - record: panel:q{i}\n        expr: '{expr}'\n" for i, (_, expr) in enumerate(panel_queries())]
    path = tmp_path / "panels.yml"
    path.write_text("groups:\n  - name: panels\n    rules:\n" + "".join(rules))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("source", ["rules", "dashboard"])
def test_every_metric_used_is_declared(source):
    exprs = rule_exprs() if source == "rules" else panel_queries()
    declared = declared_metric_names() | BUILTIN
    unknown = {(where, name) for where, expr in exprs for name in metric_names(expr) if name not in declared}
    assert not unknown, f"{source} use metrics no metrics.py declares: {sorted(unknown)}"


def test_engines_targets_from_the_generator(tmp_path):
    """scripts/compose_engines.py's targets file, mounted as targets.json (several engines), passes
    promtool like compose.json; promtool reads file_sd files and fails on a malformed one."""
    import json
    import sys

    for name in ("prometheus.yml", "rules.yml"):
        shutil.copy(PROM_DIR / name, tmp_path / name)
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "compose_engines.py"), "--cpu-engines", "2",
                             "--output", str(tmp_path / "engines.yml"), "--targets", str(tmp_path / "targets.json")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    check = promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert check.returncode == 0 and "WARNING" not in check.stdout + check.stderr, check.stdout + check.stderr
    groups = json.loads((tmp_path / "targets.json").read_text())
    assert len({(g["labels"].get("engine"), g["labels"].get("gpu")) for g in groups if g["labels"]["job"] == "engine"}) == 2
    (tmp_path / "targets.json").write_text('[{"targets": "engine:8001"}]')  # a string, not a list
    assert promtool("check", "config", "prometheus.yml", cwd=tmp_path).returncode != 0
