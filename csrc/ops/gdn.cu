// Torch bindings for gdn_decode, gdn_verify, gdn_replay_verify, gdn_replay (CUDA dispatch key).
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <initializer_list>

#include "../kernels/gdn_recurrent.cuh"
#include "../kernels/gdn_replay.cuh"
#include "common.h"
#include "library.h"

namespace ds_ops {
namespace {

// q, k [N, R, H, K]; v [N, R, HV, V]; a, b [N, R, HV] (R = 1 and the R dim absent for decode).
ds::gdn::RecurrentParams recurrent_params(const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& v, const at::Tensor& a,
                                          const at::Tensor& b, const at::Tensor& A_log,
                                          const at::Tensor& dt_bias, const at::Tensor& state,
                                          const at::Tensor& slots, double scale, bool has_r) {
  const int lead = has_r ? 2 : 1;
  for (const at::Tensor* t : TensorRefs{&q, &k, &v, &a, &b, &A_log, &dt_bias, &state, &slots})
    check_cuda(*t, "q, k, v, a, b, A_log, dt_bias, state, slots");
  TORCH_CHECK(q.dim() == lead + 2 && k.sizes() == q.sizes() && v.dim() == lead + 2 &&
                  a.dim() == lead + 1 && b.sizes() == a.sizes(),
              "deltaserve: gdn: bad q/k/v/a/b ranks");
  for (const at::Tensor* t : TensorRefs{&k, &v, &a, &b})
    check_dtype(*t, q.scalar_type(), "k, v, a, b (q's dtype)");
  check_dtype(A_log, at::kFloat, "A_log");
  check_dtype(dt_bias, at::kFloat, "dt_bias");
  check_dtype(state, at::kFloat, "state");
  check_dtype(slots, at::kInt, "slots");
  check_dense(state, "state");
  check_dense(slots, "slots");
  check_rows(q, 2, 4, "q");
  check_rows(k, 2, 4, "k");
  check_rows(v, 2, 1, "v");  // scalar loads: any row stride
  TORCH_CHECK(a.stride(-1) == 1 && b.stride(-1) == 1, "deltaserve: a, b must be dense per row");
  const int H = q.size(-2), K = q.size(-1), HV = v.size(-2), V = v.size(-1);
  TORCH_CHECK(H > 0 && HV % H == 0, "deltaserve: HV must be a positive multiple of H");
  TORCH_CHECK(state.dim() == 4 && state.size(1) == HV && state.size(2) == V && state.size(3) == K,
              "deltaserve: state must be [S, HV, V, K]");
  TORCH_CHECK(a.size(-1) == HV && A_log.numel() == HV && dt_bias.numel() == HV,
              "deltaserve: a, b, A_log, dt_bias must have HV entries per row");
  TORCH_CHECK(slots.numel() == q.size(0), "deltaserve: slots must have N entries");
  ds::gdn::RecurrentParams p{};
  p.q = q.data_ptr(); p.k = k.data_ptr(); p.v = v.data_ptr();
  p.a = a.data_ptr(); p.b = b.data_ptr();
  p.A_log = A_log.data_ptr<float>(); p.dt_bias = dt_bias.data_ptr<float>();
  p.state = state.data_ptr<float>(); p.slots = slots.data_ptr<int32_t>();
  p.q_stride_n = q.stride(0); p.k_stride_n = k.stride(0); p.v_stride_n = v.stride(0);
  p.a_stride_n = a.stride(0); p.b_stride_n = b.stride(0);
  if (has_r) {
    p.q_stride_r = q.stride(1); p.k_stride_r = k.stride(1); p.v_stride_r = v.stride(1);
    p.a_stride_r = a.stride(1); p.b_stride_r = b.stride(1);
  }
  p.N = q.size(0); p.R = has_r ? q.size(1) : 1; p.R_max = p.R;
  p.H = H; p.HV = HV; p.V = V; p.S = state.size(0); p.scale = static_cast<float>(scale);
  return p;
}

at::Tensor gdn_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& a, const at::Tensor& b, const at::Tensor& A_log,
                      const at::Tensor& dt_bias, const at::Tensor& state, const at::Tensor& slots,
                      double scale) {
  auto p = recurrent_params(q, k, v, a, b, A_log, dt_bias, state, slots, scale, false);
  const DeviceGuard guard(q.device());
  at::Tensor o = at::empty(v.sizes(), v.options());
  p.o = o.data_ptr();
  DS_DISPATCH_FLOAT(q.scalar_type(), "gdn_decode", [&] {
    check_launch(ds::gdn::launch_gdn_decode<scalar_t>(p, q.size(-1), stream_of(q)),
                 "gdn_decode");
  });
  return o;
}

// A stash's four tensors: fp32, dense, k [L, N_max, R_max, H, K], v [L, N_max, R_max, HV, V],
// g and beta [L, N_max, R_max, HV]; `what` names them.
void check_stash_layout(const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                        const at::Tensor& beta, const char* what) {
  for (const at::Tensor* t : TensorRefs{&k, &v, &g, &beta}) {
    check_cuda(*t, what);
    check_dtype(*t, at::kFloat, what);
    check_dense(*t, what);
  }
  TORCH_CHECK(k.dim() == 5 && v.dim() == 5 && g.dim() == 4 && beta.sizes() == g.sizes() &&
                  g.size(3) == v.size(3),
              "deltaserve: ", what, " must be k [L, N_max, R_max, H, K], v [L, N_max, R_max, HV, "
              "V], g and beta [L, N_max, R_max, HV]");
  for (int d = 0; d < 3; ++d)
    TORCH_CHECK(v.size(d) == k.size(d) && g.size(d) == k.size(d), "deltaserve: ", what,
                " k, v, g, beta must share [L, N_max, R_max]");
}

// The stash tensors of a verify, checked against q/v as well.
void check_stash(const ds::gdn::RecurrentParams& p, int64_t K, const at::Tensor& k,
                 const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta, int64_t layer,
                 const char* what) {
  check_stash_layout(k, v, g, beta, what);
  TORCH_CHECK(k.size(3) == p.H && k.size(4) == K && v.size(3) == p.HV && v.size(4) == p.V,
              "deltaserve: ", what, " shapes do not match q/v");
  TORCH_CHECK(0 <= layer && layer < k.size(0) && p.N <= k.size(1) && p.R <= k.size(2),
              "deltaserve: ", what, " too small for this verify");
}

// Whether two dense tensors' bytes overlap.
bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  const auto* a0 = static_cast<const char*>(a.data_ptr());
  const auto* b0 = static_cast<const char*>(b.data_ptr());
  return a.numel() > 0 && b.numel() > 0 && a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

at::Tensor verify_impl(ds::gdn::RecurrentParams& p, const at::Tensor& q, const at::Tensor& v,
                       const at::Tensor& stash_k, const at::Tensor& stash_v,
                       const at::Tensor& stash_g, const at::Tensor& stash_beta, int64_t layer) {
  // the grid takes requests in z and key heads in y (at most 65,535 each)
  TORCH_CHECK(p.N <= 65535, "deltaserve: gdn_verify takes at most 65,535 requests per call, got ",
              p.N);
  TORCH_CHECK(p.H <= 65535, "deltaserve: gdn_verify takes at most 65,535 key heads, got ", p.H);
  check_stash(p, q.size(-1), stash_k, stash_v, stash_g, stash_beta, layer, "stash");
  p.R_max = stash_k.size(2);
  p.stash_k = stash_k.data_ptr<float>() + layer * stash_k.stride(0);
  p.stash_v = stash_v.data_ptr<float>() + layer * stash_v.stride(0);
  p.stash_g = stash_g.data_ptr<float>() + layer * stash_g.stride(0);
  p.stash_beta = stash_beta.data_ptr<float>() + layer * stash_beta.stride(0);
  const DeviceGuard guard(q.device());
  at::Tensor o = at::empty(v.sizes(), v.options());
  p.o = o.data_ptr();
  DS_DISPATCH_FLOAT(q.scalar_type(), "gdn_verify", [&] {
    check_launch(ds::gdn::launch_gdn_verify<scalar_t>(p, q.size(-1), stream_of(q)),
                 "gdn_verify");
  });
  return o;
}

at::Tensor gdn_verify(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& a, const at::Tensor& b, const at::Tensor& A_log,
                      const at::Tensor& dt_bias, const at::Tensor& state, const at::Tensor& slots,
                      double scale, const at::Tensor& stash_k, const at::Tensor& stash_v,
                      const at::Tensor& stash_g, const at::Tensor& stash_beta, int64_t layer) {
  auto p = recurrent_params(q, k, v, a, b, A_log, dt_bias, state, slots, scale, true);
  return verify_impl(p, q, v, stash_k, stash_v, stash_g, stash_beta, layer);
}

// gdn_verify after applying pend_rows[i] rows of the previous verify's stash (pend_*, same
// shapes as stash_*) to request i's state, which is written back: gdn_replay of one layer
// folded into the verify launch.
at::Tensor gdn_replay_verify(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& a, const at::Tensor& b, const at::Tensor& A_log,
                             const at::Tensor& dt_bias, const at::Tensor& state,
                             const at::Tensor& slots, double scale, const at::Tensor& stash_k,
                             const at::Tensor& stash_v, const at::Tensor& stash_g,
                             const at::Tensor& stash_beta, int64_t layer,
                             const at::Tensor& pend_k, const at::Tensor& pend_v,
                             const at::Tensor& pend_g, const at::Tensor& pend_beta,
                             const at::Tensor& pend_rows) {
  auto p = recurrent_params(q, k, v, a, b, A_log, dt_bias, state, slots, scale, true);
  check_stash(p, q.size(-1), pend_k, pend_v, pend_g, pend_beta, layer, "pending stash");
  TORCH_CHECK(pend_k.sizes() == stash_k.sizes() && pend_v.sizes() == stash_v.sizes(),
              "deltaserve: the pending stash must have the stash's shapes");
  // the launch reads the pending stash while it writes the stash: one buffer would race
  for (const at::Tensor* t : TensorRefs{&pend_k, &pend_v, &pend_g, &pend_beta})
    for (const at::Tensor* u : TensorRefs{&stash_k, &stash_v, &stash_g, &stash_beta})
      TORCH_CHECK(!overlaps(*t, *u), "deltaserve: the pending stash must not share memory with "
                  "the stash it writes");
  TORCH_CHECK(stash_k.size(2) <= ds::gdn::kChunk, "deltaserve: gdn_replay_verify takes at most ",
              ds::gdn::kChunk, " rows per request");
  check_cuda(pend_rows, "pend_rows");
  check_dtype(pend_rows, at::kInt, "pend_rows");
  check_dense(pend_rows, "pend_rows");
  TORCH_CHECK(pend_rows.numel() == p.N, "deltaserve: pend_rows must have N entries");
  p.pend_k = pend_k.data_ptr<float>() + layer * pend_k.stride(0);
  p.pend_v = pend_v.data_ptr<float>() + layer * pend_v.stride(0);
  p.pend_g = pend_g.data_ptr<float>() + layer * pend_g.stride(0);
  p.pend_beta = pend_beta.data_ptr<float>() + layer * pend_beta.stride(0);
  p.pend_rows = pend_rows.data_ptr<int32_t>();
  return verify_impl(p, q, v, stash_k, stash_v, stash_g, stash_beta, layer);
}

void gdn_replay(const at::Tensor& stash_k, const at::Tensor& stash_v, const at::Tensor& stash_g,
                const at::Tensor& stash_beta, const at::Tensor& state, const at::Tensor& slots,
                const at::Tensor& accepted) {
  check_stash_layout(stash_k, stash_v, stash_g, stash_beta, "stash");
  check_cuda(state, "state_pool");
  check_dtype(state, at::kFloat, "state_pool");
  check_dense(state, "state_pool");
  check_cuda(slots, "slots");
  check_cuda(accepted, "accepted");
  check_dtype(slots, at::kInt, "slots");
  check_dtype(accepted, at::kInt, "accepted");
  check_dense(slots, "slots");
  check_dense(accepted, "accepted");
  TORCH_CHECK(state.dim() == 5 && stash_k.dim() == 5 && state.size(0) == stash_k.size(0) &&
                  state.size(2) == stash_v.size(3) && state.size(3) == stash_v.size(4) &&
                  state.size(4) == stash_k.size(4),
              "deltaserve: state_pool must be [L, S, HV, V, K] matching the stash");
  TORCH_CHECK(slots.numel() == accepted.numel() && slots.numel() <= stash_k.size(1),
              "deltaserve: slots/accepted must have N <= stash max_reqs entries");
  TORCH_CHECK(stash_k.size(3) > 0 && state.size(2) % stash_k.size(3) == 0,
              "deltaserve: HV must be a positive multiple of the stash's H");
  ds::gdn::ReplayParams p{};
  p.stash_k = stash_k.data_ptr<float>(); p.stash_v = stash_v.data_ptr<float>();
  p.stash_g = stash_g.data_ptr<float>(); p.stash_beta = stash_beta.data_ptr<float>();
  p.state = state.data_ptr<float>(); p.slots = slots.data_ptr<int32_t>();
  p.accepted = accepted.data_ptr<int32_t>();
  p.state_layer_stride = state.stride(0);
  p.L = state.size(0); p.N = slots.numel(); p.N_max = stash_k.size(1); p.R_max = stash_k.size(2);
  p.H = stash_k.size(3); p.HV = state.size(2); p.V = state.size(3);
  if (p.N == 0) return;
  const DeviceGuard guard(state.device());
  check_launch(ds::gdn::launch_gdn_replay(p, state.size(4), stream_of(state)), "gdn_replay");
}

}  // namespace

TORCH_LIBRARY_IMPL(DS_OPS_NAMESPACE, DS_OPS_KEY, m) {
  m.impl("gdn_decode", &gdn_decode);
  m.impl("gdn_verify", &gdn_verify);
  m.impl("gdn_replay_verify", &gdn_replay_verify);
  m.impl("gdn_replay", &gdn_replay);
}

}  // namespace ds_ops
