"""docker-compose.yml validates with Debian's docker-compose v1 (`config -q`) and with dclint (current
Compose spec), and wires the topology the README promises."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.common.topology import parse_cpulist

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
GPU_OVERRIDE = REPO / "docker-compose.override.yml"  # read by default with COMPOSE
DCLINT_VERSION = "3.1.0"
DCLINT_DIR = REPO / ".cache" / "dclint"  # gitignored; the test installs dclint here once


def dclint() -> Path:
    binary = DCLINT_DIR / "node_modules" / ".bin" / "dclint"
    if not binary.exists():
        npm = shutil.which("npm")
        assert npm, "npm is needed to install dclint (apt-get install npm)"
        subprocess.run([npm, "install", "--prefix", str(DCLINT_DIR), "--no-audit", "--no-fund",
                        "--loglevel=error", f"dclint@{DCLINT_VERSION}"], check=True, timeout=300)
    return binary


def run_dclint(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(dclint()), "-c", str(REPO / "docker" / "dclint.yml"), "--max-warnings", "0",
                           "--color", "false", str(path)], capture_output=True, text=True, timeout=120)


def compose_config(*paths: Path, env: dict | None = None, quiet: bool = True) -> subprocess.CompletedProcess:
    assert shutil.which("docker-compose"), "docker-compose (v1) missing: scripts/setup-system.sh installs it"
    files = [arg for path in paths for arg in ("-f", str(path))]
    return subprocess.run(["docker-compose", *files, "config", *(["-q"] if quiet else [])], capture_output=True,
                          text=True, cwd=paths[0].parent, env=env, timeout=60)


def test_docker_compose_v1_config():
    result = compose_config(COMPOSE)
    assert result.returncode == 0, result.stderr
    result = compose_config(COMPOSE, GPU_OVERRIDE)
    assert result.returncode == 0, result.stderr


def test_the_gpu_override_is_what_a_plain_up_reads(tmp_path):
    """`docker compose up` on a GPU host reads docker-compose.yml + docker-compose.override.yml: both GPU
    services reserve the same GPU; docker-compose.yml alone reserves none (the CPU path)."""
    import os

    for path in (COMPOSE, GPU_OVERRIDE):  # a copy: no .env of this checkout (COMPOSE_FILE) applies
        shutil.copy(path, tmp_path / path.name)
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    plain = yaml.safe_load(subprocess.run(["docker-compose", "config"], cwd=tmp_path, env=env, capture_output=True,
                                          text=True, check=True, timeout=60).stdout)["services"]
    for gpu_service in ("engine", "worker"):
        devices = plain[gpu_service]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
    assert plain["engine"]["deploy"] == plain["worker"]["deploy"]
    cpu = yaml.safe_load(compose_config(COMPOSE, quiet=False).stdout)["services"]
    assert not any("deploy" in svc for svc in cpu.values())


def test_docker_compose_config_with_env_example(tmp_path):
    # .env.example must stay a valid .env: copy both and let compose interpolate.
    shutil.copy(COMPOSE, tmp_path / "docker-compose.yml")
    shutil.copy(REPO / ".env.example", tmp_path / ".env")
    shutil.copy(GPU_OVERRIDE, tmp_path / GPU_OVERRIDE.name)
    result = compose_config(tmp_path / "docker-compose.yml", tmp_path / GPU_OVERRIDE.name)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("path", [COMPOSE, GPU_OVERRIDE, REPO / "tests/deploy/compose.ci.yml",
                                  REPO / "tests/deploy/compose.ci-engines.yml"], ids=lambda p: p.name)
def test_dclint(path):
    result = run_dclint(path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dclint_can_fail(tmp_path):
    bad = tmp_path / "docker-compose.yml"
    bad.write_text("services:\n  web:\n    image: nginx\n    build: .\n")
    result = run_dclint(bad)
    assert result.returncode != 0 and "no-build-and-image" in result.stdout


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def test_topology(services):
    assert set(services) == {"redis", "engine", "worker", "gateway", "prometheus", "grafana"}
    # The worker writes profiles; the engine and the gateway (GET /admin/profiles) read them.
    assert "profiles:/profiles" in services["worker"]["volumes"]
    for reader in ("engine", "gateway"):
        assert "profiles:/profiles:ro" in services[reader]["volumes"], reader
    for name, svc in services.items():
        assert "healthcheck" in svc, f"service {name} has no healthcheck"
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert cond == {"condition": "service_healthy"}, f"{name} -> {dep}"
    assert services["gateway"]["environment"]["TANDEM_ENGINES"] == "http://engine:8001"


def test_engine_and_gateway_share_the_engine_token(services):
    token = services["engine"]["environment"]["TANDEM_ENGINE_TOKEN"]
    assert token == services["gateway"]["environment"]["TANDEM_ENGINE_TOKEN"] == "${TANDEM_ENGINE_TOKEN:-}"


def test_redis_keeps_jobs_across_restarts(services):
    """The job queue and results persist: append-only file, on a named volume (docs/operating.md)."""
    command = services["redis"]["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert "redis-data:/data" in services["redis"]["volumes"]


def test_env_example_documents_every_variable():
    import re

    code = "\n".join(line for path in (COMPOSE, GPU_OVERRIDE) for line in path.read_text().splitlines()
                     if not line.lstrip().startswith("#"))
    used = set(re.findall(r"\$\{([A-Z_]+):-", code))
    assert {"TANDEM_MODEL", "TANDEM_MODELS_DIR", "TANDEM_GPU", "TANDEM_DEVICE", "REDIS_IMAGE"} <= used
    documented = {line.split("=", 1)[0] for line in (REPO / ".env.example").read_text().splitlines()
                  if "=" in line and not line.startswith("#")}
    assert used <= documented, f"not in .env.example: {sorted(used - documented)}"


def test_engine_flags_are_accepted_by_the_engine(services):
    """The compose engine command, with every ${VAR:-default} at its default, parses with the engine's
    own flags and names a backend this build has."""
    import re

    from services.engine.config import EngineConfig
    from services.engine.moe import backends
    from services.common.settings import dataclass_from_args
    from services.engine.api import build_parser

    command = [re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(word)) for word in services["engine"]["command"]]
    assert command[:2] == ["tandem", "engine"]
    config = dataclass_from_args(EngineConfig, build_parser().parse_args(command[2:]))
    for module in backends._BACKEND_MODULES:
        __import__(module)
    assert config.moe_backend in backends.BACKENDS, f"compose default backend {config.moe_backend.value} missing"


# -- several engines: scripts/compose_engines.py (issue 25) -------------------------------------------
def compose_engines(tmp_path: Path, *args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    """Run the generator into ``tmp_path``; returns its result and `docker-compose config` of the
    compose file with the override, as a dict (the effective services)."""
    import os

    out = tmp_path / "engines.yml"
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "compose_engines.py"), *args, "--output", str(out),
                             "--targets", str(tmp_path / "targets.json")], capture_output=True, text=True,
                            env=env, cwd=tmp_path, timeout=60)
    if result.returncode != 0:
        return result, {}
    env = {k: v for k, v in (env or os.environ).items() if not k.startswith("COMPOSE_")}
    config = subprocess.run(["docker-compose", "-f", str(COMPOSE), "-f", str(out), "config"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=60)
    assert config.returncode == 0, config.stderr
    return result, yaml.safe_load(config.stdout)["services"]


def test_compose_engines_cpu(tmp_path):
    """--cpu-engines 2: two engines from one definition, each with its share of the cores, the gateway in
    front of both (and waiting for both), Prometheus reading the targets file written beside it."""
    import json
    import os

    result, services = compose_engines(tmp_path, "--cpu-engines", "2")
    assert result.returncode == 0, result.stderr
    assert set(services) == {"redis", "engine", "engine-1", "worker", "gateway", "prometheus", "grafana"}
    base = yaml.safe_load(COMPOSE.read_text())["services"]["engine"]
    for name in ("engine", "engine-1"):
        engine = services[name]
        assert engine["build"]["target"] == "engine" and engine["healthcheck"]["test"] == base["healthcheck"]["test"]
        assert "deploy" not in engine
    assert services["engine"]["command"] == services["engine-1"]["command"]
    if len(os.sched_getaffinity(0)) > 1:
        cpus = [parse_cpulist(str(services[n]["cpuset"])) for n in ("engine", "engine-1")]
        assert not set(cpus[0]) & set(cpus[1]) and sorted(cpus[0] + cpus[1]) == sorted(os.sched_getaffinity(0))
    gateway = services["gateway"]
    assert gateway["environment"]["TANDEM_ENGINES"] == "http://engine:8001,http://engine-1:8001"
    assert set(gateway["depends_on"]) == {"engine", "engine-1", "redis"}
    mounts = {v.split(":")[1]: v.split(":")[0] for v in services["prometheus"]["volumes"]}
    assert Path(mounts["/etc/prometheus/targets.json"]) == tmp_path / "targets.json"
    targets = json.loads((tmp_path / "targets.json").read_text())
    engines = [g for g in targets if g["labels"]["job"] == "engine"]
    assert [(g["targets"], g["labels"]) for g in engines] == [
        (["engine:8001"], {"job": "engine", "engine": "0", "gpu": "cpu"}),
        (["engine-1:8001"], {"job": "engine", "engine": "1", "gpu": "cpu"})]
    unpinned = subprocess.run([sys.executable, str(REPO / "scripts" / "compose_engines.py"), "--cpu-engines", "2",
                               "--no-pin", "--output", str(tmp_path / "unpinned.yml"), "--targets",
                               str(tmp_path / "unpinned.json")], capture_output=True, text=True, timeout=60)
    assert unpinned.returncode == 0, unpinned.stderr
    written = yaml.safe_load((tmp_path / "unpinned.yml").read_text())["services"]
    assert "engine-1" in written and not any("cpuset" in svc for svc in written.values())


def test_compose_engines_one_per_gpu(tmp_path):
    """On a (fake) 3-GPU host: --gpus 2,0 gives engine on GPU 2 and engine-1 on GPU 0 (each reserving its
    UUID), the worker reserving both, Prometheus labelling each engine with its GPU's UUID."""
    import json
    import os

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text("#!/bin/sh\nprintf '0, GPU-a0, 00000000:17:00.0, H200\\n1, GPU-a1, 00000000:3A:00.0, H200\\n"
                    "2, GPU-a2, 00000000:9A:00.0, H200\\n'\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    result, services = compose_engines(tmp_path, "--gpus", "2,0", env=env)
    assert result.returncode == 0, result.stderr

    def reserved(name: str) -> list[str]:
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        return device["device_ids"]

    assert (reserved("engine"), reserved("engine-1"), reserved("worker")) == (["GPU-a2"], ["GPU-a0"],
                                                                             ["GPU-a2", "GPU-a0"])
    assert all(services[n].get("cpuset") for n in ("engine", "engine-1"))
    labels = [g["labels"] for g in json.loads((tmp_path / "targets.json").read_text()) if g["labels"]["job"] == "engine"]
    assert labels == [{"job": "engine", "engine": "0", "gpu": "GPU-a2"}, {"job": "engine", "engine": "1", "gpu": "GPU-a0"}]
    bad, _ = compose_engines(tmp_path, "--gpus", "7", env=env)
    assert bad.returncode == 2 and "no GPU '7'" in bad.stderr
    none, _ = compose_engines(tmp_path, env={**os.environ, "PATH": str(tmp_path / "empty")})
    assert none.returncode == 2 and "--cpu-engines" in none.stderr
