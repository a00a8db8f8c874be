// Shared checks for the torch bindings (host only).
// Messages pass only string arguments: on the device build a TORCH_CHECK that formatted an
// int64_t inside an nvcc-compiled file crashed the process (SIGSEGV) instead of raising, while
// const char* arguments raise normally (probed 2026-11-29; cause not found).
#pragma once

#include <ATen/core/Tensor.h>
#if !(defined(DS_EMU) && DS_EMU)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <cstdint>
#include <initializer_list>

#include "../kernels/compat.cuh"

namespace ds_ops {

using TensorRefs = std::initializer_list<const at::Tensor*>;  // for checks over several inputs

#if DS_EMU
inline void check_cuda(const at::Tensor& t, const char* name) {  // the emulation runs on the CPU
  TORCH_CHECK(t.is_cpu(), "deltaserve (emulated kernels): ", name, " must be a CPU tensor");
}
struct DeviceGuard {
  explicit DeviceGuard(const c10::Device&) {}
};
#else
inline void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "deltaserve: ", name, " must be a CUDA tensor");
}
using DeviceGuard = c10::cuda::CUDAGuard;
#endif

inline void check_dtype(const at::Tensor& t, at::ScalarType dt, const char* name) {
  TORCH_CHECK(t.scalar_type() == dt, "deltaserve: ", name, " must be ", c10::toString(dt),
              ", got ", c10::toString(t.scalar_type()));
}

inline void check_dense(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_contiguous(), "deltaserve: ", name, " must be contiguous");
}

// Innermost `inner` dims dense; with align > 1 also outer strides multiples of `align` elements
// and the pointer 16-byte aligned (vector loads).
inline void check_rows(const at::Tensor& t, int inner, int64_t align, const char* name) {
  int64_t expect = 1;
  for (int d = t.dim() - 1; d >= t.dim() - inner; --d) {
    TORCH_CHECK(t.size(d) == 1 || t.stride(d) == expect, "deltaserve: ", name,
                " must be dense in its innermost dims");
    expect *= t.size(d);
  }
  for (int d = 0; d < t.dim() - inner; ++d)
    TORCH_CHECK(t.stride(d) % align == 0, "deltaserve: ", name,
                " row stride must be a multiple of the vector width (16 bytes)");
  TORCH_CHECK(align == 1 || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "deltaserve: ",
              name, " must be 16-byte aligned");
}

// 16-byte accesses fit t's rows from element `offset` on, in pieces of `piece` elements: the
// start, every outer stride, the offset and the piece whole 16-byte vectors (else the kernels
// take their element-wise path).
inline bool vectors_fit(const at::Tensor& t, int64_t piece, int64_t offset = 0) {
  const int64_t n = 16 / t.element_size();
  bool ok = piece % n == 0 && offset % n == 0 &&
            reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int d = 0; d + 1 < t.dim(); ++d) ok = ok && t.stride(d) % n == 0;
  return ok;
}

inline void check_launch(ds_error_t err, const char* op) {
  TORCH_CHECK(err == DS_SUCCESS, "deltaserve: ", op, " launch failed: ",
#if DS_EMU
              "invalid launch configuration");
#elif DS_HIP
              hipGetErrorString(err));
#else
              cudaGetErrorString(err));
#endif
}

inline ds_stream_t stream_of(const at::Tensor& t) {
#if DS_EMU
  (void)t;
  return nullptr;
#else
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
#endif
}

}  // namespace ds_ops

// Storage-type dispatch: binds `scalar_t` to ds::bf16 / ds::f16 / float.
#define DS_DISPATCH_FLOAT(dtype, name, ...)                                            \
  [&] {                                                                                \
    switch (dtype) {                                                                   \
      case at::kBFloat16: { using scalar_t = ds::bf16; return __VA_ARGS__(); }         \
      case at::kHalf: { using scalar_t = ds::f16; return __VA_ARGS__(); }              \
      case at::kFloat: { using scalar_t = float; return __VA_ARGS__(); }               \
      default: TORCH_CHECK(false, "deltaserve: ", name, ": unsupported dtype ",         \
                           c10::toString(dtype));                                      \
    }                                                                                  \
  }()

// The same over the 16-bit storage types only (kernels that stage 16-byte words of 8 elements).
#define DS_DISPATCH_HALF(dtype, name, ...)                                             \
  [&] {                                                                                \
    switch (dtype) {                                                                   \
      case at::kBFloat16: { using scalar_t = ds::bf16; return __VA_ARGS__(); }         \
      case at::kHalf: { using scalar_t = ds::f16; return __VA_ARGS__(); }              \
      default: TORCH_CHECK(false, "deltaserve: ", name, ": unsupported dtype ",         \
                           c10::toString(dtype));                                      \
    }                                                                                  \
  }()
