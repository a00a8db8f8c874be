// Torch bindings for paged_attention and kv_append (CUDA dispatch key).
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <initializer_list>

#include "../kernels/attention.cuh"
#include "common.h"
#include "library.h"

namespace ds_ops {
namespace {

// k_cache / v_cache [P, page_size, Hkv, D] dense, one 16-bit dtype; page_table [N, M] int32
// (rows dense), kv_lens [N] int32; all on the device of `like`.
void check_pages(const at::Tensor& like, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& page_table, const at::Tensor& kv_lens, int64_t N) {
  for (const at::Tensor* t : TensorRefs{&like, &k_cache, &v_cache, &page_table, &kv_lens})
    check_cuda(*t, "q/k, k_cache, v_cache, page_table, kv_lens");
  TORCH_CHECK(like.scalar_type() == at::kBFloat16 || like.scalar_type() == at::kHalf,
              "deltaserve: paged attention runs bf16 or fp16 KV");
  check_dtype(k_cache, like.scalar_type(), "k_cache (q's dtype)");
  check_dtype(v_cache, like.scalar_type(), "v_cache (q's dtype)");
  check_dense(k_cache, "k_cache");
  check_dense(v_cache, "v_cache");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                  k_cache.size(-1) == like.size(-1),
              "deltaserve: k_cache and v_cache must be [P, page_size, Hkv, D] alike");
  check_dtype(page_table, at::kInt, "page_table");
  check_dtype(kv_lens, at::kInt, "kv_lens");
  check_dense(kv_lens, "kv_lens");
  TORCH_CHECK(page_table.dim() == 2 && page_table.size(0) == N && page_table.stride(1) == 1 &&
                  page_table.size(1) > 0 && kv_lens.numel() == N,
              "deltaserve: page_table must be [N, max_pages] (rows dense), kv_lens [N]");
  TORCH_CHECK(k_cache.size(1) >= 1 && k_cache.size(1) <= 0x7fffffff,
              "deltaserve: page_size out of range");
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& page_table,
                           const at::Tensor& kv_lens, double scale, int64_t max_kv_len) {
  TORCH_CHECK(q.dim() == 4, "deltaserve: q must be [N, R, Hq, D]");
  check_pages(q, k_cache, v_cache, page_table, kv_lens, q.size(0));
  check_dense(q, "q");
  const int64_t Hq = q.size(2), Hkv = k_cache.size(2), D = q.size(3);
  TORCH_CHECK(D == 64 || D == 128 || D == 256,
              "deltaserve: paged attention head dim must be 64, 128 or 256");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "deltaserve: Hq must be a multiple of Hkv");
  TORCH_CHECK(q.size(1) >= 1 && q.size(1) <= ds::attn::kMaxBlockRows,
              "deltaserve: paged attention takes 1..16 rows per request");
  ds::attn::PagedAttnParams p{};
  p.N = q.size(0); p.R = q.size(1); p.Hq = Hq; p.Hkv = Hkv; p.D = D;
  p.page_size = k_cache.size(1); p.page_div = ds::FastDiv(p.page_size);
  p.max_pages = page_table.size(1); p.page_table_stride = page_table.stride(0);
  p.heads_per_block = ds::attn::heads_per_block(p.Hq, p.Hkv, p.R);
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  const DeviceGuard guard(q.device());
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (p.N == 0) return out;
  check_launch(ds::attn::max_splits_for(p.N, p.R, p.Hq, p.heads_per_block, p.D, max_kv_len,
                                        &p.max_splits),
               "paged_attention (device query)");
  const auto f32 = q.options().dtype(at::kFloat);
  // the merge's workspace; one split: never touched
  const int64_t splits = p.max_splits > 1 ? p.max_splits : 0;
  at::Tensor part_o = at::empty({p.N * p.R * Hq * splits * D}, f32);
  at::Tensor part_lse = at::empty({p.N * p.R * Hq * splits}, f32);
  p.q = q.data_ptr(); p.k_cache = k_cache.data_ptr(); p.v_cache = v_cache.data_ptr();
  p.page_table = page_table.data_ptr<int32_t>(); p.kv_lens = kv_lens.data_ptr<int32_t>();
  p.out = out.data_ptr(); p.part_o = part_o.data_ptr<float>();
  p.part_lse = part_lse.data_ptr<float>();
  DS_DISPATCH_HALF(q.scalar_type(), "paged_attention", [&] {
    check_launch(ds::attn::launch_paged_attention<scalar_t>(p, stream_of(q)), "paged_attention");
  });
  return out;
}

void kv_append(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
               const at::Tensor& v_cache, const at::Tensor& page_table,
               const at::Tensor& kv_lens) {
  const int64_t N = kv_lens.numel();
  check_pages(k, k_cache, v_cache, page_table, kv_lens, N);
  check_dtype(v, k.scalar_type(), "v (k's dtype)");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.size(1) == k_cache.size(2) &&
                  N > 0 && k.size(0) % N == 0,
              "deltaserve: k and v must be [N * R, Hkv, D] matching the cache");
  check_rows(k, 2, 8, "k");
  check_rows(v, 2, 8, "v");
  ds::attn::KVAppendParams p{};
  p.k = k.data_ptr(); p.v = v.data_ptr();
  p.k_cache = k_cache.data_ptr(); p.v_cache = v_cache.data_ptr();
  p.page_table = page_table.data_ptr<int32_t>(); p.kv_lens = kv_lens.data_ptr<int32_t>();
  p.k_row_stride = k.stride(0); p.v_row_stride = v.stride(0);
  p.page_table_stride = page_table.stride(0);
  p.N = N; p.R = k.size(0) / N; p.Hkv = k.size(1); p.D = k.size(2);
  p.page_size = k_cache.size(1); p.page_div = ds::FastDiv(p.page_size);
  p.max_pages = page_table.size(1);
  const DeviceGuard guard(k.device());
  DS_DISPATCH_HALF(k.scalar_type(), "kv_append", [&] {
    check_launch(ds::attn::launch_kv_append<scalar_t>(p, stream_of(k)), "kv_append");
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(DS_OPS_NAMESPACE, DS_OPS_KEY, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("kv_append", &kv_append);
}

}  // namespace ds_ops
