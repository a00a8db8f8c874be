// Paged attention for decode and verify rows, and the KV append of those rows.
//
// KV lives in the page pool's layout, one layer: k_cache / v_cache [P, page_size, Hkv, D];
// request n's position t is at page page_table[n][t / page_size], offset t % page_size.
// kv_lens[n] counts the positions after this step's R rows are appended, so row r of request n
// sits at position kv_lens[n] - R + r and sees positions 0 .. kv_lens[n] - R + r (causal among
// the rows; decode is R = 1). Math: softmax(scale * q k^T) v with fp32 scores, an fp32 running
// max / sum (the online softmax of Milakov & Gimelshein, "Online normalizer calculation for
// softmax", 2018) and fp32 accumulation, in base 2 (scale pre-multiplied by log2 e). q k^T and
// p v run as 16 x 8 x 16 MMAs with 16-bit inputs: the probabilities p are rounded to T for the
// second (as FlashAttention-2 does), and the row sum adds the rounded values, so the output is
// the exact weighted mean under the weights used.
//
// Split-KV ("flash-decoding", Dao et al. 2023): the grid is (split, q-head block, request); a
// block attends one request's q rows of `heads_per_block` q heads (one kv head) over one split
// of its positions. A request's split size is chosen on the device from its own length
// (split_plan), so a CUDA graph sized for the longest context serves every length: short
// requests use few small splits, long ones up to max_splits; blocks past a request's last split
// exit at once. A request with one split writes its output directly; otherwise each split
// writes a normalised partial output and its log-sum-exp (base 2) and merge_kernel combines
// them.
#pragma once

#include "compat.cuh"

