// gdn_decode (one row, state updated in place) and gdn_verify (R rows, state read only,
// per-row outputs, stash written): one kernel template, the row step from gdn_common.cuh.
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
  float scale;            // applied to q after its L2 norm
};

// One row's inputs for this thread: its slices of q and k, and the scalars v[row], a, b.
template <int K>
struct RowInputs {
  float q[kPerLane], k[kPerLane];
  float v, a, b;

  template <typename T>
  DS_DEVICE void load(const RecurrentParams& p, int n, int r, int h, int hv, int row, int lane) {
    load_k<K>(static_cast<const T*>(p.q) + n * p.q_stride_n + r * p.q_stride_r + h * K, lane, q);
    load_k<K>(static_cast<const T*>(p.k) + n * p.k_stride_n + r * p.k_stride_r + h * K, lane, k);
    const T* vp = static_cast<const T*>(p.v) + n * p.v_stride_n + r * p.v_stride_r;
    v = to_float(vp[int64_t(hv) * p.V + row]);
    a = to_float(static_cast<const T*>(p.a)[n * p.a_stride_n + r * p.a_stride_r + hv]);
    b = to_float(static_cast<const T*>(p.b)[n * p.b_stride_n + r * p.b_stride_r + hv]);
  }
};

// One block: kRowsPerBlock value rows of head hv of request n. Blocks: row tiles fastest.
template <typename T, int K, bool VERIFY>
__global__ void __launch_bounds__(kThreads) recurrent_kernel(const RecurrentParams p) {
  using L = Layout<K>;
  const int tiles = static_cast<int>(ceil_div(p.V, L::kRowsPerBlock));
  const int64_t blk = blockIdx.x;
  const int tile = static_cast<int>(blk % tiles);
  const int hv = static_cast<int>((blk / tiles) % p.HV);
  const int n = static_cast<int>(blk / (int64_t(tiles) * p.HV));
  const int h = hv / (p.HV / p.H);
  const int lane = L::group_lane();
  const int row_raw = tile * L::kRowsPerBlock + L::block_row();
  const bool active = row_raw < p.V;  // inactive groups compute on row 0, store nothing
  const int row = active ? row_raw : 0;

  const int64_t slot = p.slots[n];
  float* srow = p.state + (slot * p.HV + hv) * int64_t(p.V) * K + int64_t(row) * K;
  float s[kPerLane];
  load_state<K>(srow, lane, s);
  const float A_log = p.A_log[hv], dt_bias = p.dt_bias[hv];

  // Row inputs are loaded one row ahead, so a verify step's loads overlap the previous row's math.
  RowInputs<K> cur, next{};
  cur.template load<T>(p, n, 0, h, hv, row, lane);
  for (int r = 0; r < p.R; ++r) {
    if (r + 1 < p.R) next.template load<T>(p, n, r + 1, h, hv, row, lane);
    float (&q)[kPerLane] = cur.q;
    float (&k)[kPerLane] = cur.k;
    const float v = cur.v, a = cur.a, b = cur.b;
    l2_normalize<K>(q, p.scale);
    l2_normalize<K>(k, 1.f);
    const float g = gate_g(a, A_log, dt_bias);
    const float beta = gate_beta(b);
    const float o = step<K, true>(s, k, q, v, g, beta);
    const int64_t nr = int64_t(n) * p.R + r;
    if (active && lane == 0)
      static_cast<T*>(p.o)[(nr * p.HV + hv) * p.V + row] = from_float<T>(o);
    if constexpr (VERIFY) {
      const int64_t sr = int64_t(n) * p.R_max + r;  // stash row
      if (active && lane == 0) p.stash_v[(sr * p.HV + hv) * p.V + row] = v;
      if (row_raw == 0 && lane == 0) {
        p.stash_g[sr * p.HV + hv] = g;
        p.stash_beta[sr * p.HV + hv] = beta;
      }
      if (row_raw == 0 && hv % (p.HV / p.H) == 0) {  // one group per key head writes k
        float* kst = p.stash_k + (sr * p.H + h) * K;
#pragma unroll
        for (int j = 0; j < 4; ++j)
          *reinterpret_cast<float4*>(kst + L::piece(lane, j)) =
              make_float4(k[j * 4], k[j * 4 + 1], k[j * 4 + 2], k[j * 4 + 3]);
      }
    }
    cur = next;
  }
  if constexpr (!VERIFY) {
    if (active) store_state<K>(srow, lane, s);
  }
}

template <typename T, int K, bool VERIFY>
inline ds_error_t launch_recurrent(const RecurrentParams& p, ds_stream_t stream) {
  const int64_t blocks = ceil_div(p.V, Layout<K>::kRowsPerBlock) * int64_t(p.HV) * p.N;
  return launch(recurrent_kernel<T, K, VERIFY>, blocks, kThreads, stream, p);
}

// Host entry points: K is a runtime value here, dispatched to the compiled head sizes.
template <typename T, bool VERIFY>
inline ds_error_t launch_recurrent_any_k(const RecurrentParams& p, int K, ds_stream_t stream) {
  switch (K) {
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
