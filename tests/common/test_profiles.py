"""Profile schema, atomic store, reader rejections and the offload/hybrid decision."""

from __future__ import annotations

import json
import logging
import os

import pytest

from services.common import profiles as P

GPU = "GPU-3f2a0000-1111-2222-3333-444455556666"
B = 9_437_184  # bytes of one Qwen3-30B-A3B bf16 expert (3 * 2048 * 768 * 2)


def make_profile(uuid: str = GPU, *, pcie=52.0, cpu=77.0, pcie_ov=52.0, cpu_ov=74.0, c_sync=14e-6,
                 h2d: float | None = 54.0, threshold=1.1) -> P.Profile:
    gpu = h2d is not None
    return P.Profile(
        schema_version=P.SCHEMA_VERSION,
        gpu=P.GpuInfo(uuid=uuid, name="NVIDIA H200" if gpu else None, index=0 if gpu else None),
        host=P.HostInfo(hostname="h", cpu_model="Xeon", physical_cores=16, numa_nodes=1),
        created_at=P.now_iso(), tandem_version="0.1.0",
        ceilings=P.Ceilings(cpu_read=103.0, h2d=h2d, d2h=h2d),
        kernels={"bfloat16": P.KernelBandwidths(cpu_executor_bs1=cpu, pcie_gather=pcie if gpu else None)},
        concurrent={"bfloat16": P.Concurrent(pcie_ov=pcie_ov, cpu_ov=cpu_ov)} if gpu else {},
        c_sync_s=c_sync,
        geometry=P.Geometry(model="qwen3-30b-a3b", num_layers=48, num_experts=128, top_k=8, hidden_size=2048,
                            moe_intermediate_size=768),
        threshold=threshold,
    )


# ---------------------------------------------------------------------------------------------- store

def test_write_read_roundtrip_is_atomic(tmp_path):
    path = P.write_profile(make_profile(), tmp_path)
    assert path == tmp_path / f"{GPU}.json"
    assert sorted(os.listdir(tmp_path)) == [path.name]  # no temp file left behind
    P.write_profile(make_profile(pcie=40.0), tmp_path)  # overwrite in place
    assert sorted(os.listdir(tmp_path)) == [path.name]
    found = P.find_profile(GPU, tmp_path)
    assert found is not None and found[1] == path
    assert found[0].kernels["bfloat16"].pcie_gather == 40.0
    # torch spells the uuid without the prefix; it must find the same file
    assert P.find_profile(GPU[4:].upper(), tmp_path) is not None


