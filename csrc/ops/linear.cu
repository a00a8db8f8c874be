// Torch binding for gemv (CUDA dispatch key): y [M, N] = x [M, K] · W [N, K]ᵀ (+ b) for M <= 8
// rows (kernels/gemv.cuh). python/deltaserve/ops/linear.py decides when to call it (and flattens
// x's leading dims); each check here guards the memory the kernel touches.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "../kernels/gemv.cuh"
#include "common.h"
#include "library.h"

namespace ds_ops {
namespace {

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight,
                const std::optional<at::Tensor>& bias) {
  check_cuda(x, "x");
  check_cuda(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "deltaserve: gemv x must be [M, K] and weight [N, K]");
  check_dtype(weight, x.scalar_type(), "weight (x's dtype)");
  check_dense(weight, "weight");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(m >= 1 && m <= ds::gemv::kMaxRows, "deltaserve: gemv takes 1 to 8 rows of x");
  TORCH_CHECK(k >= 8 && k % 8 == 0 && k <= (int64_t(1) << 30),
              "deltaserve: gemv K must be a positive multiple of 8 (at most 2^30)");
  TORCH_CHECK(n >= 1 && n <= (int64_t(1) << 31) - 1 - ds::gemv::kTileCols,
              "deltaserve: gemv N must be in [1, 2^31 - 9]");
  TORCH_CHECK(x.stride(1) == 1 && (m == 1 || x.stride(0) % 8 == 0) && aligned16(x),
              "deltaserve: gemv x rows must be dense, 16-byte aligned, a multiple of 8 apart");
  TORCH_CHECK(aligned16(weight), "deltaserve: gemv weight must be 16-byte aligned");
  ds::gemv::GemvParams p{};
  if (bias.has_value()) {
    check_cuda(*bias, "bias");
    check_dtype(*bias, x.scalar_type(), "bias (x's dtype)");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "deltaserve: gemv bias must be [N]");
    check_dense(*bias, "bias");
    p.bias = bias->data_ptr();
  }
  const DeviceGuard guard(x.device());
  at::Tensor y = at::empty({m, n}, x.options());
  p.x = x.data_ptr();
  p.w = weight.data_ptr();
  p.y = y.data_ptr();
  p.ldx = m == 1 ? k : x.stride(0);
  p.M = static_cast<int>(m);
  p.N = static_cast<int>(n);
  p.K = static_cast<int>(k);
  DS_DISPATCH_HALF(x.scalar_type(), "gemv", [&] {
    check_launch(ds::gemv::launch_gemv<scalar_t>(p, stream_of(x)), "gemv");
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(DS_OPS_NAMESPACE, DS_OPS_KEY, m) { m.impl("gemv", &gemv); }

}  // namespace ds_ops
