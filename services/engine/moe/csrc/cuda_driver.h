// The few CUDA driver entry points the eager device handoff needs, resolved at run time with dlopen:
// the extension is built without the CUDA toolkit (CPU CI builds the same source), and one C++ call that
// enqueues the input copies, the ready flag and later the result's upload replaces ~6 torch ops per
// layer (each a Python dispatch and, for copies into pinned memory, an extra event record).
#pragma once
#include <dlfcn.h>

#include <string>

namespace tandem {

struct CudaDriver {
  using CUresult = int;
  using CUdeviceptr = unsigned long long;
  using CUstream = void*;
  using CUcontext = void*;
  CUresult (*dtoh)(void* dst, CUdeviceptr src, size_t n, CUstream s) = nullptr;
  CUresult (*htod)(CUdeviceptr dst, const void* src, size_t n, CUstream s) = nullptr;
  CUresult (*ctx_get)(CUcontext* ctx) = nullptr;
  CUresult (*ctx_set)(CUcontext ctx) = nullptr;
  CUresult (*error_string)(CUresult r, const char** s) = nullptr;

  // "" when every entry point resolved, else why not
  std::string load() {
    void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);  // torch has it loaded already
    if (!h) h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) return std::string("dlopen libcuda.so.1: ") + dlerror();
    std::string missing;
    auto sym = [&](const char* name, auto& fn) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
      if (!fn) missing += std::string(missing.empty() ? "" : ", ") + name;
    };
    sym("cuMemcpyDtoHAsync_v2", dtoh);
    sym("cuMemcpyHtoDAsync_v2", htod);
    sym("cuCtxGetCurrent", ctx_get);
    sym("cuCtxSetCurrent", ctx_set);
    sym("cuGetErrorString", error_string);
    return missing.empty() ? "" : "libcuda.so.1 lacks " + missing;
  }

  std::string describe(CUresult r) const {
    const char* s = nullptr;
    if (error_string) error_string(r, &s);
    return "CUDA error " + std::to_string(r) + (s ? std::string(" (") + s + ")" : std::string());
  }
};

}  // namespace tandem
