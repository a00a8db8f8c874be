// The GDN row step shared by gdn_decode, gdn_verify and gdn_replay.
//
// Thread layout (the bitwise contract): one value row of one head (S[row, :], K floats) is held
// by a group of LANES = K/16 consecutive lanes, 16 floats per lane. Lane i of a group owns the
// K indices (j * LANES + i) * 4 + e for j, e in 0..3, so each of its four float4 accesses is
// coalesced across the group. Every dot product over K is four fixed fma chains per lane (one
// per e, j ascending), summed as (a0 + a1) + (a2 + a3), then a butterfly over the group (or
// step_rows' reduce-scatter, which adds the same pairs level by level): the same order in all
// three kernels, which is what makes replay bitwise equal to decode.
//
// A thread may hold ROWS value rows (ROWS independent copies of that layout): more bytes in
// flight per thread and interleaved chains. ROWS changes scheduling only, never the bits.
//
// Per-row inputs (q, k L2-normalised, k . q, decay = exp(g), beta, v) are formed by the
// functions below, the same ones in every kernel: per thread in decode, staged once per block
// in shared memory in verify, read from the stash in replay.
#pragma once

#include <cstdlib>

#include "compat.cuh"

namespace ds {
namespace gdn {

constexpr int kPerLane = 16;     // K elements per lane
constexpr int kThreads = 128;    // threads per block in every GDN kernel
constexpr int kWarps = kThreads / kWarp;
constexpr float kL2Eps = 1e-6f;  // q, k L2 norm: x * rsqrt(sum(x^2) + eps)
constexpr int kChunk = 8;        // verify/replay rows staged in shared memory at a time

template <int K>
struct Layout {
  static_assert(K == 32 || K == 64 || K == 128 || K == 256,
                "head_k_dim must be 32, 64, 128 or 256");
  static constexpr int kLanes = K / kPerLane;                 // lanes per value row
  static constexpr int kGroups = kThreads / kLanes;           // row groups per block
  DS_DEVICE static int group_lane() { return threadIdx.x % kLanes; }
  DS_DEVICE static int group() { return threadIdx.x / kLanes; }
  // Offset (elements) of the j-th 4-element piece this lane owns within a K-vector.
  DS_DEVICE static int piece(int lane, int j) { return (j * kLanes + lane) * 4; }
};

// Value rows per block for ROWS rows per thread; row m of group g is tile row m * kGroups + g.
template <int K, int ROWS>
struct Tile {
  static_assert(ROWS == 1 || ROWS == 2 || ROWS == 4, "rows per thread: 1, 2 or 4");
  static constexpr int kRows = Layout<K>::kGroups * ROWS;
};

// A work tile of a key head's G * tiles row tiles, w = hi * tiles + t: row tile t of the key
// head's value head hi (value head h * G + hi). Kernels walk consecutive work tiles with next(),
// with no division per tile.
struct WorkTile {
  int hi, t;
  DS_DEVICE static WorkTile of(const FastDiv& tiles, int w) {
    const int hi = tiles.div(w);
    return {hi, w - hi * static_cast<int>(tiles.d)};
  }
  DS_DEVICE WorkTile next(int tiles) const {
    return t + 1 < tiles ? WorkTile{hi, t + 1} : WorkTile{hi + 1, 0};
  }
};

// Staged per-row inputs of one block, CH rows at a time: q and k (q only where an output is
// computed; a verify block spanning several key heads stages each head's rows in turn: staged
// row kh * rows + r), and v and the gates of each of its TILES row tiles. v holds CH * VROWS
// floats, viewed as rows of `stride` floats (a span narrower than VROWS fits more rows): row
// r's tile slot i at vrow(r, stride) + i * BR.
template <int K, int VROWS, int CH, bool HAS_Q, int TILES = 1>
struct RowSmem {
  float q[HAS_Q ? CH : 1][K];
  float k[CH][K];
  float v[CH][VROWS];
  float decay[CH][TILES];
  float beta[CH][TILES];
  float kq[HAS_Q ? CH : 1];  // k . q (q scaled) per row: the output term of step()
  DS_DEVICE float* vrow(int r, int stride) { return &v[0][0] + r * stride; }
  DS_DEVICE const float* vrow(int r, int stride) const { return &v[0][0] + r * stride; }
};

// This lane's 16 elements of a K-vector of floats (global or shared), float4 loads.
template <int K>
DS_DEVICE void load_slice(const float* __restrict__ row, int lane, float (&s)[kPerLane]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float4 p = *reinterpret_cast<const float4*>(row + Layout<K>::piece(lane, j));
    s[j * 4 + 0] = p.x; s[j * 4 + 1] = p.y; s[j * 4 + 2] = p.z; s[j * 4 + 3] = p.w;
  }
}

template <int K>
DS_DEVICE void store_slice(float* __restrict__ row, int lane, const float (&s)[kPerLane]) {
#pragma unroll
  for (int j = 0; j < 4; ++j)
    *reinterpret_cast<float4*>(row + Layout<K>::piece(lane, j)) =
        make_float4(s[j * 4 + 0], s[j * 4 + 1], s[j * 4 + 2], s[j * 4 + 3]);
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

// Write back this thread's state rows that load_tile found inside V.
template <int K, int ROWS>
DS_DEVICE void store_tile(float* head, const float (&s)[ROWS][kPerLane], const int (&row)[ROWS]) {
#pragma unroll
  for (int m = 0; m < ROWS; ++m)
    if (row[m] >= 0) store_slice<K>(head + int64_t(row[m]) * K, Layout<K>::group_lane(), s[m]);
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

// This lane's partial of the dot product of two lane-held K-vectors: four fixed fma chains (one
// per e, j ascending), summed as (a0 + a1) + (a2 + a3).
template <int K>
DS_DEVICE float lane_dot(const float (&x)[kPerLane], const float (&y)[kPerLane]) {
  float acc[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) acc[e] = fmul(x[e], y[e]);
#pragma unroll
  for (int j = 1; j < 4; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[e] = ffma(x[j * 4 + e], y[j * 4 + e], acc[e]);
  return fadd(fadd(acc[0], acc[1]), fadd(acc[2], acc[3]));
}

// Dot product of two lane-held K-vectors, summed over the group (every lane gets the same bits).
template <int K>
DS_DEVICE float dot(const float (&x)[kPerLane], const float (&y)[kPerLane]) {
  return group_sum<Layout<K>::kLanes>(lane_dot<K>(x, y));
}

// This lane's slices of a row's q and k (one key head, K elements of T each), in the state's
// row layout: every group of the block holds whole vectors, so it can normalise them itself.
// load_qk = load_qk_words then qk_to_float (verify's staging issues its other loads between).
template <typename T>
struct QKWords {
  Words<T, 4> q[4], k[4];
};
template <int K, typename T>
DS_DEVICE QKWords<T> load_qk_words(const T* __restrict__ q, const T* __restrict__ k, int lane) {
  QKWords<T> w;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    w.q[j] = load_words<T, 4>(q + Layout<K>::piece(lane, j));
    w.k[j] = load_words<T, 4>(k + Layout<K>::piece(lane, j));
  }
  return w;
}
template <typename T>
DS_DEVICE void qk_to_float(const QKWords<T>& w, float (&qs)[kPerLane], float (&ks)[kPerLane]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float x[4], y[4];
    words_to_float<T, 4>(w.q[j], x);
    words_to_float<T, 4>(w.k[j], y);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      qs[j * 4 + e] = x[e];
      ks[j * 4 + e] = y[e];
    }
  }
}
template <int K, typename T>
DS_DEVICE void load_qk(const T* __restrict__ q, const T* __restrict__ k, int lane,
                       float (&qs)[kPerLane], float (&ks)[kPerLane]) {
  qk_to_float(load_qk_words<K, T>(q, k, lane), qs, ks);
}

// q <- q * (rsqrt(sum(q^2) + eps) * scale), k <- k * rsqrt(sum(k^2) + eps) on the slices
// load_qk loaded; returns k . q of the normalised vectors, taken from the raw dot as
// (q . k) * inv_q * inv_k. The three sums are lane_dot's chains and one group butterfly, run
// side by side: a group forms a row's inputs in three dependent shuffle rounds with no shared
// memory or barrier, which is what lets gdn_decode skip staging. Every kernel forms q, k and
// k . q with this function (verify stashes k), so their bits agree.
template <int K>
DS_DEVICE float normalize_qk(float (&qs)[kPerLane], float (&ks)[kPerLane], float scale) {
  float sq = lane_dot<K>(qs, qs), sk = lane_dot<K>(ks, ks), qk = lane_dot<K>(qs, ks);
#pragma unroll
  for (int off = Layout<K>::kLanes / 2; off > 0; off >>= 1) {
    const float a = shfl_xor(sq, off), b = shfl_xor(sk, off), c = shfl_xor(qk, off);
    sq = fadd(sq, a);
    sk = fadd(sk, b);
    qk = fadd(qk, c);
  }
  const float inv_q = fmul(frsqrt(fadd(sq, kL2Eps)), scale), inv_k = frsqrt(fadd(sk, kL2Eps));
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    qs[i] = fmul(qs[i], inv_q);
    ks[i] = fmul(ks[i], inv_k);
  }
  return fmul(fmul(qk, inv_q), inv_k);
}

