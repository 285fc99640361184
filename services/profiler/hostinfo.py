"""Who is being measured: the GPU (NVML identity, mapped to its torch device) and the host CPU.

NVML (`nvidia-ml-py`, import name ``pynvml``) gives the stable UUID that names the profile file;
torch gives the device index to run on. The two index spaces differ under CUDA_VISIBLE_DEVICES, so
they are joined by UUID, never by index.
"""

from __future__ import annotations

import os
import socket
import subprocess
from dataclasses import dataclass

from services.common.logging import get_logger
from services.common.profiles import GpuInfo, HostInfo, cpu_uuid, normalize_uuid

log = get_logger("profiler.hostinfo")


@dataclass(frozen=True)
class GpuTarget:
    info: GpuInfo  # uuid/name/index as NVML reports them (index: nvidia-smi index)
    torch_index: int  # the same GPU in torch's numbering


def _nvml_gpus() -> list[GpuInfo] | None:
    """Every GPU NVML sees, or None when NVML is unavailable (no driver, package missing)."""
    try:
        import pynvml
    except ImportError:
        log.info("pynvml (package nvidia-ml-py) not installed: GPU identity from torch")
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as ex:
        log.info("NVML unavailable (%s): GPU identity from torch", ex)
        return None
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid, name = pynvml.nvmlDeviceGetUUID(h), pynvml.nvmlDeviceGetName(h)
            out.append(GpuInfo(uuid=uuid.decode() if isinstance(uuid, bytes) else uuid,
                               name=name.decode() if isinstance(name, bytes) else name, index=i))
        return out
    finally:
        pynvml.nvmlShutdown()


def _torch_gpus() -> list[GpuInfo]:
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        out.append(GpuInfo(uuid=normalize_uuid(str(props.uuid)), name=props.name, index=i))
    return out


def resolve_gpu(selector: str | None) -> GpuTarget | None:
    """The GPU to measure: ``selector`` is a UUID (with or without "GPU-"), an nvidia-smi index, or
    None for the first visible one. Returns None when torch sees no CUDA GPU; raises ValueError when
    the selector names a GPU that is not there."""
    visible = _torch_gpus()
    if not visible:
        if selector:
            raise ValueError(f"--gpu {selector}: no CUDA GPU is visible to torch")
        return None
    torch_of = {normalize_uuid(g.uuid): g.index for g in visible}
    nvml = _nvml_gpus()
    candidates = [g for g in (nvml or visible) if normalize_uuid(g.uuid) in torch_of]
    if selector is None:
        chosen = candidates[0] if nvml is None else min(candidates, key=lambda g: torch_of[normalize_uuid(g.uuid)])
    elif selector.isdigit():
        matches = [g for g in candidates if g.index == int(selector)]
        if not matches:
            raise ValueError(f"--gpu {selector}: no visible GPU with that index (have {[g.index for g in candidates]})")
        chosen = matches[0]
    else:
        matches = [g for g in candidates if normalize_uuid(g.uuid) == normalize_uuid(selector)]
        if not matches:
            raise ValueError(f"--gpu {selector}: no visible GPU with that UUID (have {[g.uuid for g in candidates]})")
        chosen = matches[0]
    return GpuTarget(info=chosen, torch_index=torch_of[normalize_uuid(chosen.uuid)])


def cpu_topology() -> list[tuple[int, int, int]]:
    """(logical cpu, core key, numa node) for one logical CPU per physical core we may run on."""
    allowed = os.sched_getaffinity(0)
    try:
        text = subprocess.run(["lscpu", "-p=CPU,CORE,SOCKET,NODE"], capture_output=True, text=True,
                              check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return [(c, c, 0) for c in sorted(allowed)]
    seen: dict[tuple[int, int], tuple[int, int, int]] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        cpu, core, socket_, node = (int(x) if x else 0 for x in line.split(","))
        if cpu in allowed and (socket_, core) not in seen:
            seen[(socket_, core)] = (cpu, socket_ * 100000 + core, node)
    return list(seen.values()) or [(c, c, 0) for c in sorted(allowed)]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def host_info() -> HostInfo:
    topo = cpu_topology()
    return HostInfo(hostname=socket.gethostname(), cpu_model=_cpu_model(), physical_cores=len(topo),
                    numa_nodes=len({node for _, _, node in topo}) or 1)


def cpu_only_gpu_info() -> GpuInfo:
    """The identity of a profile measured without a GPU (the decision treats it as "no GPU")."""
    return GpuInfo(uuid=cpu_uuid(), name=None, index=None)
