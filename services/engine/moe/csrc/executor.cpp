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
#include <torch/extension.h>

#include <pthread.h>
#include <sched.h>
#include <immintrin.h>

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
#include <vector>

#include "gemv.h"

namespace tandem {

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
  int64_t ready_value = 0;
  int T = 0, A = 0, D = 0, I = 0, E = 0;
  WDtype wdt = WDtype::F32;
  // scratch, sized in submit() for the worst case R = T*A
  std::vector<int> count;            // [E]
  std::vector<int> group_expert;     // [G]
  std::vector<int> group_start;      // [G+1] into the route arrays
  std::vector<int> route_tok;        // [R] token of each route, grouped by expert
  std::vector<float> route_w;        // [R]
  std::vector<float> w_f32;          // [T, A] the route weights in fp32
  std::vector<float> x_f32;          // [T, D]
  std::vector<uint16_t> x_bf16;      // [T, D]
  std::vector<float> h;              // [R, 2I] gate then up outputs
  std::vector<float> act_f32;        // [R, I]
  std::vector<uint16_t> act_bf16;    // [R, I]
  std::vector<const void*> x_ptr;    // [R] phase-1 inputs per route
  std::vector<const void*> act_ptr;  // [R] phase-2 inputs per route
  std::vector<float*> h_ptr;         // [R]
  std::vector<float*> out_ptr;       // [R]
  int G = 0, R = 0;
  std::string error;
  int64_t t_ready_ns = 0, t_done_ns = 0;
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
    }
  }
  ~Executor() {
    if (polling_) {
      polling_ = false;
      poller_.join();
    }
    {
      std::lock_guard<std::mutex> g(m_);
      stop_ = true;
      gen_.fetch_add(1);
    }
    cv_start_.notify_all();
    for (auto& th : threads_) th.join();
  }

  std::string isa() const { return k_.name; }
  int64_t num_threads() const { return n_; }

  // hidden [T, D] fp32|bf16 · ids [T, A] int64|int32 (< 0: skipped) · weights [T, A] fp32|bf16 ·
  // gate_up [E, 2I, D], down [E, D, I] (same dtype, fp32|bf16) · out [T, D] fp32 (overwritten) ·
  // ready: empty or a pinned int64 [1] the workers poll until it is >= ready_value.
  void submit(torch::Tensor hidden, torch::Tensor ids, torch::Tensor weights, torch::Tensor gate_up,
              torch::Tensor down, torch::Tensor out, torch::Tensor ready, int64_t ready_value) {
    TORCH_CHECK(!busy_, "cpu executor: submit() while a job is in flight; call wait() first");
    TORCH_CHECK(!polling_, "cpu executor: submit() while graph-mode polling is on; stop_polling() first");
    setup_job(hidden, ids, weights, gate_up, down, out, ready, ready_value);
    dispatch();
  }

 private:
  void setup_job(torch::Tensor hidden, torch::Tensor ids, torch::Tensor weights, torch::Tensor gate_up,
                 torch::Tensor down, torch::Tensor out, torch::Tensor ready, int64_t ready_value) {
    const auto T = hidden.size(0), D = hidden.size(1), A = ids.size(1);
    const auto E = gate_up.size(0), I = down.size(2);
    TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "cpu executor: hidden must be contiguous [T, D]");
    TORCH_CHECK(ids.dim() == 2 && ids.size(0) == T && ids.is_contiguous(), "cpu executor: ids must be contiguous [T, A]");
    TORCH_CHECK(weights.sizes() == ids.sizes() && weights.is_contiguous(), "cpu executor: weights must be contiguous [T, A] like ids");
    TORCH_CHECK(gate_up.dim() == 3 && gate_up.size(1) == 2 * I && gate_up.size(2) == D && gate_up.is_contiguous(),
                "cpu executor: gate_up bank must be contiguous [E, 2I, D]");
    TORCH_CHECK(down.dim() == 3 && down.size(0) == E && down.size(1) == D && down.is_contiguous(),
                "cpu executor: down bank must be contiguous [E, D, I]");
    TORCH_CHECK(gate_up.scalar_type() == down.scalar_type() &&
                (gate_up.scalar_type() == torch::kFloat32 || gate_up.scalar_type() == torch::kBFloat16),
                "cpu executor: banks must both be float32 or bfloat16");
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
    j.ready = ready.defined() && ready.numel() > 0 ? ready : torch::Tensor();
    j.ready_value = ready_value;
    j.T = T; j.A = A; j.D = D; j.I = I; j.E = E;
    j.wdt = gate_up.scalar_type() == torch::kBFloat16 ? WDtype::BF16 : WDtype::F32;
    const size_t Rmax = static_cast<size_t>(T * A);
    j.count.assign(E, 0);
    j.group_expert.resize(Rmax + 1);
    j.group_start.resize(Rmax + 2);
    j.route_tok.resize(Rmax); j.route_w.resize(Rmax); j.w_f32.resize(Rmax);
    j.x_f32.resize(T * D);
    if (bf16_x()) j.x_bf16.resize(T * D);
    j.h.resize(Rmax * 2 * I);
    if (bf16_x()) j.act_bf16.resize(Rmax * I); else j.act_f32.resize(Rmax * I);
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
  // No Python per layer: a poller thread watches a pinned job word that the GPU stream writes after
  // copying the inputs down (seq << 20 | T << 10 | layer), runs the job on the pool and then writes
  // seq to the pinned done word, which a GPU kernel polls before adding the output. Capturable in a
  // CUDA graph because every step of the handoff is a copy or a kernel.
  void start_polling(torch::Tensor job_word, torch::Tensor done_word, torch::Tensor hidden, torch::Tensor ids,
                     torch::Tensor weights, torch::Tensor out, std::vector<torch::Tensor> gate_ups,
                     std::vector<torch::Tensor> downs) {
    TORCH_CHECK(!polling_ && !busy_, "cpu executor: start_polling() while busy or already polling");
    for (auto* w : {&job_word, &done_word})
      TORCH_CHECK(w->scalar_type() == torch::kInt64 && w->numel() >= 1 && w->device().is_cpu(),
                  "cpu executor: job/done words must be int64 CPU (pinned) tensors");
    TORCH_CHECK(gate_ups.size() == downs.size() && !gate_ups.empty(), "cpu executor: one gate_up and one down bank per layer");
    TORCH_CHECK(gate_ups.size() < 1024 && hidden.size(0) < 1024, "cpu executor: graph mode encodes layer and T in 10 bits");
    poll_ = PollState{job_word, done_word, hidden, ids, weights, out, std::move(gate_ups), std::move(downs)};
    poll_.last_seq = done_word.data_ptr<int64_t>()[0];
    polling_ = true;
    poller_ = std::thread([this] { poll_loop(); });
  }

  void stop_polling() {
    if (!polling_) return;
    polling_ = false;
    pybind11::gil_scoped_release nogil;
    poller_.join();
  }

  // (jobs, compute ns, experts, routes, last seq) since start_polling, and the last error ("" if none)
  std::tuple<std::vector<int64_t>, std::string> poll_stats() {
    std::lock_guard<std::mutex> g(poll_m_);
    return {{poll_.jobs, poll_.compute_ns, poll_.experts, poll_.routes, poll_.last_seq}, poll_.error};
  }

 private:
  struct PollState {
    torch::Tensor job_word, done_word, hidden, ids, weights, out;
    std::vector<torch::Tensor> gate_ups, downs;
    int64_t last_seq = 0, jobs = 0, compute_ns = 0, experts = 0, routes = 0;
    std::string error;
  };

  void poll_loop() {
    auto* job = reinterpret_cast<volatile int64_t*>(poll_.job_word.data_ptr<int64_t>());
    auto* done = reinterpret_cast<volatile int64_t*>(poll_.done_word.data_ptr<int64_t>());
    int64_t idle_since = now_ns();
    while (polling_) {
      const int64_t w = *job, seq = w >> 20;
      if (seq <= poll_.last_seq) {  // idle: spin while layers come back to back, then nap
        if (now_ns() - idle_since < 2000000) _mm_pause();
        else std::this_thread::sleep_for(std::chrono::microseconds(20));
        continue;
      }
      std::atomic_thread_fence(std::memory_order_acquire);
      const int64_t T = (w >> 10) & 1023, layer = w & 1023;
      std::string err;
      try {
        TORCH_CHECK(layer < (int64_t)poll_.gate_ups.size() && T <= poll_.hidden.size(0),
                    "graph-mode job word names layer ", layer, " and T=", T, " beyond the registered buffers");
        setup_job(poll_.hidden.narrow(0, 0, T), poll_.ids.narrow(0, 0, T), poll_.weights.narrow(0, 0, T),
                  poll_.gate_ups[layer], poll_.downs[layer], poll_.out.narrow(0, 0, T), torch::Tensor(), 0);
        dispatch();
        while (remaining_.load(std::memory_order_acquire) != 0) _mm_pause();
        busy_ = false;
        err = job_.error;
      } catch (const c10::Error& e) {
        err = e.what_without_backtrace();
      } catch (const std::exception& e) {
        err = e.what();
      }
      if (!err.empty()) {
        busy_ = false;
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
      std::atomic_thread_fence(std::memory_order_release);
      *done = seq;
      idle_since = now_ns();
    }
  }

 public:

  // STREAM-style read of `buf` (fp32, contiguous) by the pool, `reps` times; returns the best seconds.
  double read_seconds(torch::Tensor buf, int64_t reps) {
    TORCH_CHECK(!busy_, "cpu executor: read_seconds() while a job is in flight");
    TORCH_CHECK(buf.scalar_type() == torch::kFloat32 && buf.is_contiguous() && buf.device().is_cpu(),
                "cpu executor: read buffer must be contiguous fp32 on the CPU");
    double best = 1e30, sink = 0;
    for (int64_t r = 0; r < reps; ++r) {
      job_.read_only = true;
      job_.hidden = buf;
      job_.read_sums.assign(n_, 0.0);
      job_.error.clear();
      const int64_t t0 = now_ns();
      busy_ = true;
      remaining_.store(n_, std::memory_order_relaxed);
      {
        std::lock_guard<std::mutex> g(m_);
        gen_.fetch_add(1, std::memory_order_release);
      }
      cv_start_.notify_all();
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
    TORCH_CHECK(err.empty(), "cpu executor: ", err);
    return {j.t_ready_ns, j.t_done_ns, j.G, j.R};
  }

 private:
  bool bf16_x() const { return job_.wdt == WDtype::BF16 && k_.bf16_wants_bf16_x; }

  void worker(int tid, int cpu) {
    if (cpu >= 0) {  // pin: one worker per physical core, no migration mid-stream
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(cpu, &set);
      pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
    }
    uint64_t seen = 0;
    while (true) {
      // Spin a while for the next layer's job (decode layers arrive every few hundred µs), then sleep.
      const int64_t deadline = now_ns() + spin_ns_;
      while (gen_.load(std::memory_order_acquire) == seen && now_ns() < deadline) _mm_pause();
      if (gen_.load(std::memory_order_acquire) == seen) {
        std::unique_lock<std::mutex> lk(m_);
        cv_start_.wait(lk, [&] { return gen_.load(std::memory_order_acquire) != seen; });
      }
      seen = gen_.load(std::memory_order_acquire);
      if (stop_) return;
      run(tid);
      if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> g(m_);
        cv_done_.notify_all();
      }
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
    if (tid == 0) prepare();
    barrier_.wait();
    if (!j.error.empty()) return;
    for_chunks(cursors_[0].get(), tid, kChunkPairs, [this](int64_t a, int64_t b) { gate_up_range(a, b); });
    barrier_.wait();
    for_chunks(cursors_[1].get(), tid, kChunkRows, [this](int64_t a, int64_t b) { down_range(a, b); });
    barrier_.wait();
    if (tid == 0) j.t_done_ns = now_ns();
  }

  // Phase 0 (thread 0): wait for the inputs, group routes by expert, convert inputs.
  void prepare() {
    Job& j = job_;
    if (j.ready.defined()) {
      auto* flag = reinterpret_cast<volatile int64_t*>(j.ready.data_ptr<int64_t>());
      int64_t spins = 0;
      while (*flag < j.ready_value) {
        _mm_pause();
        if (++spins % 4096 == 0) sched_yield();  // the GPU may be ms behind the host: don't starve it
      }
      std::atomic_thread_fence(std::memory_order_acquire);
    }
    j.t_ready_ns = now_ns();
    const int T = j.T, A = j.A, D = j.D, I = j.I, E = j.E;
    const bool ids64 = j.ids.scalar_type() == torch::kInt64;
    const void* ids_raw = j.ids.data_ptr();
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
    // inputs: fp32 copy, plus bf16 for the dpbf16 kernel
    to_f32(j.hidden, (int64_t)T * D, j.x_f32.data());
    if (bf16_x()) for (int64_t i = 0; i < (int64_t)T * D; ++i) j.x_bf16[i] = f32_to_bf16(j.x_f32[i]);
    float* out = j.out.data_ptr<float>();
    for (int r = 0; r < R; ++r) {
      const int tok = j.route_tok[r];
      j.x_ptr[r] = bf16_x() ? static_cast<const void*>(&j.x_bf16[(size_t)tok * D]) : static_cast<const void*>(&j.x_f32[(size_t)tok * D]);
      j.act_ptr[r] = bf16_x() ? static_cast<const void*>(&j.act_bf16[(size_t)r * I]) : static_cast<const void*>(&j.act_f32[(size_t)r * I]);
      j.h_ptr[r] = &j.h[(size_t)r * 2 * I];
      j.out_ptr[r] = out + (size_t)tok * D;
    }
    reset_cursors(cursors_[0].get(), (int64_t)G * I);
    reset_cursors(cursors_[1].get(), D);
  }

  GemvFn gemv() const { return job_.wdt == WDtype::BF16 ? k_.gemv_bf16 : k_.gemv_f32; }
  size_t welem() const { return job_.wdt == WDtype::BF16 ? 2 : 4; }

  // Work split: each thread owns a contiguous share of a phase's units (one linear DRAM stream) and
  // takes it in chunks through its cursor; a thread done with its share takes chunks from the others'
  // cursors, so a core slowed by anything else (an interrupt, a neighbour) does not stall the barrier.
  struct alignas(64) Cursor {
    std::atomic<int64_t> next{0};
    int64_t end = 0;
  };
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
      const char* W = bank + ((size_t)j.group_expert[g] * 2 * I * D) * welem();
      thread_local std::vector<float*> y;
      y.resize(nt);
      for (int t = 0; t < nt; ++t) y[t] = j.h_ptr[r0 + t] + i0;
      GemvArgs a{W + (size_t)i0 * D * welem(), D, static_cast<int>(i1 - i0), static_cast<int>(D), &j.x_ptr[r0], nt, y.data(), nullptr};
      gemv()(a);  // gate rows
      for (int t = 0; t < nt; ++t) y[t] = j.h_ptr[r0 + t] + I + i0;
      a.W = W + (size_t)(I + i0) * D * welem();
      gemv()(a);  // up rows
      for (int t = 0; t < nt; ++t) {
        const float* hg = j.h_ptr[r0 + t];
        for (int64_t i = i0; i < i1; ++i) {
          const float gv = hg[i], uv = hg[I + i];
          const float v = gv / (1.f + std::exp(-gv)) * uv;  // silu(gate) * up
          if (bf16_x()) j.act_bf16[(size_t)(r0 + t) * I + i] = f32_to_bf16(v);
          else j.act_f32[(size_t)(r0 + t) * I + i] = v;
        }
      }
      u += i1 - i0;
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
      const char* W = bank + ((size_t)j.group_expert[g] * D * I + (size_t)d0 * I) * welem();
      GemvArgs a{W, I, static_cast<int>(d1 - d0), static_cast<int>(I), &j.act_ptr[r0], nt, y.data(), &j.route_w[r0]};
      gemv()(a);
    }
  }

  int n_;
  int64_t spin_ns_;
  IsaKernels k_{};
  Job job_;
  bool busy_ = false;
  std::atomic<bool> stop_{false};
  SpinBarrier barrier_;
  std::unique_ptr<Cursor[]> cursors_[2];  // per thread, phase 1 and phase 2
  std::atomic<bool> polling_{false};
  std::thread poller_;
  PollState poll_;
  std::mutex poll_m_;
  std::vector<std::thread> threads_;
  std::mutex m_;
  std::condition_variable cv_start_, cv_done_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int> remaining_{0};
};

}  // namespace tandem

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Tandem CPU MoE executor (persistent pinned thread pool, per-ISA GEMV kernels)";
  pybind11::class_<tandem::Executor>(m, "Executor")
      .def(pybind11::init<std::vector<int64_t>, int64_t, int64_t, std::string>(),
           pybind11::arg("cpus"), pybind11::arg("num_threads"), pybind11::arg("spin_us"), pybind11::arg("isa"))
      .def("submit", &tandem::Executor::submit)
      .def("wait", &tandem::Executor::wait)
      .def("read_seconds", &tandem::Executor::read_seconds)
      .def("start_polling", &tandem::Executor::start_polling)
      .def("stop_polling", &tandem::Executor::stop_polling)
      .def("poll_stats", &tandem::Executor::poll_stats)
      .def_property_readonly("isa", &tandem::Executor::isa)
      .def_property_readonly("num_threads", &tandem::Executor::num_threads);
  m.def("select_isa", [](std::string force) {
    auto k = tandem::select_kernels(force.c_str());
    return std::string(k.name ? k.name : "");
  });
}