namespace ds {
namespace attn {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / kWarp;
constexpr int kTile = 32;  // positions staged at a time: 8 per warp in the score phase
constexpr int kMaxBlockRows = 16;  // q rows (heads x rows) one block holds: the MMA's M
constexpr int kMinSplit = kTile;   // the smallest split (positions)
// Blocks per multiprocessor the grid aims for, so the whole grid runs as one resident wave (no
// tail of a second one), and the kernel's launch bound: at D = 256 a block takes 44 KB of static
// shared memory and 168 registers a thread (sm_90; 128 would spill), so 3 stay resident on an
// H100/H200; at D <= 128, 127 registers and <= 23 KB: 4. DS_ATTN_BLOCKS_PER_SM overrides the
// grid's figure (A/B runs: fewer, longer splits merge less, more hide more latency).
constexpr int blocks_per_sm(int D) { return D >= 256 ? 3 : 4; }

struct PagedAttnParams {
  const void* q;              // [N, R, Hq, D] T, dense
  const void* k_cache;        // [P, page_size, Hkv, D] T, dense
  const void* v_cache;        // [P, page_size, Hkv, D] T, dense
  const int32_t* page_table;  // [N, max_pages] rows page_table_stride apart
  const int32_t* kv_lens;     // [N], positions after this step's rows (>= R)
  void* out;                  // [N, R, Hq, D] T, dense
  float* part_o;              // [N, R, Hq, max_splits, D] fp32 (unused when max_splits == 1)
  float* part_lse;            // [N, R, Hq, max_splits] fp32, base-2 log-sum-exp
  float scale_log2;           // softmax scale * log2(e)
  int64_t page_table_stride;  // elements between page_table rows
  FastDiv page_div;           // divides by page_size
  int N, R, Hq, Hkv, D;
  int page_size, max_pages;   // max_pages: page_table columns
  int heads_per_block;        // q heads per block (divides Hq / Hkv; times R <= kMaxBlockRows)
  int max_splits;             // splits per request in the grid (>= 1)
};

struct KVAppendParams {
  const void* k;              // [N * R, Hkv, D] T, rows k_row_stride apart, inner dims dense
  const void* v;              // [N * R, Hkv, D] T, rows v_row_stride apart
  void* k_cache;              // [P, page_size, Hkv, D] T, dense
  void* v_cache;              // [P, page_size, Hkv, D] T, dense
  const int32_t* page_table;  // [N, max_pages]
  const int32_t* kv_lens;     // [N], as for the attention
  int64_t k_row_stride, v_row_stride, page_table_stride;
  FastDiv page_div;           // divides by page_size
  int N, R, Hkv, D, page_size, max_pages;
};

// The positions of request n that exist: kv_lens[n], capped at what its page table row can
// address (a caller breaking the contract gets a wrong answer, never a stray read).
DS_HOST_DEVICE int usable_len(int kv_len, int page_size, int max_pages) {
  const int64_t cap = int64_t(page_size) * max_pages;
  return static_cast<int>(kv_len < 0 ? 0 : (kv_len > cap ? cap : kv_len));
}

// Request split size (positions, a multiple of kTile, >= kMinSplit) and split count for `len`
// positions and at most `max_splits` splits (count <= max_splits: the workspace's size). The
// kernel and the merge both call this.
struct Split {
  int tokens, count;
};
DS_HOST_DEVICE Split split_plan(int len, int max_splits) {
  int64_t per = ceil_div(len, max_splits);
  per = ceil_div(per, kTile) * kTile;
  if (per < kMinSplit) per = kMinSplit;
  return Split{static_cast<int>(per), static_cast<int>(ceil_div(len, per))};
}

DS_DEVICE float neg_inf() { return __uint_as_float(0xff800000u); }

// One 16-byte word of a K or V row.
using Word16 = uint4;
DS_DEVICE Word16 load16(const void* p) { return *static_cast<const uint4*>(p); }
DS_DEVICE void store16(void* p, const Word16& w) { *static_cast<uint4*>(p) = w; }

// T a 16-bit float type (bf16 / f16); D 64, 128 or 256. The block's q rows (qr = local head * R
// + r, at most kMaxBlockRows, padded with zero rows to 16) are the M = 16 of warp-level
// 16 x 8 x 16 MMAs (mma_16816: tensor cores), so 4 rows (decode, GQA 4) and 16 (verify R = 4)
// cost the same math and read each K/V position once for all of them.
// Per tile of kTile positions:
//   scores: warp w computes S[16 rows][8 positions 8w ..] over all of D (D / 16 MMAs);
//   softmax: the tile's row max through shared memory, so every warp rescales with the same
//     running max; P = 2^(S - m) rounded to T goes to shared memory, and each warp keeps its
//     own part of the row sums (the sum of its positions' rounded P: the weights used);
//   values: warp w computes O[16 rows][D / 4 columns w ..] += P[16][kTile] V[kTile][cols].
// K/V rows sit in shared memory 16 bytes over D (so the 8 rows one fragment load touches start 4
// banks apart: no conflicts). The next tile's K/V words are loaded into registers while this
// tile is computed, and the page ids of the tile after it before that (so the K/V loads never
// wait on a page-table read).
// The Q, K, P and V fragments come through load_matrix_x4: with kLdsm as ldmatrix (sm_75+: one
// instruction for four registers a lane, where a V fragment pair took 8 16-bit loads and 4
// packs), else as direct loads of the same registers, so the same bits either way;
// DS_ATTN_LDMATRIX=1 picks kLdsm (A/B runs: not yet timed).
template <typename T, int D, bool kLdsm>
__global__ void DS_LAUNCH_BOUNDS_MIN_BLOCKS(kThreads, blocks_per_sm(D))
    paged_attn_kernel(const PagedAttnParams p) {
  static_assert(sizeof(T) == 2, "16-bit KV only");
  static_assert(kTile == 8 * kWarps && kTile % 16 == 0, "one n8 tile of scores per warp");
  constexpr int kChunk = 8;                      // elements per 16-byte word
  constexpr int kRowWords = D / kChunk;          // 16-byte words per K/V row
  constexpr int kLoads = kTile * kRowWords / kThreads;  // words per thread per tile, K and V each
  constexpr int kPitch = D + kChunk;             // shared row pitch (elements)
  constexpr int kCols = D / kWarps;              // output columns per warp
  constexpr int kNT = kCols / 8;                 // n8 tiles of output per warp
  constexpr int kM = kMaxBlockRows;
  static_assert(kM == 16, "the MMA's M");
  static_assert(kLoads * kThreads == kTile * kRowWords, "whole tiles per block");
  static_assert(kThreads % kRowWords == 0, "a thread's loads are whole rows apart");
  static_assert(kNT % 2 == 0 && D % 32 == 0, "load_matrix_x4 covers two n-tiles, 32 of D");
  __shared__ __align__(16) T q_s[kM][kPitch];
  __shared__ __align__(16) T k_s[kTile][kPitch];
  __shared__ __align__(16) T v_s[kTile][kPitch];
  __shared__ __align__(16) T p_s[kM][kTile + kChunk];
  __shared__ float red_s[kWarps][kM];

  grid_dependency_wait();  // q and the appended K/V rows come from the kernels before
  const int split = blockIdx.x, n = blockIdx.z;
  const int R = p.R;
  const int len = usable_len(p.kv_lens[n], p.page_size, p.max_pages);
  const Split plan = split_plan(len, p.max_splits);
  if (split >= plan.count) return;  // the whole block leaves before any barrier
  const int t_begin = split * plan.tokens;
  const int t_end = min(len, t_begin + plan.tokens);
  const int rows = p.heads_per_block * R;
  const int h0 = blockIdx.y * p.heads_per_block;
  const int kvh = h0 / (p.Hq / p.Hkv);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int g = lane / 4, t = lane % 4;  // the MMA fragments' row group and column pair

  const T* q = static_cast<const T*>(p.q);
  for (int i = threadIdx.x; i < kM * kRowWords; i += kThreads) {
    const int qr = i / kRowWords, c = i % kRowWords;
    const int64_t src = ((int64_t(n) * R + qr % R) * p.Hq + h0 + qr / R) * D + c * kChunk;
    store16(&q_s[qr][c * kChunk], qr < rows ? load16(q + src) : Word16{0u, 0u, 0u, 0u});
  }

  const int32_t* table = p.page_table + int64_t(n) * p.page_table_stride;
  // A thread loads the same 16-byte column of kLoads K/V rows a tile, rows kStep apart. A
  // position past the split reads the split's last position instead of zeros: its score is
  // masked to -inf, so its P is 0 and any finite V adds nothing. No branch, and the offsets are
  // 32-bit up to one widening multiply a load (ncu, session 47: the 64-bit arithmetic and
  // zero-fill branches were half the instructions of the loop, which is issue bound).
  constexpr int kStep = kThreads / kRowWords;  // rows between a thread's loads
  const int row0 = static_cast<int>(threadIdx.x) / kRowWords;
  const int lane_col = (static_cast<int>(threadIdx.x) % kRowWords) * kChunk;  // of a K/V row
  const int col = kvh * D + lane_col;
  const T* const kc = static_cast<const T*>(p.k_cache) + col;
  const T* const vc = static_cast<const T*>(p.v_cache) + col;
  const int kv_row = p.Hkv * D;  // elements per position of the pool
  const int pos_last = t_end - 1;
  Word16 kw[kLoads], vw[kLoads];
  int pid[kLoads];  // page ids of the positions the next load_tile reads
  const auto load_ids = [&](int t0) {
#pragma unroll
    for (int i = 0; i < kLoads; ++i)
      pid[i] = table[p.page_div.div(min(t0 + row0 + i * kStep, pos_last))];
  };
  const auto load_tile = [&](int t0) {
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int pos = min(t0 + row0 + i * kStep, pos_last);
      const int slot = pid[i] * p.page_size + p.page_div.mod(pos);  // row of the pool
      const int64_t off = static_cast<int64_t>(slot) * kv_row;
      kw[i] = load16(kc + off);
      vw[i] = load16(vc + off);
    }
  };

