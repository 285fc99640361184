"""`tandem bench bw`: a fast CPU-only run writes a valid profile; the GPU run (gpu marker) fills the
GPU fields; bad flags fail with a message naming the flag."""

from __future__ import annotations

import json
import os

import pytest
import torch

from services.common import profiles as P
from services.profiler import bench_bw, hostinfo, probes

FAST = ["--model", "tiny", "--seconds", "0.05", "--buffer-mib", "4", "--cpu-kernel", "torch"]


def test_cpu_only_run_writes_a_valid_profile(tmp_path, capsys):
    assert bench_bw.main([*FAST, "--dtype", "float32,bfloat16", "--profiles-dir", str(tmp_path)]) == 0
    files = os.listdir(tmp_path)
    assert len(files) == 1 and not files[0].startswith(".")  # the profile, no temp file
    profile = P.read_profile(tmp_path / files[0])
    assert profile.schema_version == P.SCHEMA_VERSION
    assert set(profile.kernels) == {"float32", "bfloat16"}
    assert profile.ceilings.cpu_read > 0 and profile.c_sync_s > 0
    assert profile.host.physical_cores == len(hostinfo.cpu_topology())
    assert profile.geometry.model == "tiny" and profile.geometry.top_k == bench_bw.geometry("synthetic:tiny").top_k
    assert profile.kernels["float32"].cpu_kernel == "torch"
    out = capsys.readouterr().out
    assert "profile written" in out and "cpu read" in out
    if not torch.cuda.is_available():
        assert profile.gpu.uuid == P.cpu_uuid() and not profile.has_gpu
        assert profile.ceilings.h2d is None and profile.concurrent == {} and profile.p2p == []
        assert "CPU only" in out
        assert P.find_profile(P.cpu_uuid(), tmp_path) is not None
        assert P.decide(profile, 1 << 20, 4.0, 48).backend == "offload"


def test_output_flag_writes_that_file(tmp_path):
    target = tmp_path / "sub" / "p.json"
    assert bench_bw.main([*FAST, "-o", str(target)]) == 0
    assert P.read_profile(target).kernels["bfloat16"].cpu_executor_bs1 > 0


def test_progress_lines_for_the_worker(tmp_path, capsys):
    assert bench_bw.main([*FAST, "--profiles-dir", str(tmp_path), "--progress-lines"]) == 0
    lines = capsys.readouterr().out.splitlines()
    progress = [ln for ln in lines if ln.startswith(bench_bw.PROGRESS_TAG)]
    results = [ln for ln in lines if ln.startswith(bench_bw.RESULT_TAG)]
    assert len(progress) >= 3 and len(results) == 1
    assert str(tmp_path) in results[0]


@pytest.mark.parametrize("flags, needle", [(["--dtype", "int3"], "--dtype"), (["--seconds", "0"], "--seconds"),
                                           (["--model", "synthetic:nope"], "--model"),
                                           (["--gpu", "GPU-00000000-dead-beef-0000-000000000000"], "--gpu")])
def test_bad_flags_fail_naming_the_flag(tmp_path, capsys, flags, needle):
    assert bench_bw.main(["--model", "tiny", "--profiles-dir", str(tmp_path), *flags]) == 2
    assert needle in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_cpu_probes_measure_something():
    cpus = [c for c, _, _ in hostinfo.cpu_topology()]
    assert probes.cpu_read(1 << 22, cpus, 0.05) > 0
    bank = probes.make_bank(4, 64, 32, torch.float32, pin=False)
    assert bank.expert_bytes == 3 * 64 * 32 * 4
    kern = probes.CpuKernel(bank, 2, 1, impl="torch")
    assert probes.cpu_kernel_bw(kern, 0.02) > 0
    assert 0 < probes.c_sync(kern, 64, None, 0.02) < 1.0


