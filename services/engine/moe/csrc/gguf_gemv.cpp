// GEMV micro-kernels of the CPU MoE executor for GGUF blocks (q4_K, q5_K, q6_K, q8_0, mxfp4_gguf): the
// layouts are described in services/engine/moe/gguf_quant.py, whose torch `dequantize` is the reference.
//
// Y[t][r] (+)= dot(W[r], X[t]) as in gemv.h, with W's rows made of the file's blocks: row r at
// W + r * ldb bytes (rows may be padded past their blocks). Each block is decoded once into 256 (or 32) fp32 values on the stack
// (plain loops over a sub-block with its scale in a register, which the compiler vectorizes inside the
// AVX-512 kernel), then multiplied with every token's inputs: at bs=1 the decode is the work, the block
// bytes stream once. X is fp32 in its natural order (no pair split: the decode puts values in place).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "gemv.h"

namespace tandem {

constexpr int kGgufQk[] = {0, 256, 256, 256, 32, 32};    // values per block, by GgufType
constexpr int kGgufBytes[] = {0, 144, 176, 210, 34, 17};  // bytes per block

int64_t gguf_row_bytes(int type, int64_t cols) { return cols / kGgufQk[type] * kGgufBytes[type]; }
int gguf_block_values(int type) { return kGgufQk[type]; }

int gguf_type_of_row(int64_t nbytes, int64_t cols) {
  for (int t = 1; t <= 5; ++t)
    if (cols > 0 && cols % kGgufQk[t] == 0 && cols / kGgufQk[t] * kGgufBytes[t] == nbytes) return t;
  return 0;
}

namespace {

// IEEE half -> float, exact (normals, subnormals, inf, nan), without F16C: the scalar kernel runs anywhere
inline float half_to_f32(const uint8_t* p) {
  const uint32_t h = static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8;
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else {  // zero or subnormal: man * 2**-24, exact in fp32
    float f = static_cast<float>(man) * (1.0f / 16777216.0f);
    std::memcpy(&bits, &f, sizeof bits);
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float bits_f32(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

// Decoders: one block -> its values in `out`, the reference's arithmetic (scale product first, then times q).
// always_inline: inlined into each ISA's kernel and vectorized for that ISA there.
#define TANDEM_INLINE inline __attribute__((always_inline))

TANDEM_INLINE void k4_scale_min(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

TANDEM_INLINE void decode_k(const uint8_t* b, float* out, bool five) {
  const float d = half_to_f32(b), dmin = half_to_f32(b + 2);
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + (five ? 48 : 16);
  for (int j = 0; j < 8; ++j) {
    int sc, m;
    k4_scale_min(b + 4, j, sc, m);
    const float s = d * static_cast<float>(sc), o = dmin * static_cast<float>(m);
    const uint8_t* q = qs + (j / 2) * 32;
    const int shift = (j % 2) * 4;
    float* v = out + 32 * j;
    if (five) {
      for (int l = 0; l < 32; ++l) v[l] = s * static_cast<float>(((q[l] >> shift) & 15) | (((qh[l] >> j) & 1) << 4)) - o;
    } else {
      for (int l = 0; l < 32; ++l) v[l] = s * static_cast<float>((q[l] >> shift) & 15) - o;
    }
  }
}

TANDEM_INLINE void decode_q6k(const uint8_t* b, float* out) {
  const float d = half_to_f32(b + 208);
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = b + 64 * h;
    const uint8_t* qh = b + 128 + 32 * h;
    for (int s4 = 0; s4 < 4; ++s4) {  // values 128h + 32 s4 + l
      const uint8_t* lo = ql + 32 * (s4 % 2);
      const int lshift = (s4 / 2) * 4, hshift = 2 * s4;
      float* v = out + 128 * h + 32 * s4;
      for (int half = 0; half < 2; ++half) {  // one int8 scale per 16 values
        const float s = d * static_cast<float>(sc[(128 * h + 32 * s4) / 16 + half]);
        for (int l = 16 * half; l < 16 * half + 16; ++l)
          v[l] = s * static_cast<float>((((lo[l] >> lshift) & 15) | (((qh[l] >> hshift) & 3) << 4)) - 32);
      }
    }
  }
}

TANDEM_INLINE void decode_q8_0(const uint8_t* b, float* out) {
  const float d = half_to_f32(b);
  const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
  for (int l = 0; l < 32; ++l) out[l] = d * static_cast<float>(q[l]);
}

// twice the e2m1 values (integers); times half the E8M0 scale, 2**(e - 128), as gguf-py computes it
static const float kE2m1x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, -0.f, -1, -2, -3, -4, -6, -8, -12};

// half the E8M0 scale of an mxfp4_gguf block, 2**(e - 128) (e < 2: the subnormals 2**-128, 2**-127)
TANDEM_INLINE float mxfp4_half(const uint8_t* b) {
  const uint32_t e = b[0];
  return bits_f32(e < 2 ? 0x00200000u << e : (e - 1) << 23);
}

TANDEM_INLINE void decode_mxfp4(const uint8_t* b, float* out) {
  const float half = mxfp4_half(b);
  for (int l = 0; l < 16; ++l) {
    out[l] = half * kE2m1x2[b[1 + l] & 15];
    out[l + 16] = half * kE2m1x2[b[1 + l] >> 4];
  }
}

TANDEM_INLINE void decode(int type, const uint8_t* b, float* out) {
  switch (type) {
    case 1: decode_k(b, out, false); break;
    case 2: decode_k(b, out, true); break;
    case 3: decode_q6k(b, out); break;
    case 4: decode_q8_0(b, out); break;
    default: decode_mxfp4(b, out); break;
  }
}

inline void store(const GemvArgs& a, int r, int t, float v) {
  if (a.scale) a.Y[t][r] += a.scale[t] * v;
  else a.Y[t][r] = v;
}

// q4_K / q5_K: the eight 6-bit scales (sc8) and mins (m8) of a block, one per byte, unpacked four at a time
// from the 12 bytes at b + 4 as 32-bit words (gguf_quant's unpacking: s[j], s[j + 4], s[j + 8] per field)
inline void k4_fields(const uint8_t* b, uint64_t& sc8, uint64_t& m8) {
  uint32_t s0, s4, s8;
  std::memcpy(&s0, b + 4, 4);
  std::memcpy(&s4, b + 8, 4);
  std::memcpy(&s8, b + 12, 4);
  sc8 = (s0 & 0x3f3f3f3fu) | uint64_t{(s8 & 0x0f0f0f0fu) | ((s0 >> 2) & 0x30303030u)} << 32;
  m8 = (s4 & 0x3f3f3f3fu) | uint64_t{((s8 >> 4) & 0x0f0f0f0fu) | ((s4 >> 2) & 0x30303030u)} << 32;
}

__attribute__((target("f16c"))) TANDEM_INLINE float f16c_to_f32(const uint8_t* p) {  // the vector kernels' fp16
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Where input value v (< 256) of a block sits in Q8Block::q for weights of `type` (gemv.h): q4_K / q5_K swap
// bits 5 and 6 of the index, q6_K keeps it
constexpr int q8_lane(int type, int v) {
  return type == kQ4K || type == kQ5K ? (v & ~0x60) | ((v & 0x20) << 1) | ((v & 0x40) >> 1) : v;
}

// q8_0 / mxfp4_gguf against int8 inputs: a 32-value block's quants as signed int8 in value order (mxfp4_gguf:
// twice the e2m1 values, the integers 0..12 and their negatives, by a 16-entry byte shuffle; its scale is then
// half the E8M0 one, as in decode_mxfp4). Their products with the inputs' int8 are signed x signed; vpdpbusd /
// vpmaddubsw take unsigned x signed, so the kernels multiply |w| with x carrying w's sign (exact: |w| <= 128,
// |x| <= 127).
template <int TYPE>
__attribute__((target("avx2,f16c"))) TANDEM_INLINE __m256i block32_quants(const uint8_t* b) {
  if constexpr (TYPE == kQ80) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
  } else {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 1)), nib = _mm_set1_epi8(15);
    const __m256i e2m1x2 = _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,
                                            0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m256i v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), nib), _mm_and_si128(bytes, nib));
    return _mm256_shuffle_epi8(e2m1x2, v);
  }
}
// ... and the scales of n <= 8 consecutive 32-value blocks at bp in lanes 0..n-1 (the higher lanes
// finite: they meet zero quants), read by scalar loads into one vector once per input block
template <int TYPE>
__attribute__((target("avx2,f16c"))) TANDEM_INLINE __m256 block32_scales(const uint8_t* bp, int n) {
  constexpr int bb = kGgufBytes[TYPE];
  uint64_t v[2] = {0, 0};
  if constexpr (TYPE == kQ80) {  // fp16 d, four to a word
    for (int i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, bp + bb * i, 2);
      v[i / 4] |= uint64_t{h} << (16 * (i % 4));
    }
    return _mm256_cvtph_ps(_mm_set_epi64x(static_cast<int64_t>(v[1]), static_cast<int64_t>(v[0])));
  } else {  // mxfp4_half of each E8M0 byte: (e - 1) << 23, the subnormals 0x00200000 << e for e < 2
    for (int i = 0; i < n; ++i) v[0] |= uint64_t{bp[bb * i]} << (8 * i);
    const __m256i e = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(v[0])));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
  }
}