// g = -exp(A_log) * softplus(a + dt_bias) (softplus as torch: x > 20 -> x), beta = sigmoid(b).
DS_DEVICE float gate_g(float a, float A_log, float dt_bias) {
  const float x = fadd(a, dt_bias);
  const float sp = x > 20.f ? x : flog1p(fexp(x));
  return fmul(-fexp(A_log), sp);
}
DS_DEVICE float gate_beta(float b) { return fdiv(1.f, fadd(1.f, fexp(-b))); }
// The decay factor every kernel applies: computed from g (decode/verify) or from the stashed g
// (replay) by this one function.
DS_DEVICE float gate_decay(float g) { return fexp(g); }

// One recurrence row on this lane's slice of S[row, :] (Yang et al. 2024, eq. 10):
//   S <- decay S;  delta = beta (v - S k);  S <- S + delta k^T;  o = S q.
// The output is taken as o = (decay S) q + delta (k . q), the same value as S q after the update
// in exact arithmetic: both dots then read the decayed state, so their reductions run side by
// side instead of one after the other (half the shuffle latency per row), and k . q is one
// scalar per row (normalize_qk). The state update is the same either way.
// Returns o (when WITH_OUTPUT) on every lane of the group.
template <int K, bool WITH_OUTPUT>
DS_DEVICE float step(float (&s)[kPerLane], const float (&k)[kPerLane],
                     const float (&q)[kPerLane], float v, float decay, float beta, float kq) {
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) s[i] = fmul(s[i], decay);
  const float delta = fmul(fsub(v, dot<K>(s, k)), beta);
  float sq = 0.f;
  if constexpr (WITH_OUTPUT) sq = dot<K>(s, q);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) s[i] = ffma(delta, k[i], s[i]);
  return WITH_OUTPUT ? ffma(delta, kq, sq) : 0.f;
}

