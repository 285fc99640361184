"""GGUF (ggml) block formats of expert weights: Q4_K, Q5_K, Q6_K, Q8_0 and gpt-oss's MXFP4, in torch.

A row of C values is stored as C / QK consecutive blocks of ``BLOCK[t][1]`` bytes (QK = ``BLOCK[t][0]``),
exactly as the GGUF file holds it, so an expert bank is uint8 ``[E, rows, row_bytes(t, C)]`` and is read
in place. Per block (all little-endian; fp16 = IEEE half):

    q8_0  (32 values, 34 B):  d fp16 · q int8[32]                              v = d * q
    mxfp4 (32 values, 17 B):  e E8M0 · 16 bytes of e2m1: value i < 16 in the low nibble of byte i,
                              value 16 + i in its high nibble                   v = 2**(e - 127) * e2m1
    q4_K  (256 values, 144 B): d fp16 · dmin fp16 · 12 bytes of eight 6-bit (scale, min) pairs ·
                              128 bytes of 4-bit q: sub-block j (32 values) of group g = j // 2 sits in
                              bytes 32g..32g+31, low nibbles for even j, high for odd j
                                                                             v = d*sc[j] * q - dmin*m[j]
    q5_K  (256 values, 176 B): as q4_K with 32 bytes qh before the nibbles: bit j of qh[l] is the fifth
                              bit of value l of sub-block j                  v = d*sc[j] * q - dmin*m[j]
    q6_K  (256 values, 210 B): 128 B of low nibbles ql · 64 B of 2-bit highs qh · int8 scales[16] (one
                              per 16 values) · d fp16 at the end. Value i: h = i // 128, r = i % 128;
                              low 4 bits from ql[64h + r % 64] (nibble r // 64), high 2 from
                              qh[32h + r % 32] (bits 2 * (r // 32))        v = d * sc[i // 16] * (q - 32)

The 6-bit (scale, min) pairs of q4_K / q5_K, 12 bytes s[0..11]: sub-block j < 4 has sc = s[j] & 63 and
m = s[j + 4] & 63; j >= 4 has sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4 and m = (s[j + 4] >> 4) | (s[j] >> 6) << 4.

How GGUF's MXFP4 differs from the Hub's (services/engine/models/mxfp4.py): the E8M0 byte sits inside
each 17-byte block instead of in a separate scale tensor, and a block's byte j holds values j and j + 16
instead of 2j and 2j + 1. Same e2m1 table, same exponent bias.

``dequantize`` is the pure-torch reference of every GGUF kernel (Triton: kernels/gguf_dequant.py; the
C++ CPU executor), equal to gguf-py's ``gguf.quants.dequantize`` bit for bit (tests/engine/moe/
test_gguf_quant.py). ``quantize`` writes test and synthetic banks: gguf-py's quantizers for q8_0 and mxfp4,
a simple min/max one of ours for the K-quants (gguf-py has none).

Legend: E experts · D hidden · I expert intermediate · C columns of a row · QK values per block.
"""

from __future__ import annotations

import enum

import numpy as np
import torch


class GGUFType(str, enum.Enum):
    """The GGUF block types served natively; values are the names users type (``?experts=q4_K``)."""

    Q4_K = "q4_K"
    Q5_K = "q5_K"
    Q6_K = "q6_K"
    Q8_0 = "q8_0"
    MXFP4 = "mxfp4_gguf"


# (values per block, bytes per block), as ggml's GGML_QUANT_SIZES (checked in the tests)
BLOCK: dict[GGUFType, tuple[int, int]] = {
    GGUFType.Q4_K: (256, 144),
    GGUFType.Q5_K: (256, 176),
    GGUFType.Q6_K: (256, 210),
    GGUFType.Q8_0: (32, 34),
    GGUFType.MXFP4: (32, 17),
}

