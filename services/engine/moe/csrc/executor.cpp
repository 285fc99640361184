// CPU MoE executor: a persistent pool of pinned worker threads computing one layer's routed experts
// (SwiGLU, fp32 accumulation) straight from the host banks.
//
// Dimension legend: T tokens · A routes per token · E experts · D hidden · I expert intermediate ·
// R valid routes (ids >= 0) · G distinct experts among them.
//
// One job = three phases separated by spin barriers:
//   0. thread 0 waits for the inputs (an optional pinned "ready" flag the GPU stream writes after its
//      device-to-host copies), groups the R routes by expert and converts the inputs;
//   1. gate_up: the G*I (gate row, up row) pairs are split evenly over the threads — at bs=1 that is
//      parallelism *inside* each expert GEMV, so all cores stream expert bytes; SwiGLU is fused;
//   2. down: the D output rows are split over the threads; each thread sums its rows over all experts.
// submit() returns at once; wait() blocks (GIL released) until the job is done.
//
// Why one file of ~800 lines: the pool, the job protocol, the CUDA handoffs and loop mode all touch the
// same private job state and barriers; splitting them would expose that state across headers. The
// ISA kernels themselves live apart (gemv.h / gemv.cpp).
//
// Three ways to feed jobs besides submit():
//   - eager device handoff (device_submit / device_sync): one call enqueues the device-to-host input
//     copies and the ready flag's copy on the caller's CUDA stream through the driver API, and one
//     call waits and enqueues the result's upload (cuda_driver.h says why not torch ops);
//   - graph mode (start_polling): worker 0 itself watches a pinned job word the GPU writes (no extra
//     thread: a spinning poller beside one spinning worker per core oversubscribes the cores and
//     time-slices every layer);
//   - loop mode (start_loop): jobs back to back on the workers until stop_loop(), for measuring the
//     executor's bandwidth while something else (PCIe copies) runs, with no Python in the loop.
#include <torch/extension.h>

#include <pthread.h>
#include <sched.h>
#include <sys/prctl.h>
#include <immintrin.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "cuda_driver.h"
#include "gemv.h"

namespace tandem {

using Banks = std::vector<torch::Tensor>;  // one layer's banks in the bank schema's order (banks.py)

static inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

static inline uint16_t f32_to_bf16(float f) {  // round to nearest even (NaN kept quiet)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// fp32 or bf16 tensor -> fp32 array (dtype checked once, not per element: this runs on thread 0
// while the others wait at the barrier)
static void to_f32(const torch::Tensor& t, int64_t n, float* dst) {
  if (t.scalar_type() == torch::kFloat32) {
    std::memcpy(dst, t.data_ptr<float>(), n * sizeof(float));
    return;
  }
  const uint16_t* src = reinterpret_cast<const uint16_t*>(t.data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &u, 4);
  }
}

// Sense-reversing spin barrier: a phase change costs ~1 µs, a futex round trip ~10× that.
class SpinBarrier {
 public:
  void reset(int n) { n_ = n; count_.store(0); }
  void wait() {
    const int gen = gen_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
      count_.store(0, std::memory_order_relaxed);
      gen_.fetch_add(1, std::memory_order_release);
      return;
    }
    // yield now and then: with more workers than free cores (CI) a pure spin waits out whole time slices
    for (int spins = 1; gen_.load(std::memory_order_acquire) == gen; ++spins) {
      _mm_pause();
      if (spins % 1024 == 0) sched_yield();
    }
  }
 private:
  int n_ = 1;
  std::atomic<int> count_{0};
  std::atomic<int> gen_{0};
};

struct Job {
  bool read_only = false;            // STREAM-style read job (read_bandwidth), not a MoE layer
  std::vector<double> read_sums;     // [threads]
  // inputs (kept alive by the Python wrapper until wait() returns)
  torch::Tensor hidden, ids, weights, gate_up, down, out, ready;
  torch::Tensor gate_up_scale, down_scale;  // fp8_block: fp32 [E, 2*ceil(I/128), ceil(D/128)], [E, ceil(D/128), ceil(I/128)]
                                            // mxfp4: E8M0 uint8 [E, 2I, D/32], [E, D, I/32]
  int64_t ready_value = 0;
  int T = 0, A = 0, D = 0, I = 0, E = 0;
  WDtype wdt = WDtype::F32;
  int gu_gguf = 0, dn_gguf = 0;      // GGUF: gate_up's and down's GgufType (they may differ), else 0
  int64_t gu_ldb = 0, dn_ldb = 0;    // GGUF: bytes between rows (>= the type's row bytes: padded slots)
  bool bf16_inputs = false;          // the GEMVs take bf16 inputs (x_bf16, act_bf16), else fp32
  bool q8_inputs = false;            // GGUF experts of a bf16 model: int8 inputs (x_q8, act_q8; gemv.h Q8Block)
  // scratch, sized in submit() for the worst case R = T*A
  std::vector<int> count;            // [E]
  std::vector<int> group_expert;     // [G]
  std::vector<int> group_start;      // [G+1] into the route arrays
  std::vector<int> route_tok;        // [R] token of each route, grouped by expert
  std::vector<float> route_w;        // [R]
  std::vector<float> w_f32;          // [T, A] the route weights in fp32
  std::vector<float> x_f32;          // [T, D] (mxfp4: pair-split per 32, gemv.h)
  std::vector<uint16_t> x_bf16;      // [T, D]
  std::vector<float> h;              // [R, 2I] gate then up outputs
  std::vector<float> act_f32;        // [R, I] (mxfp4: pair-split per 32)
  std::vector<uint16_t> act_bf16;    // [R, I]
  std::vector<Q8Block> x_q8;         // [T, q8_blocks(D)]
  std::vector<Q8Block> act_q8;       // [R, q8_blocks(I)]
  std::unique_ptr<std::atomic<int>[]> act_filled;  // [G, q8_blocks(I)] SwiGLU outputs written per block of act_q8
  size_t act_filled_cap = 0;
  std::vector<const void*> x_ptr;    // [R] phase-1 inputs per route
  std::vector<const void*> act_ptr;  // [R] phase-2 inputs per route
  std::vector<float*> h_ptr;         // [R]
  std::vector<float*> out_ptr;       // [R]
  int G = 0, R = 0;
  // gpt-oss experts (set_expert_math): biases in the bank dtype, gate_up_bias [E, 2I] (gate then up) and
  // down_bias [E, D]; the clamped SwiGLU (up.clamp(+-limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)
  const void* gate_up_bias = nullptr;
  const void* down_bias = nullptr;
  bool bias_bf16 = false;  // the biases' dtype: the model's (bf16 or fp32), also beside mxfp4 banks
  bool clamped = false;
  float alpha = 0.f, limit = 0.f;
  std::string error;
  int64_t t_ready_ns = 0, t_done_ns = 0;
  // loop mode: `ids` holds [rows, T, A]; each job reads row `loop_row` (element offset ids_offset)
  bool loop = false, again = false;
  int64_t ids_offset = 0, loop_row = 0, loop_rows = 1;
};

class Executor {
 public:
  Executor(std::vector<int64_t> cpus, int64_t num_threads, int64_t spin_us, std::string isa)
      : n_(static_cast<int>(num_threads)), spin_ns_(spin_us * 1000) {
    TORCH_CHECK(n_ >= 1, "cpu executor: num_threads must be >= 1, got ", num_threads);
    k_ = select_kernels(isa.c_str());
    TORCH_CHECK(k_.name != nullptr, "cpu executor: ISA '", isa, "' is not supported by this CPU");
    barrier_.reset(n_);
    for (auto& c : cursors_) c.reset(new Cursor[n_]);
    for (int t = 0; t < n_; ++t) {
      int cpu = cpus.empty() ? -1 : static_cast<int>(cpus[t % cpus.size()]);
      threads_.emplace_back([this, t, cpu] { worker(t, cpu); });
      // named before the constructor returns: the Python wrapper finds its workers by name in /proc
      pthread_setname_np(threads_.back().native_handle(), ("tandem-cpu-" + std::to_string(t)).substr(0, 15).c_str());
    }
  }
  ~Executor() {
    end_polling();
    {
      std::lock_guard<std::mutex> g(m_);
      stop_ = true;
      gen_.fetch_add(1);
    }
    cv_start_.notify_all();
    for (auto& th : threads_) th.join();
  }