// Group sums of N = 2^n partials at once, reduce-scatter style: at each butterfly level (OFF =
// LANES/2 down to 1, as group_sum) a lane keeps half of the COUNT values it holds and adds the
// partner's partials of that half, so each level adds the same two partials group_sum adds there
// (in either order: the same bits) while the later levels move half as many values. Once one
// value is left the levels are group_sum's. On return x[0] holds the full sum of value j (of
// every lane of the group whose bits at the first log2(N) levels spell j). N <= LANES.
template <int OFF, int COUNT, int N>
DS_DEVICE void scatter_sum(float (&x)[N], int lane, int& j) {
  if constexpr (OFF > 0) {
    if constexpr (COUNT > 1) {
      constexpr int kHalf = COUNT / 2;
      const bool up = (lane & OFF) != 0;
#pragma unroll
      for (int i = 0; i < kHalf; ++i) {
        const float send = up ? x[i] : x[kHalf + i], keep = up ? x[kHalf + i] : x[i];
        x[i] = fadd(keep, shfl_xor(send, OFF));
      }
      if (up) j += kHalf;
      scatter_sum<OFF / 2, kHalf>(x, lane, j);
    } else {
      x[0] = fadd(x[0], shfl_xor(x[0], OFF));
      scatter_sum<OFF / 2, 1>(x, lane, j);
    }
  }
}

// Whether step_rows sums a thread's 2 * ROWS dots with scatter_sum (one value per lane left;
// not at K = 32, where it would take one instruction more than the butterflies).
template <int K, int ROWS>
constexpr bool kScatterRows = 2 * ROWS <= Layout<K>::kLanes && Layout<K>::kLanes > 2;

// step() on this thread's ROWS rows at once (the same k, q and gates, v per row), the same bits
// as ROWS calls of step(): the same fma chains, and the 2 * ROWS dots summed by scatter_sum
// (row m's S k as value m, its S q as value ROWS + m), then each row's S k taken to the whole
// group from the first lane holding it. Per row per step that is 4 shuffles and 4 adds fewer
// than two butterflies at K = 128 with 2 rows (2 selects more). Returns row out_m's output on the
// one lane that stores it (out_m = -1 on the others).
template <int K, int ROWS>
DS_DEVICE float step_rows(float (&s)[ROWS][kPerLane], const float (&k)[kPerLane],
                          const float (&q)[kPerLane], const float (&v)[ROWS], float decay,
                          float beta, float kq, int& out_m) {
  constexpr int kLanes = Layout<K>::kLanes, kSpread = kLanes / (2 * ROWS);
  static_assert(kScatterRows<K, ROWS>, "one summed value per lane");
  const int lane = Layout<K>::group_lane();
  float x[2 * ROWS];
#pragma unroll
  for (int m = 0; m < ROWS; ++m) {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) s[m][i] = fmul(s[m][i], decay);
    x[m] = lane_dot<K>(s[m], k);
    x[ROWS + m] = lane_dot<K>(s[m], q);
  }
  int j = 0;
  scatter_sum<kLanes / 2, 2 * ROWS>(x, lane, j);
  float delta[ROWS];