constexpr int kTok = 8;  // tokens per pass over a row's blocks (their accumulators stay in registers)

// A kernel's passes over its rows, kTok tokens at a time: Rows::template run<NT>(a, t0), the pass's token
// count a template argument so that its accumulators stay in registers.
template <class Rows>
void token_passes(const GemvArgs& a) {
  for (int t0 = 0; t0 < a.ntok; t0 += kTok) {
    switch (std::min(kTok, a.ntok - t0)) {
      case 1: Rows::template run<1>(a, t0); break;
      case 2: Rows::template run<2>(a, t0); break;
      case 3: Rows::template run<3>(a, t0); break;
      case 4: Rows::template run<4>(a, t0); break;
      case 5: Rows::template run<5>(a, t0); break;
      case 6: Rows::template run<6>(a, t0); break;
      case 7: Rows::template run<7>(a, t0); break;
      default: Rows::template run<8>(a, t0); break;
    }
  }
}

}  // namespace

namespace scalar {
void gemv_gguf(const GemvArgs& a) {
  const int type = a.gguf, qk = kGgufQk[type], nb = a.K / qk;
  const int64_t rb = a.ldb, bb = kGgufBytes[type];
  alignas(64) float v[256];
  for (int r = 0; r < a.nrows; ++r) {
    const uint8_t* row = static_cast<const uint8_t*>(a.W) + r * rb;
    for (int t0 = 0; t0 < a.ntok; t0 += kTok) {
      const int nt = std::min(kTok, a.ntok - t0);
      float acc[kTok] = {};
      for (int blk = 0; blk < nb; ++blk) {
        decode(type, row + blk * bb, v);
        for (int t = 0; t < nt; ++t) {
          const float* x = static_cast<const float*>(a.X[t0 + t]) + blk * qk;
          float s = 0.f;
          for (int k = 0; k < qk; ++k) s += v[k] * x[k];
          acc[t] += s;
        }
      }
      for (int t = 0; t < nt; ++t) store(a, r, t0 + t, acc[t]);
    }
  }
}
}  // namespace scalar

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
namespace avx512 {
// The AVX-512 kernel decodes 16 values at a time straight into a register (no stack buffer) and multiplies
// it into every token's accumulator: per 16 values a byte widen, a shift/mask, a convert and one FMA for
// the block's affine scale, then an FMA per token. What the scalar kernel's stack decode would cost here:
// 2.8 G weights/s per core on a Sapphire Rapids core; this form is meant to keep up with DRAM (measure:
// benchmarks/bench_cpu_executor.py --dtype q4_K+q6_K).

// Per block: the scale (and min) of each group of 16 values, fp32: q4_K / q5_K d*sc_j, dmin*m_j per 32-value
// sub-block j (groups 2j, 2j + 1), q6_K d*scales[g], q8_0 d, mxfp4_gguf half the E8M0 scale (x twice e2m1).
template <int TYPE>
TANDEM_INLINE void header(const uint8_t* b, float* s, float* o) {
  if constexpr (TYPE == kQ4K || TYPE == kQ5K) {
    const float d = half_to_f32(b), dmin = half_to_f32(b + 2);
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      k4_scale_min(b + 4, j, sc, m);
      s[j] = d * static_cast<float>(sc);
      o[j] = dmin * static_cast<float>(m);
    }
  } else if constexpr (TYPE == kQ6K) {
    const float d = half_to_f32(b + 208);
    for (int g = 0; g < 16; ++g) s[g] = d * static_cast<float>(reinterpret_cast<const int8_t*>(b + 192)[g]);
  } else if constexpr (TYPE == kQ80) {
    s[0] = half_to_f32(b);
  } else {
    s[0] = mxfp4_half(b);
  }
}