  // gpt-oss experts: per layer the gate_up bank (its data pointer identifies the layer in every job) and
  // its biases (contiguous, the bank's dtype, kept alive here), and the clamped SwiGLU's alpha / limit.
  void set_expert_math(std::vector<torch::Tensor> gate_ups, std::vector<torch::Tensor> gate_up_biases,
                       std::vector<torch::Tensor> down_biases, double alpha, double limit) {
    TORCH_CHECK(!busy_ && !polling_, "cpu executor: set_expert_math() while a job is in flight or polling is on");
    TORCH_CHECK(gate_ups.size() == gate_up_biases.size() && gate_ups.size() == down_biases.size(),
                "cpu executor: one gate_up bias and one down bias per gate_up bank");
    expert_math_.clear();
    bias_bf16_.clear();
    for (size_t l = 0; l < gate_ups.size(); ++l) {
      const auto& gu = gate_ups[l];
      // in the bank dtype; beside mxfp4 (uint8) banks in the model's, fp32 or bf16
      const auto bt = gu.scalar_type() == torch::kUInt8 ? gate_up_biases[l].scalar_type() : gu.scalar_type();
      TORCH_CHECK(gate_up_biases[l].is_contiguous() && down_biases[l].is_contiguous() &&
                  (bt == torch::kFloat32 || bt == torch::kBFloat16) &&
                  gate_up_biases[l].scalar_type() == bt && down_biases[l].scalar_type() == bt &&
                  gate_up_biases[l].numel() == gu.size(0) * gu.size(1),
                  "cpu executor: biases must be contiguous, in the bank dtype (fp32 or bf16 beside mxfp4 banks), "
                  "[E, 2I] and [E, D]");
      expert_math_[gu.data_ptr()] = {gate_up_biases[l].data_ptr(), down_biases[l].data_ptr()};
      bias_bf16_[gu.data_ptr()] = bt == torch::kBFloat16;
    }
    bias_keep_ = {gate_up_biases, down_biases};
    clamped_ = true;
    alpha_ = static_cast<float>(alpha);
    limit_ = static_cast<float>(limit);
  }

  // GGUF layers: per layer its gate_up bank (its data pointer identifies the layer in every job, as in
  // set_expert_math) and the GgufType of gate_up and of down (gguf_quant.KERNEL_CODE; they may differ)
  void set_gguf_layers(std::vector<torch::Tensor> gate_ups, std::vector<int64_t> gate_up_types,
                       std::vector<int64_t> down_types) {
    TORCH_CHECK(!busy_ && !polling_, "cpu executor: set_gguf_layers() while a job is in flight or polling is on");
    TORCH_CHECK(gate_ups.size() == gate_up_types.size() && gate_ups.size() == down_types.size(),
                "cpu executor: one gate_up type and one down type per gate_up bank");
    for (size_t l = 0; l < gate_ups.size(); ++l) {
      TORCH_CHECK(gate_ups[l].scalar_type() == torch::kUInt8 && gguf_block_values(gate_up_types[l]) > 0 &&
                      gguf_block_values(down_types[l]) > 0,
                  "cpu executor: GGUF layers are uint8 banks of types 1..5 (gguf_quant.KERNEL_CODE)");
      gguf_layers_[gate_ups[l].data_ptr()] = {static_cast<int>(gate_up_types[l]), static_cast<int>(down_types[l])};
    }
  }

  std::string isa() const { return k_.name; }
  bool fp8_bf16_inputs() const { return k_.gemv_fp8_bx != nullptr; }
  bool gguf_q8_inputs() const { return k_.gemv_gguf_q8 != nullptr; }
  int64_t num_threads() const { return n_; }

  // hidden [T, D] fp32|bf16 · ids [T, A] int64|int32 (< 0: skipped) · weights [T, A] fp32|bf16 ·
  // banks: one layer's banks in the bank schema's order (services/engine/moe/banks.py): gate_up
  // [E, 2I, D], down [E, D, I] (same dtype, fp32|bf16|fp8 e4m3fn), then for fp8 the fp32 block scales
  // gate_up_scale and down_scale · out [T, D] fp32 (overwritten) · ready: empty or a pinned int64 [1]
  // the workers poll until it is >= ready_value.
  void submit(torch::Tensor hidden, torch::Tensor ids, torch::Tensor weights, Banks banks, torch::Tensor out,
              torch::Tensor ready, int64_t ready_value) {
    TORCH_CHECK(!busy_, "cpu executor: submit() while a job is in flight; call wait() first");
    TORCH_CHECK(!polling_, "cpu executor: submit() while graph-mode polling is on; stop_polling() first");
    setup_job(hidden, ids, weights, banks, out, ready, ready_value);
    dispatch();
  }

 private:
  // bias [e][i] as fp32
  float bias_at(const void* b, size_t i) const {
    if (job_.bias_bf16) {
      uint32_t u = static_cast<uint32_t>(static_cast<const uint16_t*>(b)[i]) << 16;
      float f;
      std::memcpy(&f, &u, sizeof f);
      return f;
    }
    return static_cast<const float*>(b)[i];
  }

