// Row-block GEMV micro-kernels of the CPU MoE executor, one set per ISA (chosen at run time).
//
// One call computes, for `nrows` weight rows W[r] (K elements, row stride ldw) and `ntok` input
// vectors X[t] (K elements each):
//     Y[t][r]  = dot(W[r], X[t])                 (scale == nullptr)
//     Y[t][r] += scale[t] * dot(W[r], X[t])      (scale != nullptr: the weighted down projection)
// Products accumulate in fp32. Each weight row block is loaded once and used for every token of the
// block, so at bs=1 the kernel is a pure stream over the expert's bytes (the point: DRAM bandwidth).
//
// FP8 (fp8_block banks): W holds float8_e4m3fn bytes and `wscale` the fp32 scales of 128x128 blocks:
// row r's block row is (srow0 + r) / 128, at wscale + that * lds; column k's block is k / 128. Each
// block's partial dot product is scaled once (fp32 accumulate), so the scale costs one FMA per block.
// Two FP8 kernels: fp32 X (exact products: fp32 models) and bf16 X (vdpbf16ps: bf16 models, ~3x the
// weights per cycle; the executor picks by the hidden states' dtype).
//
// MXFP4 (mxfp4 banks): W holds packed e2m1 values, two per byte (element 2j in the low nibble of byte j,
// 2j+1 in the high one; ldw and K still count elements), and `mxscale` one E8M0 byte per 32 values of
// a row: row r's at mxscale + r * K / 32, value 2^(s - 127). X comes *pair-split* per 32-block: the 16
// even elements of the block first, then the 16 odd ones (mxfp4_x_pos), so a byte's two nibbles meet
// their inputs at the same lane of two vectors and no nibble shuffle is needed. K is a multiple of 32.
// The bf16-input MXFP4 kernel (vdpbf16ps, bf16 models) takes X *nibble-split* per chunk of 4 blocks
// (128 elements, 64 bytes = 32 words of weights): the elements 4j (j = 0..31), then 4j + 1, 4j + 2,
// 4j + 3 (mxfp4_bx_pos); a row's last chunk of r < 4 blocks the same with 8r words.
//
// GGUF (q4_K, q5_K, q6_K, q8_0, mxfp4_gguf banks; gguf_gemv.cpp): W holds the file's blocks, `gguf` the
// type (GgufType), row r at W + r * ldb bytes (K counts values); X fp32 as is. Every type has a second
// kernel for bf16 models: X[t] points at q8_blocks(K) Q8Blocks (gguf_quantize_inputs), and the blocks' integer
// quants meet the inputs' int8 ones in vpdpbusd (AVX512-VNNI) or vpmaddubsw + vpmaddwd (AVX2).
#pragma once
#include <cstdint>