# ggml's type ids (GGMLQuantizationType), for the reader and for gguf-py's quantizers
GGML_TYPE_ID: dict[GGUFType, int] = {GGUFType.Q4_K: 12, GGUFType.Q5_K: 13, GGUFType.Q6_K: 14, GGUFType.Q8_0: 8,
                                     GGUFType.MXFP4: 39}

# small integer codes of the types in the kernels (Triton constexprs, the C++ executor's GgufType)
KERNEL_CODE: dict[GGUFType, int] = {GGUFType.Q4_K: 1, GGUFType.Q5_K: 2, GGUFType.Q6_K: 3, GGUFType.Q8_0: 4,
                                    GGUFType.MXFP4: 5}

QK_K = 256
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def row_bytes(qtype: GGUFType | str, cols: int) -> int:
    """Bytes of a row of ``cols`` values of type ``qtype`` (ValueError unless cols is a whole number of blocks)."""
    qtype = GGUFType(qtype)
    qk, nbytes = BLOCK[qtype]
    if cols <= 0 or cols % qk:
        raise ValueError(f"{qtype.value}: a row of {cols} values is not a whole number of {qk}-value blocks")
    return cols // qk * nbytes


def format_types(fmt: str) -> tuple[GGUFType, GGUFType] | None:
    """(gate_up's type, down's type) of a GGUF expert format, from its value: ``"q4_K"`` (both banks) or
    ``"q4_K+q6_K"`` (gate_up+down, as Q4_K_M files mix them); None for any other format (bf16, fp8_block,
    the Hub's mxfp4). What the compute paths pass to the kernels as ``gguf_types``."""
    parts = str(getattr(fmt, "value", fmt)).split("+")
    try:
        types = tuple(GGUFType(p) for p in parts)
    except ValueError:
        return None
    if len(types) == 1:
        return types[0], types[0]
    return types if len(types) == 2 else None


def check_bank(what: str, bank: torch.Tensor, qtype: GGUFType | str, rows: int, cols: int) -> None:
    """ValueError unless ``bank`` is uint8 [E, rows, >= row_bytes(qtype, cols)] with a contiguous last
    dimension. A row may be wider than its type needs: a GGUF file's layers of different types share one
    slot shape (the widest row), and a layer's kernels read the first row_bytes of each row."""
    qtype = GGUFType(qtype)
    need = row_bytes(qtype, cols)
    if bank.dtype != torch.uint8 or bank.dim() != 3 or bank.shape[1] != rows or bank.shape[2] < need \
            or bank.stride(2) != 1:
        raise ValueError(f"{what}: {qtype.value} bank {bank.dtype} {tuple(bank.shape)} is not uint8 [E, {rows}, "
                         f">= {need}] (rows of {cols} values) with a contiguous last dimension")


def type_of_row(nbytes: int, cols: int) -> GGUFType:
    """The GGUF type whose rows of ``cols`` values take exactly ``nbytes`` bytes. Unique: the five types'
    bytes per value (144/256, 176/256, 210/256, 34/32, 17/32) all differ. For files and tests; the kernels
    take the types explicitly (rows may be padded). ValueError when none fits."""
    for t, (qk, b) in BLOCK.items():
        if cols > 0 and cols % qk == 0 and cols // qk * b == nbytes:
            return t
    raise ValueError(f"no GGUF block type ({', '.join(t.value for t in GGUFType)}) stores a row of {cols} "
                     f"values in {nbytes} bytes")


def bank_types(gate_up: torch.Tensor, down: torch.Tensor, D: int) -> tuple[GGUFType, GGUFType]:
    """(gate_up's type, down's type) of unpadded GGUF banks gate_up uint8 [..., 2I, row_bytes(D)] and down
    uint8 [..., D, row_bytes(I)] (the two may differ: Q4_K_M files often store down as q6_K)."""
    I = gate_up.shape[-2] // 2
    return type_of_row(gate_up.shape[-1], D), type_of_row(down.shape[-1], I)