  // this lane's rows g (h = 0) and g + 8 (h = 1): running max, its warp's part of the sum, the
  // last position each may see (kv_len - R + r: the caller guarantees kv_len >= R; -1 for a
  // padding row)
  float m[2], l[2], o[kNT][4];
  int last[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int qr = g + 8 * h;
    m[h] = neg_inf();
    l[h] = 0.f;
    last[h] = qr < rows ? min(t_end - 1, p.kv_lens[n] - R + qr % R) : -1;
  }
#pragma unroll
  for (int j = 0; j < kNT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[j][e] = 0.f;

  load_ids(t_begin);
  load_tile(t_begin);
  load_ids(t_begin + kTile);
  for (int t0 = t_begin; t0 < t_end; t0 += kTile) {
    __syncthreads();  // every warp is done with the previous tile (and q_s is written)
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      store16(&k_s[row0 + i * kStep][lane_col], kw[i]);
      store16(&v_s[row0 + i * kStep][lane_col], vw[i]);
    }
    __syncthreads();
    if (t0 + kTile < t_end) {  // in flight during this tile's math
      load_tile(t0 + kTile);
      load_ids(t0 + 2 * kTile);
    }

    float s[4] = {0.f, 0.f, 0.f, 0.f};  // S[g][8w + 2t + {0, 1}], S[g + 8][...]
#pragma unroll 2
    for (int kk = 0; kk < D; kk += 32) {  // K rows 8w .. 8w + 7 over 32 of D: two MMAs' B
      uint32_t a0[4], a1[4], bk[4];
      load_matrix_x4<false, Mat4::kQuarters, kLdsm>(a0, &q_s[0][kk], kPitch);
      load_matrix_x4<false, Mat4::kQuarters, kLdsm>(a1, &q_s[0][kk + 16], kPitch);
      load_matrix_x4<false, Mat4::kRow, kLdsm>(bk, &k_s[8 * warp][kk], kPitch);
      mma_16816<T>(s, a0, {bk[0], bk[1]});
      mma_16816<T>(s, a1, {bk[2], bk[3]});
    }
    const int pos0 = t0 + 8 * warp + 2 * t;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int e = 0; e < 2; ++e)
        s[2 * h + e] = pos0 + e <= last[h] ? fmul(s[2 * h + e], p.scale_log2) : neg_inf();
      float mx = fmaxf(s[2 * h], s[2 * h + 1]);
      mx = fmaxf(mx, shfl_xor(mx, 1));
      mx = fmaxf(mx, shfl_xor(mx, 2));  // the quad: this warp's 8 positions of the row
      if (t == 0) red_s[warp][g + 8 * h] = mx;
    }
    __syncthreads();  // the warps' row maxima
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = g + 8 * h;
      float m_new = m[h];
#pragma unroll
      for (int w = 0; w < kWarps; ++w) m_new = fmaxf(m_new, red_s[w][row]);
      // a row that has seen nothing yet keeps m = -inf: no (-inf) - (-inf)
      alpha[h] = m_new == neg_inf() ? 1.f : exp2f(m[h] - m_new);
      const T p0 = from_float<T>(m_new == neg_inf() ? 0.f : exp2f(s[2 * h] - m_new));
      const T p1 = from_float<T>(m_new == neg_inf() ? 0.f : exp2f(s[2 * h + 1] - m_new));
      store_pair(&p_s[row][8 * warp + 2 * t], pack2(p0, p1));
      l[h] = ffma(l[h], alpha[h], group_sum<4>(fadd(to_float(p0), to_float(p1))));
      m[h] = m_new;
    }
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
      o[j][0] = fmul(o[j][0], alpha[0]);
      o[j][1] = fmul(o[j][1], alpha[0]);
      o[j][2] = fmul(o[j][2], alpha[1]);
      o[j][3] = fmul(o[j][3], alpha[1]);
    }
    __syncthreads();  // p_s is read by every warp

