// The `deltaserve` op library: schemas, Meta (fake) implementations, and the Python module
// entry point of deltaserve._C. CUDA implementations register from gdn.cu, conv1d.cu,
// snapshot.cu, fused.cu, fused_gate.cu, attention.cu, linear.cu, linear_prologue.cu and
// moe.cu. Only this file may say TORCH_LIBRARY(deltaserve): a second one aborts Python.
#include <ATen/ops/empty.h>
#include <Python.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>

#include "library.h"

namespace ds_ops {
namespace {

at::Tensor like(const at::Tensor& x) { return at::empty(x.sizes(), x.options()); }

at::Tensor conv_prefill_meta(const at::Tensor& x, const at::Tensor&,
                             const std::optional<at::Tensor>&,
                             const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const std::optional<at::Tensor>&, const std::optional<at::Tensor>&) {
  return like(x);
}
at::Tensor gdn_conv_prefill_meta(const at::Tensor& x, const at::Tensor&,
                                 const std::optional<at::Tensor>&, const at::Tensor&,
                                 const at::Tensor&, const at::Tensor&,
                                 const std::optional<at::Tensor>&,
                                 const std::optional<at::Tensor>&, int64_t, int64_t, double) {
  return at::empty({x.size(0) * x.size(1)}, x.options());
}
at::Tensor conv_step_meta(const at::Tensor& x, const at::Tensor&, const std::optional<at::Tensor>&,
                          const at::Tensor&, const at::Tensor&) {
  return like(x);
}
void conv_commit_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&) {}
at::Tensor gdn_decode_meta(const at::Tensor&, const at::Tensor&, const at::Tensor& v,
                           const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, const at::Tensor&, const at::Tensor&, double) {
  return like(v);
}
at::Tensor gdn_verify_meta(const at::Tensor&, const at::Tensor&, const at::Tensor& v,
                           const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                           const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, int64_t) {
  return like(v);
}
at::Tensor gdn_replay_verify_meta(const at::Tensor&, const at::Tensor&, const at::Tensor& v,
                                  const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                  const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, int64_t, const at::Tensor&,
                                  const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&) {
  return like(v);
}
void gdn_replay_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                     const at::Tensor&, const at::Tensor&, const at::Tensor&) {}
at::Tensor paged_attention_meta(const at::Tensor& q, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, double, int64_t) {
  return like(q);
}
void kv_append_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                    const at::Tensor&, const at::Tensor&) {}
void snapshot_copy_meta(const at::Tensor&, const at::Tensor&, c10::IntArrayRef, c10::IntArrayRef) {}
at::Tensor rms_norm_meta(const at::Tensor& x, const at::Tensor&, double) { return like(x); }
std::tuple<at::Tensor, at::Tensor> add_rms_norm_meta(const at::Tensor& x, const at::Tensor&,
                                                     const at::Tensor&, double) {
  return {like(x), like(x)};
}
at::Tensor gated_rms_norm_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor&, double) {
  return at::empty({x.size(0), x.size(1) * x.size(2)}, x.options());
}
std::tuple<at::Tensor, at::Tensor> qk_norm_rope_meta(const at::Tensor& q_gate,
                                                     const at::Tensor& k, const at::Tensor&,
                                                     const at::Tensor&, const at::Tensor&,
                                                     const at::Tensor&, double) {
  return {at::empty({q_gate.size(0), q_gate.size(1), k.size(2)}, k.options()), like(k)};
}
at::Tensor sigmoid_gate_mul_meta(const at::Tensor& o, const at::Tensor&) {
  return at::empty({o.size(0), o.size(1) * o.size(2)}, o.options());
}
at::Tensor silu_mul_meta(const at::Tensor& gate_up) {
  return at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
}
at::Tensor gemv_meta(const at::Tensor& x, const at::Tensor& weight,
                     const std::optional<at::Tensor>&) {
  return at::empty({x.size(0), weight.size(0)}, x.options());
}
at::Tensor silu_mul_gemv_meta(const at::Tensor& gate_up, const at::Tensor& weight,
                              const std::optional<at::Tensor>&) {
  return at::empty({gate_up.size(0), weight.size(0)}, gate_up.options());
}
at::Tensor sigmoid_gate_mul_gemv_meta(const at::Tensor& o, const at::Tensor&,
                                      const at::Tensor& weight,
                                      const std::optional<at::Tensor>&) {
  return at::empty({o.size(0), weight.size(0)}, o.options());
}
at::Tensor gated_rms_norm_gemv_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor&,
                                    double, const at::Tensor& weight,
                                    const std::optional<at::Tensor>&) {
  return at::empty({x.size(0), weight.size(0)}, x.options());
}
std::tuple<at::Tensor, at::Tensor> add_rms_norm_gemv_meta(const at::Tensor& x, const at::Tensor&,
                                                          const at::Tensor&, double,
                                                          const at::Tensor& weight,
                                                          const std::optional<at::Tensor>&) {
  return {at::empty({x.size(0), weight.size(0)}, x.options()), like(x)};
}
// moe_route's outputs as views of one int32 and one fp32 buffer (csrc/ops/moe.cu's layout).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
           at::Tensor>