TANDEM_INLINE __m512i widen16(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
TANDEM_INLINE __m512i bits(__m512i v, int shift, int mask) {
  return _mm512_and_si512(_mm512_srlv_epi32(v, _mm512_set1_epi32(shift)), _mm512_set1_epi32(mask));
}

// Values 16c .. 16c + 15 of block b as fp32 (the reference's s * q - o; one rounding where it has two).
template <int TYPE>
TANDEM_INLINE __m512 chunk(const uint8_t* b, int c, const float* s, const float* o, __m512 table) {
  if constexpr (TYPE == kQ4K || TYPE == kQ5K) {
    const int j = c >> 1, half = c & 1;  // sub-block j: bytes 32 (j / 2) + 16 half .. + 15 of qs, nibble j % 2
    __m512i q = bits(widen16(b + (TYPE == kQ4K ? 16 : 48) + 32 * (j >> 1) + 16 * half), 4 * (j & 1), 15);
    if constexpr (TYPE == kQ5K) q = _mm512_or_si512(q, _mm512_slli_epi32(bits(widen16(b + 16 + 16 * half), j, 1), 4));
    return _mm512_fmsub_ps(_mm512_set1_ps(s[j]), _mm512_cvtepi32_ps(q), _mm512_set1_ps(o[j]));
  } else if constexpr (TYPE == kQ6K) {
    const int h = c >> 3, r0 = 16 * (c & 7);  // values 128h + r0 + lane
    const __m512i lo = bits(widen16(b + 64 * h + (r0 & 63)), 4 * (r0 >> 6), 15);
    const __m512i hi = bits(widen16(b + 128 + 32 * h + (r0 & 31)), 2 * (r0 >> 5), 3);
    const __m512i q = _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)), _mm512_set1_epi32(32));
    return _mm512_mul_ps(_mm512_set1_ps(s[c]), _mm512_cvtepi32_ps(q));
  } else if constexpr (TYPE == kQ80) {
    const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + 16 * c)));
    return _mm512_mul_ps(_mm512_set1_ps(s[0]), _mm512_cvtepi32_ps(q));
  } else {  // mxfp4_gguf: chunk 0 the low nibbles of bytes 1..16, chunk 1 the high ones; twice e2m1 by table
    const __m512i nib = bits(widen16(b + 1), 4 * c, 15);
    return _mm512_mul_ps(_mm512_set1_ps(s[0]), _mm512_permutexvar_ps(nib, table));
  }
}

