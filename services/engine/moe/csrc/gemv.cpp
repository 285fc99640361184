// Per-ISA GEMV micro-kernels (see gemv.h). Each ISA's code is compiled under its own
// `#pragma GCC target` region, so one portable build carries AVX-512-BF16, AVX-512, AVX2 and scalar
// code; select_kernels() picks one with __builtin_cpu_supports at run time.
//
// Register blocking: RB weight rows x TB tokens of fp32 accumulators. TB lets batches reuse each
// loaded weight vector TB times. RB is 1: rows are contiguous, so a thread walking its rows one by one
// reads one linear stream that the hardware prefetchers follow across pages; RB=4 (four 4 KB rows in
// parallel, each a new page-bounded stream) measured 43-50% of the read ceiling vs 58-100% for RB=1 on
// the (noisy, 2-core) development machine. The block code keeps RB generic for experiments.
#include "gemv.h"

#include <immintrin.h>
#include <algorithm>
#include <cstring>
#include <vector>

namespace tandem {

// Software prefetch into the weight stream, set once per process (set_stream_prefetch, from
// cpu_executor.STREAM_PREFETCH). The L2 streamer stops at 4 KB page boundaries and a gate_up row of D=2048 bf16
// is exactly one page, so each row would restart its training; a hint ahead keeps the next page's lines
// in flight. The level decides how many can be: prefetcht0 (l1) holds one of the core's ~16 L1 fill
// buffers per line until it lands, prefetcht1 (l2) only an entry of L2's ~48-deep queue.
static int g_prefetch_bytes = 4096;  // cpu_executor.STREAM_PREFETCH (4096:l2)
static int g_prefetch_level = 1;  // 0 l1 (T0), 1 l2 (T1), 2 nta, -1 off

void set_stream_prefetch(int bytes, int level) {
  g_prefetch_bytes = bytes;
  g_prefetch_level = bytes > 0 ? level : -1;
}

template <typename T>
static inline void prefetch_ahead(const T* p) {
  const char* q = reinterpret_cast<const char*>(p) + g_prefetch_bytes;
  switch (g_prefetch_level) {
    case 0: _mm_prefetch(q, _MM_HINT_T0); break;
    case 1: _mm_prefetch(q, _MM_HINT_T1); break;
    case 2: _mm_prefetch(q, _MM_HINT_NTA); break;
    default: break;
  }
}

static inline float bf16_to_f32(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// e4m3fn byte -> fp32 (sign, 4 exponent bits of bias 7, 3 mantissa bits; exponent 0 is subnormal,
// m * 2^-9; 0x7F/0xFF are NaN). The scalar kernel reads a 256-entry table built from this.
static float fp8_e4m3_to_f32(uint8_t b) {
  const uint32_t em = b & 0x7Fu;
  float f;
  if (em == 0x7Fu) {
    f = __builtin_nanf("");
  } else if ((em >> 3) == 0) {
    f = static_cast<float>(em) * (1.f / 512.f);
  } else {
    const uint32_t u = (((em >> 3) + 120u) << 23) | ((em & 7u) << 20);
    std::memcpy(&f, &u, 4);
  }
  return (b & 0x80u) ? -f : f;
}

// FP8 rows: the scale row of weight row r, and the store of one row's results for a token block.
static inline const float* fp8_scale_row(const GemvArgs& a, int r) {
  return a.wscale + static_cast<int64_t>((a.srow0 + r) / kFp8Block) * a.lds;
}
static inline void fp8_store(const GemvArgs& a, int r, int t0, int nt, const float* v) {
  for (int t = 0; t < nt; ++t) {
    float* y = a.Y[t0 + t] + r;
    if (a.scale) *y += a.scale[t0 + t] * v[t]; else *y = v[t];
  }
}
// The row loop of an FP8 kernel ROW<TB>(W, S, K, X, out[TB]): tokens in blocks of up to 4.
#define TANDEM_DEFINE_FP8_DRIVER(NAME, ROW)                                                        \
  static void NAME(const GemvArgs& a) {                                                           \
    const float* const* X = reinterpret_cast<const float* const*>(a.X);                          \
    for (int r = 0; r < a.nrows; ++r) {                                                           \
      const uint8_t* W = static_cast<const uint8_t*>(a.W) + (int64_t)r * a.ldw;                  \
      const float* S = fp8_scale_row(a, r);                                                       \
      float v[4];                                                                                 \
      int t0 = 0;                                                                                 \
      for (; t0 + 4 <= a.ntok; t0 += 4) { ROW<4>(W, S, a.K, X + t0, v); fp8_store(a, r, t0, 4, v); } \
      switch (a.ntok - t0) {                                                                      \
        case 3: ROW<3>(W, S, a.K, X + t0, v); fp8_store(a, r, t0, 3, v); break;                  \
        case 2: ROW<2>(W, S, a.K, X + t0, v); fp8_store(a, r, t0, 2, v); break;                  \
        case 1: ROW<1>(W, S, a.K, X + t0, v); fp8_store(a, r, t0, 1, v); break;                  \
        default: break;                                                                           \
      }                                                                                           \
    }                                                                                             \
  }

// The row/token block loop shared by every ISA. BLOCK<RB, TB>(W, ldw, K, X, tmp) writes
// tmp[t * RB + r] = dot(W[r], X[t]). Expanded inside each ISA's target region so the block inlines.
#define TANDEM_DEFINE_DRIVER(NAME, BLOCK, WT, XT, RBMAX, TBMAX)                                   \
  template <int TB>                                                                               \
  static void NAME##_rows(const GemvArgs& a, int r0, int t0) {                                    \
    const WT* W = static_cast<const WT*>(a.W) + (int64_t)r0 * a.ldw;                             \
    const XT* const* X = reinterpret_cast<const XT* const*>(a.X) + t0;                           \
    float tmp[RBMAX * TBMAX];                                                                     \
    int rb = std::min(RBMAX, a.nrows - r0);                                                       \
    if (rb == RBMAX) {                                                                            \
      BLOCK<RBMAX, TB>(W, a.ldw, a.K, X, tmp);                                                    \
    } else {                                                                                      \
      for (int r = 0; r < rb; ++r) {                                                              \
        float one[TBMAX];                                                                         \
        BLOCK<1, TB>(W + (int64_t)r * a.ldw, a.ldw, a.K, X, one);                                 \
        for (int t = 0; t < TB; ++t) tmp[t * RBMAX + r] = one[t];                                 \
      }                                                                                           \
    }                                                                                             \
    for (int t = 0; t < TB; ++t) {                                                                \
      float* y = a.Y[t0 + t] + r0;                                                                \
      if (a.scale) {                                                                              \
        const float s = a.scale[t0 + t];                                                          \
        for (int r = 0; r < rb; ++r) y[r] += s * tmp[t * RBMAX + r];                              \
      } else {                                                                                    \
        for (int r = 0; r < rb; ++r) y[r] = tmp[t * RBMAX + r];                                   \
      }                                                                                           \
    }                                                                                             \
  }                                                                                               \
  static void NAME(const GemvArgs& a) {                                                           \
    for (int r0 = 0; r0 < a.nrows; r0 += RBMAX) {                                                 \
      int t0 = 0;                                                                                 \
      for (; t0 + TBMAX <= a.ntok; t0 += TBMAX) NAME##_rows<TBMAX>(a, r0, t0);                    \
      switch (a.ntok - t0) {                                                                      \
        case 1: NAME##_rows<1>(a, r0, t0); break;                                                 \
        case 2: if (TBMAX > 2) NAME##_rows<(TBMAX > 2 ? 2 : 1)>(a, r0, t0); break;               \
        case 3: if (TBMAX > 3) NAME##_rows<(TBMAX > 3 ? 3 : 1)>(a, r0, t0); break;               \
        default: break;                                                                           \
      }                                                                                           \
    }                                                                                             \
  }

// ------------------------------------------------------------------------------------------------
// Scalar: any x86-64 (and the reference for what the vector code must equal within rounding).
namespace scalar {
template <int RB, int TB, typename WT>
static inline void block(const WT* W, int64_t ldw, int K, const float* const* X, float* out) {
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < TB; ++t) {
      float acc = 0.f;
      for (int k = 0; k < K; ++k) {
        float w;
        if constexpr (sizeof(WT) == 2) w = bf16_to_f32(W[r * ldw + k]); else w = W[r * ldw + k];
        acc += w * X[t][k];
      }
      out[t * RB + r] = acc;
    }
}
template <int RB, int TB> static inline void block_f32(const float* W, int64_t l, int K, const float* const* X, float* o) { block<RB, TB, float>(W, l, K, X, o); }
template <int RB, int TB> static inline void block_bf16(const uint16_t* W, int64_t l, int K, const float* const* X, float* o) { block<RB, TB, uint16_t>(W, l, K, X, o); }
TANDEM_DEFINE_DRIVER(gemv_f32, block_f32, float, float, 1, 1)
TANDEM_DEFINE_DRIVER(gemv_bf16, block_bf16, uint16_t, float, 1, 1)
struct Fp8Table {
  float v[256];
  Fp8Table() { for (int b = 0; b < 256; ++b) v[b] = fp8_e4m3_to_f32(static_cast<uint8_t>(b)); }
};
static const Fp8Table kFp8;
// One FP8 row against TB tokens: per 128-column block, a plain fp32 dot product, then one scale.
template <int TB>
static inline void fp8_row(const uint8_t* W, const float* S, int K, const float* const* X, float* out) {
  for (int t = 0; t < TB; ++t) {
    float acc = 0.f;
    for (int kb = 0; kb < K; kb += kFp8Block) {
      const int ke = std::min(K, kb + kFp8Block);
      float part = 0.f;
      for (int k = kb; k < ke; ++k) part += kFp8.v[W[k]] * X[t][k];
      acc += S[kb / kFp8Block] * part;
    }
    out[t] = acc;
  }
}
TANDEM_DEFINE_FP8_DRIVER(gemv_fp8, fp8_row)
static double read(const float* p, int64_t n) {
  float acc[8] = {0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) acc[k] += p[i + k];
  double s = 0;
  for (; i < n; ++i) s += p[i];
  for (int k = 0; k < 8; ++k) s += acc[k];
  return s;
}
}  // namespace scalar

