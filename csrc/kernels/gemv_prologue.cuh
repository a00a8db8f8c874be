// gemv whose x is made inside it: the kernel that would have run just before a decode projection
// (python/deltaserve/ops/prologue.py holds the contracts and references) becomes the first phase
// of the projection's blocks, which removes a launch and a dependency from the step:
//   silu_mul -> down_proj              x = round(round(silu(gate)) * up)
//   sigmoid_gate_mul -> o_proj         x = round(o * round(sigmoid(gate)))
//   gated_rms_norm -> GDN out_proj     x = round(round(w * round(x_hat)) * silu(z)) per head
//   add_rms_norm -> the next layer's first projection (in_proj, qkv_proj, gate_up_proj)
//                                      s = round(residual + h), x = round(s_hat * w); s written
// Every block computes all of x (M rows of K: a few KB read from L2, while its weight tile
// streams in) into shared memory with the device functions of fused.cuh that
// the stand-alone kernels run, so x holds the same bits as their output, and the main loop
// (gemv.cuh) multiplies the same values in the same order: y is bitwise the unfused pair's.
// Block 0 alone writes the sum s of add_rms_norm (every block reads residual and h, never s).
// x must fit the stage (M <= kMaxStagedRows, M * (K + 8) <= kStageElems) and the views 16-byte
// accesses; norm rows take at most 128 threads (D <= 4096 16-bit elements). No allocation, no
// host synchronisation.
#pragma once

#include "fused.cuh"
#include "gemv.cuh"

namespace ds {
namespace gemv {

// x [M, K] = gate op of a and b (fused::GateParams with T = M rows, cols = K).
template <fused::Gate G>
struct GatePrologue {
  static constexpr bool kStaged = true;
  using Params = fused::GateParams;
  template <typename T>
  static DS_DEVICE void stage(const Params& p, T* xs, int ld, int /*M*/) {
    constexpr int N = 16 / sizeof(T);
    const int per_row = p.cols / N;
    for (int i = static_cast<int>(threadIdx.x); i < p.T * per_row;
         i += static_cast<int>(blockDim.x)) {
      const int t = i / per_row, c = (i - t * per_row) * N;
      float y[N];
      fused::gate_values<T, N, G>(p, t, c, y);
      fused::store_n<T, N>(xs + t * ld + c, y);
    }
    __syncthreads();
  }
};

// x = norm rows (fused::NormParams: rows = M for add, M * HV for gated, D elements each; row r
// of view p.x is [outer, inner] = [r / inner, r % inner] and lands at xs + outer * ld +
// inner * D). TPR threads a row as norm_kernel picks them for D.
template <fused::Norm K, int TPR>
struct NormPrologue {
  static_assert(K == fused::Norm::kAddRms || K == fused::Norm::kGated, "add or gated norms");
  static constexpr bool kStaged = true;
  using Params = fused::NormParams;
  template <typename T>
  static DS_DEVICE void stage(const Params& p, T* xs, int ld, int /*M*/) {
    constexpr int N = 16 / sizeof(T);
    const int groups = static_cast<int>(blockDim.x) / TPR;
    const int group = static_cast<int>(threadIdx.x) / TPR;
    const int lane = static_cast<int>(threadIdx.x) % TPR;
    const bool writes_sum = K == fused::Norm::kAddRms && blockIdx.x == 0;
    for (int base = 0; base < p.rows; base += groups) {  // the same trip count in every thread
      const int r = base + group;
      const bool active = r < p.rows;
      T* sum_out = writes_sum && active ? static_cast<T*>(p.y2) + int64_t(r) * p.D : nullptr;
      float v[fused::kChunks][N], g[fused::kChunks][N];
      const float inv = fused::norm_load<T, N, TPR, K>(p, p.x, r, lane, active, sum_out, v, g);
      const int outer = active ? p.x.inner.div(r) : 0;
      T* out = xs + outer * ld + (r - outer * static_cast<int>(p.x.inner.d)) * p.D;
      fused::norm_out<T, N, TPR, K>(p, static_cast<const float*>(p.w), lane, active, v, g, inv,
                                    active ? out : nullptr);
      if constexpr (TPR > kWarp) __syncthreads();  // row_sum's parts are reused next round
    }
    __syncthreads();
  }
};

// Threads a norm row of D 16-bit elements takes (fused::norm_threads_per_row); 0: too long.
inline int prologue_norm_threads(int D, int elem_bytes) {
  const int tpr = fused::norm_threads_per_row(ceil_div(D, 16 / elem_bytes));
  return tpr <= 128 ? tpr : 0;
}

template <typename T, fused::Gate G>
inline ds_error_t launch_gemv_gate(const GemvParams& p, const fused::GateParams& pro,
                                   ds_stream_t stream) {
  if (!gemv_args_ok(p) || p.M > kMaxStagedRows || !stage_fits(p.M, p.K) || pro.T != p.M ||
      pro.cols != p.K)
    return DS_ERROR_INVALID_VALUE;
  return launch_gemv_with<T, GatePrologue<G>>(p, pro, stream);
}

template <typename T, fused::Norm K>
inline ds_error_t launch_gemv_norm(const GemvParams& p, const fused::NormParams& pro,
                                   ds_stream_t stream) {
  if (!gemv_args_ok(p) || p.M > kMaxStagedRows || !stage_fits(p.M, p.K) || pro.rows < p.M ||
      pro.rows % p.M != 0 ||
      int64_t(pro.rows / p.M) * pro.D != p.K)
    return DS_ERROR_INVALID_VALUE;
  switch (prologue_norm_threads(pro.D, sizeof(T))) {
    case 16: return launch_gemv_with<T, NormPrologue<K, 16>>(p, pro, stream);
    case kWarp: return launch_gemv_with<T, NormPrologue<K, kWarp>>(p, pro, stream);
    case 128: return launch_gemv_with<T, NormPrologue<K, 128>>(p, pro, stream);
    default: return DS_ERROR_INVALID_VALUE;
  }
}

}  // namespace gemv
}  // namespace ds
