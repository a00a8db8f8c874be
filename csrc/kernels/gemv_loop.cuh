// gemv past 8 rows on grids wider than a wave (python/deltaserve/ops/linear.py decides when):
// gemv_kernel with kLoop, one or two 16-warp blocks a multiprocessor, each staging x once in
// shared memory (M rows of K + 8 elements: made by a prologue, gemv_prologue.cuh, or copied by
// CopyPrologue) and then walking its tiles blockIdx.x, + gridDim.x, ...: x is read from L2 once
// a block instead of once a tile (gemv_kernel's one tile a block re-reads all of x per 8
// columns: on an H100, 32 rows ran 0.55x of cuBLAS on the 0.8B in_proj, RESULTS.md), and a
// prologue of up to 32 rows (the add + norm before in_proj, qkv_proj, gate_up_proj at batch 32)
// runs once a block. Weights go through registers, the next tile prefetched into L2 while the
// block multiplies the one before. Off unless DS_GEMV_VARIANT has bit 8: not yet measured.
// The sums of a row differ from gemv_kernel's 4- or 8-warp blocks (16 warps here), not between
// runs. No allocation, no host synchronisation.
#pragma once

#include "gemv.cuh"

namespace ds {
namespace gemv {

// Largest stage of the looped kernel, in 16-bit elements of x (M (K + 8)): 192 KB, under the
// H100's 227 KB a block with the 16 KB of 32-row partial sums.
constexpr int64_t kLoopStageElems = 96 * 1024;

inline bool loop_on() { return (gemv_variant() & 8) != 0; }

DS_HOST_DEVICE constexpr bool loop_fits(int M, int K) {
  return M >= 1 && M <= kMaxRows && int64_t(M) * stage_ld(K) <= kLoopStageElems;
}

// x's rows copied into the stage as they are (the looped kernel without a prologue).
struct CopyPrologue {
  static constexpr bool kStaged = true;
  struct Params {
    const void* x;
    int64_t ldx;  // elements between rows (0: one row broadcast)
    int K;
  };
  template <typename T>
  static DS_DEVICE void stage(const Params& p, T* xs, int ld, int M) {
    const int per_row = p.K / 8;  // 16-byte pieces
    for (int i = static_cast<int>(threadIdx.x); i < M * per_row;
         i += static_cast<int>(blockDim.x)) {
      const int r = i / per_row, c = 8 * (i - r * per_row);
      *reinterpret_cast<uint4*>(xs + r * ld + c) =
          *reinterpret_cast<const uint4*>(static_cast<const T*>(p.x) + r * p.ldx + c);
    }
    __syncthreads();
  }
};

template <typename T, class Pro, int XR>
inline ds_error_t launch_loop_rows(const GemvParams& p, const typename Pro::Params& pro,
                                   int64_t blocks, size_t smem, ds_stream_t stream) {
  return launch_dyn(gemv_kernel<T, 16, Pro, false, XR, true>, blocks, 16 * kWarp, smem, stream,
                    Pdl::kOn, p, pro);
}

// The looped kernel: as many blocks as tiles, at most two a multiprocessor (one where two do
// not fit its shared memory).
template <typename T, class Pro>
inline ds_error_t launch_gemv_loop(GemvParams p, const typename Pro::Params& pro,
                                   ds_stream_t stream) {
  if (!gemv_args_ok(p) || !loop_fits(p.M, p.K)) return DS_ERROR_INVALID_VALUE;
  p.variant = gemv_variant();
  int sms = 0, per_sm = 0, per_block = 0;
  ds_error_t err = multiprocessor_count(&sms);
  if (err == DS_SUCCESS) err = shared_memory_limits(&per_sm, &per_block);
  if (err != DS_SUCCESS) return err;
  const int xr = x_rows_per_lane(p.M);
  const int64_t smem = dynamic_smem(p.M, p.K, false, true);
  const int64_t partials = int64_t(16) * kWarp * 2 * xr * 4;  // the static part[][][] sums
  if (smem + partials > per_block) return DS_ERROR_INVALID_VALUE;
  const int64_t per = per_sm >= 2 * (smem + partials + 1024) ? 2 : 1;
  const int64_t tiles = ceil_div(p.N, kTileCols);
  const int64_t blocks = tiles < per * sms ? tiles : per * sms;
  const auto bytes = static_cast<size_t>(smem);
  switch (xr) {
    case 1: return launch_loop_rows<T, Pro, 1>(p, pro, blocks, bytes, stream);
    case 2: return launch_loop_rows<T, Pro, 2>(p, pro, blocks, bytes, stream);
    default: return launch_loop_rows<T, Pro, 4>(p, pro, blocks, bytes, stream);
  }
}

// The plain gemv: the looped kernel past 8 rows on a grid wider than a wave when bit 8 of
// DS_GEMV_VARIANT is set, else gemv_kernel.
template <typename T>
inline ds_error_t launch_gemv_plain(const GemvParams& p, ds_stream_t stream) {
  if (!gemv_args_ok(p)) return DS_ERROR_INVALID_VALUE;
  int sms = 0;
  const ds_error_t err = multiprocessor_count(&sms);
  if (err != DS_SUCCESS) return err;
  if (loop_on() && p.M > kMaxStagedRows && ceil_div(p.N, kTileCols) > sms &&
      loop_fits(p.M, p.K)) {
    const ds_error_t e =
        launch_gemv_loop<T, CopyPrologue>(p, CopyPrologue::Params{p.x, p.ldx, p.K}, stream);
    if (e != DS_ERROR_INVALID_VALUE) return e;  // else its stage does not fit this device
  }
  return launch_gemv<T>(p, stream);
}

}  // namespace gemv
}  // namespace ds
