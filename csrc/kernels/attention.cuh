// Paged attention for decode and verify rows, and the KV append of those rows.
//
// KV lives in the page pool's layout, one layer: k_cache / v_cache [P, page_size, Hkv, D];
// request n's position t is at page page_table[n][t / page_size], offset t % page_size.
// kv_lens[n] counts the positions after this step's R rows are appended, so row r of request n
// sits at position kv_lens[n] - R + r and sees positions 0 .. kv_lens[n] - R + r (causal among
// the rows; decode is R = 1). Math: softmax(scale * q k^T) v with fp32 scores, an fp32 running
// max / sum (the online softmax of Milakov & Gimelshein, "Online normalizer calculation for
// softmax", 2018) and fp32 accumulation, in base 2 (scale pre-multiplied by log2 e).
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
constexpr int kTile = kWarp;  // positions staged at a time: one per lane in the score phase
constexpr int kMaxBlockRows = 16;  // q rows (heads x rows) one block holds: 4 per warp
constexpr int kMinSplit = kTile;   // the smallest split (positions)
// Blocks per multiprocessor the grid aims for: what stays resident on an H100/H200 (the 1- and
// 2-rows-per-warp kernels take <= 127 registers a thread, the 4-rows one 168; 36-44 KB of
// shared memory each), so the whole grid runs as one wave, with no tail of a second one.
constexpr int kBlocksPerSm = 4;
constexpr int kBlocksPerSmWide = 3;  // the 4-rows-per-warp kernel

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

DS_DEVICE float warp_max(float v) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) v = fmaxf(v, shfl_xor(v, off));
  return v;
}

DS_DEVICE float neg_inf() { return __uint_as_float(0xff800000u); }

// One 16-byte word of a K or V row.
using Word16 = uint4;
DS_DEVICE Word16 load16(const void* p) { return *static_cast<const uint4*>(p); }
DS_DEVICE void store16(void* p, const Word16& w) { *static_cast<uint4*>(p) = w; }

// T a 16-bit float type (bf16 / f16); D 64, 128 or 256; RPW q rows per warp (1, 2 or 4): warp w
// owns block rows w, w + kWarps, ... (row qr = local head * R + r).
// Score phase: lane l scores position t0 + l against each of its warp's rows (K rows in shared
// memory padded by 16 bytes, so the 8 lanes of one 16-byte access phase hit distinct banks).
// Value phase: lane l owns output elements [l * D / kWarp, (l + 1) * D / kWarp) of its rows.
// The next tile's K/V words are loaded into registers while the current tile is computed.
template <typename T, int D, int RPW>
__global__ void __launch_bounds__(kThreads) paged_attn_kernel(const PagedAttnParams p) {
  static_assert(sizeof(T) == 2, "16-bit KV only");
  constexpr int kChunk = 8;                      // elements per 16-byte word
  constexpr int kRowWords = D / kChunk;          // 16-byte words per K/V row
  constexpr int kLoads = kTile * kRowWords / kThreads;  // words per thread per tile, K and V each
  constexpr int kLane = D / kWarp;               // output elements per lane
  static_assert(kLoads * kThreads == kTile * kRowWords, "whole tiles per block");
  // D = 64 (the default model) leaves 4 bytes of V a lane: loaded element by element
  constexpr bool kWordLane = kLane * sizeof(T) % 8 == 0;
  __shared__ __align__(16) T q_s[kWarps * RPW][D];
  __shared__ __align__(16) T k_s[kTile][D + kChunk];
  __shared__ __align__(16) T v_s[kTile][D];
  __shared__ float p_s[kWarps * RPW][kTile];

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

  const T* q = static_cast<const T*>(p.q);
  for (int i = threadIdx.x; i < rows * kRowWords; i += kThreads) {
    const int qr = i / kRowWords, c = i % kRowWords;
    const int64_t src = ((int64_t(n) * R + qr % R) * p.Hq + h0 + qr / R) * D + c * kChunk;
    store16(&q_s[qr][c * kChunk], load16(q + src));
  }

  const int32_t* table = p.page_table + int64_t(n) * p.page_table_stride;
  const T* kc = static_cast<const T*>(p.k_cache);
  const T* vc = static_cast<const T*>(p.v_cache);
  Word16 kw[kLoads], vw[kLoads];
  const auto load_tile = [&](int t0) {
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int idx = threadIdx.x + i * kThreads;
      const int pos = t0 + idx / kRowWords, c = idx % kRowWords;
      if (pos < t_end) {
        const int page_idx = p.page_div.div(pos);
        const int64_t page = table[page_idx];
        const int64_t off = ((page * p.page_size + (pos - page_idx * p.page_size)) * p.Hkv +
                             kvh) * D + c * kChunk;
        kw[i] = load16(kc + off);
        vw[i] = load16(vc + off);
      } else {  // finite zeros: a masked position's value is multiplied by 0
        kw[i] = vw[i] = Word16{0u, 0u, 0u, 0u};
      }
    }
  };

  float m[RPW], l[RPW], acc[RPW][kLane];
