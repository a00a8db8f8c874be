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

#include <cstring>

#include "compat.cuh"

namespace ds {
namespace attn {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / kWarp;
constexpr int kTile = 32;  // positions staged at a time: 8 per warp in the score phase
constexpr int kMaxBlockRows = 16;  // q rows (heads x rows) one block holds: the MMA's M
constexpr int kMinSplit = kTile;   // the smallest split (positions) by default (min_split)
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
  int stages;                 // 0: paged_attn_kernel; 2..4: paged_attn_staged_kernel's ring
  int min_split;              // the smallest split (positions; a multiple of kTile)
  int num_pages;              // P: pages in the pool
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

// Request split size (positions, a multiple of kTile, >= min_split) and split count for `len`
// positions and at most `max_splits` splits (count <= max_splits: the workspace's size). The
// kernel and the merge both call this.
struct Split {
  int tokens, count;
};
DS_HOST_DEVICE Split split_plan(int len, int max_splits, int min_split) {
  int64_t per = ceil_div(len, max_splits);
  per = ceil_div(per, kTile) * kTile;
  if (per < min_split) per = min_split;
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
// Per tile of kTile positions (Rows::tile):
//   scores: warp w computes S[16 rows][8 positions 8w ..] over all of D (D / 16 MMAs);
//   softmax: the tile's row max through shared memory, so every warp rescales with the same
//     running max; P = 2^(S - m) rounded to T goes to shared memory, and each warp keeps its
//     own part of the row sums (the sum of its positions' rounded P: the weights used);
//   values: warp w computes O[16 rows][D / 4 columns w ..] += P[16][kTile] V[kTile][cols].
// K/V rows sit in shared memory 16 bytes over D (so the 8 rows one fragment load touches start 4
// banks apart: no conflicts). Two kernels feed the tiles: paged_attn_kernel loads the next
// tile's K/V words into registers while this one is computed (static shared memory: every
// target); paged_attn_staged_kernel (attention_staged.cuh) keeps Stages tiles in a ring in
// shared memory, filled by asynchronous copies Stages - 1 tiles ahead.
constexpr int kChunk = 8;                    // 16-bit elements per 16-byte word
constexpr int kPPitch = kTile + kChunk;      // P's shared row pitch (elements)

// One 16-row block's online softmax over tiles, this thread's part: rows g and g + 8 of the
// MMA fragments (g = lane / 4), their running max m, this warp's part of their sums l, and the
// output columns O of this warp. Shared buffers: q_s [16][Pitch], p_s [16][kPPitch], red_s
// [kWarps][16] floats; a tile's K and V [kTile][Pitch] each.
template <typename T, int D>
struct Rows {
  static constexpr int Pitch = D + kChunk;  // shared K/V/q row pitch (elements)
  static constexpr int Cols = D / kWarps;   // output columns per warp
  static constexpr int NT = Cols / 8;       // n8 tiles of output per warp
  float m[2], l[2], o[NT][4];
  int last[2];  // the last position each row may see (kv_len - R + r; -1 for a padding row)

  DS_DEVICE void init(int rows, int R, int t_end, int kv_len) {
    const int g = threadIdx.x % kWarp / 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int qr = g + 8 * h;
      m[h] = neg_inf();
      l[h] = 0.f;
      last[h] = qr < rows ? min(t_end - 1, kv_len - R + qr % R) : -1;
    }
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[j][e] = 0.f;
  }

  // Positions t0 .. t0 + kTile - 1, staged in k_s / v_s (masked past `last`: their K/V must
  // be finite, the masked value is multiplied by 0). Two barriers; the caller's barrier
  // before the next tile keeps p_s and the K/V buffers from being overwritten while in use.
  DS_DEVICE void tile(const T* q_s, const T* k_s, const T* v_s, T* p_s, float* red_s, int t0,
                      float scale_log2) {
    const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
    const int g = lane / 4, t = lane % 4;
    float s[4] = {0.f, 0.f, 0.f, 0.f};  // S[g][8w + 2t + {0, 1}], S[g + 8][...]
    const T* kr = k_s + (8 * warp + g) * Pitch;  // the K row of this lane's B fragment
#pragma unroll 4
    for (int kk = 0; kk < D; kk += 16) {
      const uint32_t a[4] = {load_pair(q_s + g * Pitch + kk + 2 * t),
                             load_pair(q_s + (g + 8) * Pitch + kk + 2 * t),
                             load_pair(q_s + g * Pitch + kk + 2 * t + 8),
                             load_pair(q_s + (g + 8) * Pitch + kk + 2 * t + 8)};
      const uint32_t b[2] = {load_pair(kr + kk + 2 * t), load_pair(kr + kk + 2 * t + 8)};
      mma_16816<T>(s, a, b);
    }
    const int pos0 = t0 + 8 * warp + 2 * t;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int e = 0; e < 2; ++e)
        s[2 * h + e] = pos0 + e <= last[h] ? fmul(s[2 * h + e], scale_log2) : neg_inf();
      float mx = fmaxf(s[2 * h], s[2 * h + 1]);
      mx = fmaxf(mx, shfl_xor(mx, 1));
      mx = fmaxf(mx, shfl_xor(mx, 2));  // the quad: this warp's 8 positions of the row
      if (t == 0) red_s[warp * kMaxBlockRows + g + 8 * h] = mx;
    }
    __syncthreads();  // the warps' row maxima
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = g + 8 * h;
      float m_new = m[h];
#pragma unroll
      for (int w = 0; w < kWarps; ++w) m_new = fmaxf(m_new, red_s[w * kMaxBlockRows + row]);
      // a row that has seen nothing yet keeps m = -inf: no (-inf) - (-inf)
      alpha[h] = m_new == neg_inf() ? 1.f : exp2f(m[h] - m_new);
      const T p0 = from_float<T>(m_new == neg_inf() ? 0.f : exp2f(s[2 * h] - m_new));
      const T p1 = from_float<T>(m_new == neg_inf() ? 0.f : exp2f(s[2 * h + 1] - m_new));
      store_pair(p_s + row * kPPitch + 8 * warp + 2 * t, pack2(p0, p1));
      l[h] = ffma(l[h], alpha[h], group_sum<4>(fadd(to_float(p0), to_float(p1))));
      m[h] = m_new;
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      o[j][0] = fmul(o[j][0], alpha[0]);
      o[j][1] = fmul(o[j][1], alpha[0]);
      o[j][2] = fmul(o[j][2], alpha[1]);
      o[j][3] = fmul(o[j][3], alpha[1]);
    }
    __syncthreads();  // p_s is read by every warp

#pragma unroll
    for (int ks = 0; ks < kTile; ks += 16) {
      const uint32_t a[4] = {load_pair(p_s + g * kPPitch + ks + 2 * t),
                             load_pair(p_s + (g + 8) * kPPitch + ks + 2 * t),
                             load_pair(p_s + g * kPPitch + ks + 2 * t + 8),
                             load_pair(p_s + (g + 8) * kPPitch + ks + 2 * t + 8)};
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const T* vc = v_s + warp * Cols + 8 * j + g;  // V column of this lane's B fragment
        const uint32_t b[2] = {pack2(vc[(ks + 2 * t) * Pitch], vc[(ks + 2 * t + 1) * Pitch]),
                               pack2(vc[(ks + 2 * t + 8) * Pitch], vc[(ks + 2 * t + 9) * Pitch])};
        mma_16816<T>(o[j], a, b);
      }
    }
  }

  // The block's rows: the output (one split) or the split's normalised part and its base-2
  // log-sum-exp (several). red_s's last readers passed the last tile's second barrier.
  DS_DEVICE void finish(const PagedAttnParams& p, float* red_s, int n, int h0, int rows,
                        int split, int count) {
    const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
    const int g = lane / 4, t = lane % 4, R = p.R;
    if (t == 0) {
      red_s[warp * kMaxBlockRows + g] = l[0];
      red_s[warp * kMaxBlockRows + g + 8] = l[1];
    }
    __syncthreads();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int qr = g + 8 * h;
      if (qr >= rows) continue;
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sum = fadd(sum, red_s[w * kMaxBlockRows + qr]);
      const int64_t row = (int64_t(n) * R + qr % R) * p.Hq + h0 + qr / R;
      const float inv = sum > 0.f ? fdiv(1.f, sum) : 0.f;
      if (count == 1) {
        T* out = static_cast<T*>(p.out) + row * D + warp * Cols + 2 * t;
#pragma unroll
        for (int j = 0; j < NT; ++j)
          store_pair(out + 8 * j, pack2(from_float<T>(fmul(o[j][2 * h], inv)),
                                        from_float<T>(fmul(o[j][2 * h + 1], inv))));
      } else {
        const int64_t part = row * p.max_splits + split;
        float* out = p.part_o + part * D + warp * Cols + 2 * t;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const float pair[2] = {fmul(o[j][2 * h], inv), fmul(o[j][2 * h + 1], inv)};
          store_vec<float, 2>(out + 8 * j, pair);
        }
        if (warp == 0 && t == 0)
          p.part_lse[part] = sum > 0.f ? fadd(m[h], log2f(sum)) : neg_inf();
      }
    }
  }
};

