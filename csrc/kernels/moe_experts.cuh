// The MoE experts as grouped skinny GEMMs over moe_route's tile list (moe_route.cuh); the
// contract and the pure-torch reference are in python/deltaserve/ops/moe_fused.py.
//
//   gate_up: h[r] = round(round(silu(round(gate_e x_r))) * round(up_e x_r))   [rows, I] in T
//   down:    y[r] = down_e h[r]                                             [rows, H] in fp32
//            out[t] = round(sum_j w[t, j] y[pair_row[t, j]] + s_t y_shared[t]), slots in order
// for the grouped rows r of expert e (x_r = x[row_token[r]]) and, as one more expert, the
// shared expert over the token rows (s_t = sigmoid of its gate logit, from moe_route).
//
// At decode sizes (a few rows per expert) the GEMMs are weight streams: the kernels read each
// selected expert's weights once and nothing else matters. A work item is one tile (<= 16 rows
// of one expert) times one column group over all of K: gate_up 8 intermediate columns (the 8
// gate rows and the 8 up rows of the weight, so silu * mul happens in the epilogue), down 32
// output columns. The block's warps split K as gemv.cuh's do, with its remapped-k MMA
// (mma_16816: rows 0..7 of A from lane group g, rows 8..15 from the second half), and sum their
// partials in warp order through shared memory. A round's loads (kUnroll chunks of each weight
// row, and the input rows beside them) all go out before its MMAs. The grid is persistent (at
// most kBlocksPerSm blocks a multiprocessor, each walking items gridDim.x apart), sized from the
// static bound on the tiles; the real item count is read from moe_route's n_tiles: no host sync.
//
// The combine is fused into down without float atomics: each block stores its fp32 rows, fences,
// and counts one arrival per row on the (token, column group) counter (an integer atomic); the
// block that brings the count to k (+1 with the shared expert) sums the token's k slots and the
// shared row in slot order and writes the output, then resets the counter. Whichever block
// arrives last, the sum is the same: the output bits do not depend on scheduling. Every row's
// arithmetic (K order, warp split, rounding) is independent of the other rows in its tile, so a
// token's output is also the same whatever batch it runs in.
#pragma once

#include "compat.cuh"
#include "fused.cuh"
#include "gemv.cuh"
#include "moe_route.cuh"

