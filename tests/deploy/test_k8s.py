"""deploy/k8s without a cluster: every overlay rendered by `kubectl kustomize` (Debian's kubernetes-client
in CI, scripts/setup-system.sh), every object validated against the Kubernetes schemas (kubernetes-validate,
strict) or its CRD's schema (tests/deploy/k8s_schemas), yamllint, and what the objects must say: probes,
resources and GPU requests, securityContext, no secret in args, the discovery and per-node wiring, and
that every metric the ScaledObject, the endpoint picker and the dashboard name is exported."""

from __future__ import annotations

import copy
import importlib
import json
import re
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from referencing import Registry
from referencing.jsonschema import DRAFT202012

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
SCHEMAS = Path(__file__).parent / "k8s_schemas"
OVERLAYS = ["gpu", "cpu-demo", "inference-gateway"]
KUBERNETES = "1.29"  # the oldest Kubernetes the manifests are written for (grpc probes, sidecar-free)
CRD_SCHEMAS = {("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor.json",
               ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor.json",
               ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject.json",
               ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool.json",
               ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute.json"}
SECRET_ENV = {"TANDEM_API_KEYS", "TANDEM_ADMIN_TOKEN", "TANDEM_ENGINE_TOKEN"}
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet"}


@lru_cache(maxsize=None)
def render(overlay: str) -> tuple[dict, ...]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is not installed (scripts/setup-system.sh installs Debian's kubernetes-client)"
    out = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, f"kubectl kustomize {overlay} failed:\n{out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d is not None)


def objects(overlay: str, kind: str | None = None) -> list[dict]:
    return [d for d in render(overlay) if kind is None or d["kind"] == kind]


def one(overlay: str, kind: str, name: str) -> dict:
    found = [d for d in render(overlay) if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{overlay}: {len(found)} {kind} named {name}"
    return found[0]


def pod_specs(overlay: str) -> list[tuple[str, dict]]:
    return [(f"{d['kind']}/{d['metadata']['name']}", d["spec"]["template"]["spec"])
            for d in render(overlay) if d["kind"] in WORKLOADS]


def containers(spec: dict, init: bool = False) -> list[dict]:
    return spec.get("containers", []) + (spec.get("initContainers", []) if init else [])


@lru_cache(maxsize=1)
def crd_validators() -> dict:
    resources = [DRAFT202012.create_resource(json.loads(p.read_text())) for p in sorted(SCHEMAS.glob("*.json"))]
    registry = Registry().with_resources((r.contents["$id"], r) for r in resources)
    return {key: jsonschema.Draft202012Validator(registry.contents(name), registry=registry)
            for key, name in CRD_SCHEMAS.items()}


def validate(obj: dict) -> None:
    """Raise (jsonschema or kubernetes_validate ValidationError) when ``obj`` breaks its schema."""
    key = (obj["apiVersion"], obj["kind"])
    if key in CRD_SCHEMAS:
        crd_validators()[key].validate(obj)
    else:
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)


# -- rendering and schemas -----------------------------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_every_object_is_valid(overlay):
    docs = render(overlay)
    assert len(docs) > 8
    for obj in docs:
        where = f"{overlay}: {obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        assert obj.get("kind") and obj.get("metadata", {}).get("name"), f"{where}: no kind or name"
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == "tandem", f"{where}: outside the tandem namespace"
        try:
            validate(obj)
        except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as exc:
            pytest.fail(f"{where}: {exc.message} at {list(exc.path)}")


@pytest.mark.parametrize("break_it", [
    lambda d: d["spec"]["template"]["spec"]["containers"][0].update(livenesProbe={}),  # a typo
    lambda d: d["spec"].update(replicas="two"),
])
def test_the_core_schema_refuses_a_broken_engine(break_it):
    engine = copy.deepcopy(one("gpu", "StatefulSet", "tandem-engine"))
    break_it(engine)
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(engine)


@pytest.mark.parametrize("kind, name, break_it", [
    ("InferencePool", "tandem", lambda d: d["spec"].update(targetPort=[{"number": 8000}])),
    ("InferencePool", "tandem", lambda d: d["spec"]["endpointPickerRef"].update(failureMode="Retry")),
    ("ScaledObject", "tandem-engine", lambda d: d["spec"]["triggers"][0].update(metadata={"threshold": 4})),
    ("PodMonitor", "tandem-engine", lambda d: d["spec"]["podMetricsEndpoints"][0].update(interval="15 seconds")),
    ("HTTPRoute", "tandem", lambda d: d["spec"]["rules"][0]["backendRefs"][0].pop("name")),
])
def test_the_crd_schemas_refuse_broken_objects(kind, name, break_it):
    obj = copy.deepcopy(one("inference-gateway", kind, name))
    validate(obj)
    break_it(obj)
    with pytest.raises(jsonschema.ValidationError):
        validate(obj)


def test_yamllint():
    config = json.dumps({"extends": "default", "rules": {
        "line-length": {"max": 120}, "document-start": "disable", "comments": {"min-spaces-from-content": 1},
        "truthy": {"check-keys": False}}})
    files = sorted(str(p) for p in K8S.rglob("*.yaml")) + [str(ROOT / "deploy" / "grafana" / "kustomization.yaml")]
    out = subprocess.run([sys.executable, "-m", "yamllint", "--strict", "-d", config, *files], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr


# -- what the workloads must say ---------------------------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_and_resources(overlay):
    for where, spec in pod_specs(overlay):
        for c in containers(spec):
            assert c.get("readinessProbe") and c.get("livenessProbe"), f"{where}/{c['name']}: probes missing"
            res = c.get("resources", {})
            assert {"cpu", "memory"} <= set(res.get("requests", {})), f"{where}/{c['name']}: no cpu/memory request"
            assert "memory" in res.get("limits", {}), f"{where}/{c['name']}: no memory limit"
    engine = one(overlay, "StatefulSet", "tandem-engine")["spec"]["template"]["spec"]["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert engine[probe]["httpGet"]["path"] == "/health" and engine[probe]["httpGet"]["port"] == "http"
    assert engine["startupProbe"]["periodSeconds"] * engine["startupProbe"]["failureThreshold"] >= 600, \
        "a big checkpoint loads for minutes: the startup probe must allow it"
    spec = one(overlay, "StatefulSet", "tandem-engine")["spec"]["template"]["spec"]
    shm = [v for v in spec["volumes"] if v["name"] == "shm"]
    assert shm and shm[0]["emptyDir"]["medium"] == "Memory"
    assert {"mountPath": "/dev/shm", "name": "shm"} in engine["volumeMounts"]


@pytest.mark.parametrize("overlay, gpus", [("gpu", 1), ("inference-gateway", 1), ("cpu-demo", 0)])
def test_gpu_requests(overlay, gpus):
    for where, spec in pod_specs(overlay):
        for c in containers(spec, init=True):
            res = c.get("resources", {})
            wanted = gpus if where == "StatefulSet/tandem-engine" else 0  # a worker must not take an engine's GPU
            assert res.get("requests", {}).get("nvidia.com/gpu", 0) == wanted, f"{overlay} {where}/{c['name']}"
            assert res.get("limits", {}).get("nvidia.com/gpu", 0) == wanted, f"{overlay} {where}/{c['name']}"
    if gpus:
        engine = one(overlay, "StatefulSet", "tandem-engine")["spec"]["template"]["spec"]
        assert engine["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        args = engine["containers"][0]["args"]
        assert args[args.index("--device") + 1] == "cuda"
        models = [v for v in engine["volumes"] if v["name"] == "models"][0]
        assert set(models) == {"name", "hostPath"}, "the GPU engines read the node's model store"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_security_context(overlay):
    for where, spec in pod_specs(overlay):
        pod = spec.get("securityContext", {})
        assert pod.get("runAsNonRoot") is True and pod.get("seccompProfile") == {"type": "RuntimeDefault"}, where
        for c in containers(spec, init=True):
            sc = c.get("securityContext", {})
            assert sc.get("allowPrivilegeEscalation") is False, f"{where}/{c['name']}"
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], f"{where}/{c['name']}"
            assert sc.get("privileged") is not True, f"{where}/{c['name']}"
            if c in spec.get("initContainers", []):  # the one root step: chown of the hostPath profiles dir
                assert sc["capabilities"].get("add") == ["CHOWN"] and c["command"][0] == "chown", f"{where}/{c['name']}"
            else:
                assert sc.get("runAsUser", 1) != 0 and not sc.get("capabilities", {}).get("add"), f"{where}/{c['name']}"
        if where != "Deployment/tandem-epp":  # the picker watches its pool through the API server
            assert spec.get("automountServiceAccountToken") is False, where


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_secret_in_args_or_config(overlay):
    assert not objects(overlay, "Secret"), "the Secret tandem-secrets is the operator's, never in the repository"
    for where, spec in pod_specs(overlay):
        for c in containers(spec, init=True):
            words = " ".join(c.get("command", []) + c.get("args", [])).lower()
            for flag in ("--api-key", "--admin-token", "token", "password", "secret"):
                assert flag not in words, f"{where}/{c['name']}: {flag!r} in its command line"
            for e in c.get("env", []):
                if e["name"] in SECRET_ENV or re.search(r"TOKEN|KEY|PASSWORD", e["name"]):
                    assert "value" not in e and e["valueFrom"]["secretKeyRef"]["name"] == "tandem-secrets", e
    for cm in objects(overlay, "ConfigMap"):
        assert not any(re.search(r"TOKEN|KEY|PASSWORD", k) for k in cm.get("data", {})), cm["metadata"]["name"]


# -- wiring: discovery, per-node jobs, Redis -------------------------------------------------------------------
@pytest.mark.parametrize("overlay", ["gpu", "cpu-demo"])
def test_gateway_finds_the_engines_through_their_headless_service(overlay):
    config = objects(overlay, "ConfigMap")
    config = [c for c in config if c["metadata"]["name"].startswith("tandem-config")][0]["data"]
    name = re.fullmatch(r"http://([a-z0-9-]+):(\d+)", config["TANDEM_ENGINES_DNS"])
    assert name, config["TANDEM_ENGINES_DNS"]
    service = one(overlay, "Service", name[1])
    assert service["spec"]["clusterIP"] == "None", "a ClusterIP would give one virtual address, not the engines'"
    assert service["spec"].get("publishNotReadyAddresses") is not True, "loading engines must stay out of DNS"
    engine = one(overlay, "StatefulSet", "tandem-engine")
    assert service["spec"]["selector"].items() <= engine["spec"]["template"]["metadata"]["labels"].items()
    port = engine["spec"]["template"]["spec"]["containers"][0]["ports"][0]
    assert int(name[2]) == service["spec"]["ports"][0]["port"] == port["containerPort"]
    gateway = one(overlay, "Deployment", "tandem-gateway")
    assert gateway["spec"]["template"]["spec"]["containers"][0]["envFrom"] == [
        {"configMapRef": {"name": [c for c in objects(overlay, "ConfigMap")
                                   if c["metadata"]["name"].startswith("tandem-config")][0]["metadata"]["name"]}}]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_worker_per_node_with_its_node_name_and_the_node_profiles(overlay):
    worker = one(overlay, "DaemonSet", "tandem-worker")["spec"]["template"]["spec"]
    env = {e["name"]: e for e in worker["containers"][0]["env"]}
    assert env["TANDEM_NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    engine = one(overlay, "StatefulSet", "tandem-engine")["spec"]["template"]["spec"]
    paths = [{v["name"]: v for v in spec["volumes"]}["profiles"]["hostPath"]["path"] for spec in (worker, engine)]
    assert paths[0] == paths[1], "the node's engines read the profiles its worker writes"
    mount = [m for m in engine["containers"][0]["volumeMounts"] if m["name"] == "profiles"][0]
    assert mount["readOnly"] is True


def test_redis_keeps_its_append_only_file_on_a_claim():
    redis = one("gpu", "StatefulSet", "redis")
    args = " ".join(redis["spec"]["template"]["spec"]["containers"][0]["args"])
    assert "--appendonly yes" in args and "--dir /data" in args
    claim = redis["spec"]["volumeClaimTemplates"][0]
    mounts = redis["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert {"name": claim["metadata"]["name"], "mountPath": "/data"} in mounts


# -- metrics: what KEDA, the picker and the dashboard read must exist ------------------------------------------
def exported(module: str) -> set[str]:
    """Every sample name a Tandem service's metrics module declares (a counter's with _total, a histogram's
    _bucket, _sum and _count)."""
    from prometheus_client.metrics import MetricWrapperBase

    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "summary": ["_sum", "_count"],
                "info": ["_info"]}
    names = {v._name + suffix for v in vars(importlib.import_module(module)).values()
             if isinstance(v, MetricWrapperBase) for suffix in suffixes.get(v._type, [""])}
    assert names, f"{module} declares no metric"
    return names


def worker_profile_gauges(tmp_path: Path) -> set[str]:
    """The worker's scrape-time gauges (a collector: one GPU, no profile, so both families have a sample)."""
    from services.profiler.metrics import ProfileCollector

    return {family.name for family in ProfileCollector(lambda: tmp_path, lambda: ["GPU-0"]).collect()}


def engine_gauges() -> set[str]:
    from prometheus_client import Gauge

    return {v._name for v in vars(importlib.import_module("services.engine.metrics")).values() if isinstance(v, Gauge)}


def test_the_scaledobject_and_the_picker_read_engine_gauges():
    gauges = engine_gauges()
    trigger = one("gpu", "ScaledObject", "tandem-engine")["spec"]["triggers"][0]
    assert trigger["type"] == "prometheus" and float(trigger["metadata"]["threshold"]) > 0
    names = set(re.findall(r"tandem_\w+", trigger["metadata"]["query"]))
    assert names and names <= gauges, names - gauges
    assert one("gpu", "ScaledObject", "tandem-engine")["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "name": "tandem-engine"}
    epp = one("inference-gateway", "Deployment", "tandem-epp")["spec"]["template"]["spec"]["containers"][0]["args"]
    flags = dict(a.split("=", 1) for a in epp)
    for flag, metric in [("--total-queued-requests-metric", "tandem_num_requests_waiting"),
                         ("--total-running-requests-metric", "tandem_num_requests_running"),
                         ("--kv-cache-usage-percentage-metric", "tandem_kv_cache_usage_ratio")]:
        assert flags[flag] == metric and metric in gauges


def test_every_dashboard_metric_is_exported(tmp_path):
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "tandem.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    named = {m for e in exprs for m in re.findall(r"\btandem_[a-z_]+[a-z]\b", e)}
    available = set().union(*(exported(m) for m in ("services.engine.metrics", "services.gateway.metrics",
                                                     "services.profiler.metrics")), worker_profile_gauges(tmp_path))
    assert len(named) > 20 and not named - available, sorted(named - available)
    jobs = {j for e in exprs for group in re.findall(r'job=~?"([^"]+)"', e) for j in group.split("|")}
    relabelled = {r["replacement"] for kind in ("PodMonitor", "ServiceMonitor") for d in objects("gpu", kind)
                  for ep in d["spec"].get("podMetricsEndpoints", d["spec"].get("endpoints", []))
                  for r in ep.get("relabelings", []) if r.get("targetLabel") == "job"}
    assert jobs <= relabelled, f"the dashboard selects jobs {jobs}, the monitors set {relabelled}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_dashboard_configmap_is_generated_from_deploy_grafana(overlay):
    cm = one(overlay, "ConfigMap", "tandem-grafana-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    source = (ROOT / "deploy" / "grafana" / "dashboards" / "tandem.json").read_text()
    assert cm["data"] == {"tandem.json": source}
    assert not list(K8S.rglob("*.json")), "a copy of the dashboard under deploy/k8s would drift"


# -- the inference gateway ---------------------------------------------------------------------------------------
def test_inferencepool_selects_the_engines_and_its_picker():
    pool = one("inference-gateway", "InferencePool", "tandem")["spec"]
    engine = one("inference-gateway", "StatefulSet", "tandem-engine")["spec"]["template"]
    assert pool["selector"]["matchLabels"].items() <= engine["metadata"]["labels"].items()
    main = engine["spec"]["containers"][0]
    assert main["command"] == ["tandem", "serve"], "pool pods must speak the OpenAI API (model server protocol)"
    assert [p["containerPort"] for p in main["ports"]] == [pool["targetPorts"][0]["number"]]
    args = main["args"]
    assert args[args.index("--port") + 1] == str(pool["targetPorts"][0]["number"])
    epp = one("inference-gateway", "Service", pool["endpointPickerRef"]["name"])
    assert pool["endpointPickerRef"]["port"]["number"] in [p["port"] for p in epp["spec"]["ports"]]
    route = one("inference-gateway", "HTTPRoute", "tandem")["spec"]["rules"][0]["backendRefs"][0]
    assert route == {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "tandem"}
    assert not [d for d in render("inference-gateway") if d["metadata"]["name"] == "tandem-gateway"]