// What a block attends: request n's positions [t_begin, t_end) of one split, q heads h0 ..
// h0 + heads_per_block - 1 (kv head kvh), `rows` q rows. `active` false: a block past the
// request's last split (it leaves before any barrier).
struct BlockWork {
  int n, split, count, len, t_begin, t_end, rows, h0, kvh;
  bool active;
};
DS_DEVICE BlockWork block_work(const PagedAttnParams& p) {
  BlockWork w;
  w.split = blockIdx.x;
  w.n = blockIdx.z;
  w.len = usable_len(p.kv_lens[w.n], p.page_size, p.max_pages);
  const Split plan = split_plan(w.len, p.max_splits, p.min_split);
  w.count = plan.count;
  w.active = w.split < plan.count;
  w.t_begin = w.split * plan.tokens;
  w.t_end = min(w.len, w.t_begin + plan.tokens);
  w.rows = p.heads_per_block * p.R;
  w.h0 = blockIdx.y * p.heads_per_block;
  w.kvh = w.h0 / (p.Hq / p.Hkv);
  return w;
}

// The block's q rows into q_s [16][Pitch], zero rows past `rows`.
template <typename T, int D>
DS_DEVICE void load_q(const PagedAttnParams& p, const BlockWork& w, T* q_s) {
  constexpr int kRowWords = D / kChunk;
  const T* q = static_cast<const T*>(p.q);
  for (int i = threadIdx.x; i < kMaxBlockRows * kRowWords; i += kThreads) {
    const int qr = i / kRowWords, c = i % kRowWords;
    const int64_t src = ((int64_t(w.n) * p.R + qr % p.R) * p.Hq + w.h0 + qr / p.R) * D + c * kChunk;
    store16(q_s + qr * Rows<T, D>::Pitch + c * kChunk,
            qr < w.rows ? load16(q + src) : Word16{0u, 0u, 0u, 0u});
  }
}

