// gdn_decode (one row, state updated in place) and gdn_verify (R rows, state read only,
// per-row outputs, stash written): one block body, two entry points (their register caps
// differ), the row step from gdn_common.cuh. Both are launched with programmatic dependent
// launch (compat.cuh): a block prefetches its state rows into L2 before the previous kernel in
// the stream (causal_conv1d_update/verify in a model step) has finished.
//
// A block owns Tile<K, ROWS>::kRows value rows of one value head of one request. It issues the
// loads of its state rows first, then stages the per-row inputs once for the whole block
// (q and k of a row L2-normalised by one warp, with k . q; gates by one thread; v) in shared
// memory while those loads are in flight. Verify keeps the evolving state in registers across
// its R rows and never writes it back; decode writes it once.
#pragma once

#include "gdn_common.cuh"

namespace ds {
namespace gdn {

struct RecurrentParams {
  const void* q;          // [N, R, H, K] T, strides q_stride_n / q_stride_r, [H, K] dense
  const void* k;          // [N, R, H, K] T, strides k_stride_n / k_stride_r
  const void* v;          // [N, R, HV, V] T, strides v_stride_n / v_stride_r
  const void* a;          // [N, R, HV] T, strides a_stride_n / a_stride_r
  const void* b;          // [N, R, HV] T, strides b_stride_n / b_stride_r
  const float* A_log;     // [HV]
  const float* dt_bias;   // [HV]
  float* state;           // [S, HV, V, K] fp32, one layer of the pool (read only in verify)
  const int32_t* slots;   // [N]
  void* o;                // [N, R, HV, V] T, dense
  float* stash_k;         // verify: [N_max, R_max, H, K] of this layer (else null)
  float* stash_v;         // verify: [N_max, R_max, HV, V]
  float* stash_g;         // verify: [N_max, R_max, HV]
  float* stash_beta;      // verify: [N_max, R_max, HV]
  int64_t q_stride_n, q_stride_r, k_stride_n, k_stride_r, v_stride_n, v_stride_r;
  int64_t a_stride_n, a_stride_r, b_stride_n, b_stride_r;  // all in elements
  int N, R, R_max, H, HV, V;
  int64_t S;              // slots in the pool (state.size(0))
  float scale;            // applied to q after its L2 norm
};

// Stage rows c0 .. c0+rc-1 of request n for value head hv (key head h) into shared memory;
// verify also writes the stash (k once per key head, g/beta once per value head, v per row).
// One warp takes both q and k of a row (row r: warp r % kWarps), so it also forms k . q.
// Every global load of the chunk is issued before any of them is used: one memory round trip
// per chunk instead of one per q/k vector and per v pass (verify with R = 4 spent most of its
// time waiting on those in turn, with the memory pipe idle).
template <typename T, int K, int BR, int CH, bool VERIFY>
DS_DEVICE void stage_rows(const RecurrentParams& p, RowSmem<K, BR, CH, true>& sm, int n, int c0,
                          int rc, int h, int hv, int tile) {
  constexpr int P = Layout<K>::kNormPieces;
  constexpr int kRowsPerWarp = (CH + kWarps - 1) / kWarps;
  constexpr int kVals = (CH * BR + kThreads - 1) / kThreads;  // v values per thread
  const int tid = threadIdx.x;
  const int warp = tid / kWarp;
  const bool k_writer = VERIFY && tile == 0 && hv % (p.HV / p.H) == 0;

  float x[kRowsPerWarp][2][P][4];  // [.][0]: q, [.][1]: k
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = warp + i * kWarps;
    if (r < rc) {
      const T* q = static_cast<const T*>(p.q) + n * p.q_stride_n + (c0 + r) * p.q_stride_r;
      const T* k = static_cast<const T*>(p.k) + n * p.k_stride_n + (c0 + r) * p.k_stride_r;
      warp_load_vector<K, T>(q + h * K, x[i][0]);
      warp_load_vector<K, T>(k + h * K, x[i][1]);
    }
  }
  float v[kVals];
#pragma unroll
  for (int i = 0; i < kVals; ++i) {
    const int e = tid + i * kThreads, r = e / BR, row = tile * BR + e % BR;
    v[i] = 0.f;
    if (e < rc * BR && row < p.V) {
      const T* vp = static_cast<const T*>(p.v) + n * p.v_stride_n + (c0 + r) * p.v_stride_r;
      v[i] = to_float(vp[int64_t(hv) * p.V + row]);
    }
  }
  const int gr = tid - (kThreads - rc);  // gates: the last rc threads, one row each
  float ga = 0.f, gb = 0.f, a_log = 0.f, dt_bias = 0.f;
  if (gr >= 0) {
    a_log = p.A_log[hv];
    dt_bias = p.dt_bias[hv];
    ga = to_float(static_cast<const T*>(p.a)[n * p.a_stride_n + (c0 + gr) * p.a_stride_r + hv]);
    gb = to_float(static_cast<const T*>(p.b)[n * p.b_stride_n + (c0 + gr) * p.b_stride_r + hv]);
  }

#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = warp + i * kWarps;
    if (r < rc) {
      warp_l2_normalize<K>(x[i][0], p.scale);
      warp_l2_normalize<K>(x[i][1], 1.f);
      const float kq = warp_dot<K>(x[i][1], x[i][0]);
      float* stash = nullptr;
      if (k_writer) stash = p.stash_k + ((int64_t(n) * p.R_max + c0 + r) * p.H + h) * K;
      warp_store<K>(x[i][0], sm.q[r], nullptr);
      warp_store<K>(x[i][1], sm.k[r], stash);
      if (tid % kWarp == 0) sm.kq[r] = kq;
    }
  }
#pragma unroll
  for (int i = 0; i < kVals; ++i) {
    const int e = tid + i * kThreads, r = e / BR, j = e % BR, row = tile * BR + j;
    if (e < rc * BR) {
      sm.v[r][j] = v[i];
      if (VERIFY && row < p.V)
        p.stash_v[((int64_t(n) * p.R_max + c0 + r) * p.HV + hv) * p.V + row] = v[i];
    }
  }
  if (gr >= 0) {
    const float g = gate_g(ga, a_log, dt_bias);
    const float beta = gate_beta(gb);
    sm.decay[gr] = gate_decay(g);
    sm.beta[gr] = beta;
    if (VERIFY && tile == 0) {
      const int64_t sr = int64_t(n) * p.R_max + c0 + gr;
      p.stash_g[sr * p.HV + hv] = g;
      p.stash_beta[sr * p.HV + hv] = beta;
    }
  }
}