def test_failed_write_leaves_no_temp_file(tmp_path, monkeypatch):
    def boom(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(P.os, "replace", boom)
    with pytest.raises(OSError):
        P.write_profile(make_profile(), tmp_path)
    assert os.listdir(tmp_path) == []


def test_profiles_dir_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_PROFILES_DIR", str(tmp_path / "vol"))
    path = P.write_profile(make_profile())
    assert path.parent == tmp_path / "vol"
    assert [e.path for e in P.list_profiles()] == [path]


def test_profiles_dir_default_under_xdg(tmp_path, monkeypatch):
    monkeypatch.delenv("TANDEM_PROFILES_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert P.profiles_dir() == tmp_path / "tandem" / "profiles"


# ---------------------------------------------------------------------------------------------- reader

@pytest.mark.parametrize("kind", ["corrupt", "not-object", "old-schema", "foreign", "bad-field", "deeply-nested",
                                  "4300-digits", "infinity"])
def test_reader_rejects_with_warning_naming_the_file(tmp_path, caplog, kind):
    path = P.write_profile(make_profile(), tmp_path)
    raw = json.loads(path.read_text())
    if kind == "corrupt":
        path.write_text(path.read_text()[:57])
    elif kind == "not-object":
        path.write_text("[1, 2]")
    elif kind == "old-schema":
        raw["schema_version"] = 0
        path.write_text(json.dumps(raw))
    elif kind == "foreign":
        raw["gpu"]["uuid"] = "GPU-99999999-0000-0000-0000-000000000000"  # a file copied from another host
        path.write_text(json.dumps(raw))
    elif kind == "bad-field":
        raw["ceilings"]["cpu_read"] = -1
        path.write_text(json.dumps(raw))
    elif kind == "deeply-nested":  # deeper than the JSON parser's stack: RecursionError
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif kind == "4300-digits":  # past Python's int-parsing limit: ValueError
        path.write_text(json.dumps(raw).replace('"c_sync_s": 1.4e-05', '"c_sync_s": ' + "9" * 5000))
    elif kind == "infinity":  # JSON's Infinity passes gt=0 and would make every predicted time 0
        path.write_text(json.dumps(raw).replace('"cpu_read": 103.0', '"cpu_read": Infinity'))
    with caplog.at_level(logging.WARNING, logger="tandem.profiles"):
        assert P.find_profile(GPU, tmp_path) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0]
    entry, = P.list_profiles(tmp_path)
    assert entry.profile is None and str(path) in entry.error


def test_auto_backend_ignores_an_unparsable_profile_with_a_warning(tmp_path, caplog):
    (tmp_path / P.profile_filename(GPU)).write_text('{"schema_version": 1, "c_sync_s": ' + "9" * 5000 + "}")
    with caplog.at_level(logging.WARNING, logger="tandem.profiles"):
        decision, path = P.auto_backend(GPU, B, 2.0, 48, directory=tmp_path)
    assert decision.backend == "offload" and path is None
    assert any("4300 digits" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_missing_profile_is_none_without_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        assert P.find_profile(GPU, tmp_path) is None
    assert not caplog.records


# ---------------------------------------------------------------------------------------------- decision

def test_no_profile_means_offload_and_says_how_to_make_one():
    d = P.decide(None, B, 2.0, 48)
    assert d.backend == "offload" and "tandem bench bw" in d.reason
    assert d.f_q16 == 65536


def test_cpu_only_profile_means_no_gpu():
    d = P.decide(make_profile(P.cpu_uuid("h"), h2d=None), B, 2.0, 48)
    assert d.backend == "offload" and "without a GPU" in d.reason


def test_fetch_fraction_from_concurrent_bandwidths():
    d = P.decide(make_profile(pcie_ov=40.0, cpu_ov=60.0), B, 4.0, 48)
    assert d.fetch_fraction == pytest.approx(40.0 / (40.0 + 60.0))
    assert d.f_q16 == round(0.4 * 65536)


def test_hybrid_when_predicted_faster():
    # H200 host numbers (docs/design.md §6): 52 GB/s PCIe alone, 52 + 74 concurrent, 14 us sync
    d = P.decide(make_profile(), B, 4.0, 48)
    assert d.backend == "hybrid"
    assert d.t_hybrid_s < d.t_offload_s
    # the prediction itself: 4 misses, f=52/126 -> F=2 fetched, 2 on CPU (+ c_sync)
    f = 52 / 126
    layer = max(2 * B / 52e9, 2 * B / 74e9 + 14e-6)
    assert d.t_hybrid_s == pytest.approx(48 * layer)
    assert d.t_offload_s == pytest.approx(48 * 4 * B / 52e9)
    assert P.fetch_count(4, f) == 2


def test_slow_cpu_means_offload_even_below_a_fixed_ratio_rule():
    # CPU 1.5x PCIe alone but the two collapse under contention: hybrid not faster
    d = P.decide(make_profile(pcie=50.0, cpu=75.0, pcie_ov=20.0, cpu_ov=25.0), B, 4.0, 48)
    assert d.backend == "offload" and d.t_hybrid_s > d.t_offload_s / 1.1


def test_c_sync_can_make_hybrid_lose():
    fast = make_profile(c_sync=10e-6)
    slow_sync = make_profile(c_sync=2e-3)  # 2 ms per layer: a Python-side handoff
    assert P.decide(fast, B, 2.0, 48, threshold=1.0).backend == "hybrid"
    d = P.decide(slow_sync, B, 2.0, 48, threshold=1.0)
    assert d.backend == "offload" and d.t_hybrid_s > d.t_offload_s


def test_single_miss_split_is_all_or_nothing():
    # one miss per layer, CPU slower than PCIe (f > 0.5): hybrid fetches it, like offload -> a tie -> offload
    d = P.decide(make_profile(pcie_ov=52.0, cpu_ov=40.0), B, 1.0, 48, threshold=1.0)
    assert d.backend == "offload" and d.t_hybrid_s == pytest.approx(d.t_offload_s)
    # CPU faster (f < 0.5): the miss goes to the CPU and is faster even with c_sync
    d = P.decide(make_profile(), B, 1.0, 48, threshold=1.0)
    assert d.backend == "hybrid"
    assert d.t_hybrid_s == pytest.approx(48 * (B / 74e9 + 14e-6))


def test_threshold_is_a_required_speedup():
    prof = make_profile()
    d1 = P.decide(prof, B, 4.0, 48, threshold=1.0)
    speedup = d1.t_offload_s / d1.t_hybrid_s
    assert d1.backend == "hybrid"
    assert P.decide(prof, B, 4.0, 48, threshold=speedup * 1.01).backend == "offload"


def test_fractional_misses_interpolate():
    prof = make_profile()
    d2, d3, d25 = (P.decide(prof, B, m, 48, threshold=1.0) for m in (2.0, 3.0, 2.5))
    assert d25.t_hybrid_s == pytest.approx((d2.t_hybrid_s + d3.t_hybrid_s) / 2)


@pytest.mark.parametrize("m", [0, 1, 2, 3, 7, 8, 33])
@pytest.mark.parametrize("f", [0.0, 0.1, 0.41, 0.5, 0.77, 1.0])
def test_fetch_count_minimizes_the_imbalance(m, f):
    F = P.fetch_count(m, f)
    cost = lambda k: max(k * (1 - f), (m - k) * f)  # noqa: E731
    assert 0 <= F <= m
    assert cost(F) == min(cost(k) for k in range(m + 1))


def test_auto_backend_reads_the_store(tmp_path):
    P.write_profile(make_profile(), tmp_path)
    d, path = P.auto_backend(GPU, B, 4.0, 48, directory=tmp_path)
    assert d.backend == "hybrid" and path == tmp_path / f"{GPU}.json"
    d, path = P.auto_backend("GPU-00000000-0000-0000-0000-000000000001", B, 4.0, 48, directory=tmp_path)
    assert d.backend == "offload" and path is None


# ---------------------------------------------------------------------------------------------- expert formats


FP8_B = B // 2 + 4 * (2 * 6 * 16 + 16 * 6)  # one Qwen3-30B-A3B fp8_block expert: e4m3 weights and fp32 block scales


def with_fp8(profile: P.Profile, cpu_ov: float) -> P.Profile:
    """``profile`` with an fp8_block entry: PCIe as the bf16 entry's, the CPU at ``cpu_ov`` GB/s."""
    return profile.model_copy(update={
        "kernels": {**profile.kernels, "fp8_block": P.KernelBandwidths(cpu_executor_bs1=cpu_ov, pcie_gather=52.0)},
        "concurrent": {**profile.concurrent, "fp8_block": P.Concurrent(pcie_ov=52.0, cpu_ov=cpu_ov)}})


def test_format_key_is_the_dtype_for_unquantized_experts_else_the_format():
    assert P.format_key("unquantized", "bfloat16") == "bfloat16"  # what every older profile holds
    assert P.format_key("unquantized", "float32") == "float32"
    assert P.format_key("fp8_block", "bfloat16") == P.format_key("fp8_block", "float32") == "fp8_block"
    assert P.format_key("mxfp4", "bfloat16") == "mxfp4"


def test_decision_reads_the_entry_of_the_format():
    """Same PCIe rates, the CPU 3x slower on FP8 experts than on bf16: the fp8_block entry's fraction."""
    profile = with_fp8(make_profile(cpu_ov=74.0), cpu_ov=25.0)
    bf16 = P.decide(profile, B, 4.0, 48, fmt="bfloat16")
    fp8 = P.decide(profile, FP8_B, 4.0, 48, fmt="fp8_block", fallback_fmt="bfloat16")
    assert bf16.fetch_fraction == pytest.approx(52 / (52 + 74))
    assert fp8.fetch_fraction == pytest.approx(52 / (52 + 25))
    assert "cpu 25.0" in fp8.reason


def test_missing_format_falls_back_to_the_dtype_entry_with_a_warning(caplog):
    profile = make_profile()  # bf16 only: a profile from before formats were measured
    with caplog.at_level(logging.WARNING, logger="tandem.profiles"):
        d = P.decide(profile, FP8_B, 4.0, 48, fmt="fp8_block", fallback_fmt="bfloat16")
    assert d.backend == "hybrid" and d.fetch_fraction == pytest.approx(52 / (52 + 74))
    assert "no 'fp8_block' entry" in caplog.text and "'bfloat16' rates instead" in caplog.text
    assert "bench bw --dtype fp8_block" in caplog.text
    d = P.decide(profile, FP8_B, 4.0, 48, fmt="fp8_block")  # no fallback given: offload, saying why
    assert d.backend == "offload" and "no 'fp8_block' entry" in d.reason


def test_old_profile_file_keyed_by_dtype_reads_as_the_unquantized_entries(tmp_path):
    """A file written before formats (its keys are dtype names) is read as it is and serves bf16 experts."""
    old = make_profile().model_dump(mode="json")
    path = tmp_path / f"{GPU}.json"
    path.write_text(json.dumps(old))
    profile = P.read_profile(path)
    key, why = P.resolve_format(profile, P.format_key("unquantized", "bfloat16"))
    assert (key, why) == ("bfloat16", "")
    assert P.auto_backend(GPU, B, 4.0, 48, fmt="bfloat16", directory=tmp_path)[0].backend == "hybrid"
