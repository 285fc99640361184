"""The dependencies resolve on the public index alone, as a new user's pip sees them.

Our machines' pip is configured with a local folder holding a CPU torch wheel, which once hid a
ResolutionImpossible every public install hit (triton pinned apart from the triton PyPI's torch
pins). Each check here runs pip with this machine's configuration ignored (``--isolated``) against
https://pypi.org/simple: ``--dry-run --report`` resolves without installing, and ``fast-deps`` reads
each wheel's metadata with HTTP range requests instead of downloading it (PyPI's torch alone is a
526 MB wheel plus ~2.5 GB of nvidia-* wheels; the test asserts pip read far less than one torch).
About 10 s per check on our CI machine; it needs PyPI to be reachable. Last, `make setup`'s torch
step (scripts/install-torch.sh): a torch already here is kept, TORCH_INDEX is used otherwise.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
PUBLIC_INDEX = "https://pypi.org/simple"
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
GPU_DOCKERFILE = REPO / "docker" / "gpu.Dockerfile"
# Python of the GPU image (Ubuntu 24.04's python3): its wheels are resolved for it, not for ours.
GPU_IMAGE_PYTHON = "3.12"
# pip reads its own modules too (~10 MB); a downloaded torch wheel alone would be 526 MB.
MAX_BYTES_READ = 200_000_000

# Runs pip in this interpreter and, at exit, writes how many bytes the process read (files and
# sockets: /proc/self/io rchar) to the path in argv[1].
_PIP_COUNTING_READS = """
import atexit, runpy, sys
out = sys.argv.pop(1)
def report():
    io = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
    open(out, "w").write(io["rchar"])
atexit.register(report)
sys.argv[0] = "pip"
runpy.run_module("pip", run_name="__main__", alter_sys=True)
"""


def resolve_public(requirements: list[str], tmp_path: Path, *pip_flags: str) -> dict:
    """``pip install --dry-run`` of ``requirements`` against PyPI alone; pip's JSON report."""
    report, bytes_read = tmp_path / "report.json", tmp_path / "bytes_read"
    # --isolated drops PIP_CERT with the rest of the environment's pip settings; keep the CA bundle.
    cert = ["--cert", os.environ["PIP_CERT"]] if os.environ.get("PIP_CERT") else []
    cmd = [sys.executable, "-c", _PIP_COUNTING_READS, str(bytes_read), "install", "--isolated", "--dry-run",
           "--ignore-installed", "--only-binary=:all:", "--index-url", PUBLIC_INDEX, "--use-feature=fast-deps",
           "--quiet", "--report", str(report), *cert, *pip_flags, *requirements]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{' '.join(requirements)} does not resolve on {PUBLIC_INDEX}:\n{result.stderr}"
    read = int(bytes_read.read_text())
    assert read < MAX_BYTES_READ, f"pip read {read / 1e6:.0f} MB resolving: it downloaded wheels, not metadata"
    return {canonicalize_name(i["metadata"]["name"]): i for i in json.loads(report.read_text())["install"]}


def extra(name: str) -> list[str]:
    return PROJECT["dependencies"] + PROJECT["optional-dependencies"][name]


def pinned(requirement_prefix: str, requirements: list[str]) -> str:
    found = [r for r in requirements if r.replace(" ", "").startswith(requirement_prefix)]
    assert len(found) == 1, f"expected one {requirement_prefix!r} requirement, found {found}"
    return found[0]


def check_torch_and_triton(installed: dict, requirements: list[str]) -> None:
    """torch is the pinned one and triton, when required, satisfies both our range and torch's pin."""
    torch_pin = pinned("torch==", requirements).split("==")[1]
    assert installed["torch"]["metadata"]["version"] == torch_pin
    if "triton" in installed:
        triton_range = SpecifierSet(pinned("triton", requirements).removeprefix("triton"))
        assert Version(installed["triton"]["metadata"]["version"]) in triton_range


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PROJECT["optional-dependencies"]))
def test_each_extra_resolves_on_the_public_index(name, tmp_path):
    installed = resolve_public(extra(name), tmp_path)
    missing = {canonicalize_name(Requirement(r).name) for r in extra(name)} - set(installed)
    assert not missing, f"[{name}]: resolved without {missing}"
    # An extra that pins torch must get that torch; dev pulls torch only through accelerate (transformers' GGUF
    # reference) and is installed beside engine (make setup), whose pin then holds.
    if "torch" in installed and any(Requirement(r).name == "torch" for r in extra(name)):
        check_torch_and_triton(installed, extra(name))


def gpu_image_extras() -> list[str]:
    """The extras the GPU image installs, read from its Dockerfile. Its packages, torch included, are
    those pyproject pins: the image installs only from the wheelhouse scripts/wheelhouse.py resolves."""
    extras = set(re.findall(r"pip install .*\.\[([a-z,]+)\]", GPU_DOCKERFILE.read_text()))
    assert extras, f"{GPU_DOCKERFILE.name}: no `.[extras]` install found"
    return sorted({e for group in extras for e in group.split(",")})


@pytest.mark.slow
def test_gpu_image_set_resolves_with_the_image_torch(tmp_path):
    """The GPU image's set (pyproject's pins for its extras, as scripts/wheelhouse.py downloads them)
    resolves on PyPI for the image's Python, with PyPI's CUDA torch and the triton it pins."""
    sys.path.insert(0, str(REPO / "scripts"))
    import wheelhouse

    extras = gpu_image_extras()
    assert extras == sorted(wheelhouse.IMAGES["engine"]), (extras, wheelhouse.IMAGES)
    requirements = sorted(set(PROJECT["dependencies"]).union(*(PROJECT["optional-dependencies"][e] for e in extras)))
    installed = resolve_public(requirements, tmp_path, "--python-version", GPU_IMAGE_PYTHON)
    check_torch_and_triton(installed, requirements)
    torch_wheel = installed["torch"]["download_info"]["url"].rsplit("/", 1)[1]
    assert f"cp{GPU_IMAGE_PYTHON.replace('.', '')}" in torch_wheel, torch_wheel


@pytest.mark.slow
def test_install_torch_takes_the_pin_from_torch_index_when_no_wheel_is_local(tmp_path):
    """`make setup`'s torch step on a machine whose pip sees no local torch wheel: the pinned torch
    from TORCH_INDEX (here PyPI, standing in for PyTorch's CPU index, which our CI cannot reach)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k == "PIP_CERT"}
    env.update(PIP_CONFIG_FILE=os.devnull, TORCH_INDEX=PUBLIC_INDEX)
    report = tmp_path / "report.json"
    result = subprocess.run(["bash", str(REPO / "scripts" / "install-torch.sh"), sys.executable, "--dry-run",
                             "--ignore-installed", "--use-feature=fast-deps", "--report", str(report)],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"from {PUBLIC_INDEX}" in result.stdout
    [torch] = json.loads(report.read_text())["install"]
    assert torch["metadata"]["version"] == pinned("torch==", extra("engine")).split("==")[1]
    assert torch["download_info"]["url"].startswith("https://files.pythonhosted.org/")


def test_install_torch_keeps_an_installed_torch_without_asking_an_index(tmp_path):
    """This venv already has the pinned torch (`make setup` put it there): the step is satisfied
    locally, and TORCH_INDEX (here a port nothing listens on) is never asked."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, TORCH_INDEX="http://127.0.0.1:9/simple")
    result = subprocess.run(["bash", str(REPO / "scripts" / "install-torch.sh"), sys.executable, "--dry-run"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "from a wheel already on this machine" in result.stdout