// One block: Tile<K, ROWS>::kRows value rows of head hv of request n. Blocks: row tiles fastest.
template <typename T, int K, int ROWS, bool VERIFY>
DS_DEVICE void recurrent_block(const RecurrentParams& p) {
  using L = Layout<K>;
  constexpr int BR = Tile<K, ROWS>::kRows;
  constexpr int CH = VERIFY ? kChunk : 1;
  __shared__ __align__(16) RowSmem<K, BR, CH, true> sm;

  const int tiles = static_cast<int>(ceil_div(p.V, BR));
  const int64_t blk = blockIdx.x;
  const int tile = static_cast<int>(blk % tiles);
  const int hv = static_cast<int>((blk / tiles) % p.HV);
  const int n = static_cast<int>(blk / (int64_t(tiles) * p.HV));
  const int h = hv / (p.HV / p.H);
  const int lane = L::group_lane();
  const int grp = L::group();

  // Programmatic dependent launch: the next kernel may start now; this one may have started
  // before the previous kernel finished, so until grid_dependency_wait() it only prefetches its
  // state rows into L2, from a slot index that may be stale (hence clamped; prefetch only).
  launch_dependents();
  {
    int64_t guess = p.slots[n];
    guess = guess < 0 ? 0 : (guess >= p.S ? p.S - 1 : guess);
    const float* ahead = p.state + (guess * p.HV + hv) * int64_t(p.V) * K;
#pragma unroll
    for (int m = 0; m < ROWS; ++m) {
      const int raw = tile * BR + m * L::kGroups + grp;
      if (raw < p.V && lane < K / 32) prefetch_l2(ahead + int64_t(raw) * K + lane * 32);
    }
  }
  grid_dependency_wait();

  // State rows first: their loads are in flight while the row inputs are staged.
  const int64_t slot = p.slots[n];
  float* head = p.state + (slot * p.HV + hv) * int64_t(p.V) * K;
  float s[ROWS][kPerLane];
  int row[ROWS];
#pragma unroll
  for (int m = 0; m < ROWS; ++m) {
    const int raw = tile * BR + m * L::kGroups + grp;
    row[m] = raw < p.V ? raw : -1;  // inactive rows compute on row 0 and store nothing
    load_slice<K>(head + int64_t(raw < p.V ? raw : 0) * K, lane, s[m]);
  }

  for (int c0 = 0; c0 < p.R; c0 += CH) {
    const int rc = p.R - c0 < CH ? p.R - c0 : CH;
    if (c0 > 0) __syncthreads();  // every thread is done with the previous chunk
    stage_rows<T, K, BR, CH, VERIFY>(p, sm, n, c0, rc, h, hv, tile);
    __syncthreads();
    for (int r = 0; r < rc; ++r) {
      float k[kPerLane], q[kPerLane];
      load_slice<K>(sm.k[r], lane, k);
      load_slice<K>(sm.q[r], lane, q);
      const float decay = sm.decay[r], beta = sm.beta[r];
      T* o = static_cast<T*>(p.o) + ((int64_t(n) * p.R + c0 + r) * p.HV + hv) * p.V;
#pragma unroll
      for (int m = 0; m < ROWS; ++m) {
        const float out =
            step<K, true>(s[m], k, q, sm.v[r][m * L::kGroups + grp], decay, beta, sm.kq[r]);
        if (row[m] >= 0 && lane == 0) o[row[m]] = from_float<T>(out);
      }
    }
  }
  if constexpr (!VERIFY) {
#pragma unroll
    for (int m = 0; m < ROWS; ++m)
      if (row[m] >= 0) store_slice<K>(head + int64_t(row[m]) * K, lane, s[m]);
  }
}