# -- dequantize ------------------------------------------------------------------------------------------
def _f16(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] little-endian -> fp32 [...] (fp16 -> fp32 is exact)."""
    return b.contiguous().view(torch.float16)[..., 0].float()


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [N, 12] packed 6-bit pairs -> (sc, m) fp32 [N, 8] (module docstring)."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([lo & 63, (hi & 15) | ((lo >> 6) << 4)], dim=1)
    m = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=1)
    return sc.float(), m.float()


def _dequant_blocks(b: torch.Tensor, qtype: GGUFType) -> torch.Tensor:
    """uint8 [N, bytes per block] -> fp32 [N, QK], same operation order as gguf-py (bit-equal results)."""
    n = b.shape[0]
    if qtype is GGUFType.Q8_0:
        return _f16(b[:, 0:2])[:, None] * b[:, 2:].view(torch.int8).float()
    if qtype is GGUFType.MXFP4:
        # half the scale, 2**(e - 128), as an fp32 bit pattern (e < 2: the subnormals 2**-128, 2**-127)
        # times twice the e2m1 value (an integer): gguf-py's order, so e = 255 gives inf * 0 = nan alike
        e = b[:, 0].to(torch.int32)
        half = torch.where(e < 2, torch.full_like(e, 0x00200000) << e, (e - 1) << 23).view(torch.float32)
        lut = torch.tensor([2 * v for v in E2M1], dtype=torch.float32, device=b.device)
        q = torch.cat([b[:, 1:] & 15, b[:, 1:] >> 4], dim=1)  # [N, 32]: values 0..15 low nibbles, 16..31 high
        return half[:, None] * lut[q.long()]
    if qtype is GGUFType.Q6_K:
        ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208].view(torch.int8).float(), _f16(b[:, 208:210])
        ql, qh = ql.reshape(n, 2, 64), qh.reshape(n, 2, 32)  # [N, half, bytes]
        low = torch.cat([ql & 15, ql >> 4], dim=2)  # [N, 2, 128]: value 128h + 64 nibble + r % 64
        high = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=2)  # [N, 2, 128]: value 128h + 32 shift + l
        q = (low | (high << 4)).to(torch.int8).float().reshape(n, 16, 16) - 32.0
        return ((d[:, None] * sc)[:, :, None] * q).reshape(n, QK_K)
    # q4_K / q5_K
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, m = _scale_min_k4(b[:, 4:16])
    qs = b[:, 48:] if qtype is GGUFType.Q5_K else b[:, 16:]  # [N, 128]
    q = torch.stack([qs.reshape(n, 4, 32) & 15, qs.reshape(n, 4, 32) >> 4], dim=2).reshape(n, 8, 32)
    if qtype is GGUFType.Q5_K:
        qh = b[:, 16:48]  # [N, 32]
        q = q | (torch.stack([(qh >> j) & 1 for j in range(8)], dim=1) << 4)
    scale = (d[:, None] * sc)[:, :, None]
    offset = (dmin[:, None] * m)[:, :, None]
    return (scale * q.float() - offset).reshape(n, QK_K)


def dequantize(blocks: torch.Tensor, qtype: GGUFType | str, cols: int | None = None) -> torch.Tensor:
    """blocks uint8 [..., row_bytes] (rows as the GGUF file stores them) -> fp32 [..., cols]. ``cols``
    (optional) is checked against the row's bytes; rows wider than ``row_bytes(qtype, cols)`` (padded banks,
    ``check_bank``) are cut to it. Same values as ``gguf.quants.dequantize``."""
    qtype = GGUFType(qtype)
    qk, nb = BLOCK[qtype]
    if blocks.dtype != torch.uint8:
        raise ValueError(f"{qtype.value}: blocks must be uint8, got {blocks.dtype}")
    if cols is not None and cols > 0 and cols % qk == 0 and blocks.shape[-1] > row_bytes(qtype, cols):
        blocks = blocks[..., :row_bytes(qtype, cols)]
    if blocks.shape[-1] % nb:
        raise ValueError(f"{qtype.value}: a row of {blocks.shape[-1]} bytes is not a whole number of {nb}-byte blocks")
    ncols = blocks.shape[-1] // nb * qk
    if cols is not None and cols != ncols:
        raise ValueError(f"{qtype.value}: rows of {blocks.shape[-1]} bytes hold {ncols} values, not {cols} "
                         f"(expected {row_bytes(qtype, cols) if cols > 0 and cols % qk == 0 else '?'} bytes)")
    flat = blocks.contiguous().reshape(-1, nb)
    return _dequant_blocks(flat, qtype).reshape(*blocks.shape[:-1], ncols)


def dense_experts(gate_up: torch.Tensor, down: torch.Tensor, gate_up_type: GGUFType | str, down_type: GGUFType | str,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF banks (one expert or a stack; rows possibly padded) -> (gate_up [..., 2I, D], down [..., D, I])
    in ``dtype``. D is down's rows, I half of gate_up's."""
    D, I = down.shape[-2], gate_up.shape[-2] // 2
    return dequantize(gate_up, gate_up_type, D).to(dtype), dequantize(down, down_type, I).to(dtype)


