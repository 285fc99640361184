"""services/common/topology.py on a fake sysfs: cpulists, nvidia-smi's output, the GPU's local CPUs,
splits by whole physical core, and the engine CPU sets of a two-socket, four-GPU host."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.topology import (Gpu, cpu_engine_cpusets, engine_cpusets, format_cpulist, gpu_local_cpus,
                                      parse_cpulist, parse_gpu_csv, split_cpus, sysfs_bus_id)


def test_cpulist_round_trip():
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert format_cpulist([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    assert format_cpulist([5]) == "5"
    for bad in ("a-b", "3-1", "1;2"):
        with pytest.raises(ValueError):
            parse_cpulist(bad)


def test_nvidia_smi_csv_and_bus_ids():
    text = ("0, GPU-aaaa, 00000000:17:00.0, NVIDIA H200\n"
            "1, GPU-bbbb, 00000000:9A:00.0, NVIDIA H200\n")
    assert parse_gpu_csv(text) == [Gpu(0, "GPU-aaaa", "0000:17:00.0", "NVIDIA H200"),
                                   Gpu(1, "GPU-bbbb", "0000:9a:00.0", "NVIDIA H200")]
    assert sysfs_bus_id("0000:17:00.0") == "0000:17:00.0"


def fake_host(root: Path, sockets: int, cores_per_socket: int, smt: int, gpus: dict[str, str]) -> tuple[Path, Path]:
    """A sysfs with ``sockets`` x ``cores_per_socket`` cores of ``smt`` threads, numbered like Linux
    (first thread of every core first, then the siblings), and GPUs (bus id -> local cpulist)."""
    cpu_root, pci_root = root / "cpu", root / "pci"
    cores = sockets * cores_per_socket
    for thread in range(smt):
        for core in range(cores):
            topo = cpu_root / f"cpu{thread * cores + core}" / "topology"
            topo.mkdir(parents=True)
            (topo / "physical_package_id").write_text(f"{core // cores_per_socket}\n")
            (topo / "core_id").write_text(f"{core % cores_per_socket}\n")
    for bus_id, cpulist in gpus.items():
        (pci_root / bus_id).mkdir(parents=True)
        (pci_root / bus_id / "local_cpulist").write_text(cpulist + "\n")
    return cpu_root, pci_root


def test_split_keeps_smt_siblings_together(tmp_path):
    cpu_root, _ = fake_host(tmp_path, 1, 4, 2, {})  # cpus 0-3 and their siblings 4-7
    assert split_cpus(list(range(8)), 2, cpu_root) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert split_cpus(list(range(8)), 3, cpu_root) == [[0, 1, 4, 5], [2, 6], [3, 7]]
    assert split_cpus([0, 4], 2, cpu_root) == [[0, 4], [0, 4]]  # fewer cores than engines: shared
    with pytest.raises(ValueError):
        split_cpus([0, 1], 0, cpu_root)


def test_four_gpus_on_two_sockets_get_their_own_node_split(tmp_path):
    """Two GPUs per socket: each GPU's engine gets half of its own socket's cores, never the other's."""
    buses = {"0000:17:00.0": "0-7,16-23", "0000:3a:00.0": "0-7,16-23",
             "0000:9a:00.0": "8-15,24-31", "0000:ba:00.0": "8-15,24-31"}
    cpu_root, pci_root = fake_host(tmp_path, 2, 8, 2, buses)
    gpus = [Gpu(i, f"GPU-{i}", bus) for i, bus in enumerate(buses)]
    assert gpu_local_cpus("0000:9a:00.0", pci_root) == list(range(8, 16)) + list(range(24, 32))
    sets = engine_cpusets(gpus, set(range(32)), pci_root, cpu_root)
    assert [format_cpulist(s) for s in sets] == ["0-3,16-19", "4-7,20-23", "8-11,24-27", "12-15,28-31"]
    # a cgroup allowing socket 0 only: the socket-1 GPUs may use none of their node's cores, so they fall
    # back to the allowed ones, which all four engines then split (never two engines on one core)
    sets = engine_cpusets(gpus, set(range(8)) | set(range(16, 24)), pci_root, cpu_root)
    assert [format_cpulist(s) for s in sets] == ["0-1,16-17", "2-3,18-19", "4-5,20-21", "6-7,22-23"]


def test_a_gpu_without_sysfs_info_uses_the_allowed_cpus(tmp_path):
    cpu_root, pci_root = fake_host(tmp_path, 1, 4, 1, {})
    sets = engine_cpusets([Gpu(0, "GPU-0", "0000:01:00.0")], {0, 1, 2, 3}, pci_root, cpu_root)
    assert sets == [[0, 1, 2, 3]]


def test_cpu_engines_split_the_allowed_cores(tmp_path):
    cpu_root, _ = fake_host(tmp_path, 1, 6, 1, {})
    assert cpu_engine_cpusets(2, set(range(6)), cpu_root) == [[0, 1, 2], [3, 4, 5]]
