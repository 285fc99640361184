"""services/engine/moe/gguf_quant.py against gguf-py (an independent implementation of ggml's formats):
the block sizes, the reference dequantizer bit for bit on random bytes (every code, NaN/inf scales
included), hand-built blocks that pin the layouts (nibble order, 6-bit scale packing, q6_K's halves),
and the quantizers' round trip (both dequantizers agree on what quantize writes, the error bounded by a
block's step)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from services.engine.moe.gguf_quant import (BLOCK, GGML_TYPE_ID, GGUFType, bank_types, check_bank, dequantize,
                                            format_types, quantize, row_bytes, type_of_row)

TYPES = list(GGUFType)


def gguf_reference(blocks: torch.Tensor, qtype: GGUFType) -> torch.Tensor:
    return torch.from_numpy(gguf_dequantize(blocks.numpy(), GGMLQuantizationType(GGML_TYPE_ID[qtype])).copy())


@pytest.mark.parametrize("qtype", TYPES)
def test_block_sizes_are_ggmls(qtype):
    assert BLOCK[qtype] == GGML_QUANT_SIZES[GGMLQuantizationType(GGML_TYPE_ID[qtype])]
    assert GGMLQuantizationType(GGML_TYPE_ID[qtype]).name.lower() == qtype.value.removesuffix("_gguf").lower()


def test_row_bytes_and_type_of_row():
    assert row_bytes(GGUFType.Q4_K, 512) == 288
    assert row_bytes("q8_0", 64) == 68
    with pytest.raises(ValueError, match=r"q6_K: a row of 100 values"):
        row_bytes(GGUFType.Q6_K, 100)
    for qtype in TYPES:
        for cols in (256, 2048, 2880 // 32 * 32 if BLOCK[qtype][0] == 32 else 2816):
            assert type_of_row(row_bytes(qtype, cols), cols) is qtype
    with pytest.raises(ValueError, match="no GGUF block type"):
        type_of_row(100, 256)
    gate_up = torch.empty(3, 2 * 512, row_bytes(GGUFType.Q4_K, 256), dtype=torch.uint8)
    down = torch.empty(3, 256, row_bytes(GGUFType.Q6_K, 512), dtype=torch.uint8)
    assert bank_types(gate_up, down, 256) == (GGUFType.Q4_K, GGUFType.Q6_K)


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_matches_gguf_py_bit_for_bit(qtype):
    g = torch.Generator().manual_seed(GGML_TYPE_ID[qtype])
    qk, nb = BLOCK[qtype]
    blocks = torch.randint(0, 256, (3, 5, 4 * nb), generator=g, dtype=torch.int32).to(torch.uint8)  # any bytes
    got = dequantize(blocks, qtype, cols=4 * qk)
    want = gguf_reference(blocks, qtype)
    assert got.shape == want.shape == (3, 5, 4 * qk) and got.dtype == torch.float32
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))  # bit-equal up to NaN payloads


def test_dequantize_checks_its_input():
    with pytest.raises(ValueError, match="uint8"):
        dequantize(torch.zeros(34), GGUFType.Q8_0)
    with pytest.raises(ValueError, match="whole number of 144-byte blocks"):
        dequantize(torch.zeros(100, dtype=torch.uint8), GGUFType.Q4_K)
    with pytest.raises(ValueError, match="hold 256 values, not 512"):
        dequantize(torch.zeros(144, dtype=torch.uint8), GGUFType.Q4_K, cols=512)


def _f16(x: float) -> list[int]:
    return list(np.array([x], dtype=np.float16).view(np.uint8))


def test_hand_built_blocks_pin_the_layouts():
    # mxfp4: byte j holds values j (low nibble) and j + 16 (high); e = 128 -> scale 2
    mx = torch.tensor([[128] + [0x71] + [0] * 15], dtype=torch.uint8)  # low 1 -> 0.5, high 7 -> 6.0
    v = dequantize(mx, GGUFType.MXFP4)[0]
    assert v[0] == 1.0 and v[16] == 12.0 and v[1:16].abs().sum() == 0 and v[17:].abs().sum() == 0
    # q4_K: sub-block 5 (j >= 4: 6-bit scale from s[9] low nibble + s[1] top bits) = odd, group 2, high nibbles
    s = [0] * 12
    s[1], s[9] = 0b01_000000, 0x3 | (0x2 << 4)  # sc[5] = 3 | 1 << 4 = 19; m[5] = 2 | (s[5] >> 6) << 4 = 2
    qs = [0] * 128
    qs[64 + 7] = 0x50  # group 2, byte 7, high nibble = 5 -> value 32 * 5 + 7
    blk = torch.tensor([_f16(0.5) + _f16(0.25) + s + qs], dtype=torch.uint8)
    v = dequantize(blk, GGUFType.Q4_K)[0]
    assert v[32 * 5 + 7] == 0.5 * 19 * 5 - 0.25 * 2
    assert v[32 * 5 + 8] == -0.25 * 2 and v[0] == 0.0
    # q6_K: value 128 + 64 + 32 + 3 (h=1, r=99): ql[64 + 35] high nibble, qh[32 + 3] bits 2..3 (r // 32 = 3: 6..7)
    ql, qh, sc = [0] * 128, [0] * 64, [0] * 16
    ql[64 + 35] = 0x90
    qh[32 + 3] = 0b10 << 6
    sc[(128 + 99) // 16] = -3 & 0xFF
    blk = torch.tensor([ql + qh + sc + _f16(0.5)], dtype=torch.uint8)
    v = dequantize(blk, GGUFType.Q6_K)[0]
    assert v[128 + 99] == 0.5 * -3 * ((9 | 2 << 4) - 32)
    for blocks in (mx, blk):
        qtype = GGUFType.MXFP4 if blocks is mx else GGUFType.Q6_K
        assert torch.equal(dequantize(blocks, qtype), gguf_reference(blocks, qtype))


@pytest.mark.parametrize("qtype", TYPES)
def test_quantize_round_trip(qtype):
    g = torch.Generator().manual_seed(7)
    qk = BLOCK[qtype][0]
    w = torch.randn(4, 3, 2 * qk, generator=g) * torch.rand(4, 3, 1, generator=g)
    w[0, 0, :qk] = 0.0  # an all-zero block
    w[1, 1] = w[1, 1].abs() + 0.1  # all positive: min 0 for the K-quants' offsets
    blocks = quantize(w, qtype)
    assert blocks.dtype == torch.uint8 and blocks.shape == (4, 3, row_bytes(qtype, 2 * qk))
    back = dequantize(blocks, qtype)
    assert torch.equal(back, gguf_reference(blocks, qtype))
    assert torch.equal(back[0, 0, :qk], torch.zeros(qk))
    # error per value bounded by its sub-block's step: the range over 15 (q4_K), 31 (q5_K), 2 max|x|/64 (q6_K),
    # max|x|/127 (q8_0), and for mxfp4 the e2m1 spacing (up to 2 at the top of 6, 4 past it on clipping)
    sub = {GGUFType.Q4_K: 32, GGUFType.Q5_K: 32, GGUFType.Q6_K: 16, GGUFType.Q8_0: 32, GGUFType.MXFP4: 32}[qtype]
    levels = {GGUFType.Q4_K: 15, GGUFType.Q5_K: 31, GGUFType.Q6_K: 32, GGUFType.Q8_0: 127, GGUFType.MXFP4: 1.5}[qtype]
    span = w.reshape(-1, sub)
    rng = (span.amax(1).clamp(min=0) - span.amin(1).clamp(max=0)).repeat_interleave(sub).reshape(w.shape)
    err = (back - w).abs()
    # 6-bit scales and fp16 d add a few percent to the step; the bound is loose enough for that, tight enough
    # that a swapped nibble or a wrong sub-block scale fails it
    assert (err <= rng / levels * 0.75 + 1e-6).all(), (err / (rng / levels + 1e-12)).max()


def test_quantize_refuses_partial_blocks():
    with pytest.raises(ValueError, match="whole number of 256-value blocks"):
        quantize(torch.zeros(2, 128), GGUFType.Q5_K)


def test_format_types_reads_the_format_value():
    assert format_types("q4_K") == (GGUFType.Q4_K, GGUFType.Q4_K)
    assert format_types("q4_K+q6_K") == (GGUFType.Q4_K, GGUFType.Q6_K)
    assert format_types("mxfp4_gguf") == (GGUFType.MXFP4, GGUFType.MXFP4)
    for other in ("mxfp4", "fp8_block", "unquantized", "q4_K+q6_K+q8_0", "q4_0"):
        assert format_types(other) is None


def test_check_bank_allows_padded_rows_only():
    check_bank("down", torch.empty(2, 8, row_bytes(GGUFType.Q6_K, 256), dtype=torch.uint8), GGUFType.Q4_K, 8, 256)
    with pytest.raises(ValueError, match=r"gate_up: q6_K bank torch.uint8 \(2, 8, 144\) is not uint8 \[E, 8, >= 210\]"):
        check_bank("gate_up", torch.empty(2, 8, 144, dtype=torch.uint8), GGUFType.Q6_K, 8, 256)
    padded = torch.cat([quantize(torch.randn(3, 64), "q8_0"), torch.full((3, 9), 0xFF, dtype=torch.uint8)], dim=1)
    assert torch.equal(dequantize(padded, "q8_0", 64), dequantize(padded[:, :68], "q8_0"))