// Tokens t0 .. t0 + NT - 1 over every row: NT a template argument, so the accumulators stay in registers.
template <int TYPE, int NT>
void rows_t(const GemvArgs& a, int t0) {
  constexpr int qk = kGgufQk[TYPE], bb = kGgufBytes[TYPE];
  const int nb = a.K / qk;
  const __m512 table = _mm512_loadu_ps(kE2m1x2);
  const float* x[NT];
  for (int t = 0; t < NT; ++t) x[t] = static_cast<const float*>(a.X[t0 + t]);
  alignas(64) float s[16], o[8];
  for (int r = 0; r < a.nrows; ++r) {
    const uint8_t* row = static_cast<const uint8_t*>(a.W) + r * a.ldb;
    __m512 acc[2][NT];  // even and odd chunks: two FMA chains per token (one waits on the FMA's latency)
    for (int t = 0; t < NT; ++t) acc[0][t] = acc[1][t] = _mm512_setzero_ps();
    for (int blk = 0; blk < nb; ++blk) {
      const uint8_t* bp = row + blk * bb;
      _mm_prefetch(reinterpret_cast<const char*>(bp) + 1024, _MM_HINT_T1);  // the stream ahead, into L2
      header<TYPE>(bp, s, o);
      if constexpr (TYPE == kQ4K || TYPE == kQ5K) {  // per 32 qs bytes (values 64g .. 64g + 63): each byte
        // widened once for both nibbles, immediate shifts (srlv by a set1 and a widen per 16 values: ~30% slower)
        __m512i qh0, qh1;
        if constexpr (TYPE == kQ5K) { qh0 = widen16(bp + 16); qh1 = widen16(bp + 32); }
        const __m512i m15 = _mm512_set1_epi32(15), one = _mm512_set1_epi32(1);
#pragma GCC unroll 4
        for (int g = 0; g < 4; ++g) {
          const uint8_t* qs = bp + (TYPE == kQ4K ? 16 : 48) + 32 * g;
          const __m512i b0 = widen16(qs), b1 = widen16(qs + 16);
          __m512i lo0 = _mm512_and_si512(b0, m15), lo1 = _mm512_and_si512(b1, m15);
          __m512i hi0 = _mm512_srli_epi32(b0, 4), hi1 = _mm512_srli_epi32(b1, 4);
          if constexpr (TYPE == kQ5K) {  // bit j of qh[l]: sub-block j = 2g (low nibbles), 2g + 1 (high)
            const __m512i sh_lo = _mm512_set1_epi32(2 * g), sh_hi = _mm512_set1_epi32(2 * g + 1);
            lo0 = _mm512_or_si512(lo0, _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(qh0, sh_lo), one), 4));
            lo1 = _mm512_or_si512(lo1, _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(qh1, sh_lo), one), 4));
            hi0 = _mm512_or_si512(hi0, _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(qh0, sh_hi), one), 4));
            hi1 = _mm512_or_si512(hi1, _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(qh1, sh_hi), one), 4));
          }
          const __m512 s_lo = _mm512_set1_ps(s[2 * g]), o_lo = _mm512_set1_ps(o[2 * g]);
          const __m512 s_hi = _mm512_set1_ps(s[2 * g + 1]), o_hi = _mm512_set1_ps(o[2 * g + 1]);
          const __m512 w00 = _mm512_fmsub_ps(s_lo, _mm512_cvtepi32_ps(lo0), o_lo);  // values 64g + 0..15
          const __m512 w01 = _mm512_fmsub_ps(s_lo, _mm512_cvtepi32_ps(lo1), o_lo);  // 64g + 16..31
          const __m512 w10 = _mm512_fmsub_ps(s_hi, _mm512_cvtepi32_ps(hi0), o_hi);  // 64g + 32..47
          const __m512 w11 = _mm512_fmsub_ps(s_hi, _mm512_cvtepi32_ps(hi1), o_hi);  // 64g + 48..63
          for (int t = 0; t < NT; ++t) {
            const float* xc = x[t] + blk * qk + 64 * g;
            acc[0][t] = _mm512_fmadd_ps(w00, _mm512_loadu_ps(xc), acc[0][t]);
            acc[1][t] = _mm512_fmadd_ps(w01, _mm512_loadu_ps(xc + 16), acc[1][t]);
            acc[0][t] = _mm512_fmadd_ps(w10, _mm512_loadu_ps(xc + 32), acc[0][t]);
            acc[1][t] = _mm512_fmadd_ps(w11, _mm512_loadu_ps(xc + 48), acc[1][t]);
          }
        }
        continue;
      }
      if constexpr (TYPE == kQ6K) {  // per half h (128 values): ql's 64 bytes widened once for both nibbles,
        // qh's 32 once for its four 2-bit fields
        const __m512i m15 = _mm512_set1_epi32(15), m3 = _mm512_set1_epi32(3), k32 = _mm512_set1_epi32(32);
        for (int h = 0; h < 2; ++h) {
          const __m512i qh[2] = {widen16(bp + 128 + 32 * h), widen16(bp + 128 + 32 * h + 16)};
#pragma GCC unroll 4
          for (int q = 0; q < 4; ++q) {  // ql bytes 64h + 16q + lane: values 128h + 16q + lane (low), +64 (high)
            const __m512i b = widen16(bp + 64 * h + 16 * q);
            const __m512i hb = qh[q & 1];  // qh[32h + (16q) % 32 + lane]: bits 2 (q / 2) low, 4 + 2 (q / 2) high
            const __m512i lo = _mm512_or_si512(_mm512_and_si512(b, m15), _mm512_slli_epi32(
                _mm512_and_si512(_mm512_srlv_epi32(hb, _mm512_set1_epi32(2 * (q >> 1))), m3), 4));
            const __m512i hi = _mm512_or_si512(_mm512_srli_epi32(b, 4), _mm512_slli_epi32(
                _mm512_and_si512(_mm512_srlv_epi32(hb, _mm512_set1_epi32(4 + 2 * (q >> 1))), m3), 4));
            const __m512 w_lo = _mm512_mul_ps(_mm512_set1_ps(s[8 * h + q]), _mm512_cvtepi32_ps(_mm512_sub_epi32(lo, k32)));
            const __m512 w_hi = _mm512_mul_ps(_mm512_set1_ps(s[8 * h + 4 + q]), _mm512_cvtepi32_ps(_mm512_sub_epi32(hi, k32)));
            for (int t = 0; t < NT; ++t) {
              const float* xc = x[t] + blk * qk + 128 * h + 16 * q;
              acc[0][t] = _mm512_fmadd_ps(w_lo, _mm512_loadu_ps(xc), acc[0][t]);
              acc[1][t] = _mm512_fmadd_ps(w_hi, _mm512_loadu_ps(xc + 64), acc[1][t]);
            }
          }
        }
        continue;
      }
      for (int c = 0; c < qk / 16; c += 2) {  // qk / 16 is 16 or 2
        const __m512 w0 = chunk<TYPE>(bp, c, s, o, table), w1 = chunk<TYPE>(bp, c + 1, s, o, table);
        for (int t = 0; t < NT; ++t) {
          const float* xc = x[t] + blk * qk + 16 * c;
          acc[0][t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xc), acc[0][t]);
          acc[1][t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xc + 16), acc[1][t]);
        }
      }
    }
    for (int t = 0; t < NT; ++t) store(a, r, t0 + t, _mm512_reduce_add_ps(_mm512_add_ps(acc[0][t], acc[1][t])));
  }
}

template <int TYPE>
struct Rows {
  template <int NT>
  static void run(const GemvArgs& a, int t0) { rows_t<TYPE, NT>(a, t0); }
};

void gemv_gguf(const GemvArgs& a) {
  switch (a.gguf) {
    case kQ4K: token_passes<Rows<kQ4K>>(a); break;
    case kQ5K: token_passes<Rows<kQ5K>>(a); break;
    case kQ6K: token_passes<Rows<kQ6K>>(a); break;
    case kQ80: token_passes<Rows<kQ80>>(a); break;
    default: token_passes<Rows<kMxfp4Gguf>>(a); break;
  }
}
}  // namespace avx512
#pragma GCC pop_options