// Two entry points for their register caps, measured on the H200 (RESULTS.md): decode gains
// 9% at B >= 64 from 5 blocks per SM (95 registers at K=128, no spill) over the 4 that ptxas
// picks on its own (104); verify, with R rows of inputs in flight, is best left to ptxas (a
// cap of 4 or 5 blocks cost 0-12% at K=128 and spills at K=32).
template <typename T, int K, int ROWS>
__global__ void __launch_bounds__(kThreads, 5) decode_kernel(const RecurrentParams p) {
  recurrent_block<T, K, ROWS, false>(p);
}
template <typename T, int K, int ROWS>
__global__ void __launch_bounds__(kThreads) verify_kernel(const RecurrentParams p) {
  recurrent_block<T, K, ROWS, true>(p);
}

template <typename T, int K, int ROWS, bool VERIFY>
inline ds_error_t launch_rows(int64_t blocks, const RecurrentParams& p, ds_stream_t stream) {
  if constexpr (VERIFY)
    return launch(verify_kernel<T, K, ROWS>, blocks, kThreads, stream, Pdl::kOn, p);
  else
    return launch(decode_kernel<T, K, ROWS>, blocks, kThreads, stream, Pdl::kOn, p);
}

template <typename T, int K, bool VERIFY>
inline ds_error_t launch_recurrent(const RecurrentParams& p, ds_stream_t stream) {
  const int64_t heads = int64_t(p.HV) * p.N;
  const auto blocks = [&](int rows) { return ceil_div(p.V, Layout<K>::kGroups * rows) * heads; };
  switch (pick_rows<K>(heads, p.V)) {
    case 4: return launch_rows<T, K, 4, VERIFY>(blocks(4), p, stream);
    case 2: return launch_rows<T, K, 2, VERIFY>(blocks(2), p, stream);
    default: return launch_rows<T, K, 1, VERIFY>(blocks(1), p, stream);
  }
}

// Host entry points: K is a runtime value here, dispatched to the compiled head sizes.
template <typename T, bool VERIFY>
inline ds_error_t launch_recurrent_any_k(const RecurrentParams& p, int K, ds_stream_t stream) {
  switch (K) {
    case 32: return launch_recurrent<T, 32, VERIFY>(p, stream);
    case 64: return launch_recurrent<T, 64, VERIFY>(p, stream);
    case 128: return launch_recurrent<T, 128, VERIFY>(p, stream);
    case 256: return launch_recurrent<T, 256, VERIFY>(p, stream);
    default: return DS_ERROR_INVALID_VALUE;
  }
}

template <typename T>
inline ds_error_t launch_gdn_decode(const RecurrentParams& p, int K, ds_stream_t stream) {
  return launch_recurrent_any_k<T, false>(p, K, stream);
}

template <typename T>
inline ds_error_t launch_gdn_verify(const RecurrentParams& p, int K, ds_stream_t stream) {
  return launch_recurrent_any_k<T, true>(p, K, stream);
}

}  // namespace gdn
}  // namespace ds