def q8_inputs(x: torch.Tensor) -> torch.Tensor:
    """The reference of the CPU executor's int8 inputs to GGUF blocks (bf16 models; AVX512-VNNI or AVX2): each 256
    values of the last dimension as d * q with q = round(x * 127 / amax) (half to even) and d = amax / 127,
    all in fp32 -> fp32, same shape. A last dimension that is no multiple of 256 (q8_0 / mxfp4_gguf rows, gpt-oss's
    2880) ends in a partial block with its own amax: padded with zeros, quantized, cut back. The kernel then
    multiplies the blocks' integer quants with q exactly."""
    cols = x.shape[-1]
    padded = torch.nn.functional.pad(x.float(), (0, -cols % QK_K))
    blocks = padded.reshape(*x.shape[:-1], -1, QK_K)
    amax = blocks.abs().amax(-1, keepdim=True)
    c127 = torch.full_like(amax, 127.0)  # tensor / tensor: IEEE division (a python scalar over a tensor is
    inv = torch.where(amax > 0, c127 / amax, torch.zeros_like(amax))  # computed as its reciprocal times it)
    q = torch.round(blocks * inv).clamp(-127, 127)
    return (q * (amax / c127)).reshape(padded.shape)[..., :cols]


# -- quantize --------------------------------------------------------------------------------------------
def _to_f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """fp32 [N] -> uint8 [N, 2] (fp16, little-endian as torch stores it on every supported host)."""
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(-1, 2)