#pragma unroll
    for (int ks = 0; ks < kTile; ks += 16) {
      uint32_t a[4];
      load_matrix_x4<false, Mat4::kQuarters, kLdsm>(a, &p_s[0][ks], kTile + kChunk);
#pragma unroll
      for (int j = 0; j < kNT; j += 2) {  // V rows ks .. ks + 15 of n-tiles j, j + 1
        uint32_t bv[4];
        load_matrix_x4<true, Mat4::kQuarters, kLdsm>(bv, &v_s[ks][warp * kCols + 8 * j], kPitch);
        mma_16816<T>(o[j], a, {bv[0], bv[1]});
        mma_16816<T>(o[j + 1], a, {bv[2], bv[3]});
      }
    }
  }
  launch_dependents();  // the merge may start launching; it waits for this grid's writes

  // the row sums: the warps' parts (red_s's last readers passed the loop's last barrier)
  if (t == 0) {
    red_s[warp][g] = l[0];
    red_s[warp][g + 8] = l[1];
  }
  __syncthreads();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int qr = g + 8 * h;
    if (qr >= rows) continue;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum = fadd(sum, red_s[w][qr]);
    const int64_t row = (int64_t(n) * R + qr % R) * p.Hq + h0 + qr / R;
    const float inv = sum > 0.f ? fdiv(1.f, sum) : 0.f;
    if (plan.count == 1) {
      T* out = static_cast<T*>(p.out) + row * D + warp * kCols + 2 * t;
#pragma unroll
      for (int j = 0; j < kNT; ++j)
        store_pair(out + 8 * j, pack2(from_float<T>(fmul(o[j][2 * h], inv)),
                                      from_float<T>(fmul(o[j][2 * h + 1], inv))));
    } else {
      const int64_t part = row * p.max_splits + split;
      float* out = p.part_o + part * D + warp * kCols + 2 * t;
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
        const float pair[2] = {fmul(o[j][2 * h], inv), fmul(o[j][2 * h + 1], inv)};
        store_vec<float, 2>(out + 8 * j, pair);
      }
      if (warp == 0 && t == 0) p.part_lse[part] = sum > 0.f ? fadd(m[h], log2f(sum)) : neg_inf();
    }
  }
}