namespace ds {
namespace moe {

constexpr int kExpertWarps = 4;
constexpr int kExpertThreads = kExpertWarps * kWarp;
constexpr int kChunk = 32;       // k per load of a lane quad (4 lanes x 8 elements)

enum class Stage { kGateUp, kDown };

template <Stage S>
struct StageShape;
template <>
struct StageShape<Stage::kGateUp> {  // 8 intermediate columns: n-tile 0 = gate, 1 = up rows
  static constexpr int kSub = 2, kCols = 8, kUnroll = 4;
  static constexpr int kBlocksPerSm = 5;  // resident blocks a multiprocessor: 102 registers
};
template <>
struct StageShape<Stage::kDown> {  // 32 output columns: 4 n-tiles of 8
  static constexpr int kSub = 4, kCols = 32, kUnroll = 2;
  static constexpr int kBlocksPerSm = 5;  // 102 registers a thread
};
static_assert(kExpertThreads == kTileRows * StageShape<Stage::kGateUp>::kCols,
              "gate_up's epilogue: one thread per output of the item");

// One set of experts: the routed ones, or the shared expert (a single one, E = 1).
struct ExpertSet {
  const void* w;       // gate_up: [E, 2N, K] rows [gate (N) | up (N)]; down: [E, N, K]; T dense
  int64_t w_expert;    // elements between experts (0 for the shared expert)
  const void* a;       // input rows [*, K] T, lda elements apart (16-byte aligned, lda % 8 == 0)
  int64_t lda;
  const int* a_row;    // input row of grouped row r (routed gate_up: row_token), or nullptr: r
  void* c;             // output rows, ldc elements apart: gate_up h [*, N] T, down y [*, N] fp32
  int64_t ldc;
  int N, K;            // output columns (gate_up: I), reduction length (K % 8 == 0)
  FastDiv groups;      // column groups of one tile: ceil(N / kCols)
};

struct ExpertsParams {
  ExpertSet routed, shared;   // shared.w == nullptr: no shared expert
  const int* tiles;           // [max_tiles, 4] moe_route's (expert, first row, rows, 0)
  const int* n_tiles;         // [2] moe_route's: the shared expert's tiles, all tiles
  int shared_tiles;           // ceil(T / 16) with a shared expert, else 0 (= n_tiles[0])
  int64_t max_items;          // static bound on the work items (grid size)
  // down only: the combine
  const float* weight;        // [T, k] routing weights
  const int* pair_row;        // [T, k] grouped row of each pair
  const int* row_token;       // [T k] token of each grouped row
  const float* shared_scale;  // [T] sigmoid(shared gate logit) (with a shared expert)
  int* counters;              // [T, routed.groups] zero on entry; left zero
  void* out;                  // [T, routed.N] T dense
  int k;
};

template <Stage S>
DS_DEVICE int weight_col(int group, int sub, int g) {  // output column of n-tile `sub`, lane g
  return S == Stage::kGateUp ? group * 8 + g : group * 32 + 8 * sub + g;
}

template <typename T, Stage S>
__global__ void DS_LAUNCH_BOUNDS_MIN_BLOCKS(kExpertThreads, StageShape<S>::kBlocksPerSm)
    experts_kernel(const ExpertsParams p) {
  using Shape = StageShape<S>;
  constexpr int kSub = Shape::kSub, kUnroll = Shape::kUnroll, kW = kExpertWarps;
  const int warp = static_cast<int>(threadIdx.x) / kWarp;
  const int lane = static_cast<int>(threadIdx.x) % kWarp, g = lane / 4, t = lane % 4;
  const int shared_items = p.shared_tiles * static_cast<int>(p.shared.groups.d);

  // The shared expert's tiles come first and its weights are never written by a forward: a
  // block whose first item is one pulls its first round of weight lines into L2 before the
  // wait (no data read: prefetch_l2).
  if (static_cast<int>(blockIdx.x) < shared_items && t == 0) {
    const int group = p.shared.groups.mod(static_cast<int>(blockIdx.x));
#pragma unroll
    for (int s = 0; s < kSub; ++s) {
      const int col = weight_col<S>(group, s, g);
      const int wr = S == Stage::kGateUp ? col + s * p.shared.N : col;
      const T* row = static_cast<const T*>(p.shared.w) + int64_t(wr) * p.shared.K;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int c = warp + u * kW;
        if (col < p.shared.N && c * kChunk < p.shared.K) prefetch_l2(row + c * kChunk);
      }
    }
  }
  grid_dependency_wait();  // the tiles and the input rows come from the kernels before
  launch_dependents();     // the grid is resident (<= one wave): the next kernel may queue up