#pragma unroll
  for (int m = 0; m < ROWS; ++m) {
    delta[m] = fmul(fsub(v[m], shfl_group<kLanes>(x[0], m * kSpread)), beta);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) s[m][i] = ffma(delta[m], k[i], s[m][i]);
  }
  float d = delta[0];
  out_m = -1;
#pragma unroll
  for (int m = 0; m < ROWS; ++m) {
    if (j == ROWS + m) d = delta[m];
    if (lane == (ROWS + m) * kSpread) out_m = m;
  }
  return ffma(d, kq, x[0]);
}

// The state update of step() alone (replay): the same instructions, so the same bits.
template <int K>
DS_DEVICE void update(float (&s)[kPerLane], const float (&k)[kPerLane], float v, float decay,
                      float beta) {
  step<K, false>(s, k, k, v, decay, beta, 0.f);
}

// Work tiles per block for a launch over `heads` heads of per_head row tiles each (verify and
// decode: key heads of G * tiles; replay: value heads of tiles): at most `most` (verify: all
// that Staged<>::kTiles allows; decode and replay: 2), halved until the grid has at least
// kMinBlocks blocks. Measured on the H200 at Qwen3-Next shapes: verify (session 5) 512 blocks of
// 2 tiles beat 1,024 of 1 by 30% at B=8, 512 of 8 beat 1,024 of 4 by 10% at B=32; decode
// (session 6) 2 tiles with the second prefetched beat 1 by 7-9% from B=32 on, and 4 or 8 lost
// to 2; without staging (session 7) 2 still beat 1 by 7% at B=8 and 3% at B=64. R > kChunk:
// one (the state of one tile stays in registers across chunks).
// DS_GDN_TILES=t forces t, up to `cap` (verify: the tiles a block's shared memory stages;
// tuning).
constexpr int64_t kMinBlocks = 512;

inline int pick_tiles_per_block(int64_t heads, int per_head, int most, int cap, int R) {
  if (R > kChunk) return 1;
  if (const char* forced = std::getenv("DS_GDN_TILES")) {
    const int f = std::atoi(forced), t = per_head < cap ? per_head : cap;
    if (f >= 1) return f < t ? f : t;
  }
  int t = per_head < most ? per_head : most;
  while (t > 1 && heads * ceil_div(per_head, t) < kMinBlocks) t = (t + 1) / 2;
  return t;
}

// The state update of staged rows 0 .. rc-1 on this thread's state rows (replay, and a
// verify's pending rows): row r's k at sm.k[k0 + r], its v at v[r * stride + tile row], its
// gates at column gi.
template <int K, int ROWS, int VROWS, int CH, int TILES>
DS_DEVICE void update_rows(const RowSmem<K, VROWS, CH, false, TILES>& sm,
                           float (&s)[ROWS][kPerLane], int k0, const float* v, int stride,
                           int gi, int rc) {
  using L = Layout<K>;
  const int lane = L::group_lane(), grp = L::group();
  for (int r = 0; r < rc; ++r, v += stride) {
    float k[kPerLane];
    load_slice<K>(sm.k[k0 + r], lane, k);
    const float decay = sm.decay[r][gi], beta = sm.beta[r][gi];
#pragma unroll
    for (int m = 0; m < ROWS; ++m) update<K>(s[m], k, v[m * L::kGroups + grp], decay, beta);
  }
}

// Rows per thread for a launch over `heads` (request, value head[, layer]) triples of V rows.
// Measured on the H200 (benchmarks/RESULTS.md, Qwen3-Next shapes, loads-first staging):
// decode and verify are best with 1 at B=1 (more, smaller blocks spread the state over all
// SMs) and with 2 from B=8 on; replay (all layers in one launch) with 2 from B=1. 4 rows per
// thread needs ~166 registers in verify (3 blocks per SM) and spills 44 B in decode under its
// 4-block cap; it lost in decode at every batch size (B=8 again in session 7) and in verify up
// to B=64, and wins in verify from B=96 (pick_verify_rows, gdn_recurrent.cuh). Never changes
// results. DS_GDN_ROWS=1|2|4 in the environment forces a value (tuning runs).
template <int K>
inline int pick_rows(int64_t heads, int V, bool one_launch_per_layer = true) {
  if (const char* forced = std::getenv("DS_GDN_ROWS")) {
    const int r = std::atoi(forced);
    if (r == 1 || r == 2 || r == 4) return r;
  }
  if (!one_launch_per_layer) return 2;
  const int64_t blocks2 = ceil_div(V, int64_t(Layout<K>::kGroups) * 2) * heads;
  return blocks2 >= 512 ? 2 : 1;
}

}  // namespace gdn
}  // namespace ds