// Element offset of position `pos` (page id `page`), kv head kvh, column word c in the cache.
DS_DEVICE int64_t kv_offset(const PagedAttnParams& p, int page, int pos, int kvh, int D, int c) {
  const int page_idx = p.page_div.div(pos);
  return ((int64_t(page) * p.page_size + (pos - page_idx * p.page_size)) * p.Hkv + kvh) * D +
         c * kChunk;
}

// The next tile's K/V words are loaded into registers while this tile is computed, and the
// page ids of the tile after it before that (so the K/V loads never wait on a page-table read).
template <typename T, int D>
__global__ void DS_LAUNCH_BOUNDS_MIN_BLOCKS(kThreads, blocks_per_sm(D))
    paged_attn_kernel(const PagedAttnParams p) {
  static_assert(sizeof(T) == 2, "16-bit KV only");
  static_assert(kTile == 8 * kWarps && kTile % 16 == 0, "one n8 tile of scores per warp");
  using RowsT = Rows<T, D>;
  constexpr int kRowWords = D / kChunk;                 // 16-byte words per K/V row
  constexpr int kLoads = kTile * kRowWords / kThreads;  // words per thread per tile, K and V each
  constexpr int kPitch = RowsT::Pitch;
  static_assert(kMaxBlockRows == 16, "the MMA's M");
  static_assert(kLoads * kThreads == kTile * kRowWords, "whole tiles per block");
  __shared__ __align__(16) T q_s[kMaxBlockRows * kPitch];
  __shared__ __align__(16) T k_s[kTile * kPitch];
  __shared__ __align__(16) T v_s[kTile * kPitch];
  __shared__ __align__(16) T p_s[kMaxBlockRows * kPPitch];
  __shared__ float red_s[kWarps * kMaxBlockRows];

  grid_dependency_wait();  // q and the appended K/V rows come from the kernels before
  const BlockWork w = block_work(p);
  if (!w.active) return;  // the whole block leaves before any barrier
  const int t_begin = w.t_begin, t_end = w.t_end;
  load_q<T, D>(p, w, q_s);

  const int32_t* table = p.page_table + int64_t(w.n) * p.page_table_stride;
  const T* kc = static_cast<const T*>(p.k_cache);
  const T* vc = static_cast<const T*>(p.v_cache);
  Word16 kw[kLoads], vw[kLoads];
  int pid[kLoads];  // page ids of the positions the next load_tile reads
  const auto load_ids = [&](int t0) {
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int pos = t0 + (threadIdx.x + i * kThreads) / kRowWords;
      pid[i] = pos < t_end ? table[p.page_div.div(pos)] : 0;
    }
  };
  const auto load_tile = [&](int t0) {
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int idx = threadIdx.x + i * kThreads;
      const int pos = t0 + idx / kRowWords;
      if (pos < t_end) {
        const int64_t off = kv_offset(p, pid[i], pos, w.kvh, D, idx % kRowWords);
        kw[i] = load16(kc + off);
        vw[i] = load16(vc + off);
      } else {  // finite zeros: a masked position's value is multiplied by 0
        kw[i] = vw[i] = Word16{0u, 0u, 0u, 0u};
      }
    }
  };

  RowsT rs;
  rs.init(w.rows, p.R, t_end, p.kv_lens[w.n]);
  load_ids(t_begin);
  load_tile(t_begin);
  load_ids(t_begin + kTile);
  for (int t0 = t_begin; t0 < t_end; t0 += kTile) {
    __syncthreads();  // every warp is done with the previous tile (and q_s is written)
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int idx = threadIdx.x + i * kThreads;
      store16(k_s + (idx / kRowWords) * kPitch + (idx % kRowWords) * kChunk, kw[i]);
      store16(v_s + (idx / kRowWords) * kPitch + (idx % kRowWords) * kChunk, vw[i]);
    }
    __syncthreads();
    if (t0 + kTile < t_end) {  // in flight during this tile's math
      load_tile(t0 + kTile);
      load_ids(t0 + 2 * kTile);
    }
    rs.tile(q_s, k_s, v_s, p_s, red_s, t0, p.scale_log2);
  }
  launch_dependents();  // the merge may start launching; it waits for this grid's writes
  rs.finish(p, red_s, w.n, w.h0, w.rows, w.split, w.count);
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
  launch_dependents();     // a short grid: the next kernel may start its prologue now
  const int chunks = p.D / kCols;
  const int64_t row = blockIdx.x / chunks;
  const int col0 = static_cast<int>(blockIdx.x % chunks) * kCols;
  const int n = static_cast<int>(row / (int64_t(p.R) * p.Hq));
  const int len = usable_len(p.kv_lens[n], p.page_size, p.max_pages);
  const int count = split_plan(len, p.max_splits, p.min_split).count;
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
  launch_dependents();     // a short grid: the attention may start its prefetches now
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