// ------------------------------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const uint16_t* p) {
  __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
static inline float load1(const float* p) { return *p; }
static inline float load1(const uint16_t* p) { return bf16_to_f32(*p); }

template <int RB, int TB, typename WT>
static inline void block(const WT* W, int64_t ldw, int K, const float* const* X, float* out) {
  __m256 acc[RB][TB];
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < TB; ++t) acc[r][t] = _mm256_setzero_ps();
  int k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 x[TB];
    for (int t = 0; t < TB; ++t) x[t] = _mm256_loadu_ps(X[t] + k);
    for (int r = 0; r < RB; ++r) {
      if ((k * sizeof(WT)) % 64 == 0) prefetch_ahead(W + r * ldw + k);
      __m256 w = load8(W + r * ldw + k);
      for (int t = 0; t < TB; ++t) acc[r][t] = _mm256_fmadd_ps(w, x[t], acc[r][t]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < TB; ++t) {
      float s = hsum(acc[r][t]);
      for (int kk = k; kk < K; ++kk) s += load1(W + r * ldw + kk) * X[t][kk];
      out[t * RB + r] = s;
    }
}
template <int RB, int TB> static inline void block_f32(const float* W, int64_t l, int K, const float* const* X, float* o) { block<RB, TB, float>(W, l, K, X, o); }
template <int RB, int TB> static inline void block_bf16(const uint16_t* W, int64_t l, int K, const float* const* X, float* o) { block<RB, TB, uint16_t>(W, l, K, X, o); }
TANDEM_DEFINE_DRIVER(gemv_f32, block_f32, float, float, 1, 4)
TANDEM_DEFINE_DRIVER(gemv_bf16, block_bf16, uint16_t, float, 1, 4)
static double read(const float* p, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a0 = _mm256_add_ps(a0, _mm256_loadu_ps(p + i)); a1 = _mm256_add_ps(a1, _mm256_loadu_ps(p + i + 8));
    a2 = _mm256_add_ps(a2, _mm256_loadu_ps(p + i + 16)); a3 = _mm256_add_ps(a3, _mm256_loadu_ps(p + i + 24));
  }
  double s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; i < n; ++i) s += p[i];
  return s;
}
}  // namespace avx2
#pragma GCC pop_options

