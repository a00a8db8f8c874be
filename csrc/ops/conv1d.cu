// Torch bindings for causal_conv1d_{prefill,update,verify,commit} and gdn_conv_prefill (CUDA
// dispatch key).
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <initializer_list>

#include <optional>

#include "../kernels/conv1d.cuh"
#include "common.h"
#include "library.h"

namespace ds_ops {
namespace {

constexpr int kWidth = 4;  // the only conv width compiled (Qwen3.5/3.6, Qwen3-Next)

// x [..., D] rows; weight [D, W]; conv_state [S, W-1, D]; all one dtype.
ds::conv::ConvParams conv_params(const at::Tensor& x, const at::Tensor& weight,
                                 const std::optional<at::Tensor>& bias,
                                 const at::Tensor& conv_state, const at::Tensor& slots) {
  for (const at::Tensor* t : TensorRefs{&x, &weight, &conv_state, &slots})
    check_cuda(*t, "x, weight, conv_state, slots");
  const int64_t D = x.size(-1);
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == D && weight.size(1) == kWidth,
              "deltaserve: conv weight must be [D, 4]");
  TORCH_CHECK(conv_state.dim() == 3 && conv_state.size(1) == kWidth - 1 &&
                  conv_state.size(2) == D, "deltaserve: conv_state must be [S, 3, D]");
  check_dtype(weight, x.scalar_type(), "weight (x's dtype)");
  check_dtype(conv_state, x.scalar_type(), "conv_state (x's dtype)");
  check_dtype(slots, at::kInt, "slots");
  check_dense(weight, "weight");
  check_dense(conv_state, "conv_state");
  check_dense(slots, "slots");
  const int64_t vec = 16 / x.element_size();
  TORCH_CHECK(D % vec == 0, "deltaserve: conv_dim must be a multiple of the vector width "
              "(8 elements for 16-bit dtypes, 4 for fp32)");
  check_rows(x, 1, vec, "x");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(weight.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(conv_state.data_ptr()) % 16 == 0,
              "deltaserve: weight and conv_state must be 16-byte aligned");
  // the kernels aim their pre-wait prefetches at a slot clamped into [0, S)
  TORCH_CHECK(conv_state.size(0) > 0 || slots.numel() == 0,
              "deltaserve: conv_state has no slots");
  ds::conv::ConvParams p{};
  if (bias.has_value()) {
    check_cuda(*bias, "bias");
    check_dtype(*bias, x.scalar_type(), "bias (x's dtype)");
    check_dense(*bias, "bias");
    TORCH_CHECK(bias->numel() == D, "deltaserve: bias must be [D]");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(bias->data_ptr()) % 16 == 0,
                "deltaserve: bias must be 16-byte aligned");
    p.bias = bias->data_ptr();
  }
  p.x = x.data_ptr(); p.weight = weight.data_ptr(); p.conv_state = conv_state.data_ptr();
  p.slots = slots.data_ptr<int32_t>();
  p.S = conv_state.size(0);
  p.x_row_stride = x.dim() > 1 ? x.stride(-2) : D;
  p.D = static_cast<int>(D);
  return p;
}

at::Tensor dense_like(const at::Tensor& x) { return at::empty(x.sizes(), x.options()); }