void gguf_quantize_inputs(int type, const float* x, int64_t K, Q8Block* out) {
  for (int64_t b = 0; b < q8_blocks(K); ++b) {
    const float* xb = x + 256 * b;
    const int n = static_cast<int>(std::min<int64_t>(256, K - 256 * b));  // < 256: a row's partial last block
    Q8Block& o = out[b];
    float amax = 0.f;
    for (int v = 0; v < n; ++v) amax = std::max(amax, std::fabs(xb[v]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;  // as the reference computes it: exact same roundings
    o.d = amax / 127.f;
    int sum16[16] = {};
    for (int v = 0; v < 256; ++v) {
      // nearbyint rounds half to even like torch.round; the clamp also keeps a non-finite input defined
      const int q = v < n ? static_cast<int>(std::nearbyint(std::fmax(-127.f, std::fmin(127.f, xb[v] * inv)))) : 0;
      o.q[q8_lane(type, v)] = static_cast<int8_t>(q);
      sum16[v >> 4] += q;
    }
    for (int g = 0; g < 16; ++g) o.s16[g] = o.d * static_cast<float>(sum16[g]);
    for (int j = 0; j < 16; ++j) o.s32[j] = j < 8 ? o.d * static_cast<float>(sum16[2 * j] + sum16[2 * j + 1]) : 0.f;
  }
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")
namespace avx512vnni {
// K-quant blocks against Q8Block inputs. Per block the quant bytes become four vectors of unsigned 4..6-bit
// values (64 each), each meets its 64 int8 inputs in one vpdpbusd (lane i: the sum of four products, exact in
// int32), and the lanes take their sub-block's (or 16-group's) scale in one FMA; the block's input scale d and
// the offsets (q4_K / q5_K mins, q6_K's -32) are applied once per block against the inputs' partial sums.

// q4_K / q5_K header: (d * sc_j, dmin * m_j) of the eight sub-blocks
TANDEM_INLINE void k4_header(const uint8_t* b, __m256& sc, __m256& mn) {
  uint64_t sc8, m8;
  k4_fields(b, sc8, m8);
  auto widen = [](uint64_t v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(v)))); };
  sc = _mm256_mul_ps(_mm256_set1_ps(f16c_to_f32(b)), widen(sc8));
  mn = _mm256_mul_ps(_mm256_set1_ps(f16c_to_f32(b + 2)), widen(m8));
}

TANDEM_INLINE __m512i halves_epi16(int lo, int hi) {  // 16-bit lanes: `lo` in the low 32 bytes, `hi` above
  return _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(lo)), _mm256_set1_epi16(static_cast<int16_t>(hi)), 1);
}
TANDEM_INLINE __m512i halves_epi8(int lo, int hi) {
  return _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(lo)), _mm256_set1_epi8(static_cast<char>(hi)), 1);
}
TANDEM_INLINE __m512i lanes_of(int a, int b) {  // lanes 0..7 take scale a, 8..15 scale b
  return _mm512_inserti64x4(_mm512_set1_epi32(a), _mm256_set1_epi32(b), 1);
}

template <int TYPE, int NT>
void rows_q8(const GemvArgs& a, int t0) {
  constexpr int bb = kGgufBytes[TYPE];
  const int nb = a.K / 256;
  const Q8Block* x[NT];
  for (int t = 0; t < NT; ++t) x[t] = static_cast<const Q8Block*>(a.X[t0 + t]);
  const __m512i nib = _mm512_set1_epi8(0x0f), low2 = _mm512_set1_epi8(0x03), zero = _mm512_setzero_si512();
  // vector z of a q4_K / q5_K block (c = z / 2 the 64-byte half of qs, k = z % 2 the nibble) holds
  // sub-blocks 4c + k (lanes 0..7) and 4c + 2 + k (8..15); of a q6_K block the values 64z + 4 lane ..
  __m512i scale_of[4], qh_bit[4];
  for (int z = 0; z < 4; ++z) {
    const int c = z / 2, k = z % 2;
    scale_of[z] = TYPE == kQ6K ? _mm512_add_epi32(_mm512_set1_epi32(4 * z), _mm512_srli_epi32(
                                     _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2))
                               : lanes_of(4 * c + k, 4 * c + 2 + k);
    qh_bit[z] = halves_epi8(1 << (4 * c + k), 1 << (4 * c + 2 + k));  // q5_K: bit j of qh[l] for sub-block j
  }
  const __m512i q6_shift[2] = {halves_epi16(0, 2), halves_epi16(4, 6)};  // q6_K: qh bits of values r, by r / 32
  for (int r = 0; r < a.nrows; ++r) {
    const uint8_t* row = static_cast<const uint8_t*>(a.W) + r * a.ldb;
    __m512 acc[NT], off[NT];
    for (int t = 0; t < NT; ++t) acc[t] = off[t] = _mm512_setzero_ps();
    for (int blk = 0; blk < nb; ++blk) {
      const uint8_t* bp = row + blk * bb;
      _mm_prefetch(reinterpret_cast<const char*>(bp) + 1024, _MM_HINT_T1);  // the stream ahead, into L2
      __m512i q[4];
      __m512 sv[4], ov;  // lanes' scales; the offsets' scales against the inputs' sums
      if constexpr (TYPE == kQ6K) {
        const __m512 s16 = _mm512_mul_ps(_mm512_set1_ps(f16c_to_f32(bp + 208)), _mm512_cvtepi32_ps(
                                             _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bp + 192)))));
        for (int z = 0; z < 4; ++z) sv[z] = _mm512_permutexvar_ps(scale_of[z], s16);
        ov = _mm512_mul_ps(s16, _mm512_set1_ps(32.f));  // q is stored + 32
        for (int h = 0; h < 2; ++h) {  // values 128h .. : low nibbles of ql[64h ..] then the high ones
          const __m512i ql = _mm512_loadu_si512(bp + 64 * h);
          const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + 128 + 32 * h)));
          for (int n = 0; n < 2; ++n) {
            const __m512i low = _mm512_and_si512(n ? _mm512_srli_epi16(ql, 4) : ql, nib);
            const __m512i high = _mm512_and_si512(_mm512_srlv_epi16(qh, q6_shift[n]), low2);
            q[2 * h + n] = _mm512_or_si512(low, _mm512_slli_epi16(high, 4));
          }
        }
      } else {
        __m256 sc, mn;
        k4_header(bp, sc, mn);
        for (int z = 0; z < 4; ++z) sv[z] = _mm512_permutexvar_ps(scale_of[z], _mm512_castps256_ps512(sc));
        ov = _mm512_zextps256_ps512(mn);
        const uint8_t* qs = bp + (TYPE == kQ4K ? 16 : 48);
        for (int c = 0; c < 2; ++c) {
          const __m512i w = _mm512_loadu_si512(qs + 64 * c);
          q[2 * c] = _mm512_and_si512(w, nib);
          q[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(w, 4), nib);
        }
        if constexpr (TYPE == kQ5K) {
          const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + 16)));
          for (int z = 0; z < 4; ++z)
            q[z] = _mm512_mask_add_epi8(q[z], _mm512_test_epi8_mask(qh, qh_bit[z]), q[z], _mm512_set1_epi8(16));
        }
      }
      for (int t = 0; t < NT; ++t) {
        const Q8Block& xb = x[t][blk];
        __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, q[0], _mm512_load_si512(xb.q))), sv[0]);
        for (int z = 1; z < 4; ++z)
          f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, q[z], _mm512_load_si512(xb.q + 64 * z))), sv[z], f);
        acc[t] = _mm512_fmadd_ps(f, _mm512_set1_ps(xb.d), acc[t]);
        off[t] = _mm512_fmadd_ps(ov, _mm512_load_ps(TYPE == kQ6K ? xb.s16 : xb.s32), off[t]);
      }
    }
    for (int t = 0; t < NT; ++t) store(a, r, t0 + t, _mm512_reduce_add_ps(acc[t]) - _mm512_reduce_add_ps(off[t]));
  }
}

