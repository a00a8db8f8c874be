// gdn_decode (one row, state updated in place) and gdn_verify (R rows, state read only,
// per-row outputs, stash written): two block bodies built from the same pieces (tile loads, the
// q/k norms, the gates and the row step from gdn_common.cuh), so their bits agree. Both are
// launched with programmatic dependent launch (compat.cuh): a block prefetches its first state
// tile into L2 before the previous kernel in the stream (causal_conv1d_update/verify in a model
// step) ends.
//
// A block owns one or more row tiles (Tile<K, ROWS>::kRows value rows of one value head) of one
// key head of one request, in turn: decode up to 2, verify up to Staged<>::kTiles. The first
// tile's state loads are issued first, then the row inputs are formed while those loads are in
// flight: by every thread for itself in decode (one row: nothing to share), staged for the
// whole block in shared memory in verify (q and k of row r normalised by row group r, with
// k . q; gates by one thread each; v). Verify keeps the evolving state in registers across its
// R rows and never writes it back (except the pending rows it may apply first: see
// verify_block); decode writes it once.
#pragma once

#include "gdn_common.cuh"

namespace ds {
namespace gdn {

struct RecurrentParams {
  // First what a block reads before the grid-dependency wait or on its way to the first loads
  // after it, so that those reads share constant-bank cache lines (no effect measured: the
  // B=1 figures of session 9 moved the same with either order).
  float* state;           // [S, HV, V, K] fp32, one layer of the pool (read only in verify)
  const int32_t* slots;   // [N]
  int64_t S;              // slots in the pool (state.size(0))
  FastDiv tiles;          // row tiles per value head, ceil(V / Tile<K, ROWS>::kRows)
  FastDiv splits;         // decode: blocks per key head (its 1-D grid's fastest index)
  FastDiv heads;          // decode: H
  int N, R, R_max, H, HV, V;
  int G;                  // HV / H: value heads per key head
  int tiles_per_block;    // work tiles (row tiles of a value head) per block
  int key_heads_per_block;  // verify: whole key heads a block spans (1: one, or a part of one)
  float scale;            // applied to q after its L2 norm
  // (tiles, splits, heads, G, tiles_per_block and key_heads_per_block are set by the launch)
  const void* q;          // [N, R, H, K] T, strides q_stride_n / q_stride_r, [H, K] dense
  const void* k;          // [N, R, H, K] T, strides k_stride_n / k_stride_r
  const void* v;          // [N, R, HV, V] T, strides v_stride_n / v_stride_r
  const void* a;          // [N, R, HV] T, strides a_stride_n / a_stride_r
  const void* b;          // [N, R, HV] T, strides b_stride_n / b_stride_r
  int64_t q_stride_n, q_stride_r, k_stride_n, k_stride_r, v_stride_n, v_stride_r;
  int64_t a_stride_n, a_stride_r, b_stride_n, b_stride_r;  // all in elements
  const float* A_log;     // [HV]
  const float* dt_bias;   // [HV]
  void* o;                // [N, R, HV, V] T, dense
  float* stash_k;         // verify: [N_max, R_max, H, K] of this layer (else null)
  float* stash_v;         // verify: [N_max, R_max, HV, V]
  float* stash_g;         // verify: [N_max, R_max, HV]
  float* stash_beta;      // verify: [N_max, R_max, HV]
  // verify with pending rows (gdn_replay of this layer folded in): the previous verify's stash
  // of this layer, same [N_max, R_max, ...] shapes, and its accepted rows per request [N]
  // (null: none pending)
  const float* pend_k;
  const float* pend_v;
  const float* pend_g;
  const float* pend_beta;
  const int32_t* pend_rows;
};

// Stage rows c0 .. c0+rc-1 of request n for work tiles w0 .. w0+nt-1 into shared memory (work
// tile w of the request: row tile w % tiles of value head w / tiles; the span covers key heads
// kh0 .. kh0+nkh-1, nkh <= KH <= 2, nkh * rc <= CH), and write them to the stash (k of each key
// head by the block holding its first tile: k_first says whether that is so for kh0, a later
// one starts inside the span; g/beta by the block holding row tile 0 of each value head, v per
// row). Staged row kh * rc + r holds row r's q and k of key head kh0 + kh, formed by row group
// kh * rc + r (load_qk, normalize_qk: the same bits as gdn_decode, which forms them in every
// group); v of row r at vrow(r, stride) (the caller's stride: nt * BR where R rows of a span of
// two key heads are packed, else VROWS). The q/k loads and the first pass of v and gate loads are all issued
// before any of them is used: one memory round trip per staging instead of one per q/k vector
// and per v pass (verify with R = 4 spent most of its time waiting on those in turn, with the
// memory pipe idle).
template <typename T, int K, int BR, int VROWS, int CH, int TILES, int KH>
DS_DEVICE void stage_span(const RecurrentParams& p, RowSmem<K, VROWS, CH, true, TILES>& sm,
                          int n, int c0, int rc, int kh0, int nkh, int w0, int nt,
                          int stride, bool k_first) {
  using L = Layout<K>;
  static_assert(CH <= L::kGroups, "one row group per staged row");
  static_assert(KH == 1 || KH == 2, "one or two key heads per span");
  const int tid = threadIdx.x, lane = L::group_lane(), g_qk = L::group();
  // v and the gates are taken from the last thread backwards, q and k from group 0 forwards:
  // with few rows the gate loads and math start in warps that hold no q/k row (the same warp
  // doing both cost the then-staged decode 18% at B=64, session 5).
  const int rt = kThreads - 1 - tid;

  // Every thread takes part in normalize_qk (zeros past the staged rows): its butterflies are
  // full-warp shuffles, and the rows may end inside a warp (a partial warp deadlocked in them).
  // Groups past them load row c0's q and k of kh0 (every load here is unpredicated: see v).
  // A warp holding no staged row skips it whole (a multi-tile verify at B=8 ran about 2% faster;
  // in the one-tile kernel the test raised registers 72 -> 80, so every warp runs it there).
  const int nqk = KH > 1 ? nkh * rc : rc;
  const bool has_qk = g_qk < nqk;
  const bool warp_qk = TILES == 1 || (tid / kWarp) * (kWarp / L::kLanes) < nqk;
  const int kh_qk = KH > 1 && has_qk && g_qk >= rc ? 1 : 0;
  const int r_qk = has_qk ? g_qk - kh_qk * rc : 0;
  const QKWords<T> qk_words = load_qk_words<K, T>(
      static_cast<const T*>(p.q) + n * p.q_stride_n + (c0 + r_qk) * p.q_stride_r +
          (kh0 + kh_qk) * K,
      static_cast<const T*>(p.k) + n * p.k_stride_n + (c0 + r_qk) * p.k_stride_r +
          (kh0 + kh_qk) * K,
      lane);
  // v: a thread's slot u holds staged row r0 + slot_row(u), span column slot_col(u) (tile slot
  // c / BR, tile row c % BR), all loads of a pass issued before its stores. A small span (one
  // verify tile) is covered in one pass, rows and columns spread over all threads; a wide one
  // (several verify tiles) takes the same columns in every row, four rows a pass.
  constexpr bool kSmall = CH * VROWS <= 2 * kThreads;
  constexpr int kCols = (VROWS + kThreads - 1) / kThreads;
  constexpr int kPassRows = kSmall ? CH : (CH < 4 ? CH : 4);
  constexpr int kSlots = kSmall ? (CH * VROWS + kThreads - 1) / kThreads : kPassRows * kCols;
  const auto slot_row = [&](int u) { return kSmall ? (rt + u * kThreads) / VROWS : u / kCols; };
  const auto slot_col = [&](int u) {
    return kSmall ? (rt + u * kThreads) % VROWS : rt + (u % kCols) * kThreads;
  };
  const int span = nt * BR;
  const int hvv = p.HV * p.V;  // one v row (HV * V < 2^31: the launch checks)
  // v_hv * V + v_row within a row, -1 past the span or V: per slot, or in a wide span per
  // column (its slots u and u + kCols share one)
  constexpr int kOffs = kSmall ? kSlots : kCols;
  const auto off_of = [](int u) { return kSmall ? u : u % kCols; };
  int v_off[kOffs];
#pragma unroll
  for (int u = 0; u < kOffs; ++u) {
    const int c = slot_col(u);
    const WorkTile wt = WorkTile::of(p.tiles, w0 + c / BR);
    const int vr = wt.t * BR + c % BR;
    v_off[u] = c < span && vr < p.V ? wt.hi * p.V + vr : -1;
  }
  // Every load of the staging is unpredicated (an empty slot or idle gate thread reads an
  // element that exists) and nothing loaded is converted before normalize_qk: predicated, or
  // converted where loaded, ptxas scheduled each load next to its use, and a verify block at
  // B=64 waited on about five global round trips in turn (ncu, session 12).
  // A wide pass loads row i's slots i * kCols .. i * kCols + kCols - 1 through one row pointer
  // (rows past rc: row 0, read but never used): per slot, the 64-bit row arithmetic took about
  // 13 instructions (SASS, session 15). A small span's slot rows differ per thread, so they are
  // formed per slot. The stash stores keep one expression per slot (ptxas folds it into a 64-bit
  // chain anyway; a row pointer there made it spill in the multi-tile verify with 1 row per
  // thread).
  const T* const v_req = static_cast<const T*>(p.v) + n * p.v_stride_n + c0 * p.v_stride_r;
  float* const stash_req = p.stash_v + (int64_t(n) * p.R_max + c0) * hvv;
  const auto load_v = [&](int r0, T (&raw)[kSlots]) {
    if constexpr (kSmall) {
#pragma unroll
      for (int u = 0; u < kSlots; ++u) {
        const int r = r0 + slot_row(u), off = v_off[u];
        raw[u] = r < rc && off >= 0 ? v_req[r * p.v_stride_r + off] : v_req[0];
      }
    } else {
#pragma unroll
      for (int i = 0; i < kPassRows; ++i) {
        const T* const row = v_req + (r0 + i < rc ? r0 + i : 0) * p.v_stride_r;
#pragma unroll
        for (int j = 0; j < kCols; ++j) raw[i * kCols + j] = row[v_off[j] >= 0 ? v_off[j] : 0];
      }
    }
  };
  T v[kSlots];
  load_v(0, v);
  // Gates: one (row, tile slot) pair e = i * CH + r per thread (rows past rc idle: no division
  // by the run-time nt). A value head's gates are computed by each of its tiles in the span,
  // from the same inputs by the same function, so the bits agree.
  const int ng = CH * nt;
  T ga{}, gb{};
  float a_log = 0.f, dt_bias = 0.f;
  const auto load_gate = [&](int e) {  // e < ng with e % CH < rc, or 0 (row 0 of tile slot 0)
    const int r = e % CH, hv = p.tiles.div(w0 + e / CH);
    a_log = p.A_log[hv];
    dt_bias = p.dt_bias[hv];
    ga = static_cast<const T*>(p.a)[n * p.a_stride_n + (c0 + r) * p.a_stride_r + hv];
    gb = static_cast<const T*>(p.b)[n * p.b_stride_n + (c0 + r) * p.b_stride_r + hv];
  };
  load_gate(rt < ng && rt % CH < rc ? rt : 0);

  float xq[kPerLane] = {}, xk[kPerLane] = {};
  if (has_qk) qk_to_float(qk_words, xq, xk);
  const float kq = warp_qk ? normalize_qk<K>(xq, xk, p.scale) : 0.f;
  if (has_qk) {
    store_slice<K>(sm.q[g_qk], lane, xq);
    store_slice<K>(sm.k[g_qk], lane, xk);
    if (k_first || kh_qk > 0)
      store_slice<K>(
          p.stash_k + ((int64_t(n) * p.R_max + c0 + r_qk) * p.H + kh0 + kh_qk) * K, lane, xk);
    if (lane == 0) sm.kq[g_qk] = kq;
  }
  for (int r0 = 0; r0 < rc; r0 += kPassRows) {
    if (r0 > 0) load_v(r0, v);
#pragma unroll
    for (int u = 0; u < kSlots; ++u) {
      const int r = r0 + slot_row(u), c = slot_col(u), off = v_off[off_of(u)];
      const float x = r < rc && off >= 0 ? to_float(v[u]) : 0.f;
      if (r < rc && c < span) sm.vrow(r, stride)[c] = x;  // zero past V: computes, never stored
      if (r < rc && off >= 0) stash_req[int64_t(r) * hvv + off] = x;
    }
  }
  for (int e = rt; e < ng; e += kThreads) {
    const int r = e % CH, i = e / CH;
    const WorkTile wt = WorkTile::of(p.tiles, w0 + i);
    if (r >= rc) continue;
    if (e > rt) load_gate(e);
    const float g = gate_g(to_float(ga), a_log, dt_bias);
    const float beta = gate_beta(to_float(gb));
    sm.decay[r][i] = gate_decay(g);
    sm.beta[r][i] = beta;
    if (wt.t == 0) {  // once per value head: each of its tiles computes the same gates
      const int64_t sr = int64_t(n) * p.R_max + c0 + r;
      p.stash_g[sr * p.HV + wt.hi] = g;
      p.stash_beta[sr * p.HV + wt.hi] = beta;
    }
  }
}

// The row step on this thread's state rows (row[m] = -1: past V) and the store of their
// outputs into o ([V] of T, the value head's): step_rows (SCATTER, where it applies) or step()
// per row, the same bits either way. Measured on the H200 at Qwen3-Next shapes (session 14,
// RESULTS.md): step_rows took gdn_verify from 48.6 to 45.9 us at B=64 and 5.6-5.7% off from
// B=64 to 512 (3.5% at B=8). gdn_decode lost 1.0-1.8% with it from B=64 on (gained 1.8% at
// B=8), the verify with pending rows did not move, the one-tile verify lost 2-3% at B=1: only
// the multi-tile verify without pending rows takes it.
template <typename T, int K, int ROWS, bool SCATTER>
DS_DEVICE void step_store(float (&s)[ROWS][kPerLane], const float (&k)[kPerLane],
                          const float (&q)[kPerLane], const float (&v)[ROWS], float decay,
                          float beta, float kq, const int (&row)[ROWS], T* o) {
  if constexpr (SCATTER && kScatterRows<K, ROWS>) {
    int om;
    const float out = step_rows<K, ROWS>(s, k, q, v, decay, beta, kq, om);
    int orow = -1;
#pragma unroll
    for (int m = 0; m < ROWS; ++m)
      if (om == m) orow = row[m];
    if (orow >= 0) o[orow] = from_float<T>(out);
  } else {
    const int lane = Layout<K>::group_lane();
#pragma unroll
    for (int m = 0; m < ROWS; ++m) {
      const float out = step<K, true>(s[m], k, q, v[m], decay, beta, kq);
      if (row[m] >= 0 && lane == 0) o[row[m]] = from_float<T>(out);
    }
  }
}

// The staged rows c0 .. c0+rc-1 through this thread's state rows of the span's tile slot i, one
// output per row: their q and k are staged rows q0 .. q0+rc-1, v rows stride apart; o is
// row c0's output of the tile's value head ([V] of T, rows HV * V apart). SCATTER: step_rows'
// sums (step_store).
template <typename T, int K, int ROWS, bool SCATTER, int VROWS, int CH, int TILES>
DS_DEVICE void run_rows(const RecurrentParams& p, const RowSmem<K, VROWS, CH, true, TILES>& sm,
                        float (&s)[ROWS][kPerLane], const int (&row)[ROWS], T* o, int i, int rc,
                        int q0, int stride) {
  using L = Layout<K>;
  constexpr int BR = Tile<K, ROWS>::kRows;
  const int lane = L::group_lane(), grp = L::group();
  const int o_row = p.HV * p.V;  // one verify row further (HV * V < 2^31: the launch checks)
  for (int r = 0; r < rc; ++r, o += o_row) {
    float k[kPerLane], q[kPerLane];
    load_slice<K>(sm.k[q0 + r], lane, k);
    load_slice<K>(sm.q[q0 + r], lane, q);
    float v[ROWS];
#pragma unroll
    for (int m = 0; m < ROWS; ++m) v[m] = sm.vrow(r, stride)[i * BR + m * L::kGroups + grp];
    step_store<T, K, ROWS, SCATTER>(s, k, q, v, sm.decay[r][i], sm.beta[r][i], sm.kq[q0 + r],
                                    row, o);
  }
}

// Before the previous kernel's writes are visible (programmatic dependent launch), a block only
// prefetches its first tile into L2, from a slot index that may be stale (hence clamped).
// gdn_decode also aims its first state load (after the wait) with it, and loads again if the
// slot read after the wait differs.
DS_DEVICE int64_t guess_slot(const RecurrentParams& p, int n) {
  return clamp_slot(p.slots[n], p.S);
}

// A verify block with several tiles stages v and the gates of all of them at once: at most
// kStagedRows value rows (16 KB of v for 8 rows), so it spans at most Staged<>::kTiles tiles.
// A one-tile block (MULTI false) stages only its own rows: less shared memory and less code,
// which is what the latency-bound small batches run. With pending rows (PENDING) a second set
// of k, v and gates is staged, so half the rows, to stay in 48 KB of static shared memory
// (still a whole key head's 8 tiles at Qwen3-Next shapes). kKeyHeads: the whole key heads a
// block may span, 2 for the multi-tile verify without pending rows (two key heads' 16 tiles at
// Qwen3-Next shapes; pick_key_heads_per_block), else 1.
constexpr int kStagedRows = 512;
template <int K, int ROWS, bool MULTI, bool PENDING = false>
struct Staged {
  static constexpr int kBR = Tile<K, ROWS>::kRows;
  static constexpr int kMaxRows = PENDING ? kStagedRows / 2 : kStagedRows;
  static constexpr int kTiles = MULTI && kMaxRows / kBR > 1 ? kMaxRows / kBR : 1;
  static constexpr int kRows = kTiles * kBR;
  static constexpr int kKeyHeads = MULTI && !PENDING ? 2 : 1;
};

// Stage the pending rows 0 .. rc-1 (rc <= kChunk) of request n for key head h and the request's
// work tiles w0 .. w0+nt-1 (within that key head) from the previous verify's stash: k as stashed
// (normalised), v, and the gates as replay_kernel forms them (decay = gate_decay(g), beta), so
// update_rows applies them with replay's bits, hence decode's.
template <int K, int BR, int VROWS, int TILES>
DS_DEVICE void stage_pending(const RecurrentParams& p, RowSmem<K, VROWS, kChunk, false, TILES>& pm,
                             int n, int rc, int h, int w0, int nt) {
  constexpr int kKs = (kChunk * (K / 4) + kThreads - 1) / kThreads;  // float4 pieces of k
  // v: span column tid + j * kThreads of kPass rows at a time, all loads of a pass first
  constexpr int kCols = (VROWS + kThreads - 1) / kThreads;
  constexpr int kPass = kCols >= 8 ? 1 : 8 / kCols;
  const int tid = threadIdx.x, span = nt * BR;
  const int64_t first = int64_t(n) * p.R_max;  // stash row of pending row 0
  float4 kp[kKs];
#pragma unroll
  for (int u = 0; u < kKs; ++u) {
    const int i = tid + u * kThreads;
    if (i < rc * (K / 4))
      kp[u] = *reinterpret_cast<const float4*>(
          p.pend_k + ((first + i / (K / 4)) * p.H + h) * K + (i % (K / 4)) * 4);
  }
  int64_t v_off[kCols];  // -1: past the span or past V (staged as zero)
#pragma unroll
  for (int j = 0; j < kCols; ++j) {
    const int c = tid + j * kThreads;
    const WorkTile wt = WorkTile::of(p.tiles, w0 + c / BR);
    const int vr = wt.t * BR + c % BR;
    v_off[j] = c < span && vr < p.V ? int64_t(wt.hi) * p.V + vr : -1;
  }
  for (int r0 = 0; r0 < rc; r0 += kPass) {
    float x[kPass][kCols];
#pragma unroll
    for (int u = 0; u < kPass; ++u) {
      const float* const row = p.pend_v + (first + r0 + u) * p.HV * p.V;  // once per row
#pragma unroll
      for (int j = 0; j < kCols; ++j)
        x[u][j] = r0 + u < rc && v_off[j] >= 0 ? row[v_off[j]] : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kPass; ++u)
#pragma unroll
      for (int j = 0; j < kCols; ++j)
        if (r0 + u < rc && tid + j * kThreads < span) pm.v[r0 + u][tid + j * kThreads] = x[u][j];
  }
#pragma unroll
  for (int u = 0; u < kKs; ++u) {
    const int i = tid + u * kThreads;
    if (i < rc * (K / 4))
      *reinterpret_cast<float4*>(&pm.k[i / (K / 4)][(i % (K / 4)) * 4]) = kp[u];
  }
  for (int e = tid; e < kChunk * nt; e += kThreads) {  // e = i * kChunk + r, rows past rc idle
    const int r = e % kChunk, i = e / kChunk, hv = p.tiles.div(w0 + i);
    if (r >= rc) continue;
    pm.decay[r][i] = gate_decay(p.pend_g[(first + r) * p.HV + hv]);
    pm.beta[r][i] = p.pend_beta[(first + r) * p.HV + hv];
  }
}

// gdn_decode, one block: work tiles [w0, w0 + nt) of key head h of request n (work tile w: row
// tile w % tiles of value head h * G + w / tiles), in turn, the next one prefetched into L2
// while the current one computes (two tiles per block beat one by 7-9% from B=32 on, session 6;
// prefetching further ahead was slower). Nothing is staged: each thread loads the row inputs it
// needs while its state loads are in flight (its group's slices of q and k, normalised by the
// group with normalize_qk; the v of its rows; its value head's gates), so no shared memory and
// no barrier stand between the grid-dependency wait and the first state store. Staging them for
// the block cost about 1 µs of 3.5 at B=1 and 1.5 µs of 70 at B=64 (session 7, RESULTS.md).
// 1-D grid: (splits of the G * tiles work tiles, H, N), splits fastest.
// Programmatic dependent launch: a block of a multi-tile grid lets the next kernel launch at its
// start, one of a one-tile grid only after its own grid-dependency wait. One-tile grids are the
// small ones: B <= 7 at Qwen3-Next shapes (and any verify with R > kChunk). Measured on the H200
// in 32-call chains (session 10, RESULTS.md): at B=1 the late trigger took gdn_decode from 3.1
// to 2.5-2.6 µs, gdn_verify from 4.6 to 3.8 and verify with pending rows from 7.2 to 5.6; B=2-7
// were not measured. In multi-tile grids it moved B=8 and B=64 by up to 0.7%, one way in one
// call and the other way in the next, so they keep the early trigger. (What the B=1 figures
// fit: an early trigger lets the kernel after the next one launch too, its blocks parked at
// their wait beside ours; not measured directly.)
template <typename T, int K, int ROWS, bool MULTI>
DS_DEVICE void decode_block(const RecurrentParams& p) {
  using L = Layout<K>;
  constexpr int BR = Tile<K, ROWS>::kRows;
  const int tiles = static_cast<int>(p.tiles.d);
  const int tpb = MULTI ? p.tiles_per_block : 1;
  const int blk = static_cast<int>(blockIdx.x), hn = p.splits.div(blk);  // grid < 2^31
  const int w0 = (blk - hn * static_cast<int>(p.splits.d)) * tpb;
  const int n = p.heads.div(hn), h = hn - n * p.H;
  const int per_head = p.G * tiles;
  const int nt = w0 + tpb < per_head ? tpb : per_head - w0;
  const int64_t head_elems = int64_t(p.V) * K;
  const auto head_of = [&](int64_t slot, WorkTile wt) {
    return p.state + (slot * p.HV + h * p.G + wt.hi) * head_elems;
  };
  const int lane = L::group_lane();
  // A tile's row inputs: v of its value head, and that head's gate inputs.
  struct Inputs {
    const T* v;
    const T* a;
    const T* b;
    const float* A_log;
    const float* dt_bias;
  };
  const auto inputs_of = [&](WorkTile wt) {
    const int hv = h * p.G + wt.hi;
    return Inputs{static_cast<const T*>(p.v) + n * p.v_stride_n + int64_t(hv) * p.V,
                  static_cast<const T*>(p.a) + n * p.a_stride_n + hv,
                  static_cast<const T*>(p.b) + n * p.b_stride_n + hv, p.A_log + hv,
                  p.dt_bias + hv};
  };
  float v[ROWS], decay, beta;  // the current tile's row inputs
  const auto load_tile_inputs = [&](const Inputs& in, int t) {
#pragma unroll
    for (int m = 0; m < ROWS; ++m) {
      const int raw = t * BR + m * L::kGroups + L::group();
      v[m] = raw < p.V ? to_float(in.v[raw]) : 0.f;  // zero past V: computes, never stored
    }
    decay = gate_decay(gate_g(to_float(*in.a), *in.A_log, *in.dt_bias));
    beta = gate_beta(to_float(*in.b));
  };

  if constexpr (MULTI) launch_dependents();  // the next kernel may start its prologue now
  const WorkTile first = WorkTile::of(p.tiles, w0);
  const int64_t guess = guess_slot(p, n);
  float* guess_head = head_of(guess, first);
  prefetch_tile<K, ROWS>(guess_head, first.t, p.V);
  const T* qp = static_cast<const T*>(p.q) + n * p.q_stride_n + h * K;
  const T* kp = static_cast<const T*>(p.k) + n * p.k_stride_n + h * K;
  const Inputs in = inputs_of(first);
  grid_dependency_wait();
  if constexpr (!MULTI) launch_dependents();  // one-tile grid: late (above)

  // The state loads go out first, from the slot read before the wait and checked below: the
  // slot read is then off the path to the first state load.
  float s[ROWS][kPerLane];
  int row[ROWS];
  load_tile<K, ROWS>(guess_head, first.t, p.V, s, row);
  const int64_t slot = p.slots[n];
  float q[kPerLane], k[kPerLane];
  load_qk<K, T>(qp, kp, lane, q, k);
  load_tile_inputs(in, first.t);
  const float kq = normalize_qk<K>(q, k, p.scale);
  float* head = head_of(slot, first);  // the state of value head h * G + wt.hi
  if (slot != guess) load_tile<K, ROWS>(head, first.t, p.V, s, row);
  WorkTile wt = first;
  for (int i = 0; i < nt; ++i) {
    const WorkTile nx = wt.next(tiles);
    float* const nx_head = nx.t == 0 ? head + head_elems : head;
    if (i > 0) {
      load_tile<K, ROWS>(head, wt.t, p.V, s, row);
      load_tile_inputs(inputs_of(wt), wt.t);
    }
    if (i + 1 < nt) prefetch_tile<K, ROWS>(nx_head, nx.t, p.V);
    T* o = static_cast<T*>(p.o) + (int64_t(n) * p.HV + h * p.G + wt.hi) * p.V;
    step_store<T, K, ROWS, false>(s, k, q, v, decay, beta, kq, row, o);
    store_tile<K, ROWS>(head, s, row);
    wt = nx;
    head = nx_head;
  }
}

// gdn_verify, one block: work tiles [w0, w0 + nt) of request n, of key heads h0 ..
// h0 + key_heads_per_block - 1 (work tile w of the request: row tile w % tiles of value head
// w / tiles; value heads h * G .. h * G + G - 1 share key head h's q and k). A block spans
// several whole key heads, or a part of one.
//   MULTI (several tiles, R <= kChunk, the launch sees to both): everything the block's tiles
//     need (q, k, k . q of each key head, and each tile's v and gates) is staged once, behind
//     one barrier; then the tiles run back to back, the next one prefetched into L2 while the
//     current one computes. Per-tile staging and barriers were about a third of verify's
//     instructions with several tiles per block (ncu, session 5), and a block spanning two key
//     heads stages once for 16 tiles instead of twice for 8 (RESULTS.md, session 14).
//   one tile: staged chunk by chunk (kChunk rows), the state held in registers across chunks.
//   PENDING (pend_rows set; R_max <= kChunk, the launch sees to it): the previous verify's
//     accepted rows of this request are applied to each tile as it is loaded, and that state is
//     written back, before the verify rows run on it: gdn_replay of this layer folded into the
//     launch that reads the state anyway, so a speculative step moves the state once, not
//     three times (verify read, replay read + write).
// Grid: (splits of a key head's G * tiles work tiles (1 where a block spans whole key heads),
// ceil(H / key_heads_per_block), N).
template <typename T, int K, int ROWS, bool MULTI, bool PENDING>
DS_DEVICE void verify_block(const RecurrentParams& p) {
  using S = Staged<K, ROWS, MULTI, PENDING>;
  constexpr int BR = S::kBR;
  __shared__ __align__(16) RowSmem<K, S::kRows, kChunk, true, S::kTiles> sm;
  __shared__ __align__(16) RowSmem<K, PENDING ? S::kRows : 1, PENDING ? kChunk : 1, false,
                                   PENDING ? S::kTiles : 1> pm;

  const int tiles = static_cast<int>(p.tiles.d), per_head = p.G * tiles;
  const int h0 = blockIdx.y * p.key_heads_per_block, n = blockIdx.z;
  const int w0 = h0 * per_head + blockIdx.x * p.tiles_per_block;
  const int64_t head_elems = int64_t(p.V) * K;
  const auto head_of = [&](int64_t slot, WorkTile wt) {
    return p.state + (slot * p.HV + wt.hi) * head_elems;
  };
  // Row c0's output of value head wt.hi: [V] of T, the next row HV * V further.
  const auto out_of = [&](WorkTile wt, int c0) {
    return static_cast<T*>(p.o) + ((int64_t(n) * p.R + c0) * p.HV + wt.hi) * p.V;
  };
  const WorkTile first = WorkTile::of(p.tiles, w0);

  if constexpr (MULTI) launch_dependents();
  prefetch_tile<K, ROWS>(head_of(guess_slot(p, n), first), first.t, p.V);
  grid_dependency_wait();
  if constexpr (!MULTI) launch_dependents();  // one-tile grids: late, as in gdn_decode

  const int64_t slot = p.slots[n];
  int pend = 0;  // uniform per block
  if constexpr (PENDING) {
    pend = p.pend_rows[n];
    const int most = p.R_max < kChunk ? p.R_max : kChunk;
    pend = pend < 0 ? 0 : (pend > most ? most : pend);
  }
  float s[ROWS][kPerLane];
  int row[ROWS];
  load_tile<K, ROWS>(head_of(slot, first), first.t, p.V, s, row);  // in flight while staging
  const bool k_first = w0 == h0 * per_head;  // this block writes the stash's k of key head h0
  if constexpr (MULTI) {
    const int kh_end = h0 + p.key_heads_per_block < p.H ? h0 + p.key_heads_per_block : p.H;
    const int w_end = kh_end * per_head < w0 + p.tiles_per_block ? kh_end * per_head
                                                                  : w0 + p.tiles_per_block;
    const int nt = w_end - w0, nkh = kh_end - h0;
    const int stride = S::kKeyHeads > 1 ? nt * BR : S::kRows;  // of the staged v rows
    stage_span<T, K, BR, S::kRows, kChunk, S::kTiles, S::kKeyHeads>(p, sm, n, 0, p.R, h0, nkh,
                                                                    w0, nt, stride, k_first);
    if constexpr (PENDING) {
      if (pend > 0) stage_pending<K, BR>(p, pm, n, pend, h0, w0, nt);
    }
    __syncthreads();
    WorkTile wt = first;
    float* head = head_of(slot, first);  // the state of value head wt.hi
    T* o = out_of(first, 0);             // its outputs
    int q0 = 0;                              // the staged q/k rows of the tile's key head
    int kh_left = (h0 + 1) * per_head - w0;  // tiles left in that key head
    for (int i = 0; i < nt; ++i) {
      const WorkTile nx = wt.next(tiles);
      float* const nx_head = nx.t == 0 ? head + head_elems : head;
      T* const nx_o = nx.t == 0 ? o + p.V : o;
      if (i > 0) load_tile<K, ROWS>(head, wt.t, p.V, s, row);
      if (i + 1 < nt) prefetch_tile<K, ROWS>(nx_head, nx.t, p.V);
      if constexpr (PENDING) {
        if (pend > 0) {
          update_rows<K>(pm, s, 0, pm.v[0] + i * BR, S::kRows, i, pend);
          store_tile<K, ROWS>(head, s, row);
        }
      }
      run_rows<T, K, ROWS, !PENDING>(p, sm, s, row, o, i, p.R, q0, stride);
      if constexpr (S::kKeyHeads > 1) {
        if (--kh_left == 0) {
          kh_left = per_head;
          q0 += p.R;
        }
      }
      wt = nx;
      head = nx_head;
      o = nx_o;
    }
  } else {
    if constexpr (PENDING) {
      if (pend > 0) stage_pending<K, BR>(p, pm, n, pend, h0, w0, 1);
    }
    for (int c0 = 0; c0 < p.R; c0 += kChunk) {
      const int rc = p.R - c0 < kChunk ? p.R - c0 : kChunk;
      if (c0 > 0) __syncthreads();  // every thread is done with the previous chunk
      stage_span<T, K, BR, S::kRows, kChunk, 1, 1>(p, sm, n, c0, rc, h0, 1, w0, 1, S::kRows,
                                                    k_first);
      __syncthreads();
      if constexpr (PENDING) {
        if (c0 == 0 && pend > 0) {
          update_rows<K>(pm, s, 0, pm.v[0], S::kRows, 0, pend);
          store_tile<K, ROWS>(head_of(slot, first), s, row);
        }
      }
      run_rows<T, K, ROWS, false>(p, sm, s, row, out_of(first, c0), 0, rc, 0, S::kRows);
    }
  }
}

// Register caps, measured on the H200 (RESULTS.md): decode is best with a cap of 4 blocks per SM
// (116 registers at 2 rows per thread, no spills); 5, best while decode staged its inputs in
// shared memory (session 5), now spills 36 bytes and lost 2-8% at every batch (session 7).
// Verify, with R rows of inputs in flight, is best left to ptxas (a cap of 4 or 5 blocks cost
// 0-12% at K=128, spills at K=32). The multi-tile verify with pending rows is the exception: left
// to ptxas it got 96 registers once the output pointer was walked per tile (session 12), so 5
// blocks per SM, and ran 7-11% slower at B=8 and B=64 (4% faster at B=256); bounded to 4 blocks
// per SM, ptxas gives it 122 (K=128, 2 rows per thread): 0-4% faster than before (RESULTS.md).
// Only 2 rows per thread is bounded (what runs at these shapes; 4 would spill under the bound).
template <typename T, int K, int ROWS, bool MULTI>
__global__ void DS_LAUNCH_BOUNDS_MIN_BLOCKS(kThreads, 4) decode_kernel(const RecurrentParams p) {
  decode_block<T, K, ROWS, MULTI>(p);
}
template <typename T, int K, int ROWS, bool MULTI, bool PENDING>
__global__ void __launch_bounds__(kThreads) verify_kernel(const RecurrentParams p) {
  verify_block<T, K, ROWS, MULTI, PENDING>(p);
}
template <typename T, int K, int ROWS>
__global__ void DS_LAUNCH_BOUNDS_MIN_BLOCKS(kThreads, 4) verify_pending_kernel(
    const RecurrentParams p) {
  verify_block<T, K, ROWS, true, true>(p);
}

// The one-tile verify kernel with one row per thread needs 71 registers at K=128, so 7 of its
// blocks fit per SM. Launched with PDL in a chain, the kernels after it then park more blocks at
// their grid-dependency wait, and at B=1 that cost 0.5 µs of 4.5 (H200, session 9, RESULTS.md:
// 5.04-5.13 µs; the same kernel held at 5 blocks per SM by unused dynamic shared memory, 4.59;
// the previous kernel at 95 registers, 5 per SM, 4.52-4.58; without PDL the two are even). A
// one-tile grid that fits one wave at 5 blocks per SM is held there (never a delay for a block
// of its own); kernels that registers already hold at 5 or fewer get no padding.
constexpr int kOneTileBlocksPerSm = 5;
inline size_t one_wave_pad(const void* kernel, int64_t blocks) {
#if DS_CUDA
  int sms = 0;
  if (multiprocessor_count(&sms) == DS_SUCCESS && blocks <= int64_t(kOneTileBlocksPerSm) * sms)
    return occupancy_pad_bytes(kernel, kThreads, kOneTileBlocksPerSm);  // used by PDL launches
#endif
  (void)kernel;
  (void)blocks;
  return 0;
}

// Key heads per multi-tile verify block without pending rows: 2 where a block already takes a
// whole key head, the staged rows of two fit (2 R <= kChunk, their 2 * per_head tiles within
// Staged<>::kTiles) and the grid keeps kMinBlocks blocks: B >= 64 at Qwen3-Next shapes with R
// = 4. H200, session 14 (RESULTS.md), same build with one and two: gdn_verify 2.0% / 2.5% /
// 2.0% faster at B = 64 / 128 / 256, even at 512. With pending rows two key heads were slower
// than one key head per block had been (their v takes two passes of loads), so that kernel
// keeps one. DS_GDN_KEY_HEADS=1 in the environment keeps one, =2 takes two wherever they fit
// (tuning runs and tests).
inline int pick_key_heads_per_block(const RecurrentParams& p, int per_head, int tiles_per_block,
                                    int cap) {
  const char* forced = std::getenv("DS_GDN_KEY_HEADS");
  const int force = forced != nullptr ? std::atoi(forced) : 0;
  const bool fits = tiles_per_block == per_head && p.H > 1 && 2 * p.R <= kChunk &&
                    2 * per_head <= cap;
  if (!fits || force == 1) return 1;
  return force == 2 || int64_t(p.N) * ceil_div(p.H, 2) >= kMinBlocks ? 2 : 1;
}

template <typename T, int K, int ROWS, bool PENDING>
inline ds_error_t launch_verify(RecurrentParams p, int tiles, ds_stream_t stream) {
  const int per_head = p.G * tiles;
  constexpr int cap = Staged<K, ROWS, true, PENDING>::kTiles;
  p.tiles_per_block = pick_tiles_per_block(int64_t(p.N) * p.H, per_head, cap, cap, p.R);
  p.key_heads_per_block = 1;
  if (!PENDING && p.tiles_per_block > 1) {
    p.key_heads_per_block = pick_key_heads_per_block(p, per_head, p.tiles_per_block, cap);
    p.tiles_per_block *= p.key_heads_per_block;
  }
  const int splits = p.key_heads_per_block > 1
                         ? 1 : static_cast<int>(ceil_div(per_head, p.tiles_per_block));
  const dim3 grid(static_cast<unsigned>(splits),
                  static_cast<unsigned>(ceil_div(p.H, p.key_heads_per_block)), p.N);
  if (p.tiles_per_block > 1) {
    if constexpr (PENDING && ROWS == 2)
      return launch(verify_pending_kernel<T, K, ROWS>, grid, kThreads, stream, Pdl::kOn, p);
    else
      return launch(verify_kernel<T, K, ROWS, true, PENDING>, grid, kThreads, stream, Pdl::kOn, p);
  }
  const auto kernel = verify_kernel<T, K, ROWS, false, PENDING>;
  const size_t pad =
      one_wave_pad(reinterpret_cast<const void*>(kernel), int64_t(grid.x) * p.H * p.N);
  return launch_smem(kernel, grid, kThreads, pad, stream, Pdl::kOn, p);
}

template <typename T, int K, int ROWS, bool VERIFY>
inline ds_error_t launch_rows(RecurrentParams p, ds_stream_t stream) {
  const int tiles = static_cast<int>(ceil_div(p.V, Tile<K, ROWS>::kRows));
  p.G = p.HV / p.H;
  p.tiles = FastDiv(tiles);
  if constexpr (VERIFY) {
    if (p.pend_rows == nullptr) return launch_verify<T, K, ROWS, false>(p, tiles, stream);
    if (p.R_max > kChunk) return DS_ERROR_INVALID_VALUE;  // pending rows are one staged chunk
    return launch_verify<T, K, ROWS, true>(p, tiles, stream);
  } else {
    const int per_head = p.G * tiles;
    // 2 tiles at most; DS_GDN_TILES may force up to 16 (decode stages nothing, any count works)
    p.tiles_per_block = pick_tiles_per_block(int64_t(p.N) * p.H, per_head, 2, 16, 1);
    const int64_t splits = ceil_div(per_head, p.tiles_per_block);
    const int64_t blocks = splits * p.H * p.N;
    if (blocks > 0x7fffffffLL) return DS_ERROR_INVALID_VALUE;  // FastDiv and the 1-D grid
    p.splits = FastDiv(splits);
    p.heads = FastDiv(p.H);
    return p.tiles_per_block > 1
               ? launch(decode_kernel<T, K, ROWS, true>, blocks, kThreads, stream, Pdl::kOn, p)
               : launch(decode_kernel<T, K, ROWS, false>, blocks, kThreads, stream, Pdl::kOn, p);
  }
}

// Rows per thread for gdn_verify: pick_rows', except 4 for a verify without pending rows at
// K = 128 whose state holds at least kVerifyRows4PerSm value rows per SM. 4 rows per thread
// issue fewer instructions per state element (each staged k and q read from shared memory
// serves 4 rows, and the 8 dots of a step fill scatter_sum's 8 lanes) at 3 blocks per SM
// instead of 4. H200, Qwen3-Next shapes, R = 4 (session 16, RESULTS.md, two machines): 4 rows
// 10% slower at B=64 (1,986 rows per SM: its 512 blocks fill one wave at 4 per SM, 1.3 at 3),
// 9-14% faster at B=96 (2,979), 0-7% at B=128, 5-6% at B=256 and 7-9% at B=512. The verify
// with pending rows gained nothing (0.99-1.02x from B=96) and keeps 2; other K were not
// measured.
constexpr int64_t kVerifyRows4PerSm = 2560;
template <int K>
inline int pick_verify_rows(const RecurrentParams& p) {
  const int rows = pick_rows<K>(int64_t(p.HV) * p.N, p.V);  // DS_GDN_ROWS: forced there
  if (K != 128 || rows != 2 || p.pend_rows != nullptr || p.R > kChunk ||
      std::getenv("DS_GDN_ROWS") != nullptr)
    return rows;
  int sms = 0;
  if (multiprocessor_count(&sms) != DS_SUCCESS || sms <= 0) return rows;
  return int64_t(p.N) * p.HV * p.V >= kVerifyRows4PerSm * sms ? 4 : rows;
}

template <typename T, int K, bool VERIFY>
inline ds_error_t launch_recurrent(const RecurrentParams& p, ds_stream_t stream) {
  if (p.H <= 0 || p.HV % p.H != 0) return DS_ERROR_INVALID_VALUE;
  if (p.N <= 0 || p.V <= 0 || p.HV <= 0) return DS_SUCCESS;  // nothing to compute
  if (VERIFY && (p.N > 65535 || p.H > 65535)) return DS_ERROR_INVALID_VALUE;  // grid y/z
  if (int64_t(p.HV) * p.V > 0x7fffffffLL) return DS_ERROR_INVALID_VALUE;  // run_rows' int stride
  switch (VERIFY ? pick_verify_rows<K>(p) : pick_rows<K>(int64_t(p.HV) * p.N, p.V)) {
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
