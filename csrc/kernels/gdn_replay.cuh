// gdn_replay: the first accepted[n] stashed rows of every layer into the live state, one launch.
// Same block shape and row step as gdn_decode (gdn_recurrent.cuh); the staged row inputs come
// from the stash that gdn_verify wrote (k already normalised, g, beta, v as fp32).
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

// One block: Tile<K, ROWS>::kRows value rows of head hv, request n, layer l (row tiles fastest).
template <int K, int ROWS>
__global__ void __launch_bounds__(kThreads) replay_kernel(const ReplayParams p) {
  using L = Layout<K>;
  constexpr int BR = Tile<K, ROWS>::kRows;
  __shared__ __align__(16) RowSmem<K, BR, kChunk, false> sm;

  const int tiles = static_cast<int>(ceil_div(p.V, BR));
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
  const int grp = L::group();
  const int tid = threadIdx.x;
  const int64_t slot = p.slots[n];
  float* head = p.state + layer * p.state_layer_stride + (slot * p.HV + hv) * int64_t(p.V) * K;
  float s[ROWS][kPerLane];
  int row[ROWS];
  load_tile<K, ROWS>(head, tile, p.V, s, row);

  const int64_t first = (int64_t(layer) * p.N_max + n) * p.R_max;  // stash row of row 0
  for (int c0 = 0; c0 < rows; c0 += kChunk) {
    const int rc = rows - c0 < kChunk ? rows - c0 : kChunk;
    if (c0 > 0) __syncthreads();
    // Every stash load of the chunk first (one memory round trip), then the shared stores.
    constexpr int kKs = (kChunk * (K / 4) + kThreads - 1) / kThreads;  // float4 pieces of k
    constexpr int kVs = (kChunk * BR + kThreads - 1) / kThreads;       // v values
    float4 kp[kKs];
    float vv[kVs];
#pragma unroll
    for (int u = 0; u < kKs; ++u) {
      const int i = tid + u * kThreads, r = i / (K / 4), j = (i % (K / 4)) * 4;
      if (i < rc * (K / 4))
        kp[u] = *reinterpret_cast<const float4*>(p.stash_k + ((first + c0 + r) * p.H + h) * K + j);
    }
#pragma unroll
    for (int u = 0; u < kVs; ++u) {
      const int i = tid + u * kThreads, r = i / BR, rw = tile * BR + i % BR;
      vv[u] = i < rc * BR && rw < p.V ? p.stash_v[((first + c0 + r) * p.HV + hv) * p.V + rw]
                                      : 0.f;
    }
    const int gr = tid - (kThreads - rc);  // gates: the last rc threads, one row each
    float g = 0.f, beta = 0.f;
    if (gr >= 0) {
      g = p.stash_g[(first + c0 + gr) * p.HV + hv];
      beta = p.stash_beta[(first + c0 + gr) * p.HV + hv];
    }
#pragma unroll
    for (int u = 0; u < kKs; ++u) {
      const int i = tid + u * kThreads;
      if (i < rc * (K / 4))
        *reinterpret_cast<float4*>(&sm.k[i / (K / 4)][(i % (K / 4)) * 4]) = kp[u];
    }
#pragma unroll
    for (int u = 0; u < kVs; ++u) {
      const int i = tid + u * kThreads;
      if (i < rc * BR) sm.v[i / BR][i % BR] = vv[u];
    }
    if (gr >= 0) {
      sm.decay[gr][0] = gate_decay(g);
      sm.beta[gr][0] = beta;
    }
    __syncthreads();
    for (int r = 0; r < rc; ++r) {
      float k[kPerLane];
      load_slice<K>(sm.k[r], lane, k);
      const float decay = sm.decay[r][0], beta = sm.beta[r][0];
#pragma unroll
      for (int m = 0; m < ROWS; ++m)
        update<K>(s[m], k, sm.v[r][m * L::kGroups + grp], decay, beta);
    }
  }
  store_tile<K, ROWS>(head, s, row);
}

template <int K>
inline ds_error_t launch_replay(const ReplayParams& p, ds_stream_t stream) {
  const int64_t heads = int64_t(p.HV) * p.N * p.L;
  const auto blocks = [&](int rows) { return ceil_div(p.V, Layout<K>::kGroups * rows) * heads; };
  switch (pick_rows<K>(heads, p.V, /*one_launch_per_layer=*/false)) {
    case 4: return launch(replay_kernel<K, 4>, blocks(4), kThreads, stream, Pdl::kOff, p);
    case 2: return launch(replay_kernel<K, 2>, blocks(2), kThreads, stream, Pdl::kOff, p);
    default: return launch(replay_kernel<K, 1>, blocks(1), kThreads, stream, Pdl::kOff, p);
  }
}

inline ds_error_t launch_gdn_replay(const ReplayParams& p, int K, ds_stream_t stream) {
  switch (K) {
    case 32: return launch_replay<32>(p, stream);
    case 64: return launch_replay<64>(p, stream);
    case 128: return launch_replay<128>(p, stream);
    case 256: return launch_replay<256>(p, stream);
    default: return DS_ERROR_INVALID_VALUE;
  }
}

}  // namespace gdn
}  // namespace ds