// The prefill launch shared by causal_conv1d_prefill (y [T, D]) and gdn_conv_prefill (y: the
// q | k | v blocks, q and k normalised; planes/norm set in `p` by the caller, y sized by it).
void run_prefill(ds::conv::ConvParams p, const at::Tensor& x, const at::Tensor& cu_seqlens,
                 const at::Tensor& slots, const std::optional<at::Tensor>& track_offsets,
                 const std::optional<at::Tensor>& track_slots, const at::Tensor& y) {
  check_cuda(cu_seqlens, "cu_seqlens");
  check_dtype(cu_seqlens, at::kInt, "cu_seqlens");
  check_dense(cu_seqlens, "cu_seqlens");
  TORCH_CHECK(cu_seqlens.numel() == slots.numel() + 1, "deltaserve: cu_seqlens must be [N+1]");
  TORCH_CHECK(track_offsets.has_value() == track_slots.has_value(),
              "deltaserve: track_offsets and track_slots go together");
  if (track_slots.has_value()) {
    for (const at::Tensor* t : TensorRefs{&*track_offsets, &*track_slots}) {
      check_cuda(*t, "track_offsets/track_slots");
      check_dtype(*t, at::kInt, "track_offsets/track_slots");
      check_dense(*t, "track_offsets/track_slots");
      TORCH_CHECK(t->numel() == slots.numel(), "deltaserve: track_* must be [N]");
    }
    p.track_offsets = track_offsets->data_ptr<int32_t>();
    p.track_slots = track_slots->data_ptr<int32_t>();
  }
  p.cu_seqlens = cu_seqlens.data_ptr<int32_t>();
  p.N = slots.numel(); p.T = x.size(0); p.R = 1;
  p.y = y.data_ptr();
  if (p.N == 0) return;
  const DeviceGuard guard(x.device());
  DS_DISPATCH_FLOAT(x.scalar_type(), "causal_conv1d_prefill", [&] {
    check_launch(ds::conv::launch_conv_prefill<scalar_t, kWidth>(p, stream_of(x)),
                 "causal_conv1d_prefill");
  });
}

at::Tensor conv_prefill(const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias, const at::Tensor& conv_state,
                        const at::Tensor& cu_seqlens, const at::Tensor& slots,
                        const std::optional<at::Tensor>& track_offsets,
                        const std::optional<at::Tensor>& track_slots) {
  const auto p = conv_params(x, weight, bias, conv_state, slots);
  TORCH_CHECK(x.dim() == 2, "deltaserve: prefill x must be [T, D]");
  at::Tensor y = dense_like(x);
  run_prefill(p, x, cu_seqlens, slots, track_offsets, track_slots, y);
  return y;
}

// y flat [T * D]: q [T, qk_dim], k [T, qk_dim], v [T, D - 2 qk_dim] one after the other; q and
// k L2-normalised per head_dim channels (eps).
at::Tensor gdn_conv_prefill(const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, const at::Tensor& conv_state,
                            const at::Tensor& cu_seqlens, const at::Tensor& slots,
                            const std::optional<at::Tensor>& track_offsets,
                            const std::optional<at::Tensor>& track_slots, int64_t qk_dim,
                            int64_t head_dim, double eps) {
  auto p = conv_params(x, weight, bias, conv_state, slots);
  TORCH_CHECK(x.dim() == 2, "deltaserve: prefill x must be [T, D]");
  const int64_t vec = 16 / x.element_size(), lanes = head_dim / vec;
  TORCH_CHECK(qk_dim > 0 && 2 * qk_dim < p.D && head_dim > 0 && qk_dim % head_dim == 0 &&
                  head_dim % vec == 0 && lanes <= 32 && (lanes & (lanes - 1)) == 0 &&
                  (p.D / vec) % 32 == 0,
              "deltaserve: gdn_conv_prefill needs 0 < 2 qk_dim < D, qk_dim a multiple of "
              "head_dim, head_dim a power-of-two multiple of the vector width of at most 32 "
              "of them, and D / vector width a multiple of 32");
  p.plane1 = static_cast<int>(qk_dim);
  p.plane2 = static_cast<int>(2 * qk_dim);
  p.norm_channels = static_cast<int>(2 * qk_dim);
  p.norm_group = static_cast<int>(head_dim);
  p.norm_eps = static_cast<float>(eps);
  at::Tensor y = at::empty({x.size(0) * p.D}, x.options());
  run_prefill(p, x, cu_seqlens, slots, track_offsets, track_slots, y);
  return y;
}