#pragma unroll
  for (int j = 0; j < RPW; ++j) {
    m[j] = neg_inf();
    l[j] = 0.f;
#pragma unroll
    for (int e = 0; e < kLane; ++e) acc[j][e] = 0.f;
  }
  // last position row qr may see: kv_len - R + r (the caller guarantees kv_len >= R)
  const int last_seen = p.kv_lens[n] - R;

  load_tile(t_begin);
  for (int t0 = t_begin; t0 < t_end; t0 += kTile) {
    __syncthreads();  // every warp is done with the previous tile (and q_s is written)
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int idx = threadIdx.x + i * kThreads;
      store16(&k_s[idx / kRowWords][(idx % kRowWords) * kChunk], kw[i]);
      store16(&v_s[idx / kRowWords][(idx % kRowWords) * kChunk], vw[i]);
    }
    __syncthreads();
    if (t0 + kTile < t_end) load_tile(t0 + kTile);  // in flight during this tile's math

    float s[RPW];
#pragma unroll
    for (int j = 0; j < RPW; ++j) s[j] = 0.f;
#pragma unroll 4
    for (int c = 0; c < kRowWords; ++c) {
      float kf[kChunk];
      load_vec<T, kChunk>(&k_s[lane][c * kChunk], kf);
#pragma unroll
      for (int j = 0; j < RPW; ++j) {
        float qf[kChunk];
        load_vec<T, kChunk>(&q_s[warp + kWarps * j][c * kChunk], qf);
#pragma unroll
        for (int e = 0; e < kChunk; ++e) s[j] = ffma(qf[e], kf[e], s[j]);
      }
    }
    const int pos = t0 + lane;
#pragma unroll
    for (int j = 0; j < RPW; ++j) {
      const int qr = warp + kWarps * j;
      const bool seen = qr < rows && pos < t_end && pos <= last_seen + qr % R;
      const float sj = seen ? fmul(s[j], p.scale_log2) : neg_inf();
      const float m_new = fmaxf(m[j], warp_max(sj));
      // a row that has seen nothing yet keeps m = -inf: no (-inf) - (-inf)
      const float pj = m_new == neg_inf() ? 0.f : exp2f(sj - m_new);
      const float alpha = m_new == neg_inf() ? 1.f : exp2f(m[j] - m_new);
      l[j] = ffma(l[j], alpha, group_sum<kWarp>(pj));
      m[j] = m_new;
#pragma unroll
      for (int e = 0; e < kLane; ++e) acc[j][e] = fmul(acc[j][e], alpha);
      p_s[qr][lane] = pj;
    }
    __syncthreads();  // p_s rows are read by all lanes of their warp

    const int t_n = min(kTile, t_end - t0);
    for (int t = 0; t < t_n; ++t) {
      float vf[kLane];
      if constexpr (kWordLane) {
        load_vec<T, kLane>(&v_s[t][lane * kLane], vf);
      } else {
#pragma unroll
        for (int e = 0; e < kLane; ++e) vf[e] = to_float(v_s[t][lane * kLane + e]);
      }
#pragma unroll
      for (int j = 0; j < RPW; ++j) {
        const float pj = p_s[warp + kWarps * j][t];
#pragma unroll
        for (int e = 0; e < kLane; ++e) acc[j][e] = ffma(pj, vf[e], acc[j][e]);
      }
    }
  }

