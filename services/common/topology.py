"""Engine per GPU (torch-free): which GPUs this host has, and which CPU cores each engine is pinned to.

One engine per GPU (docs/operating.md "Several GPUs") runs each engine on one GPU and on the CPU cores
near it: the hybrid backend's CPU executor streams expert weights from host DRAM, and a core on the
GPU's own NUMA node reads the banks and feeds that GPU's PCIe link without crossing the socket link.

- ``list_gpus()``: index, UUID, PCI bus id and name of every GPU, from ``nvidia-smi`` (no NVML import,
  so the launcher needs no GPU package); an empty list on a host without the driver.
- ``gpu_local_cpus(bus_id)``: the GPU's local CPU list from sysfs
  (``/sys/bus/pci/devices/<bus id>/local_cpulist``, the cores of its NUMA node).
- ``engine_cpusets(...)``: one CPU set per engine. GPUs that share a NUMA node share its cores, split
  between them (two engines' executors pinned to the same cores would each spin on them and halve
  both); CPU engines split this process's allowed cores. Splits are by whole physical core (SMT
  siblings stay together), in contiguous blocks.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

PCI_DEVICES = Path("/sys/bus/pci/devices")
CPU_SYSFS = Path("/sys/devices/system/cpu")


@dataclass(frozen=True)
class Gpu:
    index: int  # nvidia-smi's index (CUDA_VISIBLE_DEVICES and compose device_ids accept it)
    uuid: str  # "GPU-..." (stable across reboots; the profile file's name)
    bus_id: str  # PCI bus id as sysfs names it: "0000:17:00.0"
    name: str = ""


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' (the kernel's cpulist format) -> [0, 1, 2, 3, 8, 10, 11]; raises ValueError."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise ValueError(f"not a CPU list: {text!r}")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return sorted(cpus)


def format_cpulist(cpus: list[int] | set[int]) -> str:
    """[0, 1, 2, 3, 8] -> '0-3,8' (what `cpuset:` in compose and `taskset -c` accept)."""
    out, run = [], []
    for cpu in sorted(set(cpus)):
        if run and cpu != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(cpu)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def sysfs_bus_id(bus_id: str) -> str:
    """nvidia-smi's '00000000:17:00.0' -> sysfs' '0000:17:00.0' (a 4-digit PCI domain, lower case)."""
    domain, _, rest = bus_id.strip().lower().partition(":")
    if not rest:
        raise ValueError(f"not a PCI bus id: {bus_id!r}")
    return f"{int(domain, 16):04x}:{rest}"


def list_gpus(nvidia_smi: str = "nvidia-smi") -> list[Gpu]:
    """Every GPU the driver sees, in nvidia-smi's order; [] when nvidia-smi is missing or fails."""
    try:
        out = subprocess.run([nvidia_smi, "--query-gpu=index,uuid,pci.bus_id,name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return parse_gpu_csv(out)


def parse_gpu_csv(text: str) -> list[Gpu]:
    """nvidia-smi's ``--query-gpu=index,uuid,pci.bus_id,name --format=csv,noheader`` output."""
    gpus = []
    for line in text.splitlines():
        if not line.strip():
            continue
        index, uuid, bus_id, name = (x.strip() for x in line.split(",", 3))
        gpus.append(Gpu(int(index), uuid, sysfs_bus_id(bus_id), name))
    return gpus


def gpu_local_cpus(bus_id: str, pci_devices: Path = PCI_DEVICES) -> list[int]:
    """The CPUs of the GPU's NUMA node (sysfs local_cpulist); [] when sysfs does not say."""
    try:
        return parse_cpulist((pci_devices / bus_id / "local_cpulist").read_text())
    except (OSError, ValueError):
        return []


def physical_cores(cpus: list[int], cpu_sysfs: Path = CPU_SYSFS) -> list[list[int]]:
    """``cpus`` grouped by physical core (SMT siblings together), in order of each core's first CPU."""
    cores: dict[tuple[str, str], list[int]] = {}
    for cpu in sorted(cpus):
        topo = cpu_sysfs / f"cpu{cpu}" / "topology"
        try:
            key = ((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip())
        except OSError:
            key = (str(cpu), "")
        cores.setdefault(key, []).append(cpu)
    return list(cores.values())


def split_cpus(cpus: list[int], n: int, cpu_sysfs: Path = CPU_SYSFS) -> list[list[int]]:
    """``cpus`` in ``n`` contiguous shares of whole physical cores, the first shares one core larger
    when they do not divide evenly. With fewer cores than shares, the shares reuse cores round-robin
    (each engine still gets one core; they then compete for it)."""
    if n < 1:
        raise ValueError(f"cannot split CPUs into {n} shares")
    cores = physical_cores(cpus, cpu_sysfs)
    if not cores:
        raise ValueError("no CPUs to split")
    if len(cores) < n:
        return [sorted(cores[i % len(cores)]) for i in range(n)]
    base, extra = divmod(len(cores), n)
    shares, start = [], 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        shares.append(sorted(c for core in cores[start:start + size] for c in core))
        start += size
    return shares


def engine_cpusets(gpus: list[Gpu], allowed: set[int] | None = None, pci_devices: Path = PCI_DEVICES,
                   cpu_sysfs: Path = CPU_SYSFS) -> list[list[int]]:
    """One CPU set per GPU (same order): the GPU's local CPUs within ``allowed`` (default: this
    process's), split between the GPUs that share them. A GPU whose local CPUs sysfs does not give (a
    VM, a one-node host reporting nothing) shares the allowed CPUs with the other such GPUs."""
    allowed = set(os.sched_getaffinity(0) if allowed is None else allowed)
    groups: dict[tuple[int, ...], list[int]] = {}  # local CPU set -> positions of its GPUs in ``gpus``
    for pos, gpu in enumerate(gpus):
        local = tuple(c for c in gpu_local_cpus(gpu.bus_id, pci_devices) if c in allowed) or tuple(sorted(allowed))
        groups.setdefault(local, []).append(pos)
    out: list[list[int]] = [[] for _ in gpus]
    for local, positions in groups.items():
        for pos, share in zip(positions, split_cpus(list(local), len(positions), cpu_sysfs)):
            out[pos] = share
    return out


def cpu_engine_cpusets(n: int, allowed: set[int] | None = None, cpu_sysfs: Path = CPU_SYSFS) -> list[list[int]]:
    """``n`` CPU engines: the allowed CPUs split into ``n`` shares of whole cores."""
    allowed = set(os.sched_getaffinity(0) if allowed is None else allowed)
    return split_cpus(sorted(allowed), n, cpu_sysfs)