  __shared__ float part[kW][kSub * 4][kWarp];  // each warp's accumulators, lane fastest
  __shared__ int last[kTileRows];              // down: this block completes row m's token
  const int items = shared_items + (p.n_tiles[1] - p.shared_tiles) *
                                       static_cast<int>(p.routed.groups.d);
  for (int item = static_cast<int>(blockIdx.x); item < items;
       item += static_cast<int>(gridDim.x)) {
    const bool sh = item < shared_items;
    // field by field: a selected reference to a kernel parameter would go to local memory
    const T* w = static_cast<const T*>(sh ? p.shared.w : p.routed.w);
    const T* a = static_cast<const T*>(sh ? p.shared.a : p.routed.a);
    const int* a_row = sh ? p.shared.a_row : p.routed.a_row;
    const int64_t lda = sh ? p.shared.lda : p.routed.lda, ldc = sh ? p.shared.ldc : p.routed.ldc;
    const int N = sh ? p.shared.N : p.routed.N, K = sh ? p.shared.K : p.routed.K;
    const FastDiv groups = sh ? p.shared.groups : p.routed.groups;
    const int rel = sh ? item : item - shared_items;
    const int tile_rel = groups.div(rel), group = rel - tile_rel * static_cast<int>(groups.d);
    const int* tile = p.tiles + 4 * (sh ? tile_rel : p.shared_tiles + tile_rel);
    const int expert = tile[0], row0 = tile[1], rows = tile[2];
    if (!sh) w += int64_t(expert) * p.routed.w_expert;

    // this lane's weight rows (one per n-tile) and input rows g, g + 8 of the tile
    const T* wrow[kSub];
    bool w_ok[kSub];
#pragma unroll
    for (int s = 0; s < kSub; ++s) {
      const int col = weight_col<S>(group, s, g);
      w_ok[s] = col < N;
      const int wr = S == Stage::kGateUp ? col + s * N : col;
      wrow[s] = w + int64_t(w_ok[s] ? wr : 0) * K + 8 * t;
    }
    const bool lo_ok = g < rows, hi_ok = g + 8 < rows, two = rows > 8;  // two: warp-uniform
    const int r_lo = row0 + (lo_ok ? g : 0), r_hi = row0 + (hi_ok ? g + 8 : 0);
    const T* alo = a + int64_t(a_row != nullptr ? a_row[r_lo] : r_lo) * lda + 8 * t;
    const T* ahi = two ? a + int64_t(a_row != nullptr ? a_row[r_hi] : r_hi) * lda + 8 * t : alo;

    const int chunks = static_cast<int>(ceil_div(K, kChunk));
    const uint4 zero = {0u, 0u, 0u, 0u};
    float d[kSub][4] = {};
    for (int base = warp; base < chunks; base += kUnroll * kW) {
      const int k0 = base * kChunk + 8 * t;
      const int64_t off0 = int64_t(base) * kChunk;
      // All of a round's loads go out before its first MMA: the weights from HBM, input rows
      // 0..7 (gathered: other tiles' rows, from L2) beside them, not one L2 trip per MMA. Rows
      // 8..15 (tiles of > 8 rows: the shared expert's from 9 tokens on, prefill-sized batches)
      // are loaded at their MMA: registers for them too would cost gate_up its fifth block.
      uint4 wv[kUnroll][kSub], xl[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const bool in = k0 + u * kW * kChunk < K;
#pragma unroll
        for (int s = 0; s < kSub; ++s)
          wv[u][s] = w_ok[s] && in ? gemv::load_weight16(wrow[s] + off0 + u * kW * kChunk) : zero;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const bool in = k0 + u * kW * kChunk < K;
        xl[u] = lo_ok && in ? gemv::load16(alo + off0 + u * kW * kChunk) : zero;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (base + u * kW >= chunks) break;  // warp-uniform: every lane runs each MMA
        const bool in = k0 + u * kW * kChunk < K;
        const uint4 xh = two && hi_ok && in ? gemv::load16(ahi + off0 + u * kW * kChunk) : zero;
        // k remapped as in gemv.cuh: words 0, 1 of a lane's 8 k feed one MMA, words 2, 3 the next
        const uint32_t a0[4] = {xl[u].x, xh.x, xl[u].y, xh.y};
        const uint32_t a1[4] = {xl[u].z, xh.z, xl[u].w, xh.w};
#pragma unroll
        for (int s = 0; s < kSub; ++s) {
          const uint32_t b0[2] = {wv[u][s].x, wv[u][s].y}, b1[2] = {wv[u][s].z, wv[u][s].w};
          mma_16816<T>(d[s], a0, b0);
          mma_16816<T>(d[s], a1, b1);
        }
      }
    }
#pragma unroll
    for (int s = 0; s < kSub; ++s)
#pragma unroll
      for (int i = 0; i < 4; ++i) part[warp][s * 4 + i][lane] = d[s][i];
    __syncthreads();

    // Output (row m, n-tile s, column j of 8) is d[s][2 (m / 8) + j % 2] of lane 4 (m % 8) + j / 2,
    // summed over the warps in warp order.
    const auto total = [&](int m, int s, int j) {
      const int src = (m % 8) * 4 + j / 2, reg = s * 4 + (m / 8) * 2 + j % 2;
      float v = part[0][reg][src];
#pragma unroll
      for (int q = 1; q < kW; ++q) v = fadd(v, part[q][reg][src]);
      return v;
    };
    if constexpr (S == Stage::kGateUp) {
      const int m = static_cast<int>(threadIdx.x) / 8, j = static_cast<int>(threadIdx.x) % 8;
      const int col = group * 8 + j;
      if (m < rows && col < N) {  // silu_mul's rounding points (fused.cuh) on the rounded GEMMs
        const float gate = fused::round_to<T>(total(m, 0, j));
        const float up = fused::round_to<T>(total(m, 1, j));
        static_cast<T*>(sh ? p.shared.c : p.routed.c)[int64_t(row0 + m) * ldc + col] =
            from_float<T>(fmul(fused::round_to<T>(fused::silu(gate)), up));
      }
    } else {
      float* y = static_cast<float*>(sh ? p.shared.c : p.routed.c);
#pragma unroll
      for (int q = 0; q < kTileRows * 32 / kExpertThreads; ++q) {
        const int o = static_cast<int>(threadIdx.x) + q * kExpertThreads;
        const int m = o / 32, jj = o % 32, col = group * 32 + jj;
        if (m < rows && col < N) y[int64_t(row0 + m) * ldc + col] = total(m, jj / 8, jj % 8);
      }
      // the combine: count this block's rows in; the last arrival of a token sums its parts
      thread_fence();
      __syncthreads();
      const int parts = p.k + (p.shared.w != nullptr ? 1 : 0);
      if (static_cast<int>(threadIdx.x) < kTileRows) {
        const int m = static_cast<int>(threadIdx.x);
        int done = 0;
        if (m < rows) {
          const int tok = sh ? row0 + m : p.row_token[row0 + m];
          int* counter = p.counters + int64_t(tok) * p.routed.groups.d + group;
          done = atomic_add(counter, 1) == parts - 1;
          if (done) *counter = 0;  // no other block counts on it again in this launch
        }
        last[m] = done;
        thread_fence();
      }
      __syncthreads();
      for (int m = warp; m < rows; m += kW) {
        if (!last[m]) continue;
        const int tok = sh ? row0 + m : p.row_token[row0 + m];
        const int col = group * 32 + lane;
        if (col < N) {
          const float* yr = static_cast<const float*>(p.routed.c);
          float acc = 0.f;
          for (int j = 0; j < p.k; ++j) {
            const int r = p.pair_row[tok * p.k + j];
            acc = ffma(p.weight[tok * p.k + j], load_coherent(yr + int64_t(r) * p.routed.ldc + col),
                       acc);
          }
          if (p.shared.w != nullptr) {
            const float* ys = static_cast<const float*>(p.shared.c);
            acc = ffma(p.shared_scale[tok], load_coherent(ys + int64_t(tok) * p.shared.ldc + col),
                       acc);
          }
          static_cast<T*>(p.out)[int64_t(tok) * N + col] = from_float<T>(acc);
        }
      }
    }
    __syncthreads();  // part and last are rewritten by the next item
  }
}

template <typename T, Stage S>
inline ds_error_t launch_experts(const ExpertsParams& p, ds_stream_t stream) {
  const auto bad_set = [](const ExpertSet& s) {
    return s.w == nullptr || s.a == nullptr || s.c == nullptr || s.N < 1 || s.K < 8 ||
           s.K % 8 != 0 || s.lda < s.K || s.lda % 8 != 0 || s.ldc < s.N ||
           s.groups.d != static_cast<uint32_t>(ceil_div(s.N, StageShape<S>::kCols));
  };
  if (bad_set(p.routed) || (p.shared.w != nullptr && bad_set(p.shared)) ||
      (p.shared.w == nullptr && p.shared_tiles != 0) || p.max_items < 0)
    return DS_ERROR_INVALID_VALUE;
  // down's combine: the shared rows land in the routed rows' columns and counters
  if (S == Stage::kDown && p.shared.w != nullptr && p.shared.N != p.routed.N)
    return DS_ERROR_INVALID_VALUE;
  if (S == Stage::kDown && (p.weight == nullptr || p.pair_row == nullptr ||
                            p.row_token == nullptr || p.counters == nullptr ||
                            p.out == nullptr || p.k < 1 ||
                            (p.shared.w != nullptr && p.shared_scale == nullptr)))
    return DS_ERROR_INVALID_VALUE;
  int sms = 0;
  const ds_error_t err = multiprocessor_count(&sms);
  if (err != DS_SUCCESS) return err;
  const int64_t resident = int64_t(sms) * StageShape<S>::kBlocksPerSm;
  const int64_t blocks = p.max_items < resident ? p.max_items : resident;
  return launch(experts_kernel<T, S>, blocks, kExpertThreads, stream, Pdl::kOn, p);
}

}  // namespace moe
}  // namespace ds