// Shared memory of the staged kernel (bytes): q rows, P, the warps' row maxima, then Stages
// tiles of K and V.
constexpr int staged_smem_bytes(int D, int stages) {
  return (kMaxBlockRows * (D + kChunk) + kMaxBlockRows * kPPitch) * 2 +
         kWarps * kMaxBlockRows * 4 + stages * 2 * kTile * (D + kChunk) * 2;
}

// The K/V tiles in a ring of Stages buffers in (dynamic) shared memory, each filled by
// asynchronous 16-byte copies (copy_async16) Stages - 1 tiles before it is attended: a block
// keeps Stages - 1 tiles (32 KB each at D = 256) in flight while it computes one, with no
// registers held for them, where paged_attn_kernel holds one in registers. The page ids of a
// tile are read one tile before its copies start. On CUDA before sm_80, on HIP and in the
// emulation the copies are plain loads (compat.cuh): same results, no overlap (the launcher
// picks paged_attn_kernel there: attention_stages).
// Before grid_dependency_wait(): the K and V rows of the block's first Stages - 1 tiles (at
// most one row a thread) into L2, so that the copies after the wait start from L2 (PDL lets
// this run while the kernel before is still running). kv_lens and the page table are read
// through L2 and only aim the prefetches (compat.cuh, PDL): the page id is clamped into the
// pool, and a stale one costs bandwidth, never a wrong result.
template <typename T, int D, int Stages>
DS_DEVICE void prefetch_first_tiles(const PagedAttnParams& p) {
  const int n = blockIdx.z, i = threadIdx.x / 2;
  if (i >= (Stages - 1) * kTile) return;
  const int len = usable_len(load_coherent(p.kv_lens + n), p.page_size, p.max_pages);
  const Split plan = split_plan(len, p.max_splits, p.min_split);
  const int pos = static_cast<int>(blockIdx.x) * plan.tokens + i;
  if (static_cast<int>(blockIdx.x) >= plan.count || pos >= len) return;
  int page = load_coherent(p.page_table + int64_t(n) * p.page_table_stride + p.page_div.div(pos));
  page = page < 0 ? 0 : (page >= p.num_pages ? p.num_pages - 1 : page);
  const int kvh = static_cast<int>(blockIdx.y) * p.heads_per_block / (p.Hq / p.Hkv);
  const T* cache = static_cast<const T*>(threadIdx.x % 2 ? p.v_cache : p.k_cache);
  prefetch_l2_bulk(cache + kv_offset(p, page, pos, kvh, D, 0), D * sizeof(T));
}