  void setup_job(torch::Tensor hidden, torch::Tensor ids, torch::Tensor weights, const Banks& banks,
                 torch::Tensor out, torch::Tensor ready, int64_t ready_value) {
    TORCH_CHECK(banks.size() == 2 || banks.size() == 4,
                "cpu executor: a layer's banks are [gate_up, down] or [gate_up, down, gate_up_scale, down_scale]");
    const torch::Tensor& gate_up = banks[0];
    const torch::Tensor& down = banks[1];
    const auto T = hidden.size(0), D = hidden.size(1), A = ids.size(1);
    // uint8 banks: mxfp4 (two e2m1 values per byte, two scale banks) or GGUF blocks (no scale banks; the
    // layer's types from set_gguf_layers, never guessed from the row bytes: rows may be padded)
    const bool gguf = gate_up.scalar_type() == torch::kUInt8 && banks.size() == 2;
    const bool mx = gate_up.scalar_type() == torch::kUInt8 && !gguf;
    const auto E = gate_up.size(0), I = gguf ? gate_up.size(1) / 2 : down.size(2) * (mx ? 2 : 1);
    int gu_gguf = 0, dn_gguf = 0;
    if (gguf) {
      const auto types = gguf_layers_.find(gate_up.data_ptr());
      TORCH_CHECK(types != gguf_layers_.end(), "cpu executor: uint8 banks without scale banks are GGUF banks, whose "
                  "types come from set_gguf_layers (mxfp4 banks come with two scale banks)");
      gu_gguf = types->second.first;
      dn_gguf = types->second.second;
      TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3 && gate_up.size(1) % 2 == 0 &&
                      D % gguf_block_values(gu_gguf) == 0 && I % gguf_block_values(dn_gguf) == 0 &&
                      gate_up.size(2) >= gguf_row_bytes(gu_gguf, D) && down.size(2) >= gguf_row_bytes(dn_gguf, I),
                  "cpu executor: GGUF banks gate_up ", gate_up.sizes(), " and down ", down.sizes(), " with D = ", D,
                  " are not [E, 2I, >= row bytes of D] and [E, D, >= row bytes of I] in their types ", gu_gguf,
                  " and ", dn_gguf, " (gguf_quant.KERNEL_CODE)");
    }
    TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "cpu executor: hidden must be contiguous [T, D]");
    TORCH_CHECK(ids.dim() == 2 && ids.size(0) == T && ids.is_contiguous(), "cpu executor: ids must be contiguous [T, A]");
    TORCH_CHECK(weights.sizes() == ids.sizes() && weights.is_contiguous(), "cpu executor: weights must be contiguous [T, A] like ids");
    TORCH_CHECK(gate_up.dim() == 3 && gate_up.size(1) == 2 * I && (gguf || gate_up.size(2) == (mx ? D / 2 : D)) &&
                    gate_up.is_contiguous(),
                "cpu executor: gate_up bank must be contiguous [E, 2I, D] (mxfp4: uint8 [E, 2I, D/2])");
    TORCH_CHECK(down.dim() == 3 && down.size(0) == E && down.size(1) == D && down.is_contiguous(),
                "cpu executor: down bank must be contiguous [E, D, I]");
    const bool fp8 = gate_up.scalar_type() == torch::kFloat8_e4m3fn;
    TORCH_CHECK(gate_up.scalar_type() == down.scalar_type() &&
                (gate_up.scalar_type() == torch::kFloat32 || gate_up.scalar_type() == torch::kBFloat16 || fp8 || mx ||
                 gguf),
                "cpu executor: banks must both be float32, bfloat16, float8_e4m3fn or uint8 (mxfp4, GGUF)");
    TORCH_CHECK((fp8 || mx) == (banks.size() == 4),
                "cpu executor: float8_e4m3fn and mxfp4 banks (and only they) come with two scale banks");
    if (mx) check_mxfp4_scales(banks, E, D, I);
    if (fp8) {
      const int64_t gI = (I + kFp8Block - 1) / kFp8Block, gD = (D + kFp8Block - 1) / kFp8Block;
      const auto& gs = banks[2];
      const auto& ds = banks[3];
      TORCH_CHECK(gs.scalar_type() == torch::kFloat32 && gs.is_contiguous() && gs.dim() == 3 && gs.size(0) == E &&
                      gs.size(1) == 2 * gI && gs.size(2) == gD,
                  "cpu executor: gate_up_scale must be contiguous fp32 [E, 2*ceil(I/128), ceil(D/128)]");
      TORCH_CHECK(ds.scalar_type() == torch::kFloat32 && ds.is_contiguous() && ds.dim() == 3 && ds.size(0) == E &&
                      ds.size(1) == gD && ds.size(2) == gI,
                  "cpu executor: down_scale must be contiguous fp32 [E, ceil(D/128), ceil(I/128)]");
    }
    TORCH_CHECK(hidden.scalar_type() == torch::kFloat32 || hidden.scalar_type() == torch::kBFloat16,
                "cpu executor: hidden must be float32 or bfloat16");
    TORCH_CHECK(weights.scalar_type() == torch::kFloat32 || weights.scalar_type() == torch::kBFloat16,
                "cpu executor: weights must be float32 or bfloat16");
    TORCH_CHECK(ids.scalar_type() == torch::kInt64 || ids.scalar_type() == torch::kInt32, "cpu executor: ids must be int64 or int32");
    TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.is_contiguous() && out.size(0) == T && out.size(1) == D,
                "cpu executor: out must be contiguous fp32 [T, D]");
    TORCH_CHECK(hidden.device().is_cpu() && ids.device().is_cpu() && weights.device().is_cpu() && out.device().is_cpu(),
                "cpu executor: tensors must be on the CPU (copy to pinned buffers first)");
    TORCH_CHECK(!ready.defined() || ready.numel() == 0 || (ready.scalar_type() == torch::kInt64 && ready.device().is_cpu()),
                "cpu executor: ready must be an int64 CPU tensor");
    Job& j = job_;
    j.read_only = false;
    j.hidden = hidden; j.ids = ids; j.weights = weights; j.gate_up = gate_up; j.down = down; j.out = out;
    j.gate_up_scale = fp8 || mx ? banks[2] : torch::Tensor();
    j.down_scale = fp8 || mx ? banks[3] : torch::Tensor();
    j.ready = ready.defined() && ready.numel() > 0 ? ready : torch::Tensor();
    j.ready_value = ready_value;
    j.T = T; j.A = A; j.D = D; j.I = I; j.E = E;
    j.wdt = gguf ? WDtype::GGUF : mx ? WDtype::MXFP4 : fp8 ? WDtype::FP8
          : gate_up.scalar_type() == torch::kBFloat16 ? WDtype::BF16 : WDtype::F32;
    j.gu_gguf = gu_gguf; j.dn_gguf = dn_gguf;  // GGUF: fp32 inputs (bf16_inputs stays false below)
    j.gu_ldb = gate_up.size(2); j.dn_ldb = down.size(2);
    // bf16 inputs to the dpbf16 kernels: bf16 weights always (where the CPU has the kernel); FP8 weights when
    // the model computes in bf16 (hidden arrives in bf16, so only the SwiGLU output is rounded, as the
    // GPU's bf16 path rounds it). An fp32 model's FP8 experts keep the fp32-input kernel: exact products.
    // MXFP4 likewise: bf16 inputs nibble-split for a bf16 model, fp32 pair-split otherwise (gemv.h).
    j.bf16_inputs = j.wdt == WDtype::BF16 ? k_.bf16_wants_bf16_x
               : j.wdt == WDtype::FP8 ? hidden.scalar_type() == torch::kBFloat16 && k_.gemv_fp8_bx != nullptr
               : j.wdt == WDtype::MXFP4 && hidden.scalar_type() == torch::kBFloat16 && k_.gemv_mxfp4_bx != nullptr;
    // GGUF: int8 inputs (gemv.h Q8Block) for a bf16 model, as llama.cpp quantizes its activations (every type has
    // the kernel); an fp32 model's keep the fp32-input kernel, whose products are exact
    j.q8_inputs = j.wdt == WDtype::GGUF && hidden.scalar_type() == torch::kBFloat16 && k_.gemv_gguf_q8 != nullptr;
    const auto math = expert_math_.find(gate_up.data_ptr());
    j.gate_up_bias = math == expert_math_.end() ? nullptr : math->second.first;
    j.down_bias = math == expert_math_.end() ? nullptr : math->second.second;
    j.bias_bf16 = math != expert_math_.end() && bias_bf16_.at(gate_up.data_ptr());
    j.clamped = clamped_; j.alpha = alpha_; j.limit = limit_;
    const size_t Rmax = static_cast<size_t>(T * A);
    j.count.resize(E);  // prepare() zeroes it
    j.loop = false;
    j.ids_offset = 0;
    j.group_expert.resize(Rmax + 1);
    j.group_start.resize(Rmax + 2);
    j.route_tok.resize(Rmax); j.route_w.resize(Rmax); j.w_f32.resize(Rmax);
    j.x_f32.resize(T * D);
    if (bf16_x()) j.x_bf16.resize(T * D);
    j.h.resize(Rmax * 2 * I);
    if (bf16_x()) j.act_bf16.resize(Rmax * I); else j.act_f32.resize(Rmax * I);
    if (j.q8_inputs) {
      j.x_q8.resize(T * q8_blocks(D));
      j.act_q8.resize(Rmax * q8_blocks(I));
      if (j.act_filled_cap < Rmax * q8_blocks(I)) {  // G <= R groups
        j.act_filled_cap = Rmax * q8_blocks(I);
        j.act_filled.reset(new std::atomic<int>[j.act_filled_cap]);
      }
    }
    j.x_ptr.resize(Rmax); j.act_ptr.resize(Rmax); j.h_ptr.resize(Rmax); j.out_ptr.resize(Rmax);
    j.error.clear();
    j.G = j.R = 0;
  }

  void dispatch() {
    busy_ = true;
    remaining_.store(n_, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> g(m_);
      gen_.fetch_add(1, std::memory_order_release);
    }
    cv_start_.notify_all();
  }

 public:
  // ---- graph mode ------------------------------------------------------------------------------
  // No Python per layer: worker 0, when idle, watches a pinned job word that the GPU stream writes after
  // copying the inputs down (seq << 20 | T << 10 | layer), runs the job on the pool and then writes seq
  // to the pinned done word, which a GPU kernel polls before adding the output. Capturable in a CUDA
  // graph because every step of the handoff is a copy or a kernel.
  void start_polling(torch::Tensor job_word, torch::Tensor done_word, torch::Tensor hidden, torch::Tensor ids,
                     torch::Tensor weights, torch::Tensor out, std::vector<Banks> layers) {
    TORCH_CHECK(!polling_ && !busy_, "cpu executor: start_polling() while busy or already polling");
    for (auto* w : {&job_word, &done_word})
      TORCH_CHECK(w->scalar_type() == torch::kInt64 && w->numel() >= 1 && w->device().is_cpu(),
                  "cpu executor: job/done words must be int64 CPU (pinned) tensors");
    check_layers(layers);
    TORCH_CHECK(layers.size() < 1024 && hidden.size(0) < 1024, "cpu executor: graph mode encodes layer and T in 10 bits");
    poll_ = PollState{job_word, done_word, hidden, ids, weights, out, std::move(layers)};
    poll_.last_seq = done_word.data_ptr<int64_t>()[0];
    poll_idle_since_ = now_ns();
    {
      std::lock_guard<std::mutex> g(m_);
      polling_ = true;
    }
    cv_start_.notify_all();  // worker 0 may be asleep
  }

  void stop_polling() {
    pybind11::gil_scoped_release nogil;
    end_polling();
  }

  // (jobs, compute ns, experts, routes, last seq) since start_polling, and the last error ("" if none)
  std::tuple<std::vector<int64_t>, std::string> poll_stats() {
    std::lock_guard<std::mutex> g(poll_m_);
    return {{poll_.jobs, poll_.compute_ns, poll_.experts, poll_.routes, poll_.last_seq}, poll_.error};
  }

 private:
  struct PollState {
    torch::Tensor job_word, done_word, hidden, ids, weights, out;
    std::vector<Banks> layers;  // per layer, the banks in schema order
    int64_t last_seq = 0, jobs = 0, compute_ns = 0, experts = 0, routes = 0;
    std::string error;
  };

  void end_polling() {
    {
      std::lock_guard<std::mutex> g(m_);
      polling_ = false;
    }
    while (in_poll_.load()) _mm_pause();  // worker 0 finishes the job it is running, if any
  }

  // Worker 0 in graph mode: one look at the job word; runs the job on the whole pool if there is one.
  // Returns false when polling is off (the caller goes back to waiting for submit()'s jobs).
  bool poll_step(uint64_t& seen) {
    in_poll_.store(true);  // seq_cst pair with end_polling(): polling_ is re-read after this store
    if (!polling_.load()) {
      in_poll_.store(false);
      return false;
    }
    auto* job = reinterpret_cast<volatile int64_t*>(poll_.job_word.data_ptr<int64_t>());
    auto* done = reinterpret_cast<volatile int64_t*>(poll_.done_word.data_ptr<int64_t>());
    const int64_t w = *job, seq = w >> 20;
    if (seq <= poll_.last_seq) {  // idle: spin while layers come back to back, then nap
      in_poll_.store(false);
      if (now_ns() - poll_idle_since_ < 2000000) _mm_pause();
      else std::this_thread::sleep_for(std::chrono::microseconds(10));  // timer slack set to 1 us
      return true;
    }
    std::atomic_thread_fence(std::memory_order_acquire);
    const int64_t T = (w >> 10) & 1023, layer = w & 1023;
    std::string err;
    try {
      TORCH_CHECK(layer < (int64_t)poll_.layers.size() && T <= poll_.hidden.size(0),
                  "graph-mode job word names layer ", layer, " and T=", T, " beyond the registered buffers");
      setup_job(poll_.hidden.narrow(0, 0, T), poll_.ids.narrow(0, 0, T), poll_.weights.narrow(0, 0, T),
                poll_.layers[layer], poll_.out.narrow(0, 0, T), torch::Tensor(), 0);
    } catch (const c10::Error& e) {
      err = e.what_without_backtrace();
    } catch (const std::exception& e) {
      err = e.what();
    }
    if (err.empty()) {
      busy_ = true;
      remaining_.store(n_, std::memory_order_relaxed);
      {
        std::lock_guard<std::mutex> g(m_);
        seen = gen_.fetch_add(1, std::memory_order_release) + 1;
      }
      cv_start_.notify_all();  // no syscall unless some worker is asleep
      run(0);
      finish_share();
      while (remaining_.load(std::memory_order_acquire) != 0) _mm_pause();  // all out of run()
      busy_ = false;
      err = job_.error;
    }
    if (!err.empty()) {
      job_.G = job_.R = 0;
      job_.t_done_ns = job_.t_ready_ns;
    }
    {
      std::lock_guard<std::mutex> g(poll_m_);
      poll_.jobs += 1;
      poll_.compute_ns += job_.t_done_ns - job_.t_ready_ns;
      poll_.experts += job_.G;
      poll_.routes += job_.R;
      poll_.last_seq = seq;
      if (!err.empty()) poll_.error = err;  // the GPU still gets its done word: never hang the stream
    }
    job_.hidden = job_.ids = job_.weights = job_.gate_up = job_.down = job_.out = torch::Tensor();
    job_.gate_up_scale = job_.down_scale = torch::Tensor();
    std::atomic_thread_fence(std::memory_order_release);
    *done = seq;
    poll_idle_since_ = now_ns();
    in_poll_.store(false);
    return true;
  }


 public:
  // ---- eager device handoff ----------------------------------------------------------------------
  // Pinned inputs/output and the flag, a device ring of flag values (int64 1..ring_len) and every
  // layer's banks, registered once from the thread that owns the CUDA context.
  void link_device(torch::Tensor hidden_h, torch::Tensor ids_h, torch::Tensor w_h, torch::Tensor out_h,
                   torch::Tensor flag_h, int64_t ring_ptr, int64_t ring_len, std::vector<Banks> layers) {
    if (!driver_ok_) {
      const std::string why = drv_.load();
      TORCH_CHECK(why.empty(), "cpu executor: eager device handoff needs the CUDA driver: ", why);
      driver_ok_ = true;
    }
    CudaDriver::CUcontext ctx = nullptr;
    cu(drv_.ctx_get(&ctx), "cuCtxGetCurrent");
    TORCH_CHECK(ctx != nullptr, "cpu executor: no current CUDA context on the thread linking the device handoff");
    for (auto* t : {&hidden_h, &ids_h, &w_h, &out_h, &flag_h})
      TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->dim() >= 1, "cpu executor: handoff buffers must be contiguous CPU (pinned) tensors");
    TORCH_CHECK(ids_h.scalar_type() == torch::kInt64 && w_h.scalar_type() == torch::kFloat32 &&
                out_h.scalar_type() == torch::kFloat32 && flag_h.scalar_type() == torch::kInt64,
                "cpu executor: handoff buffers must be ids int64, weights/out fp32, flag int64");
    TORCH_CHECK(ring_ptr != 0 && ring_len >= 2, "cpu executor: the flag ring needs >= 2 device int64 values");
    check_layers(layers);
    const int64_t seq = link_.seq;  // kept across relinks: the next flag value must differ from the word's
    link_ = DeviceLink{hidden_h, ids_h, w_h, out_h, flag_h, std::move(layers)};
    link_.seq = seq;
    link_.ring = static_cast<CudaDriver::CUdeviceptr>(ring_ptr);
    link_.ring_len = ring_len;
    link_.ctx = ctx;
    link_.views.assign(hidden_h.size(0) + 1, {});
  }

  // Enqueue on `stream` hidden [T, D], ids [T, A] int64, weights [T, A] fp32 (device, contiguous) ->
  // pinned buffers, then the next flag value, and start layer `layer`'s job (its workers wait for the flag).
  void device_submit(int64_t layer, torch::Tensor hidden, torch::Tensor ids, torch::Tensor weights, int64_t stream) {
    TORCH_CHECK(link_.ctx != nullptr, "cpu executor: device_submit() before link_device()");
    TORCH_CHECK(!busy_ && !polling_, "cpu executor: device_submit() while a job is in flight or polling is on");
    const int64_t T = hidden.size(0), D = link_.hidden.size(1), A = link_.ids.size(1);
    TORCH_CHECK(layer >= 0 && layer < (int64_t)link_.layers.size(), "cpu executor: no banks for layer ", layer);
    TORCH_CHECK(T >= 1 && T <= link_.hidden.size(0), "cpu executor: ", T, " tokens exceed the handoff's ", link_.hidden.size(0), " rows");
    TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == D && hidden.scalar_type() == link_.hidden.scalar_type() && hidden.is_contiguous(),
                "cpu executor: device hidden must be contiguous [T, ", D, "] ", link_.hidden.scalar_type());
    TORCH_CHECK(ids.dim() == 2 && ids.size(0) == T && ids.size(1) == A && ids.scalar_type() == torch::kInt64 && ids.is_contiguous(),
                "cpu executor: device ids must be contiguous int64 [T, ", A, "]");
    TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == torch::kFloat32 && weights.is_contiguous(),
                "cpu executor: device weights must be contiguous fp32 [T, ", A, "]");
    // (device-ness is not checked: the CPU tests drive this path through a stand-in driver library)
    auto& v = link_.views[T];
    if (!v[0].defined())
      v = {link_.hidden.narrow(0, 0, T), link_.ids.narrow(0, 0, T), link_.w.narrow(0, 0, T), link_.out.narrow(0, 0, T)};
    bind_context();
    auto* s = reinterpret_cast<CudaDriver::CUstream>(stream);
    auto dptr = [](const torch::Tensor& t) { return reinterpret_cast<CudaDriver::CUdeviceptr>(t.data_ptr()); };
    cu(drv_.dtoh(link_.hidden.data_ptr(), dptr(hidden), hidden.nbytes(), s), "cuMemcpyDtoHAsync (hidden)");
    cu(drv_.dtoh(link_.ids.data_ptr(), dptr(ids), ids.nbytes(), s), "cuMemcpyDtoHAsync (ids)");
    cu(drv_.dtoh(link_.w.data_ptr(), dptr(weights), weights.nbytes(), s), "cuMemcpyDtoHAsync (weights)");
    const int64_t slot = link_.seq++ % link_.ring_len;  // ring[slot] = slot + 1: differs from the last value
    cu(drv_.dtoh(link_.flag.data_ptr(), link_.ring + slot * sizeof(int64_t), sizeof(int64_t), s), "cuMemcpyDtoHAsync (flag)");
    link_.T = T;
    setup_job(v[0], v[1], v[2], link_.layers[layer], v[3], link_.flag, slot + 1);
    dispatch();
  }

  // Wait for the job, then enqueue the upload of its out [T, D] fp32 to `out_ptr` on `stream`.
  // Returns wait()'s (t_ready_ns, t_done_ns, experts, routes).
  std::vector<int64_t> device_sync(int64_t out_ptr, int64_t stream) {
    std::vector<int64_t> r = wait();
    bind_context();
    cu(drv_.htod(static_cast<CudaDriver::CUdeviceptr>(out_ptr), link_.out.data_ptr(),
                 link_.T * link_.out.size(1) * sizeof(float), reinterpret_cast<CudaDriver::CUstream>(stream)),
       "cuMemcpyHtoDAsync (out)");
    return r;
  }

  // ---- loop mode ---------------------------------------------------------------------------------
  // hidden [T, D] · ids_table [N, T, A] · weights [T, A] · one layer's banks · out [T, D] fp32: jobs run
  // back to back on the workers, job k reading ids row k % N, until stop_loop().
  void start_loop(torch::Tensor hidden, torch::Tensor ids_table, torch::Tensor weights, Banks banks,
                  torch::Tensor out) {
    TORCH_CHECK(!busy_ && !polling_, "cpu executor: start_loop() while a job is in flight or polling is on");
    TORCH_CHECK(ids_table.dim() == 3 && ids_table.size(0) >= 1 && ids_table.is_contiguous(),
                "cpu executor: loop ids must be contiguous [N, T, A]");
    setup_job(hidden, ids_table.select(0, 0), weights, banks, out, torch::Tensor(), 0);
    Job& j = job_;
    j.ids = ids_table;
    j.loop = true;
    j.loop_row = 0;
    j.loop_rows = ids_table.size(0);
    loop_stop_.store(false);
    loop_jobs_.store(0);
    loop_bytes_.store(0);
    dispatch();
  }

  // (jobs, expert bytes read, steady-clock ns now) so far: read twice to get a rate over any window
  std::vector<int64_t> loop_counters() const { return {loop_jobs_.load(), loop_bytes_.load(), now_ns()}; }

  // Ends the loop after its current job; returns loop_counters() at the end.
  std::vector<int64_t> stop_loop() {
    loop_stop_.store(true);
    wait();
    return loop_counters();
  }

 private:
  struct DeviceLink {
    torch::Tensor hidden, ids, w, out, flag;
    std::vector<Banks> layers;
    CudaDriver::CUdeviceptr ring = 0;
    int64_t ring_len = 0, seq = 0, T = 0;
    CudaDriver::CUcontext ctx = nullptr;
    std::vector<std::array<torch::Tensor, 4>> views;  // [T] pinned row views, made once per T
  };

  void cu(CudaDriver::CUresult r, const char* what) const {
    TORCH_CHECK(r == 0, "cpu executor: ", what, " failed: ", drv_.describe(r));
  }

  // driver calls need the context current on the calling thread (the runtime binds it lazily)
  void bind_context() {
    CudaDriver::CUcontext cur = nullptr;
    drv_.ctx_get(&cur);
    if (cur != link_.ctx) cu(drv_.ctx_set(link_.ctx), "cuCtxSetCurrent");
  }

 public:

  // STREAM-style read of `buf` (fp32, contiguous) by the pool, `reps` times; returns the best seconds.
  double read_seconds(torch::Tensor buf, int64_t reps) {
    TORCH_CHECK(!busy_ && !polling_, "cpu executor: read_seconds() while a job is in flight or polling is on");
    TORCH_CHECK(buf.scalar_type() == torch::kFloat32 && buf.is_contiguous() && buf.device().is_cpu(),
                "cpu executor: read buffer must be contiguous fp32 on the CPU");
    double best = 1e30, sink = 0;
    for (int64_t r = 0; r < reps; ++r) {
      job_.read_only = true;
      job_.hidden = buf;
      job_.read_sums.assign(n_, 0.0);
      job_.error.clear();
      const int64_t t0 = now_ns();
      dispatch();
      {
        pybind11::gil_scoped_release nogil;
        while (remaining_.load(std::memory_order_acquire) != 0) _mm_pause();
      }
      busy_ = false;
      best = std::min(best, (now_ns() - t0) * 1e-9);
      for (double s : job_.read_sums) sink += s;
    }
    job_.hidden = torch::Tensor();
    job_.read_only = false;
    if (sink == 12345.678) std::printf("%f\n", sink);  // keep the sums alive
    return best;
  }

  // Blocks until the job is done; returns (t_ready_ns, t_done_ns) on the steady clock, the experts G
  // and the routes R it computed.
  std::vector<int64_t> wait() {
    TORCH_CHECK(busy_, "cpu executor: wait() without a submitted job");
    {
      pybind11::gil_scoped_release nogil;
      const int64_t deadline = now_ns() + spin_ns_;
      while (remaining_.load(std::memory_order_acquire) != 0 && now_ns() < deadline) _mm_pause();
      if (remaining_.load(std::memory_order_acquire) != 0) {
        std::unique_lock<std::mutex> lk(m_);
        cv_done_.wait(lk, [this] { return remaining_.load(std::memory_order_acquire) == 0; });
      }
    }
    busy_ = false;
    Job& j = job_;
    const std::string err = j.error;
    j.hidden = j.ids = j.weights = j.gate_up = j.down = j.out = j.ready = torch::Tensor();
    j.gate_up_scale = j.down_scale = torch::Tensor();
    TORCH_CHECK(err.empty(), "cpu executor: ", err);
    return {j.t_ready_ns, j.t_done_ns, j.G, j.R};
  }

 private:
  bool bf16_x() const { return job_.bf16_inputs; }

  void worker(int tid, int cpu) {
    if (cpu >= 0) {  // pin: one worker per physical core, no migration mid-stream
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(cpu, &set);
      pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
    }
    if (tid == 0) prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);  // graph-mode naps: 10 us, not 10 + 50
    uint64_t seen = 0;
    auto polling = [&] { return tid == 0 && polling_.load(std::memory_order_acquire); };
    while (true) {
      if (polling() && poll_step(seen)) continue;
      // Spin a while for the next layer's job (decode layers arrive every few tens of µs), then sleep.
      const int64_t deadline = now_ns() + spin_ns_;
      while (gen_.load(std::memory_order_acquire) == seen && !polling() && now_ns() < deadline) _mm_pause();
      if (gen_.load(std::memory_order_acquire) == seen) {
        if (polling()) continue;
        std::unique_lock<std::mutex> lk(m_);
        cv_start_.wait(lk, [&] { return gen_.load(std::memory_order_acquire) != seen || polling(); });
        if (gen_.load(std::memory_order_acquire) == seen) continue;  // woken to poll
      }
      seen = gen_.load(std::memory_order_acquire);
      if (stop_) return;
      run(tid);
      finish_share();
    }
  }

  // this thread is out of the job: the last one out wakes a sleeping wait()
  void finish_share() {
    if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> g(m_);
      cv_done_.notify_all();
    }
  }

  void run(int tid) {
    Job& j = job_;
    if (j.read_only) {  // each thread sums its contiguous slice of the buffer
      const int64_t n = j.hidden.numel();
      const int64_t a = n * tid / n_, b = n * (tid + 1) / n_;
      j.read_sums[tid] = k_.read(j.hidden.data_ptr<float>() + a, b - a);
      return;
    }
    for (;;) {  // one pass per job; loop mode keeps going (thread 0 prepares the next while others wait)
      if (tid == 0) prepare();
      barrier_.wait();
      if (!j.error.empty()) return;
      if (j.R == 0 && !j.loop) {  // nothing for the CPU (all routes on the GPU): thread 0 zeroed out
        if (tid == 0) j.again = false, j.t_done_ns = now_ns();  // one barrier instead of three
        return;
      }
      for_chunks(cursors_[0].get(), tid, kChunkPairs, [this](int64_t a, int64_t b) { gate_up_range(a, b); });
      barrier_.wait();
      for_chunks(cursors_[1].get(), tid, kChunkRows, [this](int64_t a, int64_t b) { down_range(a, b); });
      if (tid == 0) j.again = j.loop && !loop_stop_.load(std::memory_order_relaxed);
      barrier_.wait();
      if (tid == 0) {
        j.t_done_ns = now_ns();
        if (j.loop) {
          loop_bytes_.fetch_add((int64_t)j.G * expert_weight_bytes(), std::memory_order_relaxed);
          loop_jobs_.fetch_add(1, std::memory_order_release);
          j.loop_row = (j.loop_row + 1) % j.loop_rows;
          j.ids_offset = j.loop_row * j.T * j.A;
        }
      }
      if (!j.again) return;
    }
  }

  // Phase 0 (thread 0): wait for the inputs, group routes by expert, convert inputs.
  void prepare() {
    Job& j = job_;
    if (j.ready.defined()) {
      auto* flag = reinterpret_cast<volatile int64_t*>(j.ready.data_ptr<int64_t>());
      int64_t spins = 0;
      const int64_t t0 = now_ns();
      while (*flag != j.ready_value) {  // equality: the eager handoff's flag values cycle through a ring
        _mm_pause();
        if (++spins % 4096 == 0) {
          sched_yield();  // the GPU may be ms behind the host: don't starve it
          if (now_ns() - t0 > kReadyTimeoutNs) {  // an error beats a hung process
            j.error = "the ready flag never reached " + std::to_string(j.ready_value) + " (it reads " +
                      std::to_string(*flag) + " after 30 s): the stream never ran the input copies";
            return;
          }
        }
      }
      std::atomic_thread_fence(std::memory_order_acquire);
    }
    j.t_ready_ns = now_ns();
    const int T = j.T, A = j.A, D = j.D, I = j.I, E = j.E;
    const bool ids64 = j.ids.scalar_type() == torch::kInt64;
    const void* ids_raw = static_cast<const char*>(j.ids.data_ptr()) + j.ids_offset * j.ids.element_size();
    auto id_at = [&](int64_t i) -> int64_t {
      return ids64 ? static_cast<const int64_t*>(ids_raw)[i] : static_cast<const int32_t*>(ids_raw)[i];
    };
    std::fill(j.count.begin(), j.count.end(), 0);
    int R = 0;
    for (int64_t i = 0; i < (int64_t)T * A; ++i) {
      const int64_t e = id_at(i);
      if (e < 0) continue;
      if (e >= E) { j.error = "expert id " + std::to_string(e) + " out of range for a bank of " + std::to_string(E) + " experts"; return; }
      ++j.count[e];
      ++R;
    }
    // group_start via a prefix sum over experts present; routes ordered by (expert, token)
    std::vector<int>& pos = j.count;  // reused: count -> write position
    int G = 0, off = 0;
    for (int e = 0; e < E; ++e) {
      const int c = pos[e];
      if (c == 0) { pos[e] = -1; continue; }
      j.group_expert[G] = e; j.group_start[G] = off; ++G;
      pos[e] = off; off += c;
    }
    j.group_start[G] = off;
    to_f32(j.weights, (int64_t)T * A, j.w_f32.data());
    for (int64_t i = 0; i < (int64_t)T * A; ++i) {
      const int64_t e = id_at(i);
      if (e < 0) continue;
      const int r = pos[e]++;
      j.route_tok[r] = static_cast<int>(i / A);
      j.route_w[r] = j.w_f32[i];
    }
    j.G = G; j.R = R;
    // inputs (none to convert without routes): bf16 as is for the dpbf16 kernel, else fp32
    if (R > 0 && bf16_x() && j.hidden.scalar_type() == torch::kBFloat16 && j.wdt != WDtype::MXFP4) {
      std::memcpy(j.x_bf16.data(), j.hidden.data_ptr(), (size_t)T * D * sizeof(uint16_t));
    } else if (R > 0) {
      to_f32(j.hidden, (int64_t)T * D, j.x_f32.data());
      if (j.wdt == WDtype::MXFP4 && bf16_x()) {  // the bf16-input kernel's nibble-split rows (gemv.h)
        for (int64_t t = 0; t < T; ++t)
          for (int64_t i = 0; i < D; ++i) j.x_bf16[t * D + mxfp4_bx_pos(i, D)] = f32_to_bf16(j.x_f32[t * D + i]);
      } else {
        if (j.wdt == WDtype::MXFP4) pair_split(j.x_f32.data(), T, D);
        if (bf16_x()) for (int64_t i = 0; i < (int64_t)T * D; ++i) j.x_bf16[i] = f32_to_bf16(j.x_f32[i]);
      }
    }
    if (R > 0 && j.q8_inputs) {
      for (int64_t t = 0; t < T; ++t) gguf_quantize_inputs(j.gu_gguf, &j.x_f32[t * D], D, &j.x_q8[t * q8_blocks(D)]);
      for (int64_t b = 0; b < G * q8_blocks(I); ++b) j.act_filled[b].store(0, std::memory_order_relaxed);
    }
    float* out = j.out.data_ptr<float>();
    for (int r = 0; r < R; ++r) {
      const int tok = j.route_tok[r];
      j.x_ptr[r] = j.q8_inputs ? static_cast<const void*>(&j.x_q8[(size_t)tok * q8_blocks(D)])
                 : bf16_x() ? static_cast<const void*>(&j.x_bf16[(size_t)tok * D]) : static_cast<const void*>(&j.x_f32[(size_t)tok * D]);
      j.act_ptr[r] = j.q8_inputs ? static_cast<const void*>(&j.act_q8[(size_t)r * q8_blocks(I)])
                   : bf16_x() ? static_cast<const void*>(&j.act_bf16[(size_t)r * I]) : static_cast<const void*>(&j.act_f32[(size_t)r * I]);
      j.h_ptr[r] = &j.h[(size_t)r * 2 * I];
      j.out_ptr[r] = out + (size_t)tok * D;
    }
    if (R == 0) std::memset(out, 0, (size_t)T * D * sizeof(float));
    reset_cursors(cursors_[0].get(), (int64_t)G * I);
    reset_cursors(cursors_[1].get(), D);
  }

  GemvFn gemv() const {
    if (job_.wdt == WDtype::GGUF) return job_.q8_inputs ? k_.gemv_gguf_q8 : k_.gemv_gguf;
    if (job_.wdt == WDtype::MXFP4) return job_.bf16_inputs ? k_.gemv_mxfp4_bx : k_.gemv_mxfp4;
    if (job_.wdt == WDtype::FP8) return job_.bf16_inputs ? k_.gemv_fp8_bx : k_.gemv_fp8;
    return job_.wdt == WDtype::BF16 ? k_.gemv_bf16 : k_.gemv_f32;
  }
  // bytes of `elems` weights in the job's bank dtype (mxfp4: two per byte; not GGUF)
  size_t wbytes(size_t elems) const { return job_.wdt == WDtype::MXFP4 ? elems / 2 : elems * welem(); }
  // bytes of `rows` rows of the gate_up bank (D values each) and of the down bank (I values each)
  size_t gu_rows(size_t rows) const {
    return job_.wdt == WDtype::GGUF ? rows * job_.gu_ldb : wbytes(rows * job_.D);
  }
  size_t dn_rows(size_t rows) const {
    return job_.wdt == WDtype::GGUF ? rows * job_.dn_ldb : wbytes(rows * job_.I);
  }
  // one expert's weight bytes (what a job streams per expert; scales included for mxfp4: 1/16 more)
  int64_t expert_weight_bytes() const {
    if (job_.wdt == WDtype::GGUF)
      return 2 * (int64_t)job_.I * gguf_row_bytes(job_.gu_gguf, job_.D) + (int64_t)job_.D * gguf_row_bytes(job_.dn_gguf, job_.I);
    const int64_t n = 3 * (int64_t)job_.I * job_.D;
    return job_.wdt == WDtype::MXFP4 ? n / 2 + n / kMxBlock : n * (int64_t)welem();
  }

  // mxfp4 scale banks: E8M0 uint8 [E, 2I, D/32] and [E, D, I/32]; D and I multiples of 32
  static void check_mxfp4_scales(const Banks& banks, int64_t E, int64_t D, int64_t I) {
    TORCH_CHECK(D % kMxBlock == 0 && I % kMxBlock == 0, "cpu executor: mxfp4 banks need D and I multiples of 32");
    const auto& gs = banks[2];
    const auto& ds = banks[3];
    TORCH_CHECK(gs.scalar_type() == torch::kUInt8 && gs.is_contiguous() && gs.dim() == 3 && gs.size(0) == E &&
                    gs.size(1) == 2 * I && gs.size(2) == D / kMxBlock,
                "cpu executor: mxfp4 gate_up_scale must be contiguous uint8 (E8M0) [E, 2I, D/32]");
    TORCH_CHECK(ds.scalar_type() == torch::kUInt8 && ds.is_contiguous() && ds.dim() == 3 && ds.size(0) == E &&
                    ds.size(1) == D && ds.size(2) == I / kMxBlock,
                "cpu executor: mxfp4 down_scale must be contiguous uint8 (E8M0) [E, D, I/32]");
  }

  // rows [T, D] of fp32 into the mxfp4 kernels' pair-split layout, in place (gemv.h)
  static void pair_split(float* x, int64_t T, int64_t D) {
    float tmp[kMxBlock];
    for (int64_t b = 0; b < T * D; b += kMxBlock) {
      for (int i = 0; i < kMxBlock; ++i) tmp[mxfp4_x_pos(i)] = x[b + i];
      std::memcpy(x + b, tmp, sizeof tmp);
    }
  }
  size_t welem() const { return job_.wdt == WDtype::FP8 ? 1 : job_.wdt == WDtype::BF16 ? 2 : 4; }
  static int64_t blocks(int64_t n) { return (n + kFp8Block - 1) / kFp8Block; }

  static void check_layers(const std::vector<Banks>& layers) {
    TORCH_CHECK(!layers.empty(), "cpu executor: no layers' banks given");
    for (const auto& b : layers)
      TORCH_CHECK(b.size() == 2 || b.size() == 4, "cpu executor: each layer's banks are [gate_up, down] or "
                  "[gate_up, down, gate_up_scale, down_scale]");
  }

  // Work split: each thread owns a contiguous share of a phase's units (one linear DRAM stream) and
  // takes it in chunks through its cursor; a thread done with its share takes chunks from the others'
  // cursors, so a core slowed by anything else (an interrupt, a neighbour) does not stall the barrier.
  struct alignas(64) Cursor {
    std::atomic<int64_t> next{0};
    int64_t end = 0;
  };
  static constexpr int64_t kReadyTimeoutNs = 30000000000LL;
  static constexpr int64_t kChunkPairs = 16;  // gate+up row pairs: 128 KB of bf16 at D=2048
  static constexpr int64_t kChunkRows = 16;   // down rows, each over every expert of the step

  void reset_cursors(Cursor* c, int64_t U) {
    for (int t = 0; t < n_; ++t) {
      c[t].next.store(U * t / n_, std::memory_order_relaxed);
      c[t].end = U * (t + 1) / n_;
    }
  }

  template <typename Fn>
  void for_chunks(Cursor* c, int tid, int64_t chunk, Fn&& fn) {
    for (int k = 0; k < n_; ++k) {
      Cursor& cur = c[(tid + k) % n_];
      for (int64_t u; (u = cur.next.fetch_add(chunk, std::memory_order_relaxed)) < cur.end;)
        fn(u, std::min(u + chunk, cur.end));
    }
  }

  // Phase 1: rows (gate i, up I+i) for pair units [u, u1) of the G*I units, SwiGLU fused.
  void gate_up_range(int64_t u, const int64_t u1) {
    Job& j = job_;
    const int64_t I = j.I, D = j.D;
    const char* bank = static_cast<const char*>(j.gate_up.data_ptr());
    while (u < u1) {
      const int g = static_cast<int>(u / I);
      const int64_t i0 = u % I, i1 = std::min<int64_t>(I, i0 + (u1 - u));
      const int r0 = j.group_start[g], nt = j.group_start[g + 1] - r0;
      const char* W = bank + gu_rows((size_t)j.group_expert[g] * 2 * I);
      thread_local std::vector<float*> y;
      y.resize(nt);
      for (int t = 0; t < nt; ++t) y[t] = j.h_ptr[r0 + t] + i0;
      GemvArgs a{W + gu_rows(i0), D, static_cast<int>(i1 - i0), static_cast<int>(D), &j.x_ptr[r0], nt, y.data(), nullptr};
      a.gguf = j.gu_gguf;
      a.ldb = j.gu_ldb;
      if (j.wdt == WDtype::FP8) {  // gate's block grid first, then up's (fp8.py)
        a.lds = blocks(D);
        a.srow0 = static_cast<int>(i0);
        a.wscale = j.gate_up_scale.data_ptr<float>() + (size_t)j.group_expert[g] * 2 * blocks(I) * a.lds;
      }
      const uint8_t* mxs = nullptr;  // mxfp4: the expert's E8M0 rows, D/32 bytes each
      if (j.wdt == WDtype::MXFP4) {
        mxs = j.gate_up_scale.data_ptr<uint8_t>() + (size_t)j.group_expert[g] * 2 * I * (D / kMxBlock);
        a.mxscale = mxs + (size_t)i0 * (D / kMxBlock);
      }
      gemv()(a);  // gate rows
      for (int t = 0; t < nt; ++t) y[t] = j.h_ptr[r0 + t] + I + i0;
      a.W = W + gu_rows(I + i0);
      if (j.wdt == WDtype::FP8) a.wscale += blocks(I) * a.lds;
      if (mxs) a.mxscale = mxs + (size_t)(I + i0) * (D / kMxBlock);
      gemv()(a);  // up rows
      for (int t = 0; t < nt; ++t) {
        const float* hg = j.h_ptr[r0 + t];
        const void* gb = j.gate_up_bias;
        const size_t bias0 = (size_t)j.group_expert[g] * 2 * I;
        for (int64_t i = i0; i < i1; ++i) {
          float gv = hg[i], uv = hg[I + i];
          if (gb) { gv += bias_at(gb, bias0 + i); uv += bias_at(gb, bias0 + I + i); }
          float v;
          if (j.clamped) {  // gpt-oss
            gv = std::min(gv, j.limit);
            uv = std::max(-j.limit, std::min(uv, j.limit));
            v = (uv + 1.f) * (gv / (1.f + std::exp(-j.alpha * gv)));
          } else {
            v = gv / (1.f + std::exp(-gv)) * uv;  // silu(gate) * up
          }
          // mxfp4: in the down GEMV's layout
          if (bf16_x()) j.act_bf16[(size_t)(r0 + t) * I + (mxs ? mxfp4_bx_pos(i, I) : i)] = f32_to_bf16(v);
          else j.act_f32[(size_t)(r0 + t) * I + (mxs ? mxfp4_x_pos(i) : i)] = v;
        }
      }
      if (j.q8_inputs) quantize_filled(g, i0, i1);
      u += i1 - i0;
    }
  }

  // q8 inputs: the SwiGLU outputs [i0, i1) of group g are written. The thread that completes a 256-value block
  // (its counter reaches the block's length: 256, or I's tail for a partial last block; acq_rel: the other
  // writers' values are visible) quantizes it for the group's routes, so phase 2 needs no extra barrier.
  void quantize_filled(int g, int64_t i0, int64_t i1) {
    Job& j = job_;
    const int64_t I = j.I, nbI = q8_blocks(I);
    for (int64_t b = i0 / 256; b * 256 < i1; ++b) {
      const int64_t end = std::min(I, (b + 1) * 256);
      const int n = static_cast<int>(std::min(i1, end) - std::max(i0, b * 256));
      if (j.act_filled[g * nbI + b].fetch_add(n, std::memory_order_acq_rel) + n != end - 256 * b) continue;
      for (int r = j.group_start[g]; r < j.group_start[g + 1]; ++r)
        gguf_quantize_inputs(j.dn_gguf, &j.act_f32[(size_t)r * I + 256 * b], end - 256 * b, &j.act_q8[(size_t)r * nbI + b]);
    }
  }

  // Phase 2: output rows [d0, d1) summed over every expert group (no two threads share a row).
  void down_range(const int64_t d0, const int64_t d1) {
    Job& j = job_;
    const int64_t D = j.D, I = j.I;
    float* out = j.out.data_ptr<float>();
    for (int t = 0; t < j.T; ++t) std::fill(out + (size_t)t * D + d0, out + (size_t)t * D + d1, 0.f);
    const char* bank = static_cast<const char*>(j.down.data_ptr());
    thread_local std::vector<float*> y;
    for (int g = 0; g < j.G; ++g) {
      const int r0 = j.group_start[g], nt = j.group_start[g + 1] - r0;
      y.resize(nt);
      for (int t = 0; t < nt; ++t) y[t] = j.out_ptr[r0 + t] + d0;
      const char* W = bank + dn_rows((size_t)j.group_expert[g] * D + d0);
      GemvArgs a{W, I, static_cast<int>(d1 - d0), static_cast<int>(I), &j.act_ptr[r0], nt, y.data(), &j.route_w[r0]};
      a.gguf = j.dn_gguf;
      a.ldb = j.dn_ldb;
      if (j.wdt == WDtype::FP8) {
        a.lds = blocks(I);
        a.srow0 = static_cast<int>(d0);
        a.wscale = j.down_scale.data_ptr<float>() + (size_t)j.group_expert[g] * blocks(D) * a.lds;
      }
      if (j.wdt == WDtype::MXFP4)
        a.mxscale = j.down_scale.data_ptr<uint8_t>() + ((size_t)j.group_expert[g] * D + d0) * (I / kMxBlock);
      gemv()(a);
      if (j.down_bias) {  // gpt-oss: + route weight x bias, like transformers' (down(act) + bias) * w
        const size_t b0 = (size_t)j.group_expert[g] * D;
        for (int t = 0; t < nt; ++t)
          for (int64_t d = d0; d < d1; ++d) y[t][d - d0] += j.route_w[r0 + t] * bias_at(j.down_bias, b0 + d);
      }
    }
  }

  std::unordered_map<const void*, std::pair<const void*, const void*>> expert_math_;  // gate_up bank -> biases
  std::unordered_map<const void*, bool> bias_bf16_;  // gate_up bank -> its biases are bf16 (else fp32)
  std::unordered_map<const void*, std::pair<int, int>> gguf_layers_;  // gate_up bank -> (gate_up, down) GgufType
  std::vector<std::vector<torch::Tensor>> bias_keep_;
  bool clamped_ = false;
  float alpha_ = 0.f, limit_ = 0.f;
  int n_;
  int64_t spin_ns_;
  IsaKernels k_{};
  Job job_;
  bool busy_ = false;
  std::atomic<bool> stop_{false};
  SpinBarrier barrier_;
  std::unique_ptr<Cursor[]> cursors_[2];  // per thread, phase 1 and phase 2
  std::atomic<bool> polling_{false};
  std::atomic<bool> in_poll_{false};  // worker 0 is inside poll_step()
  int64_t poll_idle_since_ = 0;
  PollState poll_;
  CudaDriver drv_;
  bool driver_ok_ = false;
  DeviceLink link_;
  std::atomic<bool> loop_stop_{false};
  std::atomic<int64_t> loop_jobs_{0}, loop_bytes_{0};
  std::mutex poll_m_;
  std::vector<std::thread> threads_;
  std::mutex m_;
  std::condition_variable cv_start_, cv_done_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int> remaining_{0};
};

