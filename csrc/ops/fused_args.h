// View and weight checks shared by the bindings of the fused norms (fused.cu) and of the
// projections that run them as their prologue (linear_prologue.cu), and the gates' operands
// (fused_gate.cu, linear_prologue.cu). Host only.
#pragma once

#include <ATen/core/Tensor.h>

#include "../kernels/fused.cuh"
#include "common.h"

namespace ds_ops {

using ds::fused::RowView;

// t [A, D] or [A, B, D] (dense last dim) as kernel rows; `offset` elements into each row.
inline RowView row_view(const at::Tensor& t, const char* name, int64_t offset = 0) {
  check_cuda(t, name);
  TORCH_CHECK((t.dim() == 2 || t.dim() == 3) && (t.size(-1) <= 1 || t.stride(-1) == 1),
              "deltaserve: ", name, " must be [rows, D] or [T, H, D] with a dense last dim");
  TORCH_CHECK(t.size(-1) > 0, "deltaserve: ", name, " has empty rows");
  TORCH_CHECK(t.numel() / t.size(-1) < (int64_t(1) << 31), "deltaserve: ", name,
              " has 2^31 rows or more");
  const bool three = t.dim() == 3;
  return RowView{static_cast<const char*>(t.data_ptr()) + offset * t.element_size(),
                 t.stride(0), three ? t.stride(1) : 0, ds::FastDiv(three ? t.size(1) : 1)};
}

// A norm over x's rows ([rows, D] or [T, H, D], dense last dim) with weight [D].
inline ds::fused::NormParams norm_params(const at::Tensor& x, const at::Tensor& weight,
                                         double eps) {
  ds::fused::NormParams p{};
  p.x = row_view(x, "x");
  p.D = static_cast<int>(x.size(-1));
  p.rows = static_cast<int>(x.numel() / p.D);
  p.w = weight.data_ptr();
  p.eps = static_cast<float>(eps);
  return p;
}

inline void check_weight(const at::Tensor& w, int64_t d, at::ScalarType dt, const char* name) {
  check_cuda(w, name);
  check_dtype(w, dt, name);
  check_dense(w, name);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == d, "deltaserve: ", name, " must be [D]");
}

inline bool weight_fits(const at::Tensor& w) {
  return reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0;
}

inline void check_gate_input(const at::Tensor& t, int dims, const char* name) {
  check_cuda(t, name);
  TORCH_CHECK(t.dim() == dims && t.stride(-1) == 1, "deltaserve: ", name,
              " must have a dense last dim");
  TORCH_CHECK(t.size(-1) > 0 && t.numel() / t.size(-1) < (int64_t(1) << 31) &&
                  t.size(0) < (int64_t(1) << 31), "deltaserve: ", name, " is too large");
}

// sigmoid_gate_mul's operands: o [T, Hq, D] times sigmoid of q_gate [T, Hq, 2D]'s gate half;
// `vec`: 16-byte accesses fit both views.
inline ds::fused::GateParams sigmoid_gate_params(const at::Tensor& o, const at::Tensor& q_gate,
                                                 const char* op, bool& vec) {
  check_gate_input(o, 3, "o");
  check_gate_input(q_gate, 3, "q_gate");
  const int64_t d = o.size(2);
  TORCH_CHECK(q_gate.size(0) == o.size(0) && q_gate.size(1) == o.size(1) &&
                  q_gate.size(2) == 2 * d,
              "deltaserve: ", op, " o must be [T, Hq, D] and q_gate [T, Hq, 2D]");
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
  vec = vectors_fit(o, d, 0) && vectors_fit(q_gate, d, d);
  return p;
}

// silu_mul's operands: gate_up [T, 2I] = [gate | up]; `vec`: 16-byte accesses fit.
inline ds::fused::GateParams silu_mul_params(const at::Tensor& gate_up, const char* op,
                                             bool& vec) {
  check_gate_input(gate_up, 2, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "deltaserve: ", op, " gate_up must be [T, 2I]");
  const int64_t i = gate_up.size(1) / 2;
  ds::fused::GateParams p{};
  p.a = gate_up.data_ptr();
  p.b = static_cast<const char*>(gate_up.data_ptr()) + i * gate_up.element_size();
  p.a_s0 = p.b_s0 = gate_up.stride(0);
  p.block = ds::FastDiv(i);
  p.T = static_cast<int>(gate_up.size(0));
  p.cols = static_cast<int>(i);
  vec = vectors_fit(gate_up, i, i);
  return p;
}

}  // namespace ds_ops
