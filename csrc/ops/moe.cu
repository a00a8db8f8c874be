// Torch bindings for the grouped MoE decode path (CUDA dispatch key): moe_route (routing and
// pair grouping, kernels/moe_route.cuh) and moe_experts (gate_up + silu * mul, down + combine,
// kernels/moe_experts.cuh). python/deltaserve/ops/moe_fused.py owns the contract and decides
// when to call them; each check here guards the memory the kernels touch (index values are the
// caller's: moe_experts takes moe_route's outputs as they come).
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "../kernels/moe_experts.cuh"
#include "common.h"
#include "library.h"

namespace ds_ops {
namespace {

using ds::moe::Stage;
using RouteOut = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                            at::Tensor, at::Tensor, at::Tensor>;

int64_t combine_groups(int64_t hidden) { return ds::ceil_div(hidden, 32); }

void check_weight(const at::Tensor& w, at::ScalarType dt, int dims, const char* name) {
  check_cuda(w, name);
  check_dtype(w, dt, name);
  check_dense(w, name);
  TORCH_CHECK(w.dim() == dims && reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0,
              "deltaserve: moe_experts ", name, " has the wrong rank or is not 16-byte aligned");
}

void check_index(const at::Tensor& t, at::ScalarType dt, int64_t numel, const char* name) {
  check_cuda(t, name);
  check_dtype(t, dt, name);
  check_dense(t, name);
  TORCH_CHECK(t.numel() == numel, "deltaserve: moe_experts ", name, " has the wrong size");
}

RouteOut moe_route(const at::Tensor& logits, int64_t num_experts, int64_t top_k,
                   bool norm_topk_prob, bool shared, int64_t hidden) {
  check_cuda(logits, "logits");
  const int64_t t = logits.size(0), e = num_experts, k = top_k;
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) == e + (shared ? 1 : 0),
              "deltaserve: moe_route logits must be [T, E] (+1 column: the shared gate), "
              "last dim dense");
  TORCH_CHECK(t >= 1 && t <= ds::moe::kMaxTokens && e >= 1 && e <= ds::moe::kMaxExperts &&
                  k >= 1 && k <= ds::moe::kMaxTopK && k <= e && hidden >= 1,
              "deltaserve: moe_route takes 1..256 tokens, 1..512 experts, top_k 1..16 (<= E)");
  const int64_t pairs = t * k, tiles = ds::moe::max_tiles(int(t), int(e), int(k), shared);
  const int64_t counters = t * combine_groups(hidden);
  const DeviceGuard guard(logits.device());
  at::Tensor ints = at::empty({3 * pairs + 4 * tiles + 2 + counters},
                              logits.options().dtype(at::kInt));
  at::Tensor floats = at::empty({pairs + (shared ? t : 0)}, logits.options().dtype(at::kFloat));
  RouteOut out{floats.narrow(0, 0, pairs).view({t, k}), ints.narrow(0, 0, pairs).view({t, k}),
               ints.narrow(0, pairs, pairs).view({t, k}), ints.narrow(0, 2 * pairs, pairs),
               ints.narrow(0, 3 * pairs, 4 * tiles).view({tiles, 4}),
               ints.narrow(0, 3 * pairs + 4 * tiles, 2), floats.narrow(0, pairs, shared ? t : 0),
               ints.narrow(0, 3 * pairs + 4 * tiles + 2, counters)};
  ds::moe::RouteParams p{};
  p.logits = logits.data_ptr();
  p.ldl = logits.stride(0);
  p.weight = std::get<0>(out).data_ptr<float>();
  p.expert = std::get<1>(out).data_ptr<int>();
  p.pair_row = std::get<2>(out).data_ptr<int>();
  p.row_token = std::get<3>(out).data_ptr<int>();
  p.tiles = std::get<4>(out).data_ptr<int>();
  p.n_tiles = std::get<5>(out).data_ptr<int>();
  p.shared_scale = shared ? std::get<6>(out).data_ptr<float>() : nullptr;
  p.counters = std::get<7>(out).data_ptr<int>();
  p.n_counters = counters;
  p.T = int(t);
  p.E = int(e);
  p.k = int(k);
  p.norm_topk_prob = norm_topk_prob;
  DS_DISPATCH_HALF(logits.scalar_type(), "moe_route", [&] {
    check_launch(ds::moe::launch_route<scalar_t>(p, stream_of(logits)), "moe_route");
  });
  return out;
}

