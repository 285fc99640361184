"""A model that cannot be served stops `tandem engine`, `tandem serve` and `tandem stack` with one line
saying why (real subprocesses): a path that does not exist, a checkpoint we do not support, a corrupt
weight file and a model that does not fit are refused before loading (status 2); a checkpoint that
fails while loading ends the process too (status 1) instead of a /health answering 503 forever."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.models.demo import write_demo_checkpoint
from services.engine.models.loader import read_spec
from services.engine.preflight import check_fits

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 180  # a guard against the old behaviour (waiting forever), not a measurement


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo") / "demo")


def broken_copy(demo: Path, tmp_path: Path) -> Path:
    target = tmp_path / "model"
    shutil.copytree(demo, target)
    return target


def tandem(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=env)


def the_line(result: subprocess.CompletedProcess, prog: str) -> str:
    """The one stderr line the command ends with, checked to start with ``prog:``."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith(f"{prog}: "), result.stderr
    return lines[-1]


def test_engine_refuses_a_path_that_does_not_exist(tmp_path, free_port):
    result = tandem("engine", "--model", str(tmp_path / "no-such-model"), "--port", str(free_port))
    assert result.returncode == 2
    assert "no-such-model: no such directory" in the_line(result, "tandem engine")


def test_serve_refuses_an_unsupported_checkpoint(demo, tmp_path, free_port):
    model = broken_copy(demo, tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    result = tandem("serve", "--model", str(model), "--port", str(free_port))
    assert result.returncode == 2
    assert "unsupported model_type 'llama'" in the_line(result, "tandem serve")


def test_engine_refuses_a_truncated_weight_file(demo, tmp_path, free_port):
    model = broken_copy(demo, tmp_path)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    result = tandem("engine", "--model", str(model), "--port", str(free_port))
    assert result.returncode == 2
    assert "model.safetensors: corrupt or truncated" in the_line(result, "tandem engine")


def test_engine_refuses_a_model_that_does_not_fit(demo, free_port):
    """A VRAM budget (emulated on the CPU device) below one token's experts: refused before loading."""
    result = tandem("engine", "--model", str(demo), "--moe-backend", "offload", "--moe-cache-auto",
                    "--gpu-memory-limit", "0.0001", "--port", str(free_port))
    assert result.returncode == 2
    assert "below the minimum" in the_line(result, "tandem engine")


def test_engine_exits_when_loading_fails(demo, tmp_path, free_port):
    """Past the checks (the files are sound) the weights do not match config.json: the loader's error
    ends the process instead of leaving it up with a failed /health."""
    model = broken_copy(demo, tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 8}))
    result = tandem("engine", "--model", str(model), "--port", str(free_port))
    assert result.returncode == 1
    line = the_line(result, "tandem engine")
    assert "cannot serve" in line and "embed_tokens.weight" in line and "has shape" in line


def test_stack_stops_and_prints_why_the_engine_exited(tmp_path, free_port):
    result = subprocess.run([sys.executable, "-m", "services.local_stack", "--runs-dir", str(tmp_path),
                             "--services", "engine", "--engine-port", str(free_port),
                             "--model", str(tmp_path / "no-such-model")],
                            cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 1
    error = [line for line in result.stderr.splitlines() if "engine exited with code 2" in line]
    assert error and "no-such-model: no such directory" in error[0], result.stderr


def test_host_memory_check_names_what_does_not_fit(demo):
    spec = read_spec(demo)
    config = EngineConfig(model=str(demo))
    check_fits(spec, config, torch.device("cpu"), host_available=1 << 40)
    with pytest.raises(ValueError, match=r"needs .* of host memory \(experts .* \+ other weights .* \+ KV cache"):
        check_fits(spec, config, torch.device("cpu"), host_available=1 << 20)


def test_gpu_memory_check_for_resident_and_cached_backends(demo):
    """The CUDA branch with the free memory given (no GPU needed): resident needs every weight in the
    budget; a cached backend needs the non-expert weights, the KV cache and one token's experts."""
    spec, cuda = read_spec(demo), torch.device("cuda")
    resident = EngineConfig(model=str(demo), moe_backend="resident")
    check_fits(spec, resident, cuda, host_available=1 << 40, device_free=1 << 40)
    with pytest.raises(ValueError, match="resident: .* of GPU memory .* use --moe-backend offload"):
        check_fits(spec, resident, cuda, host_available=1 << 40, device_free=1 << 20)
    offload = EngineConfig(model=str(demo), moe_backend="offload", moe_cache_auto=True)
    check_fits(spec, offload, cuda, host_available=1 << 40, device_free=1 << 40)
    with pytest.raises(ValueError, match="non-expert weights and KV cache need"):
        check_fits(spec, offload, cuda, host_available=1 << 40, device_free=1 << 20)
    capped = EngineConfig(model=str(demo), moe_backend="offload", moe_cache_auto=True, gpu_memory_limit=0.0001)
    with pytest.raises(ValueError, match="--gpu-memory-limit 0.0001: 0 expert slots .* below the minimum"):
        check_fits(spec, capped, cuda, host_available=1 << 40, device_free=1 << 40)


def test_version_is_the_project_version():
    expected = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    result = tandem("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"tandem {expected}", result.stdout + result.stderr
