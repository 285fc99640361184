"""The profiler's P2P probe: every ordered pair of the devices given (none for one device; a device listed
twice is a simulated pair, as the engine's simulated peers), and the profile's p2p links round-trip."""

from __future__ import annotations

import pytest
import torch

from services.common import profiles as P
from services.profiler import probes


def test_one_device_has_no_pair():
    assert probes.p2p_links([torch.device("cpu")], 1 << 20) == []


def test_simulated_pair_measures_both_directions():
    links = probes.p2p_links([torch.device("cpu"), torch.device("cpu")], 1 << 20)
    assert [(i, j) for i, j, _ in links] == [(0, 1), (1, 0)]
    assert all(gbps > 0 for _, _, gbps in links)


@pytest.mark.gpu
def test_cuda_pairs():
    """Two pools on cuda:0 (a copy within the GPU), and every real pair when there are more GPUs."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    n = torch.cuda.device_count()
    devices = [torch.device("cuda", 0)] * 2 + [torch.device("cuda", i) for i in range(1, n)]
    links = probes.p2p_links(devices, 16 << 20)
    assert len(links) == len(devices) * (len(devices) - 1) and all(g > 0 for _, _, g in links)


def test_profile_keeps_p2p_links(tmp_path):
    link = P.P2PLink(src="GPU-a", dst="GPU-b", gbps=380.5)
    profile = P.Profile(
        schema_version=P.SCHEMA_VERSION, gpu=P.GpuInfo(uuid="GPU-b"), host=P.HostInfo(physical_cores=2),
        created_at=P.now_iso(), tandem_version="test", ceilings=P.Ceilings(cpu_read=10.0),
        kernels={"bfloat16": P.KernelBandwidths(cpu_executor_bs1=5.0)}, c_sync_s=1e-5,
        geometry=P.Geometry(model="tiny", num_layers=2, num_experts=4, top_k=2, hidden_size=8,
                            moe_intermediate_size=4), p2p=[link])
    path = P.write_profile(profile, tmp_path)
    assert P.read_profile(path).p2p == [link]
    with pytest.raises(ValueError):
        P.P2PLink(src="GPU-a", dst="GPU-b", gbps=0.0)