// Merge blocks: one per (output row, kMergeThreads / Groups * kMergeVec columns). With M the
// largest of the row's split log-sum-exps and w_s = 2^(lse_s - M), out = sum_s w_s part_s /
// sum_s w_s. Every warp finds M itself (its lanes read the log-sum-exps 32 apart, then a
// butterfly: no barrier); thread (group, column word) then adds w_s part_s over splits group,
// group + Groups, ...: loads that depend on nothing before them, so a thread has all of its
// count / Groups in flight at once. (An online-softmax fold chains each split's rescale
// through the last one: at B = 1, 32k, ~200 splits took ~9 us.) The groups' sums fold through
// shared memory, the one barrier. Requests with one split are skipped (the attention kernel
// wrote them). Groups follows the grid's split count (merge_groups): 32 groups over 32
// columns when there are many splits; with 4 splits, 28 of those 32 groups would have nothing
// to do, in 8x the blocks needed, so fewer groups then cover more columns a block.
constexpr int kMergeVec = 4;        // columns per thread (float4)
constexpr int kMergeThreads = 256;  // a block
constexpr int kMergeMaxGroups = 32;

template <int Groups>
constexpr int kMergeCols = kMergeThreads / Groups * kMergeVec;  // columns a block

// The fewest thread groups (a power of two, 4..32) that still take every split of a
// max_splits grid at once, and no fewer than a D-column row allows (kMergeCols <= D).
inline int merge_groups(int max_splits, int D) {
  int g = 4;
  while (g < kMergeMaxGroups && (g < max_splits || kMergeThreads / g * kMergeVec > D)) g *= 2;
  return g;
}

