// Torch bindings for the fused element-wise gates (CUDA dispatch key): sigmoid_gate_mul and
// silu_mul over [T, H, D] / [T, 2I] views with a dense last dim (python/deltaserve/ops/fused.py).
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "../kernels/fused.cuh"
#include "common.h"
#include "library.h"

namespace ds_ops {
namespace {

using ds::fused::Gate;

void check_gate_input(const at::Tensor& t, int dims, const char* name) {
  check_cuda(t, name);
  TORCH_CHECK(t.dim() == dims && t.stride(-1) == 1, "deltaserve: ", name,
              " must have a dense last dim");
  TORCH_CHECK(t.size(-1) > 0 && t.numel() / t.size(-1) < (int64_t(1) << 31) &&
                  t.size(0) < (int64_t(1) << 31), "deltaserve: ", name, " is too large");
}

template <Gate G>
at::Tensor run_gate(ds::fused::GateParams p, const at::Tensor& like, bool vec, const char* op) {
  const DeviceGuard guard(like.device());
  at::Tensor y = at::empty({p.T, p.cols}, like.options());
  p.y = y.data_ptr();
  DS_DISPATCH_FLOAT(like.scalar_type(), op, [&] {
    check_launch(ds::fused::launch_gate<scalar_t, G>(p, vec, stream_of(like)), op);
  });
  return y;
}

at::Tensor sigmoid_gate_mul(const at::Tensor& o, const at::Tensor& q_gate) {
  check_gate_input(o, 3, "o");
  check_gate_input(q_gate, 3, "q_gate");
  const int64_t d = o.size(2);
  TORCH_CHECK(q_gate.size(0) == o.size(0) && q_gate.size(1) == o.size(1) &&
                  q_gate.size(2) == 2 * d,
              "deltaserve: sigmoid_gate_mul o must be [T, Hq, D] and q_gate [T, Hq, 2D]");
  check_dtype(q_gate, o.scalar_type(), "q_gate (o's dtype)");
  ds::fused::GateParams p{};
  p.a = o.data_ptr();
  p.a_s0 = o.stride(0);
  p.a_s1 = o.stride(1);
  p.b = static_cast<const char*>(q_gate.data_ptr()) + d * q_gate.element_size();
  p.b_s0 = q_gate.stride(0);
  p.b_s1 = q_gate.stride(1);
  p.block = ds::FastDiv(d);
  p.T = static_cast<int>(o.size(0));
  p.cols = static_cast<int>(o.size(1) * d);
  const bool vec = vectors_fit(o, d, 0) && vectors_fit(q_gate, d, d);
  return run_gate<Gate::kSigmoidMul>(p, o, vec, "sigmoid_gate_mul");
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_gate_input(gate_up, 2, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "deltaserve: silu_mul gate_up must be [T, 2I]");
  const int64_t i = gate_up.size(1) / 2;
  ds::fused::GateParams p{};
  p.a = gate_up.data_ptr();
  p.b = static_cast<const char*>(gate_up.data_ptr()) + i * gate_up.element_size();
  p.a_s0 = p.b_s0 = gate_up.stride(0);
  p.block = ds::FastDiv(i);
  p.T = static_cast<int>(gate_up.size(0));
  p.cols = static_cast<int>(i);
  return run_gate<Gate::kSiluMul>(p, gate_up, vectors_fit(gate_up, i, i), "silu_mul");
}

}  // namespace

TORCH_LIBRARY_IMPL(DS_OPS_NAMESPACE, DS_OPS_KEY, m) {
  m.impl("sigmoid_gate_mul", &sigmoid_gate_mul);
  m.impl("silu_mul", &silu_mul);
}

}  // namespace ds_ops