#pragma unroll
  for (int j = 0; j < RPW; ++j) {
    const int qr = warp + kWarps * j;
    if (qr >= rows) continue;
    const int64_t row = (int64_t(n) * R + qr % R) * p.Hq + h0 + qr / R;
    const float inv = l[j] > 0.f ? fdiv(1.f, l[j]) : 0.f;
    float o[kLane];
#pragma unroll
    for (int e = 0; e < kLane; ++e) o[e] = fmul(acc[j][e], inv);
    if (plan.count == 1) {
      T* out = static_cast<T*>(p.out) + row * D + lane * kLane;
      if constexpr (kWordLane) {
        store_vec<T, kLane>(out, o);
      } else {
#pragma unroll
        for (int e = 0; e < kLane; ++e) out[e] = from_float<T>(o[e]);
      }
    } else {
      const int64_t part = row * p.max_splits + split;
      store_vec<float, kLane>(p.part_o + part * D + lane * kLane, o);
      if (lane == 0) p.part_lse[part] = l[j] > 0.f ? fadd(m[j], log2f(l[j])) : neg_inf();
    }
  }
}

// One block per output row (request, row, q head), one thread per element of D: combines the
// splits' partial outputs weighted by 2^(lse - max lse). Requests with one split are skipped
// (the attention kernel wrote them).
template <typename T>
__global__ void __launch_bounds__(256) merge_kernel(const PagedAttnParams p) {
  const int64_t row = blockIdx.x;
  const int n = static_cast<int>(row / (int64_t(p.R) * p.Hq));
  const int len = usable_len(p.kv_lens[n], p.page_size, p.max_pages);
  const int count = split_plan(len, p.max_splits).count;
  if (count <= 1) return;
  const float* lse = p.part_lse + row * p.max_splits;
  float mx = neg_inf();
  for (int s = 0; s < count; ++s) mx = fmaxf(mx, lse[s]);
  float sum = 0.f, o = 0.f;
  const float* part = p.part_o + row * p.max_splits * p.D + threadIdx.x;
  for (int s = 0; s < count; ++s) {
    const float w = lse[s] == neg_inf() ? 0.f : exp2f(lse[s] - mx);
    sum = fadd(sum, w);
    o = ffma(w, part[int64_t(s) * p.D], o);
  }
  static_cast<T*>(p.out)[row * p.D + threadIdx.x] = from_float<T>(fdiv(o, sum));
}

// One thread per 16-byte word of the new rows' K and V.
template <typename T>
__global__ void __launch_bounds__(kThreads) kv_append_kernel(const KVAppendParams p) {
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
// (kBlocksPerSm blocks per multiprocessor), at least 1, and no more than a request of
// max_kv_len positions can use (kMinSplit each).
inline ds_error_t max_splits_for(int N, int R, int Hq, int heads_block, int64_t max_kv_len,
                                 int* out) {
  int sms = 0;
  const ds_error_t err = multiprocessor_count(&sms);
  if (err != DS_SUCCESS) return err;
  const int64_t blocks = int64_t(N) * (Hq / heads_block);
  const int per_sm = heads_block * R > 2 * kWarps ? kBlocksPerSmWide : kBlocksPerSm;
  int64_t want = int64_t(per_sm) * sms / (blocks > 0 ? blocks : 1);
  const int64_t most = ceil_div(max_kv_len > 1 ? max_kv_len : 1, kMinSplit);
  *out = static_cast<int>(want < 1 ? 1 : (want > most ? most : want));
  return DS_SUCCESS;
}

template <typename T, int D>
inline ds_error_t launch_paged_attention_d(const PagedAttnParams& p, ds_stream_t stream) {
  const dim3 grid(p.max_splits, p.Hq / p.heads_per_block, p.N);
  const int rows = p.heads_per_block * p.R;
  ds_error_t err;
  if (rows <= kWarps)
    err = launch(paged_attn_kernel<T, D, 1>, grid, kThreads, stream, Pdl::kOff, p);
  else if (rows <= 2 * kWarps)
    err = launch(paged_attn_kernel<T, D, 2>, grid, kThreads, stream, Pdl::kOff, p);
  else
    err = launch(paged_attn_kernel<T, D, 4>, grid, kThreads, stream, Pdl::kOff, p);
  if (err != DS_SUCCESS || p.max_splits == 1) return err;
  return launch(merge_kernel<T>, int64_t(p.N) * p.R * p.Hq, D, stream, Pdl::kOff, p);
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
  return launch(kv_append_kernel<T>, ceil_div(words, kThreads), kThreads, stream, Pdl::kOff, p);
}

}  // namespace attn
}  // namespace ds
