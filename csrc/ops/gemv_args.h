// The weight-side checks of the gemv bindings (linear.cu, linear_prologue.cu): weight [N, K]
// dense and 16-byte aligned in the activation dtype, optional bias [N], M in 1..32 rows, K a
// positive multiple of 8. Host only.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstdint>
#include <optional>

#include "../kernels/gemv.cuh"
#include "common.h"

namespace ds_ops {

inline bool aligned16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

// GemvParams for y [m, N] = x [m, k] · weight [N, k]ᵀ (+ bias), x left for the caller to set;
// y allocated (like `like`) into `y`. `op` names the op in the messages.
inline ds::gemv::GemvParams gemv_params(const at::Tensor& like, const at::Tensor& weight,
                                        const std::optional<at::Tensor>& bias, int64_t m,
                                        int64_t k, at::Tensor& y) {
  check_cuda(weight, "weight");
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == k,
              "deltaserve: gemv weight must be [N, K] with K the input's width");
  check_dtype(weight, like.scalar_type(), "weight (x's dtype)");
  check_dense(weight, "weight");
  const int64_t n = weight.size(0);
  TORCH_CHECK(m >= 1 && m <= ds::gemv::kMaxRows, "deltaserve: gemv takes 1 to 32 rows of x");
  TORCH_CHECK(k >= 8 && k % 8 == 0 && k <= (int64_t(1) << 30),
              "deltaserve: gemv K must be a positive multiple of 8 (at most 2^30)");
  TORCH_CHECK(n >= 1 && n <= (int64_t(1) << 31) - 1 - ds::gemv::kTileCols,
              "deltaserve: gemv N must be in [1, 2^31 - 9]");
  TORCH_CHECK(aligned16(weight), "deltaserve: gemv weight must be 16-byte aligned");
  ds::gemv::GemvParams p{};
  if (bias.has_value()) {
    check_cuda(*bias, "bias");
    check_dtype(*bias, like.scalar_type(), "bias (x's dtype)");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "deltaserve: gemv bias must be [N]");
    check_dense(*bias, "bias");
    p.bias = bias->data_ptr();
  }
  y = at::empty({m, n}, like.options());
  p.w = weight.data_ptr();
  p.y = y.data_ptr();
  p.M = static_cast<int>(m);
  p.N = static_cast<int>(n);
  p.K = static_cast<int>(k);
  return p;
}

}  // namespace ds_ops