// Two 32-value blocks at p (the second only if `two`, else zeros) as |w| in value order and w's sign mask
template <int TYPE>
TANDEM_INLINE void pair_quants(const uint8_t* p, bool two, __m512i& aw, __mmask64& neg) {
  constexpr int bb = kGgufBytes[TYPE];
  if constexpr (TYPE == kQ80) {
    const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(block32_quants<TYPE>(p)),
                                         two ? block32_quants<TYPE>(p + bb) : _mm256_setzero_si256(), 1);
    aw = _mm512_abs_epi8(w);
    neg = _mm512_movepi8_mask(w);
  } else {  // the 16 nibble bytes of each block, low nibbles (values 0..15) then high ones (16..31) per block;
    // the magnitudes by shuffle and the sign from the nibble's bit 3 (block32_quants' table, without its abs)
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 1));
    const __m256i ab = two ? _mm256_inserti128_si256(_mm256_castsi128_si256(a), _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + bb + 1)), 1)
                           : _mm256_zextsi128_si256(a);
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(ab), _mm256_srli_epi16(ab, 4), 1);  // a, b, a >> 4, b >> 4
    const __m512i nib = _mm512_and_si512(_mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0)), _mm512_set1_epi8(15));
    const __m512i mag = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, 1, 2, 3, 4, 6, 8, 12));
    aw = _mm512_shuffle_epi8(mag, nib);  // twice the e2m1 magnitude; bit 3 of the nibble its sign
    neg = _mm512_test_epi8_mask(nib, _mm512_set1_epi8(8));
  }
}

// q8_0 / mxfp4_gguf: the n <= 8 blocks of one input block qb (a row's last may hold fewer), two per vector
// (lanes 0..7 the first, 8..15 the second; an odd n's last vector has zeros above). |w| meets the inputs with
// w's sign (a masked negation) in one vpdpbusd per token, the lanes take their block's scale in one FMA, the
// input block's d once.
template <int TYPE, int NT>
TANDEM_INLINE void q8block_32(const uint8_t* bp, int n, const Q8Block* const* x, int qb, __m512* acc) {
  constexpr int bb = kGgufBytes[TYPE];
  const __m512 s8 = _mm512_castps256_ps512(block32_scales<TYPE>(bp, n));
  const int nv = (n + 1) / 2;
  __m512i aw[4];
  __mmask64 neg[4];
  __m512 sv[4];
  for (int z = 0; z < nv; ++z) {
    pair_quants<TYPE>(bp + 2 * z * bb, 2 * z + 1 < n, aw[z], neg[z]);
    sv[z] = _mm512_permutexvar_ps(lanes_of(2 * z, 2 * z + 1), s8);
  }
  const __m512i zero = _mm512_setzero_si512();
  for (int t = 0; t < NT; ++t) {
    const Q8Block& xb = x[t][qb];
    __m512 f = _mm512_setzero_ps();
    for (int z = 0; z < nv; ++z) {
      const __m512i xv = _mm512_load_si512(xb.q + 64 * z);
      f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, aw[z], _mm512_mask_sub_epi8(xv, neg[z], zero, xv))), sv[z], f);
    }
    acc[t] = _mm512_fmadd_ps(f, _mm512_set1_ps(xb.d), acc[t]);
  }
}

template <int TYPE, int NT>
void rows_q8_32(const GemvArgs& a, int t0) {
  constexpr int bb = kGgufBytes[TYPE];
  const int nb = a.K / 32, full = nb / 8;
  const Q8Block* x[NT];
  for (int t = 0; t < NT; ++t) x[t] = static_cast<const Q8Block*>(a.X[t0 + t]);
  for (int r = 0; r < a.nrows; ++r) {
    const uint8_t* row = static_cast<const uint8_t*>(a.W) + r * a.ldb;
    __m512 acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
    for (int qb = 0; qb < full; ++qb) {
      const uint8_t* bp = row + 8 * qb * bb;
      for (int o = 0; o < 8 * bb; o += 64)  // the stream ahead, into L2
        _mm_prefetch(reinterpret_cast<const char*>(bp) + 1024 + o, _MM_HINT_T1);
      q8block_32<TYPE, NT>(bp, 8, x, qb, acc);
    }
    if (nb % 8) q8block_32<TYPE, NT>(row + 8 * full * bb, nb % 8, x, full, acc);  // a partial last input block
    for (int t = 0; t < NT; ++t) store(a, r, t0 + t, _mm512_reduce_add_ps(acc[t]));
  }
}

template <int TYPE>
struct Rows {
  template <int NT>
  static void run(const GemvArgs& a, int t0) {
    if constexpr (kGgufQk[TYPE] == 32) rows_q8_32<TYPE, NT>(a, t0);
    else rows_q8<TYPE, NT>(a, t0);
  }
};

void gemv_gguf_q8(const GemvArgs& a) {
  switch (a.gguf) {
    case kQ4K: token_passes<Rows<kQ4K>>(a); break;
    case kQ5K: token_passes<Rows<kQ5K>>(a); break;
    case kQ6K: token_passes<Rows<kQ6K>>(a); break;
    case kQ80: token_passes<Rows<kQ80>>(a); break;
    default: token_passes<Rows<kMxfp4Gguf>>(a); break;
  }
}
}  // namespace avx512vnni
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
// The same int8 inputs on AVX2 hosts (desktop CPUs without AVX-512): 32 values per vector, so each vector of
// quant bytes is one q4_K / q5_K sub-block or two q6_K 16-groups. vpmaddubsw multiplies its unsigned quants
// with the int8 inputs into pairs of int16 (at most 2 * 63 * 127: no saturation) and vpmaddwd multiplies
// those by the integer scales into int32 lanes, so a whole block sums in int32 (at most 8 * 4 * 63 * 127 *
// 127 < 2^31) and turns into fp32 once, times the two d's.