// One FP8 GEMV kernel alone, on the calling thread (tests: every e4m3 code through every kernel):
// W [N, K] float8_e4m3fn · scale [ceil(N/128), ceil(K/128)] fp32 · X [T, K] fp32 (the exact kernel) or
// bf16 (the dpbf16 kernel) -> Y [T, N] fp32, Y[t, n] = sum_k W[n, k] scale[n/128, k/128] X[t, k].
static torch::Tensor gemv_fp8(const std::string& isa, torch::Tensor W, torch::Tensor scale, torch::Tensor X) {
  const IsaKernels k = select_kernels(isa.c_str());
  TORCH_CHECK(k.name != nullptr, "gemv_fp8: ISA '", isa, "' is not supported by this CPU");
  TORCH_CHECK(W.scalar_type() == torch::kFloat8_e4m3fn && W.dim() == 2 && W.is_contiguous(), "gemv_fp8: W must be contiguous e4m3 [N, K]");
  const int64_t N = W.size(0), K = W.size(1);
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() && scale.dim() == 2 &&
              scale.size(0) == (N + kFp8Block - 1) / kFp8Block && scale.size(1) == (K + kFp8Block - 1) / kFp8Block,
              "gemv_fp8: scale must be contiguous fp32 [ceil(N/128), ceil(K/128)]");
  TORCH_CHECK(X.dim() == 2 && X.size(1) == K && X.is_contiguous(), "gemv_fp8: X must be contiguous [T, K]");
  const bool bx = X.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bx || X.scalar_type() == torch::kFloat32, "gemv_fp8: X must be float32 or bfloat16");
  const GemvFn fn = bx ? k.gemv_fp8_bx : k.gemv_fp8;
  TORCH_CHECK(fn != nullptr, "gemv_fp8: ISA '", isa, "' has no FP8 kernel for ", bx ? "bf16" : "fp32", " inputs");
  const int64_t T = X.size(0);
  torch::Tensor Y = torch::empty({T, N}, torch::kFloat32);
  std::vector<const void*> x(T);
  std::vector<float*> y(T);
  for (int64_t t = 0; t < T; ++t) {
    x[t] = static_cast<const char*>(X.data_ptr()) + t * K * X.element_size();
    y[t] = Y.data_ptr<float>() + t * N;
  }
  GemvArgs a{W.data_ptr(), K, static_cast<int>(N), static_cast<int>(K), x.data(), static_cast<int>(T), y.data(), nullptr};
  a.wscale = scale.data_ptr<float>();
  a.lds = scale.size(1);
  fn(a);
  return Y;
}

