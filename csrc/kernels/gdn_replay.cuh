// gdn_replay: the first accepted[n] stashed rows of every layer into the live state, one launch.
#pragma once

#include "gdn_common.cuh"

namespace ds {
namespace gdn {

struct ReplayParams {
  const float* stash_k;     // [L, N_max, R_max, H, K]
  const float* stash_v;     // [L, N_max, R_max, HV, V]
  const float* stash_g;     // [L, N_max, R_max, HV]
  const float* stash_beta;  // [L, N_max, R_max, HV]
  float* state;             // [L, S, HV, V, K] fp32 pool
  const int32_t* slots;     // [N]
  const int32_t* accepted;  // [N], clamped to 0..R_max
  int64_t state_layer_stride;  // S * HV * V * K elements
  int L, N, N_max, R_max, H, HV, V;
};

// One block: kRowsPerBlock value rows of head hv, request n, layer l (row tiles fastest).
template <int K>
__global__ void __launch_bounds__(kThreads) replay_kernel(const ReplayParams p) {
  using L = Layout<K>;
  const int tiles = static_cast<int>(ceil_div(p.V, L::kRowsPerBlock));
  const int64_t blk = blockIdx.x;
  const int tile = static_cast<int>(blk % tiles);
  const int hv = static_cast<int>((blk / tiles) % p.HV);
  const int64_t nl = blk / (int64_t(tiles) * p.HV);
  const int n = static_cast<int>(nl % p.N);
  const int layer = static_cast<int>(nl / p.N);
  int rows = p.accepted[n];
  rows = rows < 0 ? 0 : (rows > p.R_max ? p.R_max : rows);
  if (rows == 0) return;  // uniform per block

  const int h = hv / (p.HV / p.H);
  const int lane = L::group_lane();
  const int row_raw = tile * L::kRowsPerBlock + L::block_row();
  const bool active = row_raw < p.V;
  const int row = active ? row_raw : 0;
  const int64_t slot = p.slots[n];
  float* srow = p.state + layer * p.state_layer_stride +
                (slot * p.HV + hv) * int64_t(p.V) * K + int64_t(row) * K;
  float s[kPerLane];
  load_state<K>(srow, lane, s);
  const int64_t first = (int64_t(layer) * p.N_max + n) * p.R_max;  // stash row of row 0
  const float unused_q[kPerLane] = {};
  for (int r = 0; r < rows; ++r) {
    const int64_t sr = first + r;
    float k[kPerLane];
    load_state<K>(p.stash_k + (sr * p.H + h) * K, lane, k);
    const float v = p.stash_v[(sr * p.HV + hv) * p.V + row];
    step<K, false>(s, k, unused_q, v, p.stash_g[sr * p.HV + hv], p.stash_beta[sr * p.HV + hv]);
  }
  if (active) store_state<K>(srow, lane, s);
}

inline ds_error_t launch_gdn_replay(const ReplayParams& p, int K, ds_stream_t stream) {
  auto blocks = [&](int rows_per_block) {
    return ceil_div(p.V, rows_per_block) * int64_t(p.HV) * p.N * p.L;
  };
  switch (K) {
    case 64:
      return launch(replay_kernel<64>, blocks(Layout<64>::kRowsPerBlock), kThreads, stream, p);
    case 128:
      return launch(replay_kernel<128>, blocks(Layout<128>::kRowsPerBlock), kThreads, stream, p);
    case 256:
      return launch(replay_kernel<256>, blocks(Layout<256>::kRowsPerBlock), kThreads, stream, p);
    default:
      return DS_ERROR_INVALID_VALUE;
  }
}

}  // namespace gdn
}  // namespace ds
