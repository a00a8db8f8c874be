// Torch binding for snapshot_copy: every layer of a list of slots, one 2-D async copy per slot.
// Host code only (no kernel): device<->device and device<->pinned host through the copy engines.
#include <torch/library.h>

#include <initializer_list>

#include <vector>

#include "common.h"

namespace ds_ops {
namespace {

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
  const int64_t es = src.element_size();
  const size_t width = static_cast<size_t>(slot_elems * es);
  const auto* s_base = static_cast<const char*>(src.data_ptr());
  auto* d_base = static_cast<char*>(dst.data_ptr());
  const at::Tensor& dev = src.is_cuda() ? src : dst;
  const c10::cuda::CUDAGuard guard(dev.device());
  const ds_stream_t stream = stream_of(dev);
  for (size_t j = 0; j < src_slots.size(); ++j) {
    TORCH_CHECK(0 <= src_slots[j] && src_slots[j] < src.size(1) && 0 <= dst_slots[j] &&
                    dst_slots[j] < dst.size(1), "deltaserve: slot id out of range");
#if DS_HIP
    const auto err = hipMemcpy2DAsync(
#else
    const auto err = cudaMemcpy2DAsync(
#endif
        d_base + dst_slots[j] * width, static_cast<size_t>(dst.stride(0) * es),
        s_base + src_slots[j] * width, static_cast<size_t>(src.stride(0) * es), width,
        static_cast<size_t>(src.size(0)),
#if DS_HIP
        hipMemcpyDefault, stream);
#else
        cudaMemcpyDefault, stream);
#endif
    check_launch(err, "snapshot_copy");
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(deltaserve, CUDA, m) { m.impl("snapshot_copy", &snapshot_copy); }

}  // namespace ds_ops
