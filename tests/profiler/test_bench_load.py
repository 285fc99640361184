"""Loader benchmark: every mode fills the banks with exactly the checkpoint's bytes (reference: the
safetensors library + torch.cat), the checksum sees a reordered expert, and the CLI says BAD for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from services.profiler import bankfile, bench_load
from services.profiler.chunked_read import read_jobs
from services.profiler.expert_layout import expert_layout
from tests.profiler.conftest import CONFIG, ROOT

MOE_LAYER_IDS = [0, 2]  # CONFIG: 3 layers, layer 1 dense


def reference_banks(model_dir: Path) -> list[dict[str, torch.Tensor]]:
    """gate_up [E, 2I, D] and down [E, D, I] per MoE layer, built independently of the code under test."""
    tensors = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    out = []
    for layer in MOE_LAYER_IDS:
        p = f"model.layers.{layer}.mlp.experts"
        E = CONFIG["num_experts"]
        gate_up = torch.stack([torch.cat([tensors[f"{p}.{e}.gate_proj.weight"], tensors[f"{p}.{e}.up_proj.weight"]])
                               for e in range(E)])
        down = torch.stack([tensors[f"{p}.{e}.down_proj.weight"] for e in range(E)])
        out.append({"gate_up": gate_up, "down": down})
    return out


def assert_banks_equal(banks, ref) -> None:
    assert len(banks.layers) == len(ref)
    for layer, expect in zip(banks.layers, ref):
        for name, t in expect.items():
            assert layer.tensors[name].dtype == t.dtype
            assert torch.equal(layer.tensors[name], t), name


def test_layout_plans_every_expert(moe_checkpoint):
    layout = expert_layout(moe_checkpoint)
    assert layout.spec.moe_layer_ids == tuple(MOE_LAYER_IDS)
    assert len(layout.jobs) == len(MOE_LAYER_IDS) * CONFIG["num_experts"] * 3
    assert layout.dtype == torch.bfloat16 and len(layout.files) >= 2
    assert layout.total_bytes == layout.allocate().total_nbytes()


def test_serial_and_parallel_match_the_reference(moe_checkpoint):
    layout, ref = expert_layout(moe_checkpoint), reference_banks(moe_checkpoint)
    assert_banks_equal(bench_load.load_serial(layout)[0], ref)
    assert_banks_equal(bench_load.load_parallel(layout, threads=3, chunk_mib=16)[0], ref)


def test_small_chunks_split_tensors_across_reads(moe_checkpoint):
    layout, ref = expert_layout(moe_checkpoint), reference_banks(moe_checkpoint)
    banks = layout.allocate()
    flat = {(i, n): t.view(-1).view(torch.uint8) for i, lb in enumerate(banks.layers) for n, t in lb.tensors.items()}
    stats = read_jobs(layout.jobs, lambda j: flat[(j.layer, j.bank)], threads=3, chunk_bytes=2 * 4096)
    assert_banks_equal(banks, ref)
    assert stats.bytes_read >= layout.total_bytes
    assert stats.direct or stats.notes  # buffered reads are allowed, silently falling back is not


def test_buffered_fallback_gives_the_same_bytes(moe_checkpoint):
    layout = expert_layout(moe_checkpoint)
    banks, notes = bench_load.load_parallel(layout, threads=2, chunk_mib=1, direct=False)
    assert_banks_equal(banks, reference_banks(moe_checkpoint))
    assert any("buffered" in n for n in notes)


def test_repacked_roundtrip(moe_checkpoint, tmp_path):
    layout = expert_layout(moe_checkpoint)
    banks = bench_load.load_serial(layout)[0]
    path = bankfile.write_bank_file(tmp_path / "b" / bankfile.FILENAME, banks, layout)
    assert bankfile.is_current(path, layout)
    header, jobs = bankfile.bank_file_jobs(path)
    assert all(j.src_offset % bankfile.ALIGN == 0 for j in jobs)  # every region is one aligned read
    assert header["moe_layer_ids"] == MOE_LAYER_IDS
    assert_banks_equal(bench_load.load_repacked(path, layout, 2, 1)[0], reference_banks(moe_checkpoint))
    shard = layout.files[0]
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))  # source changed
    assert not bankfile.is_current(path, expert_layout(moe_checkpoint))


def _swap_experts_in_file(path: Path, layer: int, bank: str, e1: int, e2: int, num_experts: int) -> None:
    header = bankfile.read_header(path)
    region = header["layers"][layer]["banks"][bank]
    per = region["nbytes"] // num_experts
    with open(path, "r+b") as f:
        f.seek(region["offset"] + e1 * per)
        a = f.read(per)
        f.seek(region["offset"] + e2 * per)
        b = f.read(per)
        f.seek(region["offset"] + e1 * per)
        f.write(b)
        f.seek(region["offset"] + e2 * per)
        f.write(a)


def test_checksum_sees_a_reordered_expert(moe_checkpoint):
    layout = expert_layout(moe_checkpoint)
    banks = bench_load.load_serial(layout)[0]
    before = bench_load.checksum(banks)
    down = banks.layers[1].tensors["down"]  # [E, D, I]
    plain_sum = down.float().sum()
    down[[1, 4]] = down[[4, 1]].clone()
    assert down.float().sum() == plain_sum  # a plain sum cannot see it...
    assert bench_load.checksum(banks) != before  # ...the position-weighted one does
    assert bench_load.checksum(banks, samples=64) != bench_load.checksum(bench_load.load_serial(layout)[0], samples=64)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", "bench", "load", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_cli_says_bad_for_a_reordered_bank_file(moe_checkpoint, tmp_path):
    layout = expert_layout(moe_checkpoint)
    bank_dir = tmp_path / "banks"
    path = bankfile.write_bank_file(bank_dir / bankfile.FILENAME, bench_load.load_serial(layout)[0], layout)
    _swap_experts_in_file(path, 0, "gate_up", 0, 3, CONFIG["num_experts"])  # a buggy converter, simulated
    out_json = tmp_path / "r.json"
    proc = _cli("--model", str(moe_checkpoint), "--modes", "repacked", "--bank-dir", str(bank_dir),
                "--keep-bank", "--json", str(out_json))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "BAD" in proc.stdout and "BAD" in proc.stderr
    rows = {r["mode"]: r for r in json.loads(out_json.read_text())["rows"]}
    assert set(rows) == {"serial", "repacked"}  # the stale-free bank file was reused, not reconverted
    assert rows["serial"]["status"] == "ok" and rows["repacked"]["status"] == "BAD"


@pytest.mark.slow
def test_cli_all_modes_agree(moe_checkpoint, tmp_path):
    out_json = tmp_path / "r.json"
    bank_dir = tmp_path / "banks"
    proc = _cli("--model", str(moe_checkpoint), "--bank-dir", str(bank_dir), "--json", str(out_json))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out_json.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["serial", "parallel", "convert (one-time)", "repacked"]
    assert {r["checksum"] for r in rows} == {rows[0]["checksum"]} and all(r["status"] == "ok" for r in rows)
    assert all(r["peak_rss"] > 0 and r["min_available"] > 0 for r in rows)
    assert not bank_dir.exists()  # removed without --keep-bank


def test_cli_rejects_a_bad_checkpoint(tmp_path):
    proc = _cli("--model", str(tmp_path))
    assert proc.returncode == 2 and "config.json" in proc.stderr


def test_synthetic_checkpoint_cli_and_mixtral_names(tmp_path):
    from services.profiler import synth_checkpoint

    assert synth_checkpoint.main([str(tmp_path / "q"), "--model", "synthetic:tiny", "--shard-gib", "0.0001"]) == 0
    layout = expert_layout(tmp_path / "q")
    assert layout.spec.num_moe_layers == 2 and len(layout.files) > 1
    mixtral = dict(model_type="mixtral", num_hidden_layers=1, num_local_experts=4, num_experts_per_tok=2,
                   hidden_size=64, intermediate_size=32, num_attention_heads=4, vocab_size=100)
    d = synth_checkpoint.write_checkpoint(tmp_path / "m", mixtral, torch.float32)
    layout = expert_layout(d)
    assert {j.name.rsplit(".", 2)[-2] for j in layout.jobs} == {"w1", "w3", "w2"}
    banks = bench_load.load_serial(layout)[0]
    t = load_file(str(layout.files[0]))
    e2 = "model.layers.0.block_sparse_moe.experts.2"
    assert torch.equal(banks.layers[0].tensors["gate_up"][2], torch.cat([t[f"{e2}.w1.weight"], t[f"{e2}.w3.weight"]]))
    assert torch.equal(banks.layers[0].tensors["down"][2], t[f"{e2}.w2.weight"])
