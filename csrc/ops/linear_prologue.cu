// Torch bindings of the projections that make their own input (CUDA dispatch key;
// kernels/gemv_prologue.cuh): silu_mul_gemv, sigmoid_gate_mul_gemv, gated_rms_norm_gemv,
// add_rms_norm_gemv. Each takes the inputs of the fused op it absorbs (fused.cu, fused_gate.cu:
// the same views and checks) and the projection's weight (gemv_args.h); the Python wrappers
// (python/deltaserve/ops/prologue.py) call them only where the views allow 16-byte accesses and
// x fits the kernel's stage, and the checks here guard that again.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "../kernels/gemv_prologue.cuh"
#include "common.h"
#include "fused_args.h"
#include "gemv_args.h"
#include "library.h"

namespace ds_ops {
namespace {

using ds::fused::Gate;
using ds::fused::Norm;

void check_stage(int64_t m, int64_t k, bool vec, const char* op) {
  TORCH_CHECK(vec, "deltaserve: ", op, ": the inputs must allow 16-byte accesses");
  TORCH_CHECK(m <= ds::gemv::kMaxStagedRows && ds::gemv::stage_fits(static_cast<int>(m),
                                                              static_cast<int>(k)),
              "deltaserve: ", op, ": the input is too large for the kernel's stage");
}

// y = gate op of g's operands (x's rows, `vec`: they allow 16-byte accesses) times weightᵀ.
template <Gate G>
at::Tensor gate_gemv(const ds::fused::GateParams& g, bool vec, const at::Tensor& x,
                     const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                     const char* op) {
  check_stage(g.T, g.cols, vec, op);
  const DeviceGuard guard(x.device());
  at::Tensor y;
  const ds::gemv::GemvParams p = gemv_params(x, weight, bias, g.T, g.cols, y);
  DS_DISPATCH_HALF(x.scalar_type(), op, [&] {
    check_launch(ds::gemv::launch_gemv_gate<scalar_t, G>(p, g, stream_of(x)), op);
  });
  return y;
}

at::Tensor silu_mul_gemv(const at::Tensor& gate_up, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias) {
  bool vec = false;
  const ds::fused::GateParams g = silu_mul_params(gate_up, "silu_mul_gemv", vec);
  return gate_gemv<Gate::kSiluMul>(g, vec, gate_up, weight, bias, "silu_mul_gemv");
}

at::Tensor sigmoid_gate_mul_gemv(const at::Tensor& o, const at::Tensor& q_gate,
                                 const at::Tensor& weight,
                                 const std::optional<at::Tensor>& bias) {
  bool vec = false;
  const ds::fused::GateParams g = sigmoid_gate_params(o, q_gate, "sigmoid_gate_mul_gemv", vec);
  return gate_gemv<Gate::kSigmoidMul>(g, vec, o, weight, bias, "sigmoid_gate_mul_gemv");
}

template <Norm K>
void run_norm(const ds::fused::NormParams& n, const ds::gemv::GemvParams& p, const at::Tensor& x,
              const char* op) {
  TORCH_CHECK(ds::gemv::prologue_norm_threads(n.D, static_cast<int>(x.element_size())) > 0,
              "deltaserve: ", op, ": norm rows too long for the kernel's prologue");
  DS_DISPATCH_HALF(x.scalar_type(), op, [&] {
    check_launch(ds::gemv::launch_gemv_norm<scalar_t, K>(p, n, stream_of(x)), op);
  });
}

at::Tensor gated_rms_norm_gemv(const at::Tensor& x, const at::Tensor& z,
                               const at::Tensor& gated_weight, double eps,
                               const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 3 && z.sizes() == x.sizes(),
              "deltaserve: gated_rms_norm_gemv x and z must both be [T, HV, V]");
  check_dtype(z, x.scalar_type(), "z (x's dtype)");
  ds::fused::NormParams n = norm_params(x, gated_weight, eps);
  check_weight(gated_weight, n.D, x.scalar_type(), "gated_weight (x's dtype)");
  n.x2 = row_view(z, "z");
  const int64_t m = x.size(0), k = x.size(1) * x.size(2);
  check_stage(m, k, vectors_fit(x, n.D) && vectors_fit(z, n.D) && weight_fits(gated_weight),
              "gated_rms_norm_gemv");
  const DeviceGuard guard(x.device());
  at::Tensor y;
  const ds::gemv::GemvParams p = gemv_params(x, weight, bias, m, k, y);
  run_norm<Norm::kGated>(n, p, x, "gated_rms_norm_gemv");
  return y;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_gemv(const at::Tensor& x,
                                                     const at::Tensor& residual,
                                                     const at::Tensor& rms_weight, double eps,
                                                     const at::Tensor& weight,
                                                     const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes(),
              "deltaserve: add_rms_norm_gemv x and residual must both be [T, D]");
  check_dtype(residual, x.scalar_type(), "residual (x's dtype)");
  ds::fused::NormParams n = norm_params(x, rms_weight, eps);
  check_weight(rms_weight, n.D, at::kFloat, "rms_weight (fp32)");
  n.x2 = row_view(residual, "residual");
  const int64_t m = x.size(0), k = x.size(1);
  check_stage(m, k, vectors_fit(x, k) && vectors_fit(residual, k) && weight_fits(rms_weight),
              "add_rms_norm_gemv");
  const DeviceGuard guard(x.device());
  at::Tensor y;
  const ds::gemv::GemvParams p = gemv_params(x, weight, bias, m, k, y);
  at::Tensor s = at::empty(x.sizes(), x.options());
  n.y2 = s.data_ptr();
  run_norm<Norm::kAddRms>(n, p, x, "add_rms_norm_gemv");
  return {y, s};
}

}  // namespace

TORCH_LIBRARY_IMPL(DS_OPS_NAMESPACE, DS_OPS_KEY, m) {
  m.impl("silu_mul_gemv", &silu_mul_gemv);
  m.impl("sigmoid_gate_mul_gemv", &sigmoid_gate_mul_gemv);
  m.impl("gated_rms_norm_gemv", &gated_rms_norm_gemv);
  m.impl("add_rms_norm_gemv", &add_rms_norm_gemv);
}

}  // namespace ds_ops