template <typename T, int Groups>
__global__ void __launch_bounds__(kMergeThreads) merge_kernel(const PagedAttnParams p) {
  constexpr int kColThreads = kMergeThreads / Groups, kCols = kMergeCols<Groups>;
  __shared__ __align__(16) float o_s[Groups][kCols];
  __shared__ float w_s[Groups];
  grid_dependency_wait();  // the partial outputs of the attention kernel before
  const int chunks = p.D / kCols;
  const int64_t row = blockIdx.x / chunks;
  const int col0 = static_cast<int>(blockIdx.x % chunks) * kCols;
  const int n = static_cast<int>(row / (int64_t(p.R) * p.Hq));
  const int len = usable_len(p.kv_lens[n], p.page_size, p.max_pages);
  const int count = split_plan(len, p.max_splits).count;
  if (count <= 1) return;  // the whole block: count is the request's
  const float* lse = p.part_lse + row * p.max_splits;
  const int tid = threadIdx.x;
  float mx = neg_inf();
  for (int s = tid % kWarp; s < count; s += kWarp) mx = fmaxf(mx, lse[s]);
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) mx = fmaxf(mx, shfl_xor(mx, off));
  const int cw = tid % kColThreads, grp = tid / kColThreads;
  const float* part = p.part_o + row * p.max_splits * p.D + col0 + cw * kMergeVec;
  float acc[kMergeVec] = {0.f, 0.f, 0.f, 0.f};
  float wsum = 0.f;
#pragma unroll 4
  for (int s = grp; s < count; s += Groups) {
    const float ls = lse[s];
    const float4 v = *reinterpret_cast<const float4*>(part + int64_t(s) * p.D);
    // a split whose positions this row sees none of has lse -inf: weight 0
    const float w = ls == neg_inf() ? 0.f : exp2f(ls - mx);
    wsum = fadd(wsum, w);
    acc[0] = ffma(w, v.x, acc[0]);
    acc[1] = ffma(w, v.y, acc[1]);
    acc[2] = ffma(w, v.z, acc[2]);
    acc[3] = ffma(w, v.w, acc[3]);
  }
#pragma unroll
  for (int e = 0; e < kMergeVec; ++e) o_s[grp][cw * kMergeVec + e] = acc[e];
  if (cw == 0) w_s[grp] = wsum;
  __syncthreads();
  if (tid >= kCols) return;
  float sum = 0.f, total = 0.f;
#pragma unroll 8
  for (int g = 0; g < Groups; ++g) {
    sum = fadd(sum, o_s[g][tid]);
    total = fadd(total, w_s[g]);
  }
  static_cast<T*>(p.out)[row * p.D + col0 + tid] =
      from_float<T>(total > 0.f ? fdiv(sum, total) : 0.f);
}

template <typename T, int Groups>
inline ds_error_t launch_merge(const PagedAttnParams& p, ds_stream_t stream) {
  return launch(merge_kernel<T, Groups>, int64_t(p.N) * p.R * p.Hq * (p.D / kMergeCols<Groups>),
                kMergeThreads, stream, Pdl::kOn, p);
}

// One thread per 16-byte word of the new rows' K and V.
template <typename T>
__global__ void __launch_bounds__(kThreads) kv_append_kernel(const KVAppendParams p) {
  grid_dependency_wait();  // k and v come from the kernel before
  const int words = p.D / 8;
  const int64_t idx = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (idx >= int64_t(p.N) * p.R * p.Hkv * words) return;
  const int c = static_cast<int>(idx % words);
  const int h = static_cast<int>(idx / words % p.Hkv);
  const int64_t row = idx / words / p.Hkv;
  const int n = static_cast<int>(row / p.R), r = static_cast<int>(row % p.R);
  const int pos = p.kv_lens[n] - p.R + r;
  const int page_idx = p.page_div.div(pos < 0 ? 0 : pos);
  if (pos < 0 || page_idx >= p.max_pages) return;  // outside the contract: write nothing
  const int64_t page = p.page_table[int64_t(n) * p.page_table_stride + page_idx];
  const int64_t dst = ((page * p.page_size + (pos - page_idx * p.page_size)) * p.Hkv + h) * p.D +
                      c * 8;
  const int64_t src = h * int64_t(p.D) + c * 8;
  store16(static_cast<T*>(p.k_cache) + dst,
          load16(static_cast<const T*>(p.k) + row * p.k_row_stride + src));
  store16(static_cast<T*>(p.v_cache) + dst,
          load16(static_cast<const T*>(p.v) + row * p.v_row_stride + src));
}

