// Torch bindings for the fused element-wise gates (CUDA dispatch key): sigmoid_gate_mul and
// silu_mul over [T, H, D] / [T, 2I] views with a dense last dim (python/deltaserve/ops/fused.py).
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "../kernels/fused.cuh"
#include "common.h"
#include "fused_args.h"
#include "library.h"

namespace ds_ops {
namespace {

using ds::fused::Gate;

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
  bool vec = false;
  const auto p = sigmoid_gate_params(o, q_gate, "sigmoid_gate_mul", vec);
  return run_gate<Gate::kSigmoidMul>(p, o, vec, "sigmoid_gate_mul");
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  bool vec = false;
  const auto p = silu_mul_params(gate_up, "silu_mul", vec);
  return run_gate<Gate::kSiluMul>(p, gate_up, vec, "silu_mul");
}

}  // namespace

TORCH_LIBRARY_IMPL(DS_OPS_NAMESPACE, DS_OPS_KEY, m) {
  m.impl("sigmoid_gate_mul", &sigmoid_gate_mul);
  m.impl("silu_mul", &silu_mul);
}

}  // namespace ds_ops