// ------------------------------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
namespace avx512 {
static inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
static inline __m512 load16(const uint16_t* p, __mmask16 m) {
  __m512i v = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
template <int RB, int TB, typename WT>
static inline void block(const WT* W, int64_t ldw, int K, const float* const* X, float* out) {
  __m512 acc[RB][TB];
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < TB; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int k = 0; k < K; k += 16) {
    const __mmask16 m = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
    __m512 x[TB];
    for (int t = 0; t < TB; ++t) x[t] = _mm512_maskz_loadu_ps(m, X[t] + k);
    for (int r = 0; r < RB; ++r) {
      if ((k * sizeof(WT)) % 64 == 0) prefetch_ahead(W + r * ldw + k);
      __m512 w = load16(W + r * ldw + k, m);
      for (int t = 0; t < TB; ++t) acc[r][t] = _mm512_fmadd_ps(w, x[t], acc[r][t]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < TB; ++t) out[t * RB + r] = _mm512_reduce_add_ps(acc[r][t]);
}
template <int RB, int TB> static inline void block_f32(const float* W, int64_t l, int K, const float* const* X, float* o) { block<RB, TB, float>(W, l, K, X, o); }
template <int RB, int TB> static inline void block_bf16(const uint16_t* W, int64_t l, int K, const float* const* X, float* o) { block<RB, TB, uint16_t>(W, l, K, X, o); }
TANDEM_DEFINE_DRIVER(gemv_f32, block_f32, float, float, 1, 4)
TANDEM_DEFINE_DRIVER(gemv_bf16, block_bf16, uint16_t, float, 1, 4)

// 32 e4m3fn bytes -> two fp16 vectors' bits, each value 2^-8 times its e4m3 value: shifted left by 7,
// the 4 exponent and 3 mantissa bits land on fp16's bits 13..7 (an e4m3 exponent of bias 7 reads as an
// fp16 exponent of bias 15) and the sign on bit 14, which adding bit 14 to itself carries to bit 15.
// vcvtph2ps then widens exactly (fp16 subnormals included, no denormal fp32 input anywhere); the 2^8
// is folded into the block scale. Three ALU ops per 32 weights besides the widenings, then two fp32 FMAs
// per 32 weights and token: the exact kernel for fp32 inputs (fp32 models); with bf16 inputs the
// avx512bf16_vbmi kernel below does the same work in a third of the cycles.
static inline __m512i fp8x32_as_fp16(const uint8_t* p, __mmask32 m) {
  const __m512i t = _mm512_slli_epi16(_mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(m, p)), 7);
  return _mm512_add_epi16(t, _mm512_and_si512(t, _mm512_set1_epi16(0x4000)));
}
template <int TB>
static inline void fp8_row(const uint8_t* W, const float* S, int K, const float* const* X, float* out) {
  __m512 acc[TB];
  for (int t = 0; t < TB; ++t) acc[t] = _mm512_setzero_ps();
  for (int kb = 0; kb < K; kb += kFp8Block) {
    const int ke = std::min(K, kb + kFp8Block);
    __m512 part[TB];
    for (int t = 0; t < TB; ++t) part[t] = _mm512_setzero_ps();
    for (int k = kb; k < ke; k += 32) {
      const __mmask32 m = ke - k >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (ke - k)) - 1);
      if (k % 64 == 0) prefetch_ahead(W + k);
      const __m512i h = fp8x32_as_fp16(W + k, m);
      const __m512 w0 = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
      const __m512 w1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
      const __mmask16 m0 = (__mmask16)(m & 0xFFFF), m1 = (__mmask16)(m >> 16);
      for (int t = 0; t < TB; ++t) {
        part[t] = _mm512_fmadd_ps(w0, _mm512_maskz_loadu_ps(m0, X[t] + k), part[t]);
        part[t] = _mm512_fmadd_ps(w1, _mm512_maskz_loadu_ps(m1, X[t] + k + 16), part[t]);
      }
    }
    const __m512 s = _mm512_set1_ps(S[kb / kFp8Block] * 256.f);  // x 2^8: see fp8x32_as_fp16
    for (int t = 0; t < TB; ++t) acc[t] = _mm512_fmadd_ps(part[t], s, acc[t]);
  }
  for (int t = 0; t < TB; ++t) out[t] = _mm512_reduce_add_ps(acc[t]);
}
TANDEM_DEFINE_FP8_DRIVER(gemv_fp8, fp8_row)

