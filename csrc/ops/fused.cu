// Torch bindings for the fused norms and gates (CUDA dispatch key): rms_norm, add_rms_norm,
// gated_rms_norm, qk_norm_rope, sigmoid_gate_mul, silu_mul. The Python wrappers
// (python/deltaserve/ops/fused.py) hand over 2-D [rows, D] or 3-D [T, H, D] views whose last dim
// is dense; each check here guards the memory the kernels touch. Views that allow 16-byte
// accesses take the vector kernels, others the element-wise ones.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <tuple>

#include "../kernels/fused.cuh"
#include "common.h"
#include "fused_args.h"
#include "library.h"

namespace ds_ops {
namespace {

template <ds::fused::Norm K>
void run_norm(const ds::fused::NormParams& p, const at::Tensor& x, bool vec, const char* op) {
  const at::ScalarType dt = x.scalar_type();
  TORCH_CHECK(p.D <= ds::fused::norm_max_row(vec ? 16 / c10::elementSize(dt) : 1),
              "deltaserve: ", op, ": rows too long for the kernels");
  DS_DISPATCH_FLOAT(dt, op, [&] {
    check_launch(ds::fused::launch_norm<scalar_t, K>(p, vec, stream_of(x)), op);
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  auto p = norm_params(x, weight, eps);
  check_weight(weight, p.D, at::kFloat, "rms_weight (fp32)");
  const DeviceGuard guard(x.device());
  at::Tensor y = at::empty(x.sizes(), x.options());
  p.y = y.data_ptr();
  run_norm<ds::fused::Norm::kRms>(p, x, vectors_fit(x, p.D) && weight_fits(weight), "rms_norm");
  return y;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes(),
              "deltaserve: add_rms_norm x and residual must both be [T, D]");
  check_dtype(residual, x.scalar_type(), "residual (x's dtype)");
  auto p = norm_params(x, weight, eps);
  check_weight(weight, p.D, at::kFloat, "rms_weight (fp32)");
  p.x2 = row_view(residual, "residual");
  const DeviceGuard guard(x.device());
  at::Tensor y = at::empty(x.sizes(), x.options()), s = at::empty(x.sizes(), x.options());
  p.y = y.data_ptr();
  p.y2 = s.data_ptr();
  const bool vec = vectors_fit(x, p.D) && vectors_fit(residual, p.D) && weight_fits(weight);
  run_norm<ds::fused::Norm::kAddRms>(p, x, vec, "add_rms_norm");
  return {y, s};
}

at::Tensor gated_rms_norm(const at::Tensor& x, const at::Tensor& z, const at::Tensor& weight,
                          double eps) {
  TORCH_CHECK(x.dim() == 3 && z.sizes() == x.sizes(),
              "deltaserve: gated_rms_norm x and z must both be [T, HV, V]");
  check_dtype(z, x.scalar_type(), "z (x's dtype)");
  auto p = norm_params(x, weight, eps);
  check_weight(weight, p.D, x.scalar_type(), "gated_weight (x's dtype)");
  p.x2 = row_view(z, "z");
  const DeviceGuard guard(x.device());
  at::Tensor y = at::empty({x.size(0), x.size(1) * x.size(2)}, x.options());
  p.y = y.data_ptr();
  const bool vec = vectors_fit(x, p.D) && vectors_fit(z, p.D) && weight_fits(weight);
  run_norm<ds::fused::Norm::kGated>(p, x, vec, "gated_rms_norm");
  return y;
}

std::tuple<at::Tensor, at::Tensor> qk_norm_rope(const at::Tensor& q_gate, const at::Tensor& k,
                                                const at::Tensor& q_weight,
                                                const at::Tensor& k_weight, const at::Tensor& cos,
                                                const at::Tensor& sin, double eps) {
  const int64_t d = k.size(-1), t = q_gate.size(0);
  TORCH_CHECK(q_gate.dim() == 3 && k.dim() == 3 && q_gate.size(2) == 2 * d && k.size(0) == t,
              "deltaserve: qk_norm_rope q_gate must be [T, Hq, 2D] and k [T, Hkv, D]");
  check_dtype(k, q_gate.scalar_type(), "k (q_gate's dtype)");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == t &&
                  cos.stride(-1) == 1 && sin.stride(-1) == 1 && cos.stride(0) == sin.stride(0),
              "deltaserve: cos and sin must be [T, rot] with one row stride, dense rows");
  check_cuda(cos, "cos");
  check_cuda(sin, "sin");
  check_dtype(cos, q_gate.scalar_type(), "cos (the activation dtype)");
  check_dtype(sin, q_gate.scalar_type(), "sin (the activation dtype)");
  check_weight(q_weight, d, at::kFloat, "q_weight (fp32)");
  check_weight(k_weight, d, at::kFloat, "k_weight (fp32)");
  ds::fused::NormParams p{};
  p.x = row_view(q_gate, "q_gate");
  p.x2 = row_view(k, "k");
  p.D = static_cast<int>(d);
  p.rows = static_cast<int>(t * q_gate.size(1));
  p.rows2 = static_cast<int>(t * k.size(1));
  p.rot = static_cast<int>(cos.size(1));
  p.w = q_weight.data_ptr();
  p.w2 = k_weight.data_ptr<float>();
  p.cos = cos.data_ptr();
  p.sin = sin.data_ptr();
  p.cs_stride = cos.stride(0);
  p.eps = static_cast<float>(eps);
  TORCH_CHECK(p.rot % 2 == 0 && p.rot <= d && p.rot <= ds::fused::kMaxRot,
              "deltaserve: qk_norm_rope rot must be even and at most min(D, 256)");
  const DeviceGuard guard(k.device());
  at::Tensor q = at::empty({t, q_gate.size(1), d}, k.options());
  at::Tensor ko = at::empty(k.sizes(), k.options());
  p.y = q.data_ptr();
  p.y2 = ko.data_ptr();
  const bool vec = vectors_fit(q_gate, d) && vectors_fit(k, d) && weight_fits(q_weight) &&
                   weight_fits(k_weight);
  run_norm<ds::fused::Norm::kQkRope>(p, k, vec, "qk_norm_rope");
  return {q, ko};
}

}  // namespace

TORCH_LIBRARY_IMPL(DS_OPS_NAMESPACE, DS_OPS_KEY, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("gated_rms_norm", &gated_rms_norm);
  m.impl("qk_norm_rope", &qk_norm_rope);
}

}  // namespace ds_ops
