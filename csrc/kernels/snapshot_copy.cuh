// Device->device snapshot copy: every layer of up to kMaxPairs slot pairs in one launch.
//
// Layout (all sizes and offsets in bytes): a pool is L layers, layer l starting at
// base + l * layer_stride; within a layer slot s is the `width` contiguous bytes at s * width.
// For every layer l < L and pair j < n_pairs:
//   dst[l * dst_layer_stride + dst_slot[j] * width, +width) = src[l * src_layer_stride + ...]
// The copy engines (one cudaMemcpy2DAsync per slot) reached 63% of copy bandwidth on an H200
// for these many short rows; a kernel keeps every SM streaming instead.
//
// Work split: each (layer, pair) row is cut into tiles of kThreads * kUnroll units (unit =
// 16, 4 or 1 bytes, the widest that every pointer, width and stride is aligned to); one block
// per tile (grid-stride only past the grid limit), each thread with kUnroll independent loads
// in flight before it stores. Source and destination rows must not overlap
// (the caller checks): pairs run in no particular order.
#pragma once

#include "compat.cuh"

namespace ds {
namespace snapshot {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr int kMaxPairs = 64;  // slot ids ride in the kernel parameters: no upload, no sync
constexpr int64_t kMaxBlocks = 0x7fffffff;  // grid x limit; tiles beyond it are taken grid-stride

struct SnapshotCopyParams {
  const char* src;           // [L, S_src, width] bytes, layers src_layer_stride apart
  char* dst;                 // [L, S_dst, width] bytes, layers dst_layer_stride apart
  int64_t src_layer_stride;  // bytes between layers of src (>= S_src * width)
  int64_t dst_layer_stride;  // bytes between layers of dst (>= S_dst * width)
  int64_t width;             // bytes of one slot in one layer
  int64_t layers;            // L
  int n_pairs;               // 0..kMaxPairs
  int32_t src_slot[kMaxPairs];  // [n_pairs] slot ids in src
  int32_t dst_slot[kMaxPairs];  // [n_pairs] slot ids in dst
};

// V: the copy unit (uint4, uint32_t or uint8_t); every address and length is a multiple of it.
template <typename V>
__global__ void __launch_bounds__(kThreads) copy_kernel(const SnapshotCopyParams p) {
  constexpr int64_t kTile = int64_t(kThreads) * kUnroll;
  const int64_t row_units = p.width / int64_t(sizeof(V));
  const int64_t tiles_per_row = ceil_div(row_units, kTile);
  const int64_t n_tiles = p.layers * p.n_pairs * tiles_per_row;
  for (int64_t t = blockIdx.x; t < n_tiles; t += gridDim.x) {
    const int64_t row = t / tiles_per_row;
    const int64_t layer = row / p.n_pairs;
    const int pair = static_cast<int>(row - layer * p.n_pairs);
    const V* __restrict__ s = reinterpret_cast<const V*>(
        p.src + layer * p.src_layer_stride + p.src_slot[pair] * p.width);
    V* __restrict__ d = reinterpret_cast<V*>(
        p.dst + layer * p.dst_layer_stride + p.dst_slot[pair] * p.width);
    const int64_t c0 = (t - row * tiles_per_row) * kTile + threadIdx.x;
    V v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (c0 + u * kThreads < row_units) v[u] = s[c0 + u * kThreads];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (c0 + u * kThreads < row_units) d[c0 + u * kThreads] = v[u];
  }
}

inline ds_error_t launch_snapshot_copy(const SnapshotCopyParams& p, ds_stream_t stream) {
  if (p.n_pairs < 0 || p.n_pairs > kMaxPairs) return DS_ERROR_INVALID_VALUE;
  // Slot offsets are multiples of width, so these five decide every address's alignment.
  const uint64_t bits = reinterpret_cast<uintptr_t>(p.src) | reinterpret_cast<uintptr_t>(p.dst) |
                        uint64_t(p.width) | uint64_t(p.src_layer_stride) |
                        uint64_t(p.dst_layer_stride);
  const int unit = bits % 16 == 0 ? 16 : bits % 4 == 0 ? 4 : 1;
  const int64_t tiles = p.layers * p.n_pairs * ceil_div(p.width / unit, kThreads * kUnroll);
  if (tiles == 0) return DS_SUCCESS;
  // One block per tile: back to back, 8 slots x 48 layers at Qwen3-Next shapes moved 92.8% of
  // copy bandwidth, against 87.8-88.2% with 4, 8, 16 or 32 resident blocks per SM taking tiles
  // grid-stride (RESULTS.md, session 8; 16-byte units, the only ones measured).
  const int64_t blocks = tiles < kMaxBlocks ? tiles : kMaxBlocks;
  if (unit == 16) return launch(copy_kernel<uint4>, blocks, kThreads, stream, Pdl::kOff, p);
  if (unit == 4) return launch(copy_kernel<uint32_t>, blocks, kThreads, stream, Pdl::kOff, p);
  return launch(copy_kernel<uint8_t>, blocks, kThreads, stream, Pdl::kOff, p);
}

}  // namespace snapshot
}  // namespace ds
