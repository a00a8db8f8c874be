// gdn_decode (one row, state updated in place) and gdn_verify (R rows, state read only,
// per-row outputs, stash written): two block bodies built from the same pieces (tile loads,
// row staging, the row step from gdn_common.cuh), so their bits agree. Both are launched with
// programmatic dependent launch (compat.cuh): a block prefetches its first state tile into L2
// before the previous kernel in the stream (causal_conv1d_update/verify in a model step) ends.
//
// A decode block owns Tile<K, ROWS>::kRows value rows of one value head of one request; a
// verify block owns one or more such tiles of one key head, in turn. Each tile's state loads
// are issued first, then the per-row inputs are staged for the whole block (q and k of a row
// L2-normalised by one warp, with k . q; gates by one thread; v) in shared memory while those
// loads are in flight. Verify keeps the evolving state in registers across its R rows and never
// writes it back; decode writes it once.
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
  int tiles_per_block;    // verify: work tiles (row tiles of a value head) per block
  float scale;            // applied to q after its L2 norm
};

// Stage rows c0 .. c0+rc-1 of request n for value head hv (key head h) into shared memory;
// verify also writes the stash (k by the k_writer block of each key head, g/beta by row tile 0
// of each value head, v per row). q and k only `with_qk` (a block serving several tiles keeps
// them). One warp takes both q and k of a row (row r: warp r % kWarps), so it also forms k . q.
// Every global load of the chunk is issued before any of them is used: one memory round trip
// per chunk instead of one per q/k vector and per v pass (verify with R = 4 spent most of its
// time waiting on those in turn, with the memory pipe idle).
template <typename T, int K, int BR, int CH, bool VERIFY>
DS_DEVICE void stage_rows(const RecurrentParams& p, RowSmem<K, BR, CH, true>& sm, int n, int c0,
                          int rc, int h, int hv, int tile, bool with_qk, bool k_writer) {
  constexpr int P = Layout<K>::kNormPieces;
  constexpr int kRowsPerWarp = (CH + kWarps - 1) / kWarps;
  constexpr int kVals = (CH * BR + kThreads - 1) / kThreads;  // v values per thread
  const int tid = threadIdx.x;
  const int warp = tid / kWarp;

  float x[kRowsPerWarp][2][P][4];  // [.][0]: q, [.][1]: k
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = warp + i * kWarps;
    if (with_qk && r < rc) {
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
    if (with_qk && r < rc) {
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

// Prefetch into L2 the state rows this thread will load for row tile `tile` of `head`.
template <int K, int ROWS>
DS_DEVICE void prefetch_tile(const float* head, int tile, int V) {
  using L = Layout<K>;
  const int lane = L::group_lane();
#pragma unroll
  for (int m = 0; m < ROWS; ++m) {
    const int raw = tile * Tile<K, ROWS>::kRows + m * L::kGroups + L::group();
    if (raw < V && lane < K / 32) prefetch_l2(head + int64_t(raw) * K + lane * 32);
  }
}

// This thread's state rows of row tile `tile` of `head` (row[m] = -1: past V, computes on row
// 0 and stores nothing).
template <int K, int ROWS>
DS_DEVICE void load_tile(const float* head, int tile, int V, float (&s)[ROWS][kPerLane],
                         int (&row)[ROWS]) {
  using L = Layout<K>;
#pragma unroll
  for (int m = 0; m < ROWS; ++m) {
    const int raw = tile * Tile<K, ROWS>::kRows + m * L::kGroups + L::group();
    row[m] = raw < V ? raw : -1;
    load_slice<K>(head + int64_t(raw < V ? raw : 0) * K, L::group_lane(), s[m]);
  }
}

// The staged rows c0 .. c0+rc-1 through this thread's state rows, one output per row.
template <typename T, int K, int ROWS, int BR, int CH>
DS_DEVICE void run_rows(const RecurrentParams& p, const RowSmem<K, BR, CH, true>& sm,
                        float (&s)[ROWS][kPerLane], const int (&row)[ROWS], int n, int hv,
                        int c0, int rc) {
  using L = Layout<K>;
  const int lane = L::group_lane(), grp = L::group();
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

// Before the previous kernel's writes are visible (programmatic dependent launch), a block only
// prefetches its first tile into L2, from a slot index that may be stale (hence clamped).
DS_DEVICE int64_t guess_slot(const RecurrentParams& p, int n) {
  const int64_t guess = p.slots[n];
  return guess < 0 ? 0 : (guess >= p.S ? p.S - 1 : guess);
}

// gdn_decode, one block: Tile<K, ROWS>::kRows value rows of head hv of request n; 1-D grid, row
// tiles fastest.
template <typename T, int K, int ROWS>
DS_DEVICE void decode_block(const RecurrentParams& p) {
  constexpr int BR = Tile<K, ROWS>::kRows;
  __shared__ __align__(16) RowSmem<K, BR, 1, true> sm;

  const int tiles = static_cast<int>(ceil_div(p.V, BR));
  const int64_t blk = blockIdx.x;
  const int tile = static_cast<int>(blk % tiles);
  const int hv = static_cast<int>((blk / tiles) % p.HV);
  const int n = static_cast<int>(blk / (int64_t(tiles) * p.HV));
  const int h = hv / (p.HV / p.H);
  const int64_t head_elems = int64_t(p.V) * K;

  launch_dependents();  // the next kernel may start its prologue now
  prefetch_tile<K, ROWS>(p.state + (guess_slot(p, n) * p.HV + hv) * head_elems, tile, p.V);
  grid_dependency_wait();

  // State rows first: their loads are in flight while the row inputs are staged.
  float* head = p.state + (int64_t(p.slots[n]) * p.HV + hv) * head_elems;
  float s[ROWS][kPerLane];
  int row[ROWS];
  load_tile<K, ROWS>(head, tile, p.V, s, row);
  stage_rows<T, K, BR, 1, false>(p, sm, n, 0, 1, h, hv, tile, true, false);
  __syncthreads();
  run_rows<T, K, ROWS>(p, sm, s, row, n, hv, 0, 1);
#pragma unroll
  for (int m = 0; m < ROWS; ++m)
    if (row[m] >= 0) store_slice<K>(head + int64_t(row[m]) * K, Layout<K>::group_lane(), s[m]);
}

// gdn_verify, one block: work tiles [w0, w1) of key head h of request n, one after another.
// Work tile w is row tile w % tiles of value head h * G + w / tiles (G = HV / H value heads
// share q and k), so a block that stages q, k once serves every tile it owns: the per-block work
// (index math, q/k loads, L2 norms, k . q; about a third of verify's instructions at one tile per
// block) is paid once per key head instead of once per tile. Grid: (splits of the G * tiles work
// tiles, H, N).
template <typename T, int K, int ROWS>
DS_DEVICE void verify_block(const RecurrentParams& p) {
  constexpr int BR = Tile<K, ROWS>::kRows;
  __shared__ __align__(16) RowSmem<K, BR, kChunk, true> sm;

  const int tiles = (p.V + BR - 1) / BR;
  const int G = p.HV / p.H;
  const int h = blockIdx.y, n = blockIdx.z;
  const int w0 = blockIdx.x * p.tiles_per_block;
  const int w_end = w0 + p.tiles_per_block < G * tiles ? w0 + p.tiles_per_block : G * tiles;
  const int64_t head_elems = int64_t(p.V) * K;

  launch_dependents();
  prefetch_tile<K, ROWS>(p.state + (guess_slot(p, n) * p.HV + h * G + w0 / tiles) * head_elems,
                         w0 % tiles, p.V);
  grid_dependency_wait();

  const int64_t slot = p.slots[n];
  const bool qk_once = p.R <= kChunk;  // one chunk: q, k staged once for every tile
  for (int w = w0; w < w_end; ++w) {
    const int hv = h * G + w / tiles, tile = w % tiles;
    float s[ROWS][kPerLane];
    int row[ROWS];
    load_tile<K, ROWS>(p.state + (slot * p.HV + hv) * head_elems, tile, p.V, s, row);
    if (w + 1 < w_end)
      prefetch_tile<K, ROWS>(p.state + (slot * p.HV + h * G + (w + 1) / tiles) * head_elems,
                             (w + 1) % tiles, p.V);
    for (int c0 = 0; c0 < p.R; c0 += kChunk) {
      const int rc = p.R - c0 < kChunk ? p.R - c0 : kChunk;
      if (w > w0 || c0 > 0) __syncthreads();  // every thread is done with the staged rows
      stage_rows<T, K, BR, kChunk, true>(p, sm, n, c0, rc, h, hv, tile, !qk_once || w == w0,
                                         w == 0);
      __syncthreads();
      run_rows<T, K, ROWS>(p, sm, s, row, n, hv, c0, rc);
    }
  }
}

// Register caps, measured on the H200 (RESULTS.md): decode gained 9% at B >= 64 from a cap of 5
// blocks per SM over the 4 that ptxas picked on its own; verify, with R rows of inputs in
// flight, is best left to ptxas (a cap of 4 or 5 blocks cost 0-12% at K=128, spills at K=32).
template <typename T, int K, int ROWS>
__global__ void DS_LAUNCH_BOUNDS_MIN_BLOCKS(kThreads, 5) decode_kernel(const RecurrentParams p) {
  decode_block<T, K, ROWS>(p);
}
template <typename T, int K, int ROWS>
__global__ void __launch_bounds__(kThreads) verify_kernel(const RecurrentParams p) {
  verify_block<T, K, ROWS>(p);
}

// Verify work tiles per block: a whole key head (G * tiles) or a whole value head (tiles) when
// that still leaves kLoopBlocks blocks (about two waves on a 132-SM H200), else one.
// DS_GDN_TILES=1 forces one (tuning).
constexpr int64_t kLoopBlocks = 1024;

inline int pick_tiles_per_block(int64_t n_h, int per_head, int tiles) {
  if (const char* forced = std::getenv("DS_GDN_TILES"))
    if (forced[0] == '1') return 1;
  if (n_h >= kLoopBlocks) return per_head;
  if (n_h * ceil_div(per_head, tiles) >= kLoopBlocks) return tiles;
  return 1;
}

template <typename T, int K, int ROWS, bool VERIFY>
inline ds_error_t launch_rows(RecurrentParams p, ds_stream_t stream) {
  const int tiles = static_cast<int>(ceil_div(p.V, Tile<K, ROWS>::kRows));
  if constexpr (VERIFY) {
    const int per_head = (p.HV / p.H) * tiles;
    p.tiles_per_block = pick_tiles_per_block(int64_t(p.N) * p.H, per_head, tiles);
    const dim3 grid(static_cast<unsigned>(ceil_div(per_head, p.tiles_per_block)), p.H, p.N);
    return launch(verify_kernel<T, K, ROWS>, grid, kThreads, stream, Pdl::kOn, p);
  } else {
    const int64_t blocks = int64_t(tiles) * p.HV * p.N;
    return launch(decode_kernel<T, K, ROWS>, blocks, kThreads, stream, Pdl::kOn, p);
  }
}

template <typename T, int K, bool VERIFY>
inline ds_error_t launch_recurrent(const RecurrentParams& p, ds_stream_t stream) {
  if (p.N <= 0 || p.V <= 0 || p.HV <= 0) return DS_SUCCESS;  // nothing to compute
  if (VERIFY && (p.N > 65535 || p.H > 65535)) return DS_ERROR_INVALID_VALUE;  // grid y/z
  switch (pick_rows<K>(int64_t(p.HV) * p.N, p.V)) {
    case 4: return launch_rows<T, K, 4, VERIFY>(p, stream);
    case 2: return launch_rows<T, K, 2, VERIFY>(p, stream);
    default: return launch_rows<T, K, 1, VERIFY>(p, stream);
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