TANDEM_INLINE __m256i scaled(__m256i q, const int8_t* x, __m256i scale16) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(q, _mm256_load_si256(reinterpret_cast<const __m256i*>(x))), scale16);
}

TANDEM_INLINE float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

template <int TYPE, int NT>
void rows_q8(const GemvArgs& a, int t0) {
  constexpr int bb = kGgufBytes[TYPE];
  const int nb = a.K / 256;
  const Q8Block* x[NT];
  for (int t = 0; t < NT; ++t) x[t] = static_cast<const Q8Block*>(a.X[t0 + t]);
  const __m256i nib = _mm256_set1_epi8(0x0f), low2 = _mm256_set1_epi8(0x03);
  for (int r = 0; r < a.nrows; ++r) {
    const uint8_t* row = static_cast<const uint8_t*>(a.W) + r * a.ldb;
    __m256 acc[NT], off[NT];
    for (int t = 0; t < NT; ++t) acc[t] = off[t] = _mm256_setzero_ps();
    for (int blk = 0; blk < nb; ++blk) {
      const uint8_t* bp = row + blk * bb;
      _mm_prefetch(reinterpret_cast<const char*>(bp) + 1024, _MM_HINT_T1);
      __m256i q[8], sc[8];  // 32 quants each and their int16 scales
      int xo[8];            // where each vector's inputs sit in Q8Block::q
      __m256 ov[2];         // the offsets' scales against the inputs' sums (s32: one vector; s16: two)
      float d;
      if constexpr (TYPE == kQ6K) {
        d = f16c_to_f32(bp + 208);
        const int8_t* s = reinterpret_cast<const int8_t*>(bp + 192);
        const __m256 s16a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s))));
        const __m256 s16b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + 8))));
        ov[0] = _mm256_mul_ps(_mm256_set1_ps(32.f * d), s16a);  // q is stored + 32
        ov[1] = _mm256_mul_ps(_mm256_set1_ps(32.f * d), s16b);
        for (int h = 0; h < 2; ++h) {  // values 128h + r: ql[64h + r % 64] nibble r / 64, qh[32h + r % 32] bits 2 (r / 32)
          const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + 64 * h));       // r % 64 < 32
          const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + 64 * h + 32));  // r % 64 >= 32
          const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + 128 + 32 * h));
          for (int k = 0; k < 4; ++k) {  // values 128h + 32k ..
            const __m256i l = k % 2 ? hi : lo;
            const __m256i low = _mm256_and_si256(k / 2 ? _mm256_srli_epi16(l, 4) : l, nib);
            const __m256i high = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * k), low2);
            const int v = 4 * h + k, g = 8 * h + 2 * k;  // the vector, its first 16-group
            q[v] = _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
            sc[v] = _mm256_set_m128i(_mm_set1_epi16(s[g + 1]), _mm_set1_epi16(s[g]));
            xo[v] = 32 * v;
          }
        }
      } else {
        d = f16c_to_f32(bp);
        uint64_t sc8, m8;
        k4_fields(bp, sc8, m8);
        ov[0] = _mm256_mul_ps(_mm256_set1_ps(f16c_to_f32(bp + 2)),
                              _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(m8)))));
        const uint8_t* qs = bp + (TYPE == kQ4K ? 16 : 48);
        __m256i qh;
        if constexpr (TYPE == kQ5K) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + 16));
        for (int j = 0; j < 8; ++j) {  // sub-block j: nibble j % 2 of qs bytes 32 (j / 2) ..; bit j of qh
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * (j / 2)));
          q[j] = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(w, 4) : w, nib);
          if constexpr (TYPE == kQ5K) {
            const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << j));
            q[j] = _mm256_or_si256(q[j], _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit),
                                                          _mm256_set1_epi8(16)));
          }
          sc[j] = _mm256_set1_epi16(static_cast<int16_t>((sc8 >> (8 * j)) & 0xff));
          xo[j] = q8_lane(TYPE, 32 * j);  // sub-block j's 32 inputs, contiguous in Q8Block's order
        }
      }
      for (int t = 0; t < NT; ++t) {
        const Q8Block& xb = x[t][blk];
        __m256i isum = scaled(q[0], xb.q + xo[0], sc[0]);
        for (int v = 1; v < 8; ++v) isum = _mm256_add_epi32(isum, scaled(q[v], xb.q + xo[v], sc[v]));
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d * xb.d), acc[t]);
        if constexpr (TYPE == kQ6K) {
          off[t] = _mm256_fmadd_ps(ov[0], _mm256_load_ps(xb.s16), off[t]);
          off[t] = _mm256_fmadd_ps(ov[1], _mm256_load_ps(xb.s16 + 8), off[t]);
        } else {
          off[t] = _mm256_fmadd_ps(ov[0], _mm256_load_ps(xb.s32), off[t]);
        }
      }
    }
    for (int t = 0; t < NT; ++t) store(a, r, t0 + t, hsum(acc[t]) - hsum(off[t]));
  }
}

// q8_0 / mxfp4_gguf: one 32-value block per vector; vpsignb puts w's sign on the inputs, vpmaddubsw makes
// int16 pairs of |w| times them (at most 2 * 128 * 127: no saturation), vpmaddwd by ones int32 lanes, which
// take the block's scale in one FMA; the input block's d once per input block (n <= 8 blocks: a row's last may
// hold fewer).
template <int TYPE, int NT>
TANDEM_INLINE void q8block_32(const uint8_t* bp, int n, const Q8Block* const* x, int qb, __m256* acc) {
  constexpr int bb = kGgufBytes[TYPE];
  const __m256 s8 = block32_scales<TYPE>(bp, n);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 f[NT];
  for (int t = 0; t < NT; ++t) f[t] = _mm256_setzero_ps();
  for (int i = 0; i < n; ++i) {
    const __m256i w = block32_quants<TYPE>(bp + i * bb), aw = _mm256_abs_epi8(w);
    const __m256 sw = _mm256_permutevar8x32_ps(s8, _mm256_set1_epi32(i));
    for (int t = 0; t < NT; ++t) {
      const __m256i xv = _mm256_load_si256(reinterpret_cast<const __m256i*>(x[t][qb].q + 32 * i));
      const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, w)), ones);
      f[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sw, f[t]);
    }
  }
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_fmadd_ps(f[t], _mm256_set1_ps(x[t][qb].d), acc[t]);
}