// The same loop as the probe `cpubw.c` (103 GB/s with 16 threads on the H200 host).
static double read(const float* p, int64_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    a0 = _mm512_add_ps(a0, _mm512_loadu_ps(p + i)); a1 = _mm512_add_ps(a1, _mm512_loadu_ps(p + i + 16));
    a2 = _mm512_add_ps(a2, _mm512_loadu_ps(p + i + 32)); a3 = _mm512_add_ps(a3, _mm512_loadu_ps(p + i + 48));
  }
  double s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  for (; i < n; ++i) s += p[i];
  return s;
}
}  // namespace avx512
#pragma GCC pop_options

// ------------------------------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")
namespace avx512bf16 {
// bf16 weights x bf16 inputs with vdpbf16ps: 32 products per instruction, exact products, fp32 sums.
// Two accumulators per (row, token), for even and odd 32-column chunks: one chain of vdpbf16ps (latency ~5)
// per 32 weights bounds a core at ~6 weights a cycle, near what its share of DRAM delivers.
template <int RB, int TB>
static inline void block(const uint16_t* W, int64_t ldw, int K, const uint16_t* const* X, float* out) {
  __m512 acc[2][RB][TB];
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < RB; ++r)
      for (int t = 0; t < TB; ++t) acc[h][r][t] = _mm512_setzero_ps();
  auto step = [&](int k, __mmask32 m, int h) {
    __m512bh x[TB];
    for (int t = 0; t < TB; ++t) x[t] = (__m512bh)_mm512_maskz_loadu_epi16(m, X[t] + k);
    for (int r = 0; r < RB; ++r) {
      prefetch_ahead(W + r * ldw + k);
      __m512bh w = (__m512bh)_mm512_maskz_loadu_epi16(m, W + r * ldw + k);
      for (int t = 0; t < TB; ++t) acc[h][r][t] = _mm512_dpbf16_ps(acc[h][r][t], w, x[t]);
    }
  };
  int k = 0;
  for (; k + 64 <= K; k += 64) {
    step(k, 0xFFFFFFFFu, 0);
    step(k + 32, 0xFFFFFFFFu, 1);
  }
  for (; k < K; k += 32) step(k, K - k >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (K - k)) - 1), 0);
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < TB; ++t) out[t * RB + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][r][t], acc[1][r][t]));
}
TANDEM_DEFINE_DRIVER(gemv_bf16, block, uint16_t, uint16_t, 1, 4)
}  // namespace avx512bf16
#pragma GCC pop_options

// ------------------------------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,fma")
namespace avx512bf16_vbmi {
// FP8 weights x bf16 inputs with vdpbf16ps. Every e4m3fn value is a bf16 value (4 significant bits,
// exponents 2^-9..2^8), so the widening is exact and the products are exact in fp32, like the bf16 kernel's.
// The widening is two table lookups per 64 weights: vpermi2b reads a 128-entry byte table indexed by each
// code's low 7 bits (exponent and mantissa; it ignores bit 7), one table for the bf16 value's low byte and
// one for its high byte less the sign; the sign is OR-ed in from the code, and vpunpck{l,h}bw pair the
// bytes into 2 x 32 bf16 words. Five shuffle/logic ops per 64 weights, against the AVX-512 kernel's
// ~12 per 64 (widen, two shifts, fp16 -> fp32 twice) and its two fp32 FMAs per 32 weights: on the H200
// host's Xeon that kernel turned 2.4 G weights/s per core, a third of what a core's share of DRAM holds.
// The unpacks interleave within 16-byte lanes, so the words come out in a fixed order other than k's; the
// inputs are put in the same order once per call (perm_inputs), which costs 2 ops per 64 inputs per token
// against 5 per 64 weights per row.
struct Fp8Bf16Tables {
  alignas(64) uint8_t lo[128];  // bf16 bits 7..0 of code c (c < 128)
  alignas(64) uint8_t hi[128];  // bf16 bits 14..8 (bit 15, the sign, is the code's bit 7)
  alignas(64) uint16_t perm_lo[32];  // word p of the unpacklo half holds weight 16 (p / 8) + p % 8 of 64
  alignas(64) uint16_t perm_hi[32];  // ... of the unpackhi half: 16 (p / 8) + 8 + p % 8
  Fp8Bf16Tables() {
    for (int c = 0; c < 128; ++c) {
      const float f = fp8_e4m3_to_f32(static_cast<uint8_t>(c));  // exact; code 0x7F: a quiet NaN
      uint32_t u;
      std::memcpy(&u, &f, 4);
      lo[c] = static_cast<uint8_t>(u >> 16);
      hi[c] = static_cast<uint8_t>(u >> 24);
    }
    for (int p = 0; p < 32; ++p) {
      perm_lo[p] = static_cast<uint16_t>(16 * (p / 8) + p % 8);
      perm_hi[p] = static_cast<uint16_t>(16 * (p / 8) + 8 + p % 8);
    }
  }
};
static const Fp8Bf16Tables kTab;

static inline __mmask64 mask64(int n) { return n >= 64 ? ~0ULL : (1ULL << n) - 1; }

// 64 codes -> (w0, w1): 32 bf16 each, in the order perm_lo / perm_hi name.
static inline void fp8x64_as_bf16(__m512i b, __m512i lo0, __m512i lo1, __m512i hi0, __m512i hi1,
                                  __m512i& w0, __m512i& w1) {
  const __m512i lo = _mm512_permutex2var_epi8(lo0, b, lo1);
  const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, b, hi1), b,
                                               _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // hi | (b & 0x80)
  w0 = _mm512_unpacklo_epi8(lo, hi);
  w1 = _mm512_unpackhi_epi8(lo, hi);
}

