// gdn_replay: the first accepted[n] stashed rows of every layer into the live state, one launch.
// Same block shape and row step as gdn_decode (gdn_recurrent.cuh); the row inputs are staged in
// shared memory from the stash that gdn_verify wrote (k already normalised, g, beta, v as fp32).
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

// One block: row tiles [t0, t0 + nt) (Tile<K, ROWS>::kRows value rows each) of head hv,
// request n, layer l; grid (tile groups, HV, N, L) flattened, tile groups fastest. MULTI (two
// tiles, rows <= kChunk, the launch sees to both): k, the gates and both tiles' v are staged
// once; the second tile is prefetched into L2 while the first computes, as gdn_decode does.
template <int K, int ROWS, bool MULTI>
__global__ void __launch_bounds__(kThreads) replay_kernel(const ReplayParams p) {
  constexpr int BR = Tile<K, ROWS>::kRows;
  constexpr int TP = MULTI ? 2 : 1;
  constexpr int VR = TP * BR;  // staged value rows
  __shared__ __align__(16) RowSmem<K, VR, kChunk, false> sm;

  const int tiles = static_cast<int>(ceil_div(p.V, BR));
  const int groups = static_cast<int>(ceil_div(tiles, TP));
  const int64_t blk = blockIdx.x;
  const int t0 = static_cast<int>(blk % groups) * TP;
  const int nt = t0 + TP < tiles ? TP : tiles - t0;
  const int hv = static_cast<int>((blk / groups) % p.HV);
  const int64_t nl = blk / (int64_t(groups) * p.HV);
  const int n = static_cast<int>(nl % p.N);
  const int layer = static_cast<int>(nl / p.N);
  int rows = p.accepted[n];
  rows = rows < 0 ? 0 : (rows > p.R_max ? p.R_max : rows);
  if (rows == 0) return;  // uniform per block

  const int h = hv / (p.HV / p.H);
  const int tid = threadIdx.x;
  const int64_t slot = p.slots[n];
  float* head = p.state + layer * p.state_layer_stride + (slot * p.HV + hv) * int64_t(p.V) * K;
  float s[ROWS][kPerLane];
  int row[ROWS];
  load_tile<K, ROWS>(head, t0, p.V, s, row);

  const int64_t first = (int64_t(layer) * p.N_max + n) * p.R_max;  // stash row of row 0
  for (int c0 = 0; c0 < rows; c0 += kChunk) {
    const int rc = rows - c0 < kChunk ? rows - c0 : kChunk;
    if (c0 > 0) __syncthreads();
    // Every stash load of the chunk first (one memory round trip), then the shared stores.
    constexpr int kKs = (kChunk * (K / 4) + kThreads - 1) / kThreads;  // float4 pieces of k
    constexpr int kVs = (kChunk * VR + kThreads - 1) / kThreads;       // v values
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
      const int i = tid + u * kThreads, r = i / VR, rw = t0 * BR + i % VR;
      vv[u] = i < rc * VR && rw < p.V ? p.stash_v[((first + c0 + r) * p.HV + hv) * p.V + rw]
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
      if (i < rc * VR) sm.v[i / VR][i % VR] = vv[u];
    }
    if (gr >= 0) {
      sm.decay[gr][0] = gate_decay(g);
      sm.beta[gr][0] = beta;
    }
    __syncthreads();
    for (int i = 0; i < nt; ++i) {  // one tile unless MULTI
      if (i > 0) load_tile<K, ROWS>(head, t0 + i, p.V, s, row);
      if (i + 1 < nt) prefetch_tile<K, ROWS>(head, t0 + i + 1, p.V);
      update_rows<K>(sm, s, 0, &sm.v[0][i * BR], VR, 0, rc);
      if (MULTI) store_tile<K, ROWS>(head, s, row);
    }
  }
  if (!MULTI) store_tile<K, ROWS>(head, s, row);
}

template <int K, int ROWS>
inline ds_error_t launch_replay_rows(const ReplayParams& p, int64_t heads, ds_stream_t stream) {
  const int tiles = static_cast<int>(ceil_div(p.V, Tile<K, ROWS>::kRows));
  const int tp = pick_tiles_per_block(heads, tiles, 2, 2, p.R_max);
  const int64_t blocks = ceil_div(tiles, tp) * heads;
  return tp > 1 ? launch(replay_kernel<K, ROWS, true>, blocks, kThreads, stream, Pdl::kOff, p)
                : launch(replay_kernel<K, ROWS, false>, blocks, kThreads, stream, Pdl::kOff, p);
}

template <int K>
inline ds_error_t launch_replay(const ReplayParams& p, ds_stream_t stream) {
  const int64_t heads = int64_t(p.HV) * p.N * p.L;
  switch (pick_rows<K>(heads, p.V, /*one_launch_per_layer=*/false)) {
    case 4: return launch_replay_rows<K, 4>(p, heads, stream);
    case 2: return launch_replay_rows<K, 2>(p, heads, stream);
    default: return launch_replay_rows<K, 1>(p, heads, stream);
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
