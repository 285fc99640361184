"""The compose stack as a user runs it: images built for real, `docker-compose up`, checked through the
published ports, `down -v`. Run by `make test-images` (CI: .ci/run); needs root, podman, debootstrap and
docker-compose (scripts/setup-system.sh), and network to Debian's mirror (apt inside the builds) and to
the machine's Python index (the wheelhouse).

Docker's part is played by podman (tests/deploy/podman.py). What is substituted, and nothing else
(tests/deploy/compose.ci.yml lays it over docker-compose.yml; the GPU override is left out):
  CUDA / python base images -> one Debian bookworm made by debootstrap (python3 + venv)
  GPU wheelhouse            -> the same script's wheelhouse for the base's Python, with the CPU torch
                               the machine's pip finds
  engine on the GPU         -> TANDEM_DEVICE=cpu, float32, hybrid backend (the C++ CPU executor)
  redis, Prometheus         -> Debian's packages behind the same commands (tests/deploy/standins.Dockerfile)
  Grafana                   -> a static server of the mounted dashboards answering /api/health
Two engines, as on a 2-GPU host (issue 25): scripts/compose_engines.py --cpu-engines 2 writes the override
that adds engine-1 (each engine pinned to one of the machine's cores) behind the gateway, and Prometheus'
targets labelled by engine; tests/deploy/compose.ci-engines.yml gives engine-1 compose.ci.yml's build args.
The whole run must fit BUDGET_S; its build and run times and the image sizes are printed at the end.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.deploy.net import free_ports
from tests.deploy.podman import HealthLoop, Podman

REPO = Path(__file__).resolve().parents[2]
BUDGET_S = 45 * 60
pytestmark = pytest.mark.timeout(BUDGET_S)
PROJECT = "tandemci"
BASE_IMAGE = "localhost/tandem-ci/base:bookworm"
STANDINS = ("redis", "prometheus", "grafana")
WHEELHOUSE = "build/wheelhouse-ci"  # compose.ci.yml's WHEELHOUSE build arg; .dockerignore lets it in
API_KEY, ADMIN_TOKEN = "ci-key", "ci-admin"
PROFILE_REQUEST = {"kind": "bw", "seconds": 0.2, "buffer_mib": 32}  # a quick CPU-only `tandem bench bw`
ENGINES = ("engine", "engine-1")
SERVICES = {"redis", *ENGINES, "worker", "gateway", "prometheus", "grafana"}
ENGINES_OVERRIDE, ENGINES_TARGETS = "build/compose-ci/engines.yml", "build/compose-ci/targets.json"
COMPOSE_FILES = ("docker-compose.yml", "tests/deploy/compose.ci.yml", ENGINES_OVERRIDE,
                 "tests/deploy/compose.ci-engines.yml")


class Stack:
    def __init__(self, podman: Podman, env: dict[str, str], ports: dict[str, int]):
        self.podman, self.env, self.ports = podman, env, ports
        self.timings: dict[str, float] = {}
        self.deadline = time.monotonic() + BUDGET_S

    def left(self) -> float:
        left = self.deadline - time.monotonic()
        assert left > 0, f"the compose test ran past its budget of {BUDGET_S} s: {self.timings}"
        return left

    def timed(self, label: str, fn, *args):
        t0 = time.monotonic()
        result = fn(*args)
        self.timings[label] = time.monotonic() - t0
        print(f"compose test: {label}: {self.timings[label]:.0f} s", flush=True)
        return result

    def compose(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        cmd = ["docker-compose", *(arg for path in COMPOSE_FILES for arg in ("-f", path)), *args]
        result = subprocess.run(cmd, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=self.left())
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)}: exit {result.returncode}\n{result.stdout[-3000:]}"
                                 f"\n{result.stderr[-5000:]}")
        return result

    def exec(self, service: str, *cmd: str) -> str:
        """``cmd``'s output in ``service``'s container (podman's own exec: exec sessions made through the
        API by `docker-compose exec` leave their conmon behind in podman 4.3)."""
        return self.podman.run("exec", self.container(service), *cmd).stdout

    def container(self, service: str) -> str:
        return self.compose("ps", "-q", service).stdout.strip()

    def logs(self, service: str, lines: int = 40) -> str:
        return self.compose("logs", "--no-color", "--tail", str(lines), service, check=False).stdout

    def url(self, service: str, path: str) -> str:
        return f"http://127.0.0.1:{self.ports[service]}{path}"


def wheelhouse(python: str) -> None:
    result = subprocess.run([sys.executable, "scripts/wheelhouse.py", "--dest", WHEELHOUSE,
                             "--python-version", python], cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]


def compose_engines() -> None:
    """The two-engine override, as a user makes it (scripts/compose_engines.py)."""
    result = subprocess.run([sys.executable, "scripts/compose_engines.py", "--cpu-engines", "2", "--output",
                             ENGINES_OVERRIDE, "--targets", ENGINES_TARGETS], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    print(result.stdout, flush=True)


def build_images(stack: Stack) -> None:
    podman = stack.podman
    compose_engines()
    stack.timed("base image (debootstrap + import)", podman.debootstrap_image, BASE_IMAGE, "bookworm",
                ["python3", "python3-venv"], "http://deb.debian.org/debian")
    python = podman.run("run", "--rm", BASE_IMAGE, "python3", "-c",
                        "import sys; print('%d.%d.%d' % sys.version_info[:3])").stdout.strip()
    stack.timed("wheelhouse", wheelhouse, python)
    for name in STANDINS:
        stack.timed(f"build {name} stand-in", podman.run, "build", "--format", "docker", "-q",
                    "-f", "tests/deploy/standins.Dockerfile", "--target", name, "--build-arg",
                    f"BASE_IMAGE={BASE_IMAGE}", "-t", stack.env[f"{name.upper()}_IMAGE"], ".")
    for service in (*ENGINES, "worker", "gateway"):  # engine-1 and worker after engine: its layers are cached
        stack.timed(f"build {service}", stack.compose, "build", service)


@pytest.fixture(scope="module")
def stack():
    podman = Podman(REPO / ".cache" / "podman")
    ports = dict(zip(("gateway", "prometheus", "grafana"), free_ports(3)))
    env = {**podman.env, "COMPOSE_PROJECT_NAME": PROJECT, "CI_BASE_IMAGE": BASE_IMAGE,
           "TANDEM_DEVICE": "cpu", "TANDEM_DTYPE": "float32", "TANDEM_MOE_BACKEND": "hybrid",
           "TANDEM_MODEL": "demo", "TANDEM_API_KEYS": API_KEY, "TANDEM_ADMIN_TOKEN": ADMIN_TOKEN,
           "TANDEM_PORT": str(ports["gateway"]), "PROMETHEUS_PORT": str(ports["prometheus"]),
           "GRAFANA_PORT": str(ports["grafana"]),
           **{f"{name.upper()}_IMAGE": f"localhost/tandem-ci/{name}:standin" for name in STANDINS}}
    running = Stack(podman, env, ports)
    podman.start_service()
    try:
        build_images(running)
        running.sizes = {image: podman.image_size(image) for image in
                         [f"{PROJECT}_{s}" for s in ("engine", "worker", "gateway")]
                         + [env[f"{n.upper()}_IMAGE"] for n in STANDINS]}
        running.compose("down", "-v", check=False)  # leftovers of an interrupted run
        with HealthLoop(podman, PROJECT) as health:
            running.health = health
            # `up` returns once every depends_on is healthy, i.e. after the engine loaded its model
            running.timed("compose up (until the gateway started)", running.compose, "up", "-d")
            running.timed("every service healthy", wait_healthy, running)
            yield running
    finally:
        if not getattr(running, "down_done", False):  # a failed run: leave nothing behind either
            running.compose("down", "-v", check=False)
            label = f"label=com.docker.compose.project={PROJECT}"
            for kind in ("container", "volume", "network"):
                every = ["-a"] if kind == "container" else []
                ids = podman.run(kind, "ls", "-q", *every, "--filter", label, check=False).stdout.split()
                if ids:
                    podman.run(kind, "rm", "-f", *ids, check=False)
        podman.stop_service()
        summary(running)


def wait_healthy(stack: Stack) -> None:
    while True:
        states = stack.health.states()
        if set(states) == SERVICES and all(s == "healthy" for s in states.values()):
            return
        bad = [name for name, s in states.items() if s not in ("healthy", "starting")]
        assert not bad, f"unhealthy: {states}\n" + "\n".join(stack.logs(b) for b in bad)
        assert stack.left() > 60, f"not healthy in time: {states}"
        time.sleep(3)


def summary(stack: Stack) -> None:
    print("\ncompose test summary (s):", json.dumps({k: round(v) for k, v in stack.timings.items()}, indent=1))
    for image, size in getattr(stack, "sizes", {}).items():
        print(f"  image {image}: {size / 1e6:.0f} MB")


def test_every_healthcheck_is_healthy(stack):
    assert stack.health.states() == {name: "healthy" for name in SERVICES}
    for service in ("engine", "worker", "gateway"):  # built in Docker's format, the images keep theirs
        healthcheck = stack.podman.run("image", "inspect", "--format", "{{json .HealthCheck}}",
                                       f"{PROJECT}_{service}")
        assert "tandem-healthcheck" in healthcheck.stdout, (service, healthcheck.stdout)


def test_chat_completion_with_the_openai_client(stack):
    from openai import OpenAI

    client = OpenAI(base_url=stack.url("gateway", "/v1"), api_key=API_KEY, timeout=300)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, max_tokens=8,
                                           messages=[{"role": "user", "content": "Say hello."}])
    assert reply.choices[0].message.content and reply.usage.completion_tokens > 0, reply
    with pytest.raises(Exception, match="401"):
        OpenAI(base_url=stack.url("gateway", "/v1"), api_key="wrong").models.list()


def test_the_engine_loaded_the_cpu_executor_built_into_its_image(stack):
    """The hybrid backend's C++ extension was compiled by the image build, not at the container's start:
    the engine logged loading it, and the library is older than the container."""
    assert "cpu executor extension ready" in stack.logs("engine", lines=10_000)
    started = int(stack.podman.run("inspect", "--format", "{{.State.StartedAt.Unix}}",
                                   stack.container("engine")).stdout)
    built = stack.exec("engine", "sh", "-c", "stat -c '%Y %n' $(find /opt/tandem/ext -name '*.so')").splitlines()
    assert built and all(int(line.split()[0]) < started for line in built), (started, built)


def test_profile_job_lands_in_the_shared_volume(stack):
    """POST /admin/profiles -> the worker writes /profiles/<uuid>.json -> the gateway lists it and the
    engine container reads the same file from its (read-only) mount of the volume."""
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    resp = httpx.post(stack.url("gateway", "/admin/profiles"), json=PROFILE_REQUEST, headers=admin,
                      timeout=30)
    assert resp.status_code == 202, resp.text
    job_id = resp.json()["id"]
    end_by = time.monotonic() + min(600, stack.left())
    while (job := httpx.get(stack.url("gateway", f"/admin/jobs/{job_id}"), headers=admin,
                            timeout=30).json())["state"] not in ("SUCCESS", "FAILURE"):
        assert time.monotonic() < end_by, f"job {job_id} not done: {job}\n{stack.logs('worker')}"
        time.sleep(2)
    assert job["state"] == "SUCCESS", f"{job}\n{stack.logs('worker')}"
    listed = httpx.get(stack.url("gateway", "/admin/profiles"), headers=admin, timeout=30).json()["data"]
    assert len(listed) == 1 and listed[0]["valid"], listed
    seen_by_engine = stack.exec("engine", "python", "-c",
                                "from services.common.profiles import list_profiles; "
                                "print(*[e.path.name for e in list_profiles() if e.profile])").split()
    assert seen_by_engine == [listed[0]["file"]], (seen_by_engine, listed)


def test_prometheus_scrapes_every_service_by_its_compose_name(stack):
    """Both engines up, each labelled with its engine id (the gateway's) and device."""
    expected = {("engine", "engine:8001", "0", "cpu"), ("engine", "engine-1:8001", "1", "cpu"),
                ("gateway", "gateway:8000", None, None), ("worker", "worker:9101", None, None)}
    end_by = time.monotonic() + min(120, stack.left())
    while True:
        targets = httpx.get(stack.url("prometheus", "/api/v1/targets"), timeout=30).json()["data"]["activeTargets"]
        up = {(t["labels"]["job"], t["labels"]["instance"], t["labels"].get("engine"), t["labels"].get("gpu"))
              for t in targets if t["health"] == "up"}
        if up == expected:
            return
        assert time.monotonic() < end_by, f"Prometheus targets: {json.dumps(targets, indent=1)}"
        time.sleep(3)


def engine_finished(stack: Stack, service: str) -> int:
    """Requests ``service`` has finished, from its own stats (inside its container: engines publish no port)."""
    return int(stack.exec(service, "python", "-c", "import json, urllib.request; print(json.load(urllib.request."
                          "urlopen('http://127.0.0.1:8001/engine/v1/stats'))['requests_finished'])"))


def test_requests_land_on_both_engines_behind_one_gateway(stack):
    """Each engine runs on the cores its override's cpuset gives it; the gateway lists both healthy;
    requests sent one at a time alternate between the two idle engines."""
    import yaml

    from services.common.topology import parse_cpulist

    override = yaml.safe_load((REPO / ENGINES_OVERRIDE).read_text())
    for service in ENGINES:
        allowed = stack.exec(service, "python", "-c", "import os; print(*sorted(os.sched_getaffinity(0)))").split()
        assert [int(c) for c in allowed] == parse_cpulist(str(override["services"][service]["cpuset"])), service
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    engines = httpx.get(stack.url("gateway", "/admin/engines"), headers=admin, timeout=30).json()["data"]
    assert [(e["id"], e["url"], e["healthy"]) for e in engines] == [
        ("0", "http://engine:8001", True), ("1", "http://engine-1:8001", True)]
    before = [engine_finished(stack, s) for s in ENGINES]
    body = {"model": engines[0]["model_id"], "prompt": "hi", "max_tokens": 2}
    for _ in range(4):
        resp = httpx.post(stack.url("gateway", "/v1/completions"), json=body, timeout=300,
                          headers={"Authorization": f"Bearer {API_KEY}"})
        assert resp.status_code == 200, resp.text
    assert [engine_finished(stack, s) - b for s, b in zip(ENGINES, before)] == [2, 2]


def test_grafana_stand_in_serves_the_mounted_dashboard(stack):
    served = httpx.get(stack.url("grafana", "/dashboards/tandem.json"), timeout=30)
    assert served.status_code == 200
    assert served.json() == json.loads((REPO / "deploy/grafana/dashboards/tandem.json").read_text())


def test_down_v_removes_containers_volumes_and_network(stack):
    stack.timed("compose down -v", stack.compose, "down", "-v")
    stack.down_done = True
    label = f"label=com.docker.compose.project={PROJECT}"
    assert stack.podman.run("ps", "-a", "-q", "--filter", label).stdout.split() == []
    assert stack.podman.run("volume", "ls", "-q", "--filter", label).stdout.split() == []
    assert stack.podman.run("network", "ls", "-q", "--filter", label).stdout.split() == []