// X[t][0, K) (bf16) -> P + t * Kp in the weights' order per 64-element chunk (zeros past K: the weights
// there load as code 0, and 0 x 0 keeps the sum).
static void perm_inputs(const uint16_t* const* X, int ntok, int K, int Kp, uint16_t* P) {
  const __m512i ilo = _mm512_load_si512(kTab.perm_lo), ihi = _mm512_load_si512(kTab.perm_hi);
  for (int t = 0; t < ntok; ++t)
    for (int k = 0; k < K; k += 64) {
      const int n = K - k;
      const __m512i x0 = _mm512_maskz_loadu_epi16(n >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << n) - 1), X[t] + k);
      const __m512i x1 = n > 32 ? _mm512_maskz_loadu_epi16(n >= 64 ? 0xFFFFFFFFu : (__mmask32)((1u << (n - 32)) - 1), X[t] + k + 32)
                                : _mm512_setzero_si512();
      _mm512_store_si512(P + (int64_t)t * Kp + k, _mm512_permutex2var_epi16(x0, ilo, x1));
      _mm512_store_si512(P + (int64_t)t * Kp + k + 32, _mm512_permutex2var_epi16(x0, ihi, x1));
    }
}

// One FP8 row against TB tokens (P: the permuted inputs, row stride Kp): per 128-column block two fp32
// partial sums (the unpacklo and unpackhi halves: two independent vdpbf16ps chains), then one scale FMA.
template <int TB>
static inline void fp8_row(const uint8_t* W, const float* S, int K, const uint16_t* P, int Kp, float* out) {
  const __m512i lo0 = _mm512_load_si512(kTab.lo), lo1 = _mm512_load_si512(kTab.lo + 64);
  const __m512i hi0 = _mm512_load_si512(kTab.hi), hi1 = _mm512_load_si512(kTab.hi + 64);
  __m512 acc[TB];
  for (int t = 0; t < TB; ++t) acc[t] = _mm512_setzero_ps();
  for (int kb = 0; kb < K; kb += kFp8Block) {
    const int ke = std::min(K, kb + kFp8Block);
    __m512 p0[TB], p1[TB];
    for (int t = 0; t < TB; ++t) p0[t] = p1[t] = _mm512_setzero_ps();
    auto chunk = [&](int k, __m512i b) {
      __m512i w0, w1;
      fp8x64_as_bf16(b, lo0, lo1, hi0, hi1, w0, w1);
      for (int t = 0; t < TB; ++t) {
        const uint16_t* x = P + (int64_t)t * Kp + k;
        p0[t] = _mm512_dpbf16_ps(p0[t], (__m512bh)w0, (__m512bh)_mm512_load_si512(x));
        p1[t] = _mm512_dpbf16_ps(p1[t], (__m512bh)w1, (__m512bh)_mm512_load_si512(x + 32));
      }
    };
    if (ke - kb == kFp8Block) {  // a whole block: two unmasked chunks
      prefetch_ahead(W + kb);
      prefetch_ahead(W + kb + 64);
      chunk(kb, _mm512_loadu_si512(W + kb));
      chunk(kb + 64, _mm512_loadu_si512(W + kb + 64));
    } else {
      for (int k = kb; k < ke; k += 64) chunk(k, _mm512_maskz_loadu_epi8(mask64(ke - k), W + k));
    }
    const __m512 s = _mm512_set1_ps(S[kb / kFp8Block]);
    for (int t = 0; t < TB; ++t) acc[t] = _mm512_fmadd_ps(_mm512_add_ps(p0[t], p1[t]), s, acc[t]);
  }
  for (int t = 0; t < TB; ++t) out[t] = _mm512_reduce_add_ps(acc[t]);
}

static void gemv_fp8(const GemvArgs& a) {
  const int Kp = (a.K + 63) / 64 * 64;
  thread_local std::vector<uint16_t> buf;  // [ntok, Kp] + alignment: this call's permuted inputs
  if (buf.size() < (size_t)a.ntok * Kp + 32) buf.resize((size_t)a.ntok * Kp + 32);
  uint16_t* P = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
  perm_inputs(reinterpret_cast<const uint16_t* const*>(a.X), a.ntok, a.K, Kp, P);
  for (int r = 0; r < a.nrows; ++r) {
    const uint8_t* W = static_cast<const uint8_t*>(a.W) + (int64_t)r * a.ldw;
    const float* S = fp8_scale_row(a, r);
    float v[4];
    int t0 = 0;
    for (; t0 + 4 <= a.ntok; t0 += 4) { fp8_row<4>(W, S, a.K, P + (int64_t)t0 * Kp, Kp, v); fp8_store(a, r, t0, 4, v); }
    switch (a.ntok - t0) {
      case 3: fp8_row<3>(W, S, a.K, P + (int64_t)t0 * Kp, Kp, v); fp8_store(a, r, t0, 3, v); break;
      case 2: fp8_row<2>(W, S, a.K, P + (int64_t)t0 * Kp, Kp, v); fp8_store(a, r, t0, 2, v); break;
      case 1: fp8_row<1>(W, S, a.K, P + (int64_t)t0 * Kp, Kp, v); fp8_store(a, r, t0, 1, v); break;
      default: break;
    }
  }
}
}  // namespace avx512bf16_vbmi
#pragma GCC pop_options