at::Tensor conv_step(const at::Tensor& x, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias, const at::Tensor& conv_state,
                     const at::Tensor& slots, bool verify) {
  auto p = conv_params(x, weight, bias, conv_state, slots);
  TORCH_CHECK(x.dim() == (verify ? 3 : 2) && x.size(0) == slots.numel(),
              "deltaserve: conv x must be [N, D] (update) or [N, R, D] (verify)");
  if (verify)
    TORCH_CHECK(x.stride(0) == x.size(1) * x.stride(1),
              "deltaserve: x rows must be evenly strided");
  p.N = x.size(0); p.R = verify ? x.size(1) : 1;
  const DeviceGuard guard(x.device());
  at::Tensor y = dense_like(x);
  p.y = y.data_ptr();
  DS_DISPATCH_FLOAT(x.scalar_type(), "causal_conv1d_update/verify", [&] {
    check_launch(ds::conv::launch_conv_step<scalar_t, kWidth>(p, verify, stream_of(x)),
                 "causal_conv1d_update/verify");
  });
  return y;
}

at::Tensor conv_update(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, const at::Tensor& conv_state,
                       const at::Tensor& slots) {
  return conv_step(x, weight, bias, conv_state, slots, false);
}

at::Tensor conv_verify(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, const at::Tensor& conv_state,
                       const at::Tensor& slots) {
  return conv_step(x, weight, bias, conv_state, slots, true);
}

void conv_commit(const at::Tensor& x, const at::Tensor& conv_state, const at::Tensor& slots,
                 const at::Tensor& accepted) {
  for (const at::Tensor* t : TensorRefs{&x, &conv_state, &slots, &accepted})
    check_cuda(*t, "x, conv_state, slots, accepted");
  TORCH_CHECK(x.dim() == 3 && x.size(0) == slots.numel() && accepted.numel() == slots.numel(),
              "deltaserve: commit x must be [N, R, D] with N slots and N accept counts");
  TORCH_CHECK(conv_state.dim() == 3 && conv_state.size(1) == kWidth - 1 &&
                  conv_state.size(2) == x.size(2), "deltaserve: conv_state must be [S, 3, D]");
  TORCH_CHECK(x.stride(0) == x.size(1) * x.stride(1),
              "deltaserve: x rows must be evenly strided");
  check_dtype(conv_state, x.scalar_type(), "conv_state (x's dtype)");
  check_dtype(slots, at::kInt, "slots");
  check_dtype(accepted, at::kInt, "accepted");
  check_dense(conv_state, "conv_state");
  check_dense(slots, "slots");
  check_dense(accepted, "accepted");
  const int64_t vec = 16 / x.element_size();
  TORCH_CHECK(x.size(2) % vec == 0, "deltaserve: conv_dim must be a multiple of the vector width "
              "(8 elements for 16-bit dtypes, 4 for fp32)");
  check_rows(x, 1, vec, "x");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(conv_state.data_ptr()) % 16 == 0,
              "deltaserve: conv_state must be 16-byte aligned");
  ds::conv::ConvParams p{};
  p.x = x.data_ptr(); p.conv_state = conv_state.data_ptr();
  p.slots = slots.data_ptr<int32_t>(); p.accepted = accepted.data_ptr<int32_t>();
  p.x_row_stride = x.stride(1);
  p.N = x.size(0); p.R = x.size(1); p.D = x.size(2);
  const DeviceGuard guard(x.device());
  DS_DISPATCH_FLOAT(x.scalar_type(), "causal_conv1d_commit", [&] {
    check_launch(ds::conv::launch_conv_commit<scalar_t, kWidth>(p, stream_of(x)),
                 "causal_conv1d_commit");
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(DS_OPS_NAMESPACE, DS_OPS_KEY, m) {
  m.impl("causal_conv1d_prefill", &conv_prefill);
  m.impl("gdn_conv_prefill", &gdn_conv_prefill);
  m.impl("causal_conv1d_update", &conv_update);
  m.impl("causal_conv1d_verify", &conv_verify);
  m.impl("causal_conv1d_commit", &conv_commit);
}

}  // namespace ds_ops