moe_route_meta(const at::Tensor& logits, int64_t num_experts, int64_t top_k, bool,
               bool shared, int64_t hidden) {
  const int64_t t = logits.size(0), pairs = t * top_k, groups = (hidden + 31) / 32;
  const int64_t tiles = (shared ? (t + 15) / 16 : 0) + std::min(num_experts, pairs) + pairs / 16;
  const auto i32 = logits.options().dtype(at::kInt), f32 = logits.options().dtype(at::kFloat);
  return {at::empty({t, top_k}, f32), at::empty({t, top_k}, i32), at::empty({t, top_k}, i32),
          at::empty({pairs}, i32), at::empty({tiles, 4}, i32), at::empty({2}, i32),
          at::empty({shared ? t : 0}, f32), at::empty({t * groups}, i32)};
}
at::Tensor moe_experts_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor&,
                            const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                            const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&) {
  return like(x);
}

}  // namespace

DS_TORCH_LIBRARY(DS_OPS_NAMESPACE, m) {
  m.def("causal_conv1d_prefill(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) conv_state, "
        "Tensor cu_seqlens, Tensor slots, Tensor? track_offsets, Tensor? track_slots) -> Tensor");
  m.def("gdn_conv_prefill(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) conv_state, "
        "Tensor cu_seqlens, Tensor slots, Tensor? track_offsets, Tensor? track_slots, "
        "int qk_dim, int head_dim, float eps) -> Tensor");
  m.def("causal_conv1d_update(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) conv_state, "
        "Tensor slots) -> Tensor");
  m.def("causal_conv1d_verify(Tensor x, Tensor weight, Tensor? bias, Tensor conv_state, "
        "Tensor slots) -> Tensor");
  m.def("causal_conv1d_commit(Tensor x, Tensor(a!) conv_state, Tensor slots, "
        "Tensor accepted) -> ()");
  m.def("gdn_decode(Tensor q, Tensor k, Tensor v, Tensor a, Tensor b, Tensor A_log, "
        "Tensor dt_bias, Tensor(a!) state, Tensor slots, float scale) -> Tensor");
  m.def("gdn_verify(Tensor q, Tensor k, Tensor v, Tensor a, Tensor b, Tensor A_log, "
        "Tensor dt_bias, Tensor state, Tensor slots, float scale, Tensor(a!) stash_k, "
        "Tensor(b!) stash_v, Tensor(c!) stash_g, Tensor(d!) stash_beta, int layer) -> Tensor");
  m.def("gdn_replay_verify(Tensor q, Tensor k, Tensor v, Tensor a, Tensor b, Tensor A_log, "
        "Tensor dt_bias, Tensor(a!) state, Tensor slots, float scale, Tensor(b!) stash_k, "
        "Tensor(c!) stash_v, Tensor(d!) stash_g, Tensor(e!) stash_beta, int layer, "
        "Tensor pend_k, Tensor pend_v, Tensor pend_g, Tensor pend_beta, Tensor pend_rows) "
        "-> Tensor");
  m.def("gdn_replay(Tensor stash_k, Tensor stash_v, Tensor stash_g, Tensor stash_beta, "
        "Tensor(a!) state, Tensor slots, Tensor accepted) -> ()");
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, "
        "Tensor kv_lens, float scale, int max_kv_len) -> Tensor");
  m.def("kv_append(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor page_table, Tensor kv_lens) -> ()");
  m.def("snapshot_copy(Tensor src, Tensor(a!) dst, int[] src_slots, int[] dst_slots) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("gated_rms_norm(Tensor x, Tensor z, Tensor weight, float eps) -> Tensor");
  m.def("qk_norm_rope(Tensor q_gate, Tensor k, Tensor q_weight, Tensor k_weight, Tensor cos, "
        "Tensor sin, float eps) -> (Tensor, Tensor)");
  m.def("sigmoid_gate_mul(Tensor o, Tensor q_gate) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("silu_mul_gemv(Tensor gate_up, Tensor weight, Tensor? bias) -> Tensor");
  m.def("sigmoid_gate_mul_gemv(Tensor o, Tensor q_gate, Tensor weight, Tensor? bias) -> Tensor");
  m.def("gated_rms_norm_gemv(Tensor x, Tensor z, Tensor gated_weight, float eps, Tensor weight, "
        "Tensor? bias) -> Tensor");
  m.def("add_rms_norm_gemv(Tensor x, Tensor residual, Tensor rms_weight, float eps, "
        "Tensor weight, Tensor? bias) -> (Tensor, Tensor)");
  m.def("moe_route(Tensor logits, int num_experts, int top_k, bool norm_topk_prob, "
        "bool shared, int hidden) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
        "Tensor)");
  m.def("moe_experts(Tensor x, Tensor gate_up, Tensor down, Tensor? shared_gate_up, "
        "Tensor? shared_down, Tensor weight, Tensor pair_row, Tensor row_token, Tensor tiles, "
        "Tensor n_tiles, Tensor shared_scale, Tensor(a!) counters) -> Tensor");
}

TORCH_LIBRARY_IMPL(DS_OPS_NAMESPACE, Meta, m) {
  m.impl("causal_conv1d_prefill", &conv_prefill_meta);
  m.impl("gdn_conv_prefill", &gdn_conv_prefill_meta);
  m.impl("causal_conv1d_update", &conv_step_meta);
  m.impl("causal_conv1d_verify", &conv_step_meta);
  m.impl("causal_conv1d_commit", &conv_commit_meta);
  m.impl("gdn_decode", &gdn_decode_meta);
  m.impl("gdn_verify", &gdn_verify_meta);
  m.impl("gdn_replay_verify", &gdn_replay_verify_meta);
  m.impl("gdn_replay", &gdn_replay_meta);
  m.impl("paged_attention", &paged_attention_meta);
  m.impl("kv_append", &kv_append_meta);
  m.impl("snapshot_copy", &snapshot_copy_meta);
  m.impl("rms_norm", &rms_norm_meta);
  m.impl("add_rms_norm", &add_rms_norm_meta);
  m.impl("gated_rms_norm", &gated_rms_norm_meta);
  m.impl("qk_norm_rope", &qk_norm_rope_meta);
  m.impl("sigmoid_gate_mul", &sigmoid_gate_mul_meta);
  m.impl("silu_mul", &silu_mul_meta);
  m.impl("gemv", &gemv_meta);
  m.impl("silu_mul_gemv", &silu_mul_gemv_meta);
  m.impl("sigmoid_gate_mul_gemv", &sigmoid_gate_mul_gemv_meta);
  m.impl("gated_rms_norm_gemv", &gated_rms_norm_gemv_meta);
  m.impl("add_rms_norm_gemv", &add_rms_norm_gemv_meta);
  m.impl("moe_route", &moe_route_meta);
  m.impl("moe_experts", &moe_experts_meta);
}

}  // namespace ds_ops

#if !(defined(DS_EMU) && DS_EMU)
// `from deltaserve import _C` loads this library, which registers the ops above.
static PyModuleDef ds_module = {PyModuleDef_HEAD_INIT, "_C", "deltaserve CUDA/HIP kernels", -1,
                                nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&ds_module); }
#endif