// MXFP4 (gemv.h): one row of packed e2m1 bytes against TB pair-split fp32 inputs. Per 32-value block the
// 16 bytes widen to 16 int32 lanes; vpermps reads only an index's low 4 bits, so the lanes index the
// 16-entry e2m1 table as they are (the low nibbles, element 2j) and shifted right by 4 (the high ones,
// 2j+1) with no masking; the block's E8M0 scale multiplies the table once (2^(s-127) is the fp32 whose
// exponent field is s: kE8m0 holds the 256 of them, read by a broadcast load, no exp2, no port-5 move),
// so each block costs 1 widen + 1 shift + 1 mul + 2 vpermps, then 2 FMAs per token, ~3 port-5 ops
// (widen, 2 vpermps) per 16 bytes. Two blocks per step feed four FMA chains (one FMA's latency per
// block otherwise bounds a token's row). Measured on the 2-core (shared, Zen 5) development box in L2:
// ~12 G weights/s per core, ~6.4 GB/s of MXFP4: a core's share of the H200 host's DRAM (103 GB/s over
// 15 workers) is ~6.9 GB/s.
// E8M0 s = 0 reads as 0 (2^-127 times at most 6 is below fp32's normal range) and s = 255 (NaN in the OCP
// spec, never in a checkpoint) as infinity.
#define TANDEM_DEFINE_MXFP4_DRIVER(NAME, ROW)                                                      \
  static void NAME(const GemvArgs& a) {                                                           \
    const float* const* X = reinterpret_cast<const float* const*>(a.X);                          \
    const int nb = a.K / kMxBlock;                                                                \
    for (int r = 0; r < a.nrows; ++r) {                                                           \
      const uint8_t* W = static_cast<const uint8_t*>(a.W) + (int64_t)r * (a.ldw / 2);            \
      const uint8_t* S = a.mxscale + (int64_t)r * nb;                                             \
      float v[4];                                                                                 \
      int t0 = 0;                                                                                 \
      for (; t0 + 4 <= a.ntok; t0 += 4) { ROW<4>(W, S, nb, X + t0, v); fp8_store(a, r, t0, 4, v); } \
      switch (a.ntok - t0) {                                                                      \
        case 3: ROW<3>(W, S, nb, X + t0, v); fp8_store(a, r, t0, 3, v); break;                   \
        case 2: ROW<2>(W, S, nb, X + t0, v); fp8_store(a, r, t0, 2, v); break;                   \
        case 1: ROW<1>(W, S, nb, X + t0, v); fp8_store(a, r, t0, 1, v); break;                   \
        default: break;                                                                           \
      }                                                                                           \
    }                                                                                             \
  }

static const float kE2m1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

static inline float e8m0_to_f32(uint8_t s) {
  const uint32_t u = static_cast<uint32_t>(s) << 23;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
struct E8m0Table {
  float v[256];
  E8m0Table() { for (int s = 0; s < 256; ++s) v[s] = e8m0_to_f32(static_cast<uint8_t>(s)); }
};
static const E8m0Table kE8m0;

namespace scalar {
template <int TB>
static inline void mxfp4_row(const uint8_t* W, const uint8_t* S, int nb, const float* const* X, float* out) {
  for (int t = 0; t < TB; ++t) {
    float acc = 0.f;
    for (int b = 0; b < nb; ++b) {
      const uint8_t* w = W + b * (kMxBlock / 2);
      const float* x = X[t] + b * kMxBlock;  // pair-split: x[j] meets byte j's low nibble, x[16 + j] its high
      float part = 0.f;
      for (int j = 0; j < kMxBlock / 2; ++j) part += kE2m1[w[j] & 15] * x[j] + kE2m1[w[j] >> 4] * x[16 + j];
      acc += kE8m0.v[S[b]] * part;
    }
    out[t] = acc;
  }
}
TANDEM_DEFINE_MXFP4_DRIVER(gemv_mxfp4, mxfp4_row)
}  // namespace scalar

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
namespace avx512 {
template <int TB>
static inline void mxfp4_row(const uint8_t* W, const uint8_t* S, int nb, const float* const* X, float* out) {
  const __m512 table = _mm512_loadu_ps(kE2m1);
  __m512 acc[TB][4];  // even / odd halves of even / odd blocks apart: four FMA chains per token
  for (int t = 0; t < TB; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = _mm512_setzero_ps();
  auto step = [&](int b, int c) {  // block b into chains c, c + 1
    const uint8_t* w = W + b * (kMxBlock / 2);
    const __m512i lanes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    const __m512 scaled = _mm512_mul_ps(table, _mm512_set1_ps(kE8m0.v[S[b]]));
    const __m512 w_even = _mm512_permutexvar_ps(lanes, scaled);                         // low nibbles
    const __m512 w_odd = _mm512_permutexvar_ps(_mm512_srli_epi32(lanes, 4), scaled);    // high nibbles
    for (int t = 0; t < TB; ++t) {
      const float* x = X[t] + b * kMxBlock;
      acc[t][c] = _mm512_fmadd_ps(w_even, _mm512_loadu_ps(x), acc[t][c]);
      acc[t][c + 1] = _mm512_fmadd_ps(w_odd, _mm512_loadu_ps(x + 16), acc[t][c + 1]);
    }
  };
  int b = 0;
  for (; b + 2 <= nb; b += 2) {
    if ((b & 3) == 0) prefetch_ahead(W + b * (kMxBlock / 2));  // once per 64 bytes
    step(b, 0);
    step(b + 1, 2);
  }
  if (b < nb) step(b, 0);
  for (int t = 0; t < TB; ++t)
    out[t] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[t][0], acc[t][1]), _mm512_add_ps(acc[t][2], acc[t][3])));
}
TANDEM_DEFINE_MXFP4_DRIVER(gemv_mxfp4, mxfp4_row)
}  // namespace avx512
#pragma GCC pop_options

