// Torch binding for gemv (CUDA dispatch key): y [M, N] = x [M, K] · W [N, K]ᵀ (+ b) for M <= 8
// rows (kernels/gemv.cuh). python/deltaserve/ops/linear.py decides when to call it (and flattens
// x's leading dims); each check here guards the memory the kernel touches.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "../kernels/gemv.cuh"
#include "common.h"
#include "gemv_args.h"
#include "library.h"

namespace ds_ops {
namespace {

at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight,
                const std::optional<at::Tensor>& bias) {
  check_cuda(x, "x");
  TORCH_CHECK(x.dim() == 2, "deltaserve: gemv x must be [M, K] and weight [N, K]");
  const int64_t m = x.size(0), k = x.size(1);
  const DeviceGuard guard(x.device());
  at::Tensor y;
  ds::gemv::GemvParams p = gemv_params(x, weight, bias, m, k, y);
  TORCH_CHECK(x.stride(1) == 1 && (m == 1 || x.stride(0) % 8 == 0) && aligned16(x),
              "deltaserve: gemv x rows must be dense, 16-byte aligned, a multiple of 8 apart");
  p.x = x.data_ptr();
  p.ldx = m == 1 ? k : x.stride(0);
  DS_DISPATCH_HALF(x.scalar_type(), "gemv", [&] {
    check_launch(ds::gemv::launch_gemv<scalar_t>(p, stream_of(x)), "gemv");
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(DS_OPS_NAMESPACE, DS_OPS_KEY, m) { m.impl("gemv", &gemv); }

}  // namespace ds_ops