def _round(x: torch.Tensor) -> torch.Tensor:
    """Round half away from zero (ggml's nearest_int / roundf; torch.round rounds half to even)."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def _quant_k(x: torch.Tensor, bits: int) -> torch.Tensor:
    """q4_K / q5_K: fp32 [N, 256] -> uint8 [N, 144 or 176]. Per 32-value sub-block the range [min(x, 0),
    max(x)] in 2**bits - 1 steps; the sub-blocks' steps and offsets in 6 bits of the block's d / dmin."""
    n, top = x.shape[0], (1 << bits) - 1
    sub = x.reshape(n, 8, 32)
    lo = sub.amin(dim=2).clamp(max=0.0)  # [N, 8]
    hi = sub.amax(dim=2).clamp(min=0.0)
    step, offset = (hi - lo) / top, -lo  # both >= 0
    d = (step.amax(dim=1) / 63).to(torch.float16).float()  # [N], as stored
    dmin = (offset.amax(dim=1) / 63).to(torch.float16).float()
    sc = torch.where(d[:, None] > 0, _round(step / d.clamp(min=1e-30)[:, None]), 0.0).clamp(0, 63)
    m = torch.where(dmin[:, None] > 0, _round(offset / dmin.clamp(min=1e-30)[:, None]), 0.0).clamp(0, 63)
    ds, dm = d[:, None] * sc, dmin[:, None] * m  # [N, 8] what dequantize uses
    q = torch.where(ds[:, :, None] > 0, _round((sub + dm[:, :, None]) / ds.clamp(min=1e-30)[:, :, None]), 0.0)
    q = q.clamp(0, top).to(torch.uint8)  # [N, 8, 32]
    sc, m = sc.to(torch.uint8), m.to(torch.uint8)
    scales = torch.empty((n, 12), dtype=torch.uint8, device=x.device)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    nib = q & 15
    qs = (nib[:, 0::2] | (nib[:, 1::2] << 4)).reshape(n, 128)  # group g: sub-blocks 2g (low), 2g + 1 (high)
    parts = [_to_f16_bytes(d), _to_f16_bytes(dmin), scales]
    if bits == 5:
        qh = torch.zeros((n, 32), dtype=torch.uint8, device=x.device)
        for j in range(8):
            qh |= ((q[:, j] >> 4) & 1) << j
        parts.append(qh)
    return torch.cat(parts + [qs], dim=1)


def _quant_q6k(x: torch.Tensor) -> torch.Tensor:
    """q6_K: fp32 [N, 256] -> uint8 [N, 210]. Per 16-value sub-block the step max|x| / 31 (q in -31..31: the
    code -32 left unused, so +max|x| is not clipped), in int8 units of the block's d."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    amax = sub.abs().amax(dim=2)  # [N, 16]
    step = amax / 31
    d = (step.amax(dim=1) / 127).to(torch.float16).float()  # [N]
    sc = torch.where(d[:, None] > 0, _round(step / d.clamp(min=1e-30)[:, None]), 0.0).clamp(-128, 127)
    ds = d[:, None] * sc
    q = torch.where(ds[:, :, None] > 0, _round(sub / ds.clamp(min=1e-30)[:, :, None]), 0.0).clamp(-32, 31)
    q = (q + 32).to(torch.uint8).reshape(n, 2, 128)  # [N, h, r]
    low, high = q & 15, q >> 4
    ql = (low[:, :, :64] | (low[:, :, 64:] << 4)).reshape(n, 128)
    high = high.reshape(n, 2, 4, 32)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(n, 64)
    return torch.cat([ql, qh, sc.to(torch.int8).view(torch.uint8), _to_f16_bytes(d)], dim=1)


QUANT_CHUNK = 1 << 16  # blocks per gguf-py call (128 MiB of mxfp4 search temporaries)


def quantize(weights: torch.Tensor, qtype: GGUFType | str) -> torch.Tensor:
    """weights float [..., C] (C a multiple of the block's values) -> uint8 [..., row_bytes(qtype, C)].
    q8_0 and mxfp4 by gguf-py (bit-equal to ggml's); the K-quants by the min/max rounding above (valid
    blocks, coarser than llama.cpp's error-minimizing search: for tests and synthetic models)."""
    qtype = GGUFType(qtype)
    qk, nb = BLOCK[qtype]
    nbytes = row_bytes(qtype, weights.shape[-1])
    x = weights.detach().float().reshape(-1, qk)
    if qtype in (GGUFType.Q8_0, GGUFType.MXFP4):
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize as gguf_quantize

        # in chunks: gguf-py's mxfp4 search makes a [blocks, 32, 16] fp32 temporary (2 KiB per block)
        host, ggml = x.cpu().numpy(), GGMLQuantizationType(GGML_TYPE_ID[qtype])
        out = torch.from_numpy(np.concatenate([gguf_quantize(host[i:i + QUANT_CHUNK], ggml)
                                               for i in range(0, len(host), QUANT_CHUNK)])).to(weights.device)
    elif qtype is GGUFType.Q6_K:
        out = _quant_q6k(x)
    else:
        out = _quant_k(x, 5 if qtype is GGUFType.Q5_K else 4)
    return out.reshape(*weights.shape[:-1], nbytes)