// MXFP4 with bf16 inputs (bf16 models, AVX-512-BF16): four blocks (64 bytes, 128 weights) per chunk, read
// as 32 words with no widening. vpermw reads an index's low 5 bits, so a 32-entry table (the 16 bf16 e2m1
// values twice) decodes nibble 0 of every word as it is, and nibbles 1, 2, 3 after word shifts by 4, 8, 12
// (bits above the nibble's 4 are ignored or zero). Word j of a chunk holds elements 4j..4j+3, so the
// inputs come *nibble-split* per chunk (mxfp4_bx_pos). Four vdpbf16ps per token put 128 exact products
// into 16 fp32 lanes, 4 lanes per block, and one FMA applies the four scales: the chunk's 4 E8M0 bytes,
// one dword broadcast, vpshufb'd to byte q of 128-bit lane q and shifted to the exponent field (2^(s-127)
// is the fp32 whose exponent field is s). Per 128 weights: 1 load + 3 shifts + 4 vpermw to decode, 1
// broadcast + vpshufb + shift for the scales, 4 vdpbf16ps and 1 FMA per token: ~17 ops and 5 port-5 ops
// besides loop and prefetch, against ~60 instructions (2 widening loads, 4 vpermw, 4 scale loads, 2 masked
// broadcasts, 2 FMAs, scalar index math) for the former kernel's two 32-byte steps, whose two accumulators,
// picked by a run-time index, lived on the stack (a store and a reload per step). Products are
// exact (bf16 e2m1 times a bf16 input); the inputs are what is rounded: the hidden state is bf16 already
// in a bf16 model, the SwiGLU output is rounded to bf16 as the GPU's bf16 path does.
static const uint16_t kE2m1Bf16[32] = {
    0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
    0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0,
    0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
    0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};

#define TANDEM_DEFINE_MXFP4_BX_DRIVER(NAME, ROW)                                                   \
  static void NAME(const GemvArgs& a) {                                                           \
    const uint16_t* const* X = reinterpret_cast<const uint16_t* const*>(a.X);                    \
    const int nb = a.K / kMxBlock;                                                                \
    for (int r = 0; r < a.nrows; ++r) {                                                           \
      const uint8_t* W = static_cast<const uint8_t*>(a.W) + (int64_t)r * (a.ldw / 2);            \
      const uint8_t* S = a.mxscale + (int64_t)r * nb;                                             \
      float v[4];                                                                                 \
      int t0 = 0;                                                                                 \
      for (; t0 + 4 <= a.ntok; t0 += 4) { ROW<4>(W, S, nb, X + t0, v); fp8_store(a, r, t0, 4, v); } \
      switch (a.ntok - t0) {                                                                      \
        case 3: ROW<3>(W, S, nb, X + t0, v); fp8_store(a, r, t0, 3, v); break;                   \
        case 2: ROW<2>(W, S, nb, X + t0, v); fp8_store(a, r, t0, 2, v); break;                   \
        case 1: ROW<1>(W, S, nb, X + t0, v); fp8_store(a, r, t0, 1, v); break;                   \
        default: break;                                                                           \
      }                                                                                           \
    }                                                                                             \
  }

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")
namespace avx512bf16_mx {
// One chunk of r blocks (r = 4, or 1..3 for a row's last chunk: masked loads, the absent words decode to
// 0 and meet zero inputs; the absent scales read 0, so no inf x 0) at W, S against TB tokens' inputs at
// X[t] (nibble-split: vector q of the chunk, the elements 4j + q, at X[t] + q * 8r), FMA'd into acc[t].
template <int TB, bool kFull>
static inline void mxfp4_bx_chunk(const uint8_t* W, const uint8_t* S, int r, const uint16_t* const* X, int64_t x0,
                                  const __m512i table, __m512* acc) {
  const __mmask32 m = kFull ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (8 * r)) - 1);
  const __m512i words = kFull ? _mm512_loadu_si512(W) : _mm512_maskz_loadu_epi16(m, W);
  const __m512bh n0 = (__m512bh)_mm512_permutexvar_epi16(words, table);
  const __m512bh n1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), table);
  const __m512bh n2 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(words, 8), table);
  const __m512bh n3 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(words, 12), table);
  int32_t s4;  // the chunk's scale bytes
  if (kFull) std::memcpy(&s4, S, 4);
  else s4 = _mm_cvtsi128_si32(_mm_maskz_loadu_epi8((__mmask16)((1u << r) - 1), S));
  // fp32 lanes 4q..4q+3 (128-bit lane q) hold block q's sums: its scale byte into each dword's low byte
  const __m512i spread = _mm512_set_epi32(0x80808003, 0x80808003, 0x80808003, 0x80808003, 0x80808002, 0x80808002,
                                          0x80808002, 0x80808002, 0x80808001, 0x80808001, 0x80808001, 0x80808001,
                                          0x80808000, 0x80808000, 0x80808000, 0x80808000);
  const __m512 sv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_shuffle_epi8(_mm512_set1_epi32(s4), spread), 23));
  const int n = kFull ? 32 : 8 * r;  // words per input vector
  auto load = [&](const uint16_t* x) { return (__m512bh)(kFull ? _mm512_loadu_si512(x) : _mm512_maskz_loadu_epi16(m, x)); };
  for (int t = 0; t < TB; ++t) {
    const uint16_t* x = X[t] + x0;
    __m512 part = _mm512_dpbf16_ps(_mm512_setzero_ps(), n0, load(x));
    part = _mm512_dpbf16_ps(part, n1, load(x + n));
    part = _mm512_dpbf16_ps(part, n2, load(x + 2 * n));
    part = _mm512_dpbf16_ps(part, n3, load(x + 3 * n));
    acc[t] = _mm512_fmadd_ps(part, sv, acc[t]);
  }
}