def test_fp8_bank_probes():
    """fp8_block banks: e4m3 codes (finite) with their scales, counted in the expert's bytes; the torch kernel
    dequantizes them; the profile gets an 'fp8_block' entry."""
    bank = probes.make_bank(4, 192, 160, torch.bfloat16, pin=False, fmt="fp8_block")
    assert bank.gate_up.dtype == torch.float8_e4m3fn and bank.act_dtype == torch.bfloat16
    assert list(bank.tensors) == ["gate_up", "down", "gate_up_scale", "down_scale"]
    assert bank.expert_bytes == 3 * 192 * 160 + 4 * (2 * 2 * 2 + 2 * 2)
    assert ((bank.gate_up.view(torch.uint8) & 0x7F) != 0x7F).all()
    kern = probes.CpuKernel(bank, 2, 1, impl="torch")
    assert probes.cpu_kernel_bw(kern, 0.02) > 0
    assert 0 < probes.c_sync(kern, 192, None, 0.02) < 1.0


def test_fp8_block_is_measured_as_its_own_entry(tmp_path):
    assert bench_bw.main([*FAST, "--dtype", "bfloat16,fp8_block", "--profiles-dir", str(tmp_path)]) == 0
    profile = P.list_profiles(tmp_path)[0].profile
    assert set(profile.kernels) == {"bfloat16", "fp8_block"}
    assert profile.kernels["fp8_block"].cpu_executor_bs1 > 0