template <int TYPE, int NT>
void rows_q8_32(const GemvArgs& a, int t0) {
  constexpr int bb = kGgufBytes[TYPE];
  const int nb = a.K / 32, full = nb / 8;
  const Q8Block* x[NT];
  for (int t = 0; t < NT; ++t) x[t] = static_cast<const Q8Block*>(a.X[t0 + t]);
  for (int r = 0; r < a.nrows; ++r) {
    const uint8_t* row = static_cast<const uint8_t*>(a.W) + r * a.ldb;
    __m256 acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
    for (int qb = 0; qb < full; ++qb) {
      const uint8_t* bp = row + 8 * qb * bb;
      for (int o = 0; o < 8 * bb; o += 64) _mm_prefetch(reinterpret_cast<const char*>(bp) + 1024 + o, _MM_HINT_T1);
      q8block_32<TYPE, NT>(bp, 8, x, qb, acc);
    }
    if (nb % 8) q8block_32<TYPE, NT>(row + 8 * full * bb, nb % 8, x, full, acc);  // a partial last input block
    for (int t = 0; t < NT; ++t) store(a, r, t0 + t, hsum(acc[t]));
  }
}

template <int TYPE>
struct Rows {
  template <int NT>
  static void run(const GemvArgs& a, int t0) {
    if constexpr (kGgufQk[TYPE] == 32) rows_q8_32<TYPE, NT>(a, t0);
    else rows_q8<TYPE, NT>(a, t0);
  }
};

void gemv_gguf_q8(const GemvArgs& a) {
  switch (a.gguf) {
    case kQ4K: token_passes<Rows<kQ4K>>(a); break;
    case kQ5K: token_passes<Rows<kQ5K>>(a); break;
    case kQ6K: token_passes<Rows<kQ6K>>(a); break;
    case kQ80: token_passes<Rows<kQ80>>(a); break;
    default: token_passes<Rows<kMxfp4Gguf>>(a); break;
  }
}

// mxfp4_gguf 8 values at a time: the e2m1 magnitude by an 8-entry permute, the sign bit moved into place
// (the plain decoder's 16-entry table lookup does not vectorize)
TANDEM_INLINE void decode_mxfp4_8(const uint8_t* b, float* out) {
  const __m256 half = _mm256_set1_ps(mxfp4_half(b));
  const __m256 mag = _mm256_loadu_ps(kE2m1x2);  // entries 0..7: twice the e2m1 magnitudes
  for (int c = 0; c < 4; ++c) {  // values 8c ..: low nibbles of bytes 1 + 8c .. for c < 2, high ones after
    const __m256i byte = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 1 + 8 * (c % 2))));
    const __m256i nib = _mm256_and_si256(c < 2 ? byte : _mm256_srli_epi32(byte, 4), _mm256_set1_epi32(15));
    const __m256 m = _mm256_permutevar8x32_ps(mag, nib);  // uses the low 3 bits
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(nib, _mm256_set1_epi32(8)), 28);
    _mm256_store_ps(out + 8 * c, _mm256_mul_ps(half, _mm256_xor_ps(m, _mm256_castsi256_ps(sign))));
  }
}

// fp32 inputs on AVX2 (fp32 models, q8_0 / mxfp4_gguf banks): the scalar kernel's form, each block decoded
// once into fp32 values on the stack (the decoders' plain loops, vectorized here for AVX2), then 8-wide FMAs
// per token; 1.3-3.5x the scalar kernel, whose dot products the compiler may not reorder into vectors.
template <int NT>
void rows_f32(const GemvArgs& a, int t0) {
  const int type = a.gguf, qk = kGgufQk[type], nb = a.K / qk, bb = kGgufBytes[type];
  alignas(32) float v[256];
  for (int r = 0; r < a.nrows; ++r) {
    const uint8_t* row = static_cast<const uint8_t*>(a.W) + r * a.ldb;
    __m256 acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
    for (int blk = 0; blk < nb; ++blk) {
      _mm_prefetch(reinterpret_cast<const char*>(row + blk * bb) + 1024, _MM_HINT_T1);
      if (type == kMxfp4Gguf) decode_mxfp4_8(row + blk * bb, v);
      else decode(type, row + blk * bb, v);
      for (int t = 0; t < NT; ++t) {
        const float* x = static_cast<const float*>(a.X[t0 + t]) + blk * qk;
        for (int k = 0; k < qk; k += 8) acc[t] = _mm256_fmadd_ps(_mm256_load_ps(v + k), _mm256_loadu_ps(x + k), acc[t]);
      }
    }
    for (int t = 0; t < NT; ++t) store(a, r, t0 + t, hsum(acc[t]));
  }
}

struct RowsF32 {
  template <int NT>
  static void run(const GemvArgs& a, int t0) { rows_f32<NT>(a, t0); }
};

void gemv_gguf(const GemvArgs& a) { token_passes<RowsF32>(a); }
}  // namespace avx2
#pragma GCC pop_options

static bool avx512_isa(const char* isa) { return std::strcmp(isa, "avx512bf16") == 0 || std::strcmp(isa, "avx512") == 0; }

GemvFn gguf_q8_kernel(const char* isa) {
  if (!isa || std::strcmp(isa, "scalar") == 0) return nullptr;  // the ISAs below scalar all have AVX2 + FMA
  if (avx512_isa(isa) && __builtin_cpu_supports("avx512vnni")) return avx512vnni::gemv_gguf_q8;
  return __builtin_cpu_supports("f16c") ? avx2::gemv_gguf_q8 : nullptr;
}

GemvFn gguf_kernel(const char* isa) {
  if (!isa) return nullptr;
  return avx512_isa(isa) ? avx512::gemv_gguf : std::strcmp(isa, "avx2") == 0 ? avx2::gemv_gguf : scalar::gemv_gguf;
}

}  // namespace tandem
