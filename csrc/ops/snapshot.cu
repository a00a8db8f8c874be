// Torch binding for snapshot_copy: every layer of a list of slots. Within one GPU the copy
// kernel (kernels/snapshot_copy.cuh) moves up to kMaxPairs slots per launch; with a pinned host
// side (or two GPUs) the copy engines take one 2-D async copy per slot, which already fills the
// host link.
#include <torch/library.h>

#include <algorithm>
#include <initializer_list>
#include <vector>

#include "../kernels/snapshot_copy.cuh"
#include "common.h"
#include "library.h"

namespace ds_ops {
namespace {

// The kernel runs all pairs of a call at once, where the per-slot memcpys ran in list order: a
// slot written twice, or (within one pool) written and read by one call, would be a race. A
// slot copied onto itself is rejected rather than skipped: GDNStatePool.copy skips that case
// before calling, so reaching here means the caller's bookkeeping is wrong. The messages carry
// no slot number: a TORCH_CHECK formatting an int64_t here crashed the process (SIGSEGV) on the
// device build instead of raising; formatted const char* arguments elsewhere raise normally.
void check_unordered_is_safe(const at::Tensor& src, const at::Tensor& dst,
                             c10::IntArrayRef src_slots, c10::IntArrayRef dst_slots) {
  const bool same_pool = src.is_alias_of(dst);
  TORCH_CHECK(!same_pool || (src.data_ptr() == dst.data_ptr() && src.sizes() == dst.sizes() &&
                             src.strides() == dst.strides()),
              "deltaserve: device pools that share memory must be one and the same pool");
  std::vector<char> written(static_cast<size_t>(dst.size(1)), 0);
  for (const int64_t s : dst_slots) {
    TORCH_CHECK(!written[s], "deltaserve: snapshot_copy writes a destination slot twice");
    written[s] = 1;
  }
  if (same_pool)
    for (const int64_t s : src_slots)
      TORCH_CHECK(!written[s], "deltaserve: snapshot_copy within one pool both reads and "
                  "writes a slot");
}

void copy_on_device(const at::Tensor& src, const at::Tensor& dst, c10::IntArrayRef src_slots,
                    c10::IntArrayRef dst_slots, int64_t width, ds_stream_t stream) {
  check_unordered_is_safe(src, dst, src_slots, dst_slots);
  const int64_t es = src.element_size();
  ds::snapshot::SnapshotCopyParams p{};
  p.src = static_cast<const char*>(src.data_ptr());
  p.dst = static_cast<char*>(dst.data_ptr());
  p.src_layer_stride = src.stride(0) * es;
  p.dst_layer_stride = dst.stride(0) * es;
  p.width = width;
  p.layers = src.size(0);
  const int64_t n = static_cast<int64_t>(src_slots.size());
  for (int64_t j0 = 0; j0 < n; j0 += ds::snapshot::kMaxPairs) {
    p.n_pairs = static_cast<int>(std::min<int64_t>(ds::snapshot::kMaxPairs, n - j0));
    for (int j = 0; j < p.n_pairs; ++j) {
      p.src_slot[j] = static_cast<int32_t>(src_slots[j0 + j]);
      p.dst_slot[j] = static_cast<int32_t>(dst_slots[j0 + j]);
    }
    check_launch(ds::snapshot::launch_snapshot_copy(p, stream), "snapshot_copy");
  }
}

void copy_by_memcpy(const at::Tensor& src, const at::Tensor& dst, c10::IntArrayRef src_slots,
                    c10::IntArrayRef dst_slots, int64_t width, ds_stream_t stream) {
  const int64_t es = src.element_size();
  const auto* s_base = static_cast<const char*>(src.data_ptr());
  auto* d_base = static_cast<char*>(dst.data_ptr());
  for (size_t j = 0; j < src_slots.size(); ++j) {
#if DS_HIP
    const auto err = hipMemcpy2DAsync(
#else
    const auto err = cudaMemcpy2DAsync(
#endif
        d_base + dst_slots[j] * width, static_cast<size_t>(dst.stride(0) * es),
        s_base + src_slots[j] * width, static_cast<size_t>(src.stride(0) * es),
        static_cast<size_t>(width), static_cast<size_t>(src.size(0)),
#if DS_HIP
        hipMemcpyDefault, stream);
#else
        cudaMemcpyDefault, stream);
#endif
    check_launch(err, "snapshot_copy");
  }
}

// src, dst [L, S, ...] (S may differ), same dtype and per-slot shape; one side may be pinned host
// memory. Enqueued on the current stream of the CUDA side; returns without waiting.
void snapshot_copy(const at::Tensor& src, const at::Tensor& dst, c10::IntArrayRef src_slots,
                   c10::IntArrayRef dst_slots) {
  TORCH_CHECK(src.is_cuda() || dst.is_cuda(), "deltaserve: snapshot_copy needs a CUDA side");
  for (const at::Tensor* t : TensorRefs{&src, &dst})
    TORCH_CHECK(t->is_cuda() || t->is_pinned(),
                "deltaserve: host pools must be pinned (an unpinned copy would block)");
  TORCH_CHECK(src.scalar_type() == dst.scalar_type() && src.dim() == dst.dim() && src.dim() >= 2 &&
                  src.size(0) == dst.size(0), "deltaserve: pools must match in dtype and layers");
  for (int d = 2; d < src.dim(); ++d)
    TORCH_CHECK(src.size(d) == dst.size(d), "deltaserve: per-slot shapes differ");
  TORCH_CHECK(src_slots.size() == dst_slots.size(), "deltaserve: slot lists differ in length");
  int64_t slot_elems = 1;
  for (int d = 2; d < src.dim(); ++d) slot_elems *= src.size(d);
  for (const at::Tensor* t : TensorRefs{&src, &dst}) {
    int64_t expect = 1;
    for (int d = t->dim() - 1; d >= 1; --d) {
      TORCH_CHECK(t->size(d) == 1 || t->stride(d) == expect,
                  "deltaserve: pools must be dense per layer ([S, ...] contiguous)");
      expect *= t->size(d);
    }
  }
  // All ids are checked before anything is enqueued, so a bad call copies nothing.
  for (size_t j = 0; j < src_slots.size(); ++j)
    TORCH_CHECK(0 <= src_slots[j] && src_slots[j] < src.size(1) && 0 <= dst_slots[j] &&
                    dst_slots[j] < dst.size(1), "deltaserve: slot id out of range");
  const int64_t width = slot_elems * src.element_size();
  const at::Tensor& dev = src.is_cuda() ? src : dst;
  const DeviceGuard guard(dev.device());
  const ds_stream_t stream = stream_of(dev);
  if (src.is_cuda() && dst.is_cuda() && src.device() == dst.device())
    copy_on_device(src, dst, src_slots, dst_slots, width, stream);
  else
    copy_by_memcpy(src, dst, src_slots, dst_slots, width, stream);
}

}  // namespace

TORCH_LIBRARY_IMPL(DS_OPS_NAMESPACE, DS_OPS_KEY, m) { m.impl("snapshot_copy", &snapshot_copy); }

}  // namespace ds_ops