// One GGUF GEMV kernel alone, on the calling thread (tests): W uint8 [N, >= row bytes of K] of `type`
// (gguf_quant.KERNEL_CODE) · X [T, K] fp32 -> Y [T, N] fp32; q8: X quantized (gguf_quantize_inputs) for the
// int8-input kernel, else the fp32-input kernel.
static torch::Tensor gemv_gguf(const std::string& isa, torch::Tensor W, int64_t type, torch::Tensor X, bool q8) {
  const IsaKernels k = select_kernels(isa.c_str());
  TORCH_CHECK(k.name != nullptr, "gemv_gguf: ISA '", isa, "' is not supported by this CPU");
  TORCH_CHECK(X.scalar_type() == torch::kFloat32 && X.dim() == 2 && X.is_contiguous(), "gemv_gguf: X must be contiguous fp32 [T, K]");
  const int64_t N = W.size(0), K = X.size(1), T = X.size(0);
  TORCH_CHECK(gguf_block_values(type) > 0 && K % gguf_block_values(type) == 0 && W.scalar_type() == torch::kUInt8 &&
                  W.dim() == 2 && W.is_contiguous() && W.size(1) >= gguf_row_bytes(type, K),
              "gemv_gguf: W must be contiguous uint8 [N, >= row bytes] of a type 1..5 whose blocks divide K");
  const GemvFn fn = q8 ? k.gemv_gguf_q8 : k.gemv_gguf;
  TORCH_CHECK(fn != nullptr, "gemv_gguf: ISA '", isa, "' has no ", q8 ? "int8-input kernel" : "GGUF kernel");
  std::vector<Q8Block> xq(q8 ? T * q8_blocks(K) : 0);
  torch::Tensor Y = torch::empty({T, N}, torch::kFloat32);
  std::vector<const void*> x(T);
  std::vector<float*> y(T);
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = X.data_ptr<float>() + t * K;
    if (q8) gguf_quantize_inputs(static_cast<int>(type), xt, K, &xq[t * q8_blocks(K)]);
    x[t] = q8 ? static_cast<const void*>(&xq[t * q8_blocks(K)]) : static_cast<const void*>(xt);
    y[t] = Y.data_ptr<float>() + t * N;
  }
  GemvArgs a{W.data_ptr(), K, static_cast<int>(N), static_cast<int>(K), x.data(), static_cast<int>(T), y.data(), nullptr};
  a.gguf = static_cast<int>(type);
  a.ldb = W.size(1);
  fn(a);
  return Y;
}

}  // namespace tandem

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Tandem CPU MoE executor (persistent pinned thread pool, per-ISA GEMV kernels)";
  pybind11::class_<tandem::Executor>(m, "Executor")
      .def(pybind11::init<std::vector<int64_t>, int64_t, int64_t, std::string>(),
           pybind11::arg("cpus"), pybind11::arg("num_threads"), pybind11::arg("spin_us"), pybind11::arg("isa"))
      .def("submit", &tandem::Executor::submit)
      .def("set_expert_math", &tandem::Executor::set_expert_math)
      .def("set_gguf_layers", &tandem::Executor::set_gguf_layers)
      .def("wait", &tandem::Executor::wait)
      .def("read_seconds", &tandem::Executor::read_seconds)
      .def("start_polling", &tandem::Executor::start_polling)
      .def("stop_polling", &tandem::Executor::stop_polling)
      .def("poll_stats", &tandem::Executor::poll_stats)
      .def("link_device", &tandem::Executor::link_device)
      .def("device_submit", &tandem::Executor::device_submit)
      .def("device_sync", &tandem::Executor::device_sync)
      .def("start_loop", &tandem::Executor::start_loop)
      .def("stop_loop", &tandem::Executor::stop_loop)
      .def("loop_counters", &tandem::Executor::loop_counters)
      .def_property_readonly("isa", &tandem::Executor::isa)
      .def_property_readonly("fp8_bf16_inputs", &tandem::Executor::fp8_bf16_inputs)
      .def_property_readonly("gguf_q8_inputs", &tandem::Executor::gguf_q8_inputs)
      .def_property_readonly("num_threads", &tandem::Executor::num_threads);
  m.def("set_stream_prefetch", &tandem::set_stream_prefetch);
  m.def("gemv_fp8", &tandem::gemv_fp8, pybind11::arg("isa"), pybind11::arg("W"), pybind11::arg("scale"), pybind11::arg("X"));
  m.def("gemv_gguf", &tandem::gemv_gguf, pybind11::arg("isa"), pybind11::arg("W"), pybind11::arg("type"), pybind11::arg("X"),
        pybind11::arg("q8"));
  m.def("select_isa", [](std::string force) {
    auto k = tandem::select_kernels(force.c_str());
    return std::string(k.name ? k.name : "");
  });
}