def test_mxfp4_bank_probes():
    """mxfp4 banks: gpt-oss's experts (packed e2m1 + E8M0 per 32 tiled from the shared pool, zero biases, the
    clamped SwiGLU, bf16 activations), every bank counted in the expert's bytes and copied; the torch kernel
    dequantizes them."""
    from services.engine.moe.banks import BIAS_BANKS, ExpertFormat, expert_nbytes
    from services.engine.moe.reference import ClampedSwiGLU
    from services.profiler.random_banks import MX_SCALES

    E, D, I = 4, 96, 64
    bank = probes.make_bank(E, D, I, torch.float32, pin=False, fmt="mxfp4")
    assert bank.fmt == "mxfp4" and bank.act_dtype == torch.bfloat16 and bank.activation == ClampedSwiGLU()
    assert list(bank.tensors) == ["gate_up", "down", "gate_up_scale", "down_scale", "gate_up_bias", "down_bias"]
    assert bank.gate_up.shape == (E, 2 * I, D // 2) and bank.scales["down_scale"].shape == (E, D, I // 32)
    assert bank.expert_bytes == expert_nbytes(ExpertFormat.MXFP4, D, I, torch.bfloat16) + 2 * (2 * I + D)
    assert len(BIAS_BANKS) == len(bank.biases) and all(b.dtype == torch.bfloat16 for b in bank.biases.values())
    sc = bank.scales["gate_up_scale"]
    assert MX_SCALES[0] <= int(sc.min()) and int(sc.max()) <= MX_SCALES[1]
    assert len(torch.unique(bank.gate_up)) == 256  # random bytes, not a constant fill
    kern = probes.CpuKernel(bank, 2, 1, impl="torch")
    assert kern.step() == 2 * bank.expert_bytes and probes.cpu_kernel_bw(kern, 0.02) > 0


def test_mxfp4_is_measured_as_its_own_entry_and_an_mxfp4_model_reads_it(tmp_path):
    """--dtype bfloat16,mxfp4 writes an 'mxfp4' entry with a CPU rate of its own; the engine's lookup for a
    bf16 model with MXFP4 banks (hybrid_split.profile_format -> resolve_format, what auto and hybrid's prior
    call) takes that entry, not the bf16 fallback, and warns of nothing; a profile without it falls back."""
    from types import SimpleNamespace

    from services.engine.moe import hybrid_split
    from services.engine.moe.banks import ExpertBanks, ExpertFormat
    from services.engine.moe.reference import ClampedSwiGLU

    assert bench_bw.main([*FAST, "--dtype", "bfloat16,mxfp4", "--profiles-dir", str(tmp_path)]) == 0
    profile = P.list_profiles(tmp_path)[0].profile
    assert set(profile.kernels) == {"bfloat16", "mxfp4"}
    assert profile.kernels["mxfp4"].cpu_executor_bs1 > 0
    geo = bench_bw.geometry("tiny")
    banks = ExpertBanks.allocate(ExpertFormat.MXFP4, 1, geo.num_experts, geo.hidden_size, geo.moe_intermediate_size,
                                 torch.bfloat16, bias=True, activation=ClampedSwiGLU())
    fmt = hybrid_split.profile_format(SimpleNamespace(dtype=torch.bfloat16, banks=banks))
    assert fmt == ("mxfp4", "bfloat16")
    assert P.resolve_format(profile, *fmt) == ("mxfp4", "")  # no reason given: the callers warn of nothing
    bf16_only = profile.model_copy(update={"kernels": {"bfloat16": profile.kernels["bfloat16"]}})
    key, why = P.resolve_format(bf16_only, *fmt)
    assert key == "bfloat16" and "no 'mxfp4' entry" in why and "bench bw --dtype mxfp4" in why


def test_mxfp4_refused_for_a_geometry_without_32_wide_blocks(tmp_path, capsys, monkeypatch):
    from services.engine.models import synthetic

    monkeypatch.setitem(synthetic.PRESETS, "tiny-odd", {**synthetic.PRESETS["tiny"], "hidden_size": 48})
    assert bench_bw.main([*FAST, "--model", "tiny-odd", "--dtype", "bfloat16,mxfp4",
                          "--profiles-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--dtype mxfp4" in err[0] and "tiny-odd" in err[0] and "multiples of 32" in err[0]
    assert os.listdir(tmp_path) == []
    assert bench_bw.main([*FAST, "--model", "tiny-odd", "--dtype", "bfloat16", "--profiles-dir", str(tmp_path)]) == 0


def test_gguf_bank_probes():
    """GGUF banks: the file's uint8 blocks (no scale banks), random valid blocks tiled from a pool, bf16
    activations; the torch kernel dequantizes them (gate_up and down of different types)."""
    from services.engine.moe.banks import ExpertFormat, expert_nbytes

    assert probes.GGUF_FORMATS == bench_bw.GGUF_FORMATS
    E, D, I = 3, 256, 512
    bank = probes.make_bank(E, D, I, torch.float32, pin=False, fmt="q4_K+q6_K")
    assert bank.fmt == "q4_K+q6_K" and bank.act_dtype == torch.bfloat16 and list(bank.tensors) == ["gate_up", "down"]
    assert bank.gate_up.shape == (E, 2 * I, 144) and bank.down.shape == (E, D, 2 * 210)
    assert bank.expert_bytes == expert_nbytes(ExpertFormat.Q4_K_Q6_K, D, I, torch.bfloat16)
    assert len(torch.unique(bank.gate_up)) == 256
    kern = probes.CpuKernel(bank, 2, 1, impl="torch")
    assert kern.step() == 2 * bank.expert_bytes and probes.cpu_kernel_bw(kern, 0.02) > 0


def test_gguf_formats_are_measured_and_a_gguf_model_reads_its_most_common_layer_format(tmp_path):
    """--dtype bfloat16,q8_0,mxfp4_gguf writes an entry per GGUF format; a model whose layers mix GGUF formats
    (a Q4_K_M file: q4_K and q4_K+q6_K) reads its most common layer format's entry."""
    from types import SimpleNamespace

    from services.engine.moe import hybrid_split
    from services.engine.moe.banks import ExpertBanks, ExpertFormat

    assert bench_bw.main([*FAST, "--dtype", "bfloat16,q8_0,mxfp4_gguf", "--profiles-dir", str(tmp_path)]) == 0
    profile = P.list_profiles(tmp_path)[0].profile
    assert set(profile.kernels) == {"bfloat16", "q8_0", "mxfp4_gguf"}
    assert profile.kernels["q8_0"].cpu_executor_bs1 > 0
    formats = [ExpertFormat.Q4_K_Q6_K, ExpertFormat.Q4_K, ExpertFormat.Q4_K]
    banks = ExpertBanks.allocate(formats, 3, 2, 256, 256, torch.bfloat16)
    assert hybrid_split.profile_format(SimpleNamespace(dtype=torch.bfloat16, banks=banks)) == ("q4_K", "bfloat16")


def test_gguf_k_type_refused_for_a_geometry_without_256_wide_blocks(tmp_path, capsys):
    assert bench_bw.main([*FAST, "--dtype", "bfloat16,q4_K", "--profiles-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--dtype q4_K" in err[0] and "multiple of 256" in err[0]


def test_geometry_from_the_synthetic_presets():
    g = bench_bw.geometry("synthetic:qwen3-30b-a3b")
    assert (g.num_layers, g.num_experts, g.top_k, g.hidden_size, g.moe_intermediate_size) == (48, 128, 8, 2048, 768)
    assert bench_bw.geometry("qwen3-30b-a3b?layers=4").num_layers == 4


@pytest.mark.slow  # builds the C++ executor extension when its cached build is stale (~40 s on 2 cores)
def test_executor_is_the_real_cpu_kernel(tmp_path):
    assert bench_bw.main(["--model", "tiny", "--seconds", "0.05", "--buffer-mib", "4", "--cpu-kernel", "executor",
                          "--profiles-dir", str(tmp_path)]) == 0
    profile = P.list_profiles(tmp_path)[0].profile
    assert profile.kernels["bfloat16"].cpu_kernel.startswith("cpu_executor(")
    assert profile.c_sync_s > 0


@pytest.mark.slow  # builds the C++ executor extension when its cached build is stale
@pytest.mark.parametrize("fmt,D,I", [("fp8_block", 256, 128), ("mxfp4", 128, 64), ("q4_K+q6_K", 256, 256),
                                     ("q8_0", 64, 32)])
def test_executor_measures_quantized_experts(fmt, D, I):
    """The executor's kernel of each quantized format runs on the probe's bank (mxfp4: with gpt-oss's biases
    and clamped SwiGLU, bf16 activations): the rate `bench bw --dtype FORMAT` writes."""
    bank = probes.make_bank(4, D, I, torch.bfloat16, pin=False, fmt=fmt)
    kern = probes.CpuKernel(bank, 2, 1, impl="executor")
    try:
        assert kern.name.startswith("cpu_executor(")
        assert kern.step() == 2 * bank.expert_bytes
        assert probes.cpu_kernel_bw(kern, 0.05) > 0
    finally:
        kern.close()


@pytest.mark.gpu
def test_gpu_run_fills_gpu_fields(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    assert bench_bw.main(["--model", "tiny", "--seconds", "0.2", "--buffer-mib", "64", "--cpu-kernel", "executor",
                          "--profiles-dir", str(tmp_path), "--gpu", "0"]) == 0
    uuid = P.normalize_uuid(str(torch.cuda.get_device_properties(0).uuid))
    found = P.find_profile(uuid, tmp_path)
    assert found is not None
    profile = found[0]
    assert profile.has_gpu and profile.ceilings.h2d > 0 and profile.ceilings.d2h > 0
    k, ov = profile.kernels["bfloat16"], profile.concurrent["bfloat16"]
    assert k.pcie_gather > 0 and ov.pcie_ov > 0 and ov.cpu_ov > 0
    assert k.gather_kernel == "copy_missing(fused)" and k.cpu_kernel.startswith("cpu_executor(")
    assert profile.c_sync_s > 0
    n = torch.cuda.device_count()  # every ordered pair of GPUs (none on a one-GPU host)
    assert len(profile.p2p) == n * (n - 1) and all(link.gbps > 0 and link.src != link.dst for link in profile.p2p)
    d = P.decide(profile, 1 << 20, 4.0, 48)
    assert d.fetch_fraction == pytest.approx(ov.pcie_ov / (ov.pcie_ov + ov.cpu_ov))


def test_compare_with_physlimits(tmp_path, capsys):
    from services.profiler import compare

    target = tmp_path / "p.json"
    assert bench_bw.main([*FAST, "-o", str(target)]) == 0
    limits = tmp_path / "physlimits.json"
    limits.write_text(json.dumps({"cpu_read_sum_fp32_GBs": 74.0, "c_avx512_stream_read_GBs": 103.0,
                                  "h2d_pinned_linear_GBs": 54.0, "lscpu": "text"}))
    rows = {r["what"]: r for r in compare.compare(target, limits)}
    ours = P.read_profile(target).ceilings.cpu_read
    assert rows["CPU DRAM read"]["bound_key"] == "c_avx512_stream_read_GBs"
    assert rows["CPU DRAM read"]["ratio"] == pytest.approx(ours / 103.0)
    assert rows["PCIe expert gather"]["bound"] is None
    assert compare.main([str(target), str(limits)]) == 0
    assert "CPU DRAM read" in capsys.readouterr().out