// Largest divisor of Hq / Hkv whose rows (times R) fit one block.
inline int heads_per_block(int Hq, int Hkv, int R) {
  const int group = Hkv > 0 ? Hq / Hkv : 1;
  int best = 1;
  for (int g = 1; g <= group; ++g)
    if (group % g == 0 && g * R <= kMaxBlockRows) best = g;
  return best;
}

// Splits per request in the grid: as many as keep the whole batch within one resident wave
// (blocks_per_sm(D) blocks per multiprocessor), at least 1, and no more than a request of
// max_kv_len positions can use (kMinSplit each).
inline ds_error_t max_splits_for(int N, int R, int Hq, int heads_block, int D, int64_t max_kv_len,
                                 int* out) {
  int sms = 0;
  const ds_error_t err = multiprocessor_count(&sms);
  if (err != DS_SUCCESS) return err;
  (void)R;  // every block is one 16-row MMA tile, whatever R
  const int64_t blocks = int64_t(N) * (Hq / heads_block);
  static const int env_per_sm = [] {
    const char* e = std::getenv("DS_ATTN_BLOCKS_PER_SM");
    const int v = e != nullptr ? atoi(e) : 0;
    return v >= 1 && v <= 64 ? v : 0;
  }();
  const int per_sm = env_per_sm > 0 ? env_per_sm : blocks_per_sm(D);
  int64_t want = int64_t(per_sm) * sms / (blocks > 0 ? blocks : 1);
  const int64_t most = ceil_div(max_kv_len > 1 ? max_kv_len : 1, kMinSplit);
  *out = static_cast<int>(want < 1 ? 1 : (want > most ? most : want));
  return DS_SUCCESS;
}

template <typename T, int D>
inline ds_error_t launch_paged_attention_d(const PagedAttnParams& p, ds_stream_t stream) {
  const dim3 grid(p.max_splits, p.Hq / p.heads_per_block, p.N);
  // both with PDL: at a small batch the launch gaps, not the bytes, are most of the time
  const char* ldsm = std::getenv("DS_ATTN_LDMATRIX");  // read per launch: A/B runs, tests
  const ds_error_t err =
      ldsm != nullptr && ldsm[0] == '1'
          ? launch(paged_attn_kernel<T, D, true>, grid, kThreads, stream, Pdl::kOn, p)
          : launch(paged_attn_kernel<T, D, false>, grid, kThreads, stream, Pdl::kOn, p);
  if (err != DS_SUCCESS || p.max_splits == 1) return err;
  switch (merge_groups(p.max_splits, D)) {
    case 4: return launch_merge<T, 4>(p, stream);
    case 8: return launch_merge<T, 8>(p, stream);
    case 16: return launch_merge<T, 16>(p, stream);
    default: return launch_merge<T, kMergeMaxGroups>(p, stream);
  }
}

// The attention of every row, then (max_splits > 1) the merge. p.heads_per_block and
// p.max_splits come from heads_per_block / max_splits_for; D is 64, 128 or 256.
template <typename T>
inline ds_error_t launch_paged_attention(const PagedAttnParams& p, ds_stream_t stream) {
  if (p.heads_per_block * p.R > kMaxBlockRows || p.heads_per_block < 1 || p.max_splits < 1)
    return DS_ERROR_INVALID_VALUE;
  if (p.D == 64) return launch_paged_attention_d<T, 64>(p, stream);
  if (p.D == 128) return launch_paged_attention_d<T, 128>(p, stream);
  if (p.D == 256) return launch_paged_attention_d<T, 256>(p, stream);
  return DS_ERROR_INVALID_VALUE;
}

template <typename T>
inline ds_error_t launch_kv_append(const KVAppendParams& p, ds_stream_t stream) {
  if (p.D % 8 != 0) return DS_ERROR_INVALID_VALUE;
  const int64_t words = int64_t(p.N) * p.R * p.Hkv * (p.D / 8);
  return launch(kv_append_kernel<T>, ceil_div(words, kThreads), kThreads, stream, Pdl::kOn, p);
}

}  // namespace attn
}  // namespace ds