template <int TB>
static inline void mxfp4_bx_row(const uint8_t* W, const uint8_t* S, int nb, const uint16_t* const* X, float* out) {
  const __m512i table = _mm512_loadu_si512(kE2m1Bf16);
  __m512 acc[2][TB];  // alternate chunks: two FMA chains per token
  for (int t = 0; t < TB; ++t) acc[0][t] = acc[1][t] = _mm512_setzero_ps();
  int b = 0;
  for (; b + 8 <= nb; b += 8) {  // two chunks, two cache lines
    const uint8_t* w = W + b * (kMxBlock / 2);
    prefetch_ahead(w);
    prefetch_ahead(w + 64);
    mxfp4_bx_chunk<TB, true>(w, S + b, 4, X, b * kMxBlock, table, acc[0]);
    mxfp4_bx_chunk<TB, true>(w + 64, S + b + 4, 4, X, (b + 4) * kMxBlock, table, acc[1]);
  }
  if (b + 4 <= nb) {
    prefetch_ahead(W + b * (kMxBlock / 2));
    mxfp4_bx_chunk<TB, true>(W + b * (kMxBlock / 2), S + b, 4, X, b * kMxBlock, table, acc[0]);
    b += 4;
  }
  if (b < nb) mxfp4_bx_chunk<TB, false>(W + b * (kMxBlock / 2), S + b, nb - b, X, b * kMxBlock, table, acc[1]);
  for (int t = 0; t < TB; ++t) out[t] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][t], acc[1][t]));
}
TANDEM_DEFINE_MXFP4_BX_DRIVER(gemv_mxfp4_bx, mxfp4_bx_row)
}  // namespace avx512bf16_mx
#pragma GCC pop_options

// The MXFP4 kernels of an ISA (set apart from the table below: AVX-512 and AVX-512-BF16 share the fp32-input
// one; AVX2 hosts take the scalar one, like FP8; the bf16-input one needs AVX-512-BF16).
static GemvFn mxfp4_kernel(const char* isa) {
  if (!isa) return nullptr;
  const bool has512 = std::strcmp(isa, "avx512bf16") == 0 || std::strcmp(isa, "avx512") == 0;
  return has512 ? avx512::gemv_mxfp4 : scalar::gemv_mxfp4;
}
static GemvFn mxfp4_bx_kernel(const char* isa) {
  return isa && std::strcmp(isa, "avx512bf16") == 0 ? avx512bf16_mx::gemv_mxfp4_bx : nullptr;
}

static bool cpu_has_avx512bf16() {
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 12
  unsigned a = 0, b = 0, c = 0, d = 0;  // old GCC lacks the name: CPUID leaf 7 subleaf 1, EAX bit 5
  if (!__builtin_cpu_supports("avx512f")) return false;
  __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(1));
  return (a >> 5) & 1;
#else
  return __builtin_cpu_supports("avx512bf16");
#endif
}

static IsaKernels select_table(const char* force);

IsaKernels select_kernels(const char* force) {
  IsaKernels k = select_table(force);
  k.gemv_mxfp4 = mxfp4_kernel(k.name);
  k.gemv_mxfp4_bx = mxfp4_bx_kernel(k.name);
  k.gemv_gguf = gguf_kernel(k.name);
  k.gemv_gguf_q8 = gguf_q8_kernel(k.name);
  return k;
}

static IsaKernels select_table(const char* force) {
  __builtin_cpu_init();
  const bool has512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  const bool has_bf16 = has512 && cpu_has_avx512bf16();
  const bool has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  // FP8 x bf16 inputs needs VBMI beside BF16 (Sapphire Rapids and later, Zen 4 and later; not Cooper Lake)
  const GemvFn fp8_bx = has_bf16 && __builtin_cpu_supports("avx512vbmi") ? avx512bf16_vbmi::gemv_fp8 : nullptr;
  const IsaKernels table[] = {
      // FP8 with fp32 inputs has an AVX-512 kernel and the scalar one (no AVX2 FP8 kernel: hosts that serve
      // FP8 experts from the CPU at speed have AVX-512)
      {"avx512bf16", avx512::gemv_f32, avx512bf16::gemv_bf16, avx512::gemv_fp8, fp8_bx, true, avx512::read},
      {"avx512", avx512::gemv_f32, avx512::gemv_bf16, avx512::gemv_fp8, nullptr, false, avx512::read},
      {"avx2", avx2::gemv_f32, avx2::gemv_bf16, scalar::gemv_fp8, nullptr, false, avx2::read},
      {"scalar", scalar::gemv_f32, scalar::gemv_bf16, scalar::gemv_fp8, nullptr, false, scalar::read},
  };
  const bool ok[] = {has_bf16, has512, has2, true};
  for (int i = 0; i < 4; ++i) {
    if (force && *force) {
      if (std::strcmp(force, table[i].name) == 0) return ok[i] ? table[i] : IsaKernels{};
    } else if (ok[i]) {
      return table[i];
    }
  }
  return IsaKernels{};
}

}  // namespace tandem