// Registers: 2 blocks a multiprocessor at D = 256 (shared memory allows 2 anyway), 4 below.
constexpr int staged_min_blocks(int D) { return D >= 256 ? 2 : 4; }

template <typename T, int D, int Stages>
__global__ void DS_LAUNCH_BOUNDS_MIN_BLOCKS(kThreads, staged_min_blocks(D))
    paged_attn_staged_kernel(const PagedAttnParams p) {
  static_assert(sizeof(T) == 2, "16-bit KV only");
  static_assert(Stages >= 2, "a ring of at least two tiles");
  using RowsT = Rows<T, D>;
  constexpr int kRowWords = D / kChunk;
  constexpr int kLoads = kTile * kRowWords / kThreads;
  constexpr int kPitch = RowsT::Pitch;
  constexpr int kStageElems = 2 * kTile * kPitch;  // one tile: K rows, then V rows
  DS_DYNAMIC_SHARED(smem);
  T* q_s = reinterpret_cast<T*>(smem);
  T* p_s = q_s + kMaxBlockRows * kPitch;
  float* red_s = reinterpret_cast<float*>(p_s + kMaxBlockRows * kPPitch);
  T* ring = reinterpret_cast<T*>(red_s + kWarps * kMaxBlockRows);

  prefetch_first_tiles<T, D, Stages>(p);  // while the kernel before runs (PDL)
  grid_dependency_wait();  // q and the appended K/V rows come from the kernels before
  const BlockWork w = block_work(p);
  if (!w.active) return;  // the whole block leaves before any barrier
  const int t_begin = w.t_begin, t_end = w.t_end;
  const int tiles = static_cast<int>(ceil_div(t_end - t_begin, kTile));
  const int32_t* table = p.page_table + int64_t(w.n) * p.page_table_stride;
  const T* kc = static_cast<const T*>(p.k_cache);
  const T* vc = static_cast<const T*>(p.v_cache);
  // this thread's words of a tile: rows (threadIdx.x + i * kThreads) / kRowWords, one column
  const int col = threadIdx.x % kRowWords;
  const auto ids = [&](int tile, int (&pid)[kLoads]) {
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int pos = t_begin + tile * kTile + (threadIdx.x + i * kThreads) / kRowWords;
      pid[i] = pos < t_end ? table[p.page_div.div(pos)] : 0;
    }
  };
  const auto issue = [&](int tile, const int (&pid)[kLoads]) {
    T* k_s = ring + (tile % Stages) * kStageElems;
    T* v_s = k_s + kTile * kPitch;
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int r = (threadIdx.x + i * kThreads) / kRowWords;
      const int pos = t_begin + tile * kTile + r;
      const bool valid = pos < t_end;  // else 16 zero bytes: finite, multiplied by P = 0
      const int64_t off = valid ? kv_offset(p, pid[i], pos, w.kvh, D, col) : 0;
      copy_async16(k_s + r * kPitch + col * kChunk, kc + off, valid);
      copy_async16(v_s + r * kPitch + col * kChunk, vc + off, valid);
    }
  };

  {  // the first Stages - 1 tiles: all their page ids, then all their copies
    int pid[Stages - 1][kLoads];
#pragma unroll
    for (int s = 0; s < Stages - 1; ++s) ids(s, pid[s]);
#pragma unroll
    for (int s = 0; s < Stages - 1; ++s) {
      if (s < tiles) issue(s, pid[s]);
      copy_async_commit();  // one group per tile, empty ones too: wait<> counts groups
    }
  }
  load_q<T, D>(p, w, q_s);
  RowsT rs;
  rs.init(w.rows, p.R, t_end, p.kv_lens[w.n]);
  int pid[kLoads];
  ids(Stages - 1, pid);
  for (int j = 0; j < tiles; ++j) {
    copy_async_wait<Stages - 2>();  // this thread's copies of tile j have landed
    __syncthreads();  // everyone's; every warp is done with tile j - 1's buffer (and q_s)
    if (j + Stages - 1 < tiles) issue(j + Stages - 1, pid);  // into tile j - 1's buffer
    copy_async_commit();
    if (j + Stages < tiles) ids(j + Stages, pid);
    const T* k_s = ring + (j % Stages) * kStageElems;
    rs.tile(q_s, k_s, k_s + kTile * kPitch, p_s, red_s, t_begin + j * kTile, p.scale_log2);
  }
  launch_dependents();  // the merge may start launching; it waits for this grid's writes
  rs.finish(p, red_s, w.n, w.h0, w.rows, w.split, w.count);
}