namespace tandem {

enum class WDtype : int { F32 = 0, BF16 = 1, FP8 = 2, MXFP4 = 3, GGUF = 4 };

// GGUF block types, numbered as services/engine/moe/gguf_quant.KERNEL_CODE (0: not GGUF)
enum GgufType : int { kQ4K = 1, kQ5K = 2, kQ6K = 3, kQ80 = 4, kMxfp4Gguf = 5 };
int64_t gguf_row_bytes(int type, int64_t cols);  // bytes of a row of `cols` values (a multiple of the block's)
int gguf_block_values(int type);                 // values per block: 256 (K-quants) or 32
int gguf_type_of_row(int64_t nbytes, int64_t cols);  // the type whose rows of `cols` values take nbytes; 0: none

// 256 inputs of a GGUF GEMV as int8 (reference: services/engine/moe/gguf_quant.q8_inputs): value v is
// d * q[pos(v)], q = round(v * 127 / amax) half to even, d = amax / 127. pos is the weight type's lane order:
// q4_K / q5_K swap bits 5 and 6 of the index, so one 64-byte vector of a block's quant bytes meets its
// inputs with the low nibbles (sub-blocks 4c + {0, 2}) in one vector and the high ones in the next; q6_K,
// q8_0 and mxfp4_gguf keep the natural order. The sums carry the K-quant blocks' offsets: q4_K / q5_K's mins,
// q6_K's -32 (q8_0 and mxfp4_gguf have none). A row of K values takes q8_blocks(K) blocks: K-quant rows are
// whole blocks, a 32-value type's may end in a partial one (gpt-oss: 2880 = 11.25 x 256), whose tail has its
// own amax and zeros past K.
struct alignas(64) Q8Block {
  int8_t q[256];
  float s16[16];  // d * sum of q over each 16 values (natural order)
  float s32[16];  // d * sum over each 32 values; lanes 8..15 zero (one vector against 8 mins)
  float d;
};
inline int64_t q8_blocks(int64_t K) { return (K + 255) / 256; }
void gguf_quantize_inputs(int type, const float* x, int64_t K, Q8Block* out);  // q8_blocks(K) blocks

constexpr int kFp8Block = 128;  // the fp8_block format's block edge (services/engine/moe/fp8.py BLOCK)
constexpr int kMxBlock = 32;    // values per E8M0 scale (services/engine/models/mxfp4.py BLOCK)

// Where element i of an MXFP4 GEMV's input vector sits in its pair-split layout (see above).
inline int64_t mxfp4_x_pos(int64_t i) { return (i & ~int64_t{31}) | ((i & 1) << 4) | ((i & 31) >> 1); }
// ... and in the bf16-input kernel's nibble-split layout of a vector of K elements.
inline int64_t mxfp4_bx_pos(int64_t i, int64_t K) {
  const int64_t chunk = i & ~int64_t{127};
  const int64_t words = (K - chunk >= 128 ? 128 : K - chunk) / 4;  // 32, or 8 per block of a short last chunk
  return chunk + (i & 3) * words + ((i & 127) >> 2);
}

struct GemvArgs {
  const void* W;        // weight rows, WDtype elements
  int64_t ldw;          // elements between consecutive rows
  int nrows;
  int K;
  const void* const* X; // ntok input pointers: bf16 (uint16) for the AVX-512-BF16 bf16 kernel, else fp32
  int ntok;
  float* const* Y;      // ntok output pointers, nrows floats each
  const float* scale;   // nullptr or ntok route weights
  const float* wscale = nullptr;  // FP8 only: the scale row of block row srow0 / 128 ...
  int64_t lds = 0;                // ... floats between block rows (ceil(K / 128))
  int srow0 = 0;                  // ... and the first row's index on the block grid
  const uint8_t* mxscale = nullptr;  // MXFP4 only: the first row's E8M0 bytes (K / 32 per row)
  int gguf = 0;                      // GGUF only: the rows' GgufType ...
  int64_t ldb = 0;                   // ... and the bytes between rows (>= gguf_row_bytes(gguf, K): padded slots)
};

using GemvFn = void (*)(const GemvArgs&);
using ReadFn = double (*)(const float* p, int64_t n);  // STREAM-style read: sum of n floats

// Kernels per ISA. `bf16_wants_bf16_x` says whether gemv_bf16 wants X in bf16 (only avx512bf16);
// gemv_fp8_bx always takes bf16 X, gemv_fp8 fp32 X.
struct IsaKernels {
  const char* name = nullptr;
  GemvFn gemv_f32 = nullptr;   // fp32 weights, fp32 X
  GemvFn gemv_bf16 = nullptr;  // bf16 weights
  GemvFn gemv_fp8 = nullptr;   // float8_e4m3fn weights with fp32 block scales, fp32 X (exact products)
  GemvFn gemv_fp8_bx = nullptr;  // the same weights with bf16 X (vdpbf16ps), or nullptr where the CPU has none
  bool bf16_wants_bf16_x = false;
  ReadFn read = nullptr;       // the CPU read ceiling's kernel (benchmarks)
  GemvFn gemv_mxfp4 = nullptr;  // packed e2m1 weights with E8M0 scales per 32, fp32 X pair-split
  GemvFn gemv_mxfp4_bx = nullptr;  // the same weights with bf16 X nibble-split (vdpbf16ps), or nullptr
  GemvFn gemv_gguf = nullptr;   // GGUF blocks (GemvArgs::gguf), fp32 X
  GemvFn gemv_gguf_q8 = nullptr;  // GGUF blocks with Q8Block X (AVX512-VNNI or AVX2), nullptr for scalar
};

GemvFn gguf_kernel(const char* isa);     // the GGUF kernel of an ISA (gguf_gemv.cpp)
GemvFn gguf_q8_kernel(const char* isa);  // ... and its int8-input kernel (every GGUF type), or nullptr

IsaKernels select_kernels(const char* force);

// Software prefetch in every GEMV's weight stream: `bytes` ahead at `level` (0 L1, 1 L2, 2 NTA);
// bytes <= 0 turns it off. Process-wide; set while no job runs.
void set_stream_prefetch(int bytes, int level);  // force: nullptr/"" = best supported, else an ISA name

}  // namespace tandem