ds::moe::ExpertSet expert_set(const at::Tensor& w, int64_t w_expert, const at::Tensor& a,
                              const int* a_row, const at::Tensor& c, int64_t n, int64_t k,
                              int cols) {
  ds::moe::ExpertSet s{};
  s.w = w.data_ptr();
  s.w_expert = w_expert;
  s.a = a.data_ptr();
  s.lda = a.size(0) == 1 ? k : a.stride(0);
  s.a_row = a_row;
  s.c = c.data_ptr();
  s.ldc = n;
  s.N = int(n);
  s.K = int(k);
  s.groups = ds::FastDiv(ds::ceil_div(n, cols));
  return s;
}

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down,
                       const std::optional<at::Tensor>& shared_gate_up,
                       const std::optional<at::Tensor>& shared_down, const at::Tensor& weight,
                       const at::Tensor& pair_row, const at::Tensor& row_token,
                       const at::Tensor& tiles, const at::Tensor& n_tiles,
                       const at::Tensor& shared_scale, const at::Tensor& counters) {
  check_cuda(x, "x");
  const auto dt = x.scalar_type();
  check_weight(gate_up, dt, 3, "gate_up (x's dtype)");
  check_weight(down, dt, 3, "down (x's dtype)");
  const int64_t t = x.size(0), h = gate_up.size(2), e = gate_up.size(0), i = gate_up.size(1) / 2;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == h && x.stride(1) == 1 &&
                  (t == 1 || x.stride(0) % 8 == 0) &&
                  reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
              "deltaserve: moe_experts x must be [T, H] rows dense, 16-byte aligned, a "
              "multiple of 8 apart");
  TORCH_CHECK(gate_up.size(1) == 2 * i && down.size(0) == e && down.size(1) == h &&
                  down.size(2) == i && h % 8 == 0 && i % 8 == 0 && i >= 8,
              "deltaserve: moe_experts gate_up must be [E, 2I, H] and down [E, H, I], "
              "H and I multiples of 8");
  const bool shared = shared_gate_up.has_value();
  TORCH_CHECK(shared == shared_down.has_value(),
              "deltaserve: moe_experts shared_gate_up and shared_down come together");
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == t,
              "deltaserve: moe_experts weight must be [T, k] (moe_route's)");
  const int64_t k = weight.size(1), pairs = t * k;
  const int64_t n_max = ds::moe::max_tiles(int(t), int(e), int(k), shared);
  check_index(weight, at::kFloat, pairs, "weight");
  check_index(pair_row, at::kInt, pairs, "pair_row");
  check_index(row_token, at::kInt, pairs, "row_token");
  check_index(tiles, at::kInt, 4 * n_max, "tiles");
  check_index(n_tiles, at::kInt, 2, "n_tiles");
  check_index(counters, at::kInt, t * combine_groups(h), "counters");
  const DeviceGuard guard(x.device());
  at::Tensor hid = at::empty({pairs, i}, x.options());
  at::Tensor y = at::empty({pairs, h}, x.options().dtype(at::kFloat));
  at::Tensor out = at::empty({t, h}, x.options());
  ds::moe::ExpertsParams up{}, dn{};
  const int* rows = row_token.data_ptr<int>();
  up.routed = expert_set(gate_up, 2 * i * h, x, rows, hid, i, h, 8);
  dn.routed = expert_set(down, h * i, hid, nullptr, y, h, i, 32);
  at::Tensor hid_s, y_s;
  int64_t is = 0;
  if (shared) {
    check_weight(*shared_gate_up, dt, 2, "shared_gate_up (x's dtype)");
    check_weight(*shared_down, dt, 2, "shared_down (x's dtype)");
    is = shared_gate_up->size(0) / 2;
    TORCH_CHECK(shared_gate_up->size(0) == 2 * is && shared_gate_up->size(1) == h &&
                    shared_down->size(0) == h && shared_down->size(1) == is && is % 8 == 0 &&
                    is >= 8,
                "deltaserve: moe_experts shared_gate_up must be [2Is, H] and shared_down "
                "[H, Is], Is a multiple of 8");
    check_index(shared_scale, at::kFloat, t, "shared_scale");
    hid_s = at::empty({t, is}, x.options());
    y_s = at::empty({t, h}, x.options().dtype(at::kFloat));
    up.shared = expert_set(*shared_gate_up, 0, x, nullptr, hid_s, is, h, 8);
    dn.shared = expert_set(*shared_down, 0, hid_s, nullptr, y_s, h, is, 32);
    up.shared_tiles = dn.shared_tiles = ds::moe::shared_tiles(int(t), true);
    dn.shared_scale = shared_scale.data_ptr<float>();
  }
  up.tiles = dn.tiles = tiles.data_ptr<int>();
  up.n_tiles = dn.n_tiles = n_tiles.data_ptr<int>();
  const int64_t routed_tiles = n_max - up.shared_tiles;
  up.max_items = up.shared_tiles * ds::ceil_div(is, 8) + routed_tiles * ds::ceil_div(i, 8);
  dn.max_items = n_max * combine_groups(h);
  dn.weight = weight.data_ptr<float>();
  dn.pair_row = pair_row.data_ptr<int>();
  dn.row_token = rows;
  dn.counters = counters.data_ptr<int>();
  dn.out = out.data_ptr();
  dn.k = int(k);
  DS_DISPATCH_HALF(dt, "moe_experts", [&] {
    check_launch(ds::moe::launch_experts<scalar_t, Stage::kGateUp>(up, stream_of(x)),
                 "moe_experts (gate_up)");
    check_launch(ds::moe::launch_experts<scalar_t, Stage::kDown>(dn, stream_of(x)),
                 "moe_experts (down)");
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(DS_OPS_NAMESPACE, DS_OPS_KEY, m) {
  m.impl("moe_route", &moe_route);
  m.impl("moe_experts", &moe_experts);
}

}  // namespace ds_ops