// The kernel when DS_ATTN_STAGES is unset: 0, the register-prefetch kernel, until the staged
// one has run on a GPU (-1 would pick it wherever it fits: "auto" below).
constexpr int kDefaultStages = 0;

// Tiles in the staged kernel's ring for head dim D: DS_ATTN_STAGES, read at each call (A/B
// runs): 0 the register kernel; 2..4 that many (fewer where the shared memory does not fit);
// "auto" the most of 3 and 2 whose shared memory fits a block on this device (3 at D = 256
// takes 109 KB: an H100/H200, not an RTX card's 99 KB, which takes 2), else 0. Unset or
// empty: kDefaultStages. 0 on HIP (gfx11 gives a block 64 KB; its kernels keep to static
// shared memory) and where the kernel was built without cp.async (before sm_80).
inline ds_error_t attention_stages(int D, int* out) {
  *out = 0;
#if DS_HIP
  (void)D;
  return DS_SUCCESS;
#else
  const char* env = std::getenv("DS_ATTN_STAGES");
  const bool unset = env == nullptr || env[0] == '\0';
  const int want = unset ? kDefaultStages : (std::strcmp(env, "auto") == 0 ? -1 : atoi(env));
  if (want == 0) return DS_SUCCESS;
  int per_sm = 0, per_block = 0;
  const ds_error_t err = shared_memory_limits(&per_sm, &per_block);
  if (err != DS_SUCCESS) return err;
  if (!kernel_arch_at_least(reinterpret_cast<const void*>(paged_attn_staged_kernel<bf16, 64, 2>),
                            80))
    return DS_SUCCESS;  // built for an older GPU: no cp.async in the kernel
  for (int s = (want >= 2 && want <= 4) ? want : 3; s >= 2; --s)
    if (staged_smem_bytes(D, s) <= per_block) {
      *out = s;
      break;
    }
  return DS_SUCCESS;
#endif
}

// Blocks of the staged kernel that one multiprocessor holds: its shared memory over a block's
// (with the 1 KB the runtime reserves per block), at most staged_min_blocks(D) (what its
// launch bounds promise of registers).
inline ds_error_t staged_blocks_per_sm(int D, int stages, int* out) {
  int per_sm = 0, per_block = 0;
  const ds_error_t err = shared_memory_limits(&per_sm, &per_block);
  const int fit = per_sm / (staged_smem_bytes(D, stages) + 1024);
  *out = fit < 1 ? 1 : (fit > staged_min_blocks(D) ? staged_min_blocks(D) : fit);
  return err;
}

// The smallest split (positions): DS_ATTN_MIN_SPLIT rounded up to whole tiles (read at each
// call, for A/B runs), else kMinSplit. A longer one spends fewer blocks and merges less on a
// short context; a shorter one spreads a long context over more of the GPU.
inline int attention_min_split() {
  const char* env = std::getenv("DS_ATTN_MIN_SPLIT");
  const int v = env != nullptr ? atoi(env) : 0;
  return v > kMinSplit && v <= (1 << 20) ? static_cast<int>(ceil_div(v, kTile)) * kTile
                                         : kMinSplit;
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
// (blocks_per_sm(D) blocks per multiprocessor, or staged_blocks_per_sm for `stages` > 0), at
// least 1, and no more than a request of max_kv_len positions can use (min_split each).
inline ds_error_t max_splits_for(int N, int R, int Hq, int heads_block, int D, int64_t max_kv_len,
                                 int stages, int min_split, int* out) {
  int sms = 0, resident = blocks_per_sm(D);
  ds_error_t err = multiprocessor_count(&sms);
  if (err == DS_SUCCESS && stages > 0) err = staged_blocks_per_sm(D, stages, &resident);
  if (err != DS_SUCCESS) return err;
  (void)R;  // every block is one 16-row MMA tile, whatever R
  const int64_t blocks = int64_t(N) * (Hq / heads_block);
  static const int env_per_sm = [] {
    const char* e = std::getenv("DS_ATTN_BLOCKS_PER_SM");
    const int v = e != nullptr ? atoi(e) : 0;
    return v >= 1 && v <= 64 ? v : 0;
  }();
  const int per_sm = env_per_sm > 0 ? env_per_sm : resident;
  int64_t want = int64_t(per_sm) * sms / (blocks > 0 ? blocks : 1);
  const int64_t most = ceil_div(max_kv_len > 1 ? max_kv_len : 1, min_split);
  *out = static_cast<int>(want < 1 ? 1 : (want > most ? most : want));
  return DS_SUCCESS;
}

template <typename T, int D>
inline ds_error_t launch_attend(const PagedAttnParams& p, ds_stream_t stream) {
  const dim3 grid(p.max_splits, p.Hq / p.heads_per_block, p.N);
  // with PDL, as the merge: at a small batch the launch gaps, not the bytes, are most of the time
  switch (p.stages) {
    case 0: return launch(paged_attn_kernel<T, D>, grid, kThreads, stream, Pdl::kOn, p);
    case 2: return launch_dyn(paged_attn_staged_kernel<T, D, 2>, grid, kThreads,
                              staged_smem_bytes(D, 2), stream, Pdl::kOn, p);
    case 3: return launch_dyn(paged_attn_staged_kernel<T, D, 3>, grid, kThreads,
                              staged_smem_bytes(D, 3), stream, Pdl::kOn, p);
    case 4: return launch_dyn(paged_attn_staged_kernel<T, D, 4>, grid, kThreads,
                              staged_smem_bytes(D, 4), stream, Pdl::kOn, p);
    default: return DS_ERROR_INVALID_VALUE;
  }
}

template <typename T, int D>
inline ds_error_t launch_paged_attention_d(const PagedAttnParams& p, ds_stream_t stream) {
  const ds_error_t err = launch_attend<T, D>(p, stream);
  if (err != DS_SUCCESS || p.max_splits == 1) return err;
  switch (merge_groups(p.max_splits, D)) {
    case 4: return launch_merge<T, 4>(p, stream);
    case 8: return launch_merge<T, 8>(p, stream);
    case 16: return launch_merge<T, 16>(p, stream);
    default: return launch_merge<T, kMergeMaxGroups>(p, stream);
  }
}

// The attention of every row, then (max_splits > 1) the merge. p.heads_per_block, p.stages and
// p.max_splits come from heads_per_block, attention_stages and max_splits_for (with the same
// stages); D is 64, 128 or 256.
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
