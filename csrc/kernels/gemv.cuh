// Skinny GEMM for decode projections (python/deltaserve/ops/linear.py holds the contract and the
// reference): y [M, N] = x [M, K] · W [N, K]ᵀ (+ b [N]), M <= 8 rows, K % 8 == 0, bf16 / fp16,
// fp32 accumulation, one rounding to T per output.
//
// At M <= 8 the GEMM is a weight stream: every weight element is used M times, so the kernel
// must read W once at copy bandwidth and nothing else matters. cuBLAS picks 64 x 8 tiles with
// split-K and a second reduce kernel for these shapes (0.7-1.4 TB/s on the H200, issue 27).
// Here one block owns kTileCols = 8 weight rows (output columns) over all of K, its warps split
// K, and a shared-memory sum of the warps' partials ends it: one launch, one write per (m, n).
//
// The math is one warp-level 16 x 8 x 16 MMA (mma_16816: tensor cores on sm_80+) per 16 k:
//   A [16 m][16 k] = x rows (rows 8..15 are zero: a[1] = a[3] = 0),
//   B [16 k][8 n]  = the block's 8 weight rows, column n = weight row n0 + n,
//   D [16 m][8 n]  = y[m][n0 + n] (d[0], d[1]; d[2], d[3] stay zero).
// A fragment register's k index depends only on t = lane % 4, in A and in B alike, so the k of
// each register may be remapped freely as long as both use the same map. Lane (g = lane / 4, t)
// loads 16 bytes = 8 consecutive k, [32 c + 8 t, + 8) of chunk c, of weight row n0 + g and of x
// row g, and feeds words 0, 1 of both to one MMA and words 2, 3 to the next: no shuffles, no
// conversions, and the raw weight words go straight into the B registers. A warp load moves 8
// rows x 64 bytes; the kUnroll chunks a warp loads before its first MMA of a round are WARPS
// chunks apart, so the block's warps together read each weight row front to back.
//
// The weights are never written by the kernels of a forward (they are loaded once), so before
// grid_dependency_wait() (PDL) the block only pulls its first weight lines into L2 (prefetch,
// no data read); x, which the previous kernel writes, is read after the wait.
// No allocation, no host synchronisation: CUDA-graph capturable.
#pragma once

#include "compat.cuh"

namespace ds {
namespace gemv {

constexpr int kMaxRows = 8;   // rows of x: the MMA's m rows 0..7 (lane groups g)
constexpr int kTileCols = 8;  // weight rows (output columns) per block: the MMA's n
constexpr int kChunk = 32;    // k per warp load of one weight row: 4 lanes x 8 elements
constexpr int kUnroll = 8;    // chunks a warp loads before it multiplies (loads in flight)

struct GemvParams {
  const void* x;     // [M, K] T, rows ldx elements apart, 16-byte aligned
  const void* w;     // [N, K] T dense, 16-byte aligned
  const void* bias;  // [N] T, or nullptr
  void* y;           // [M, N] T dense
  int64_t ldx;       // elements between rows of x (a multiple of 8; 0: one row broadcast)
  int M, N, K;       // 1 <= M <= kMaxRows, K % 8 == 0
};

// 16 bytes of weights: read once per forward, so they skip L1 (x, read by every block of an SM,
// stays there).
DS_DEVICE uint4 load_weight16(const void* p) {
#if !DS_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
#else
  return *static_cast<const uint4*>(p);
#endif
}
DS_DEVICE uint4 load16(const void* p) { return *static_cast<const uint4*>(p); }

// Where the main loop reads x: global rows (NoPrologue), or a copy of x the block made in shared
// memory before it (gemv_prologue.cuh: x computed from the outputs of the kernel that would
// otherwise have run before this one). Rows of the staged copy are stage_ld(K) elements apart.
constexpr int kStageElems = 8192 + 8 * kMaxRows;  // 16.1 KB of 16-bit x a block, at most
DS_HOST_DEVICE constexpr int stage_ld(int K) { return K + 8; }  // + 16 bytes: no bank conflicts
DS_HOST_DEVICE constexpr bool stage_fits(int M, int K) {
  return int64_t(M) * stage_ld(K) <= kStageElems;
}

struct NoPrologue {
  static constexpr bool kStaged = false;
  struct Params {};
};

template <typename T, int WARPS, class Pro>
__global__ void __launch_bounds__(WARPS * kWarp) gemv_kernel(const GemvParams p,
                                                             const typename Pro::Params pro) {
  static_assert(sizeof(T) == 2, "16-bit operands (the MMA's)");
  static_assert(WARPS * kWarp >= kMaxRows * kTileCols, "one thread per output of the tile");
  const int warp = static_cast<int>(threadIdx.x) / kWarp;
  const int lane = static_cast<int>(threadIdx.x) % kWarp, g = lane / 4, t = lane % 4;
  const int n0 = static_cast<int>(blockIdx.x) * kTileCols;
  const bool w_ok = n0 + g < p.N;  // a tile past the last column reads zeros
  const T* wrow = static_cast<const T*>(p.w) + int64_t(w_ok ? n0 + g : n0) * p.K + 8 * t;
  const int chunks = static_cast<int>(ceil_div(p.K, kChunk));

  if (w_ok && t == 0) {  // this lane group's first round of weight lines
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = u * WARPS + warp;
      if (c < chunks) prefetch_l2(wrow + int64_t(c) * kChunk);
    }
  }
  grid_dependency_wait();  // x (or what the prologue makes it from) comes from the kernel before

  const uint4 zero = {0u, 0u, 0u, 0u};
  // chunk c = base + u * WARPS: this lane's first element k = c * kChunk + 8 t, whose row
  // offset from `wfirst` (`xfirst`) is a constant per u: an immediate in the loads
  uint4 wv[kUnroll];
  const auto load_round = [&](int base) {
    const int k0 = base * kChunk + 8 * t;
    const T* wfirst = wrow + int64_t(base) * kChunk;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      wv[u] = w_ok && k0 + u * WARPS * kChunk < p.K ? load_weight16(wfirst + u * WARPS * kChunk)
                                                    : zero;
  };
  // The prologue runs before the first weight loads: its row values and the loads' registers
  // would otherwise be live together (a norm prologue then takes 128 registers a thread, and a
  // 1024-block grid two waves). The weights' first lines are in L2 already (prefetched above).
  __shared__ __align__(16) T staged[Pro::kStaged ? kStageElems : 1];
  if constexpr (Pro::kStaged) Pro::template stage<T>(pro, staged, stage_ld(p.K), p.M);
  load_round(warp);

  const bool x_ok = g < p.M;
  const T* xrow = Pro::kStaged ? staged + (x_ok ? g : 0) * stage_ld(p.K) + 8 * t
                               : static_cast<const T*>(p.x) + (x_ok ? g : 0) * p.ldx + 8 * t;
  float d[4] = {0.f, 0.f, 0.f, 0.f};
  for (int base = warp; base < chunks; base += kUnroll * WARPS) {
    if (base != warp) load_round(base);
    const int k0 = base * kChunk + 8 * t;
    const T* xfirst = xrow + int64_t(base) * kChunk;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * WARPS >= chunks) break;  // warp-uniform: every lane runs each MMA
      const uint4 xv = x_ok && k0 + u * WARPS * kChunk < p.K ? load16(xfirst + u * WARPS * kChunk)
                                                             : zero;
      const uint32_t a0[4] = {xv.x, 0u, xv.y, 0u}, b0[2] = {wv[u].x, wv[u].y};
      const uint32_t a1[4] = {xv.z, 0u, xv.w, 0u}, b1[2] = {wv[u].z, wv[u].w};
      mma_16816<T>(d, a0, b0);
      mma_16816<T>(d, a1, b1);
    }
  }
  launch_dependents();  // the next kernel may start launching; it waits for this grid's writes

  // d[0], d[1] = this warp's part of y[g][n0 + 2t], y[g][n0 + 2t + 1]; summed over the warps in
  // warp order (fixed: the same bits on every run).
  __shared__ float part[WARPS][kWarp][2];
  part[warp][lane][0] = d[0];
  part[warp][lane][1] = d[1];
  __syncthreads();
  const int out = static_cast<int>(threadIdx.x);
  if (out < kMaxRows * kTileCols) {
    const int m = out / kTileCols, j = out % kTileCols, col = n0 + j;
    if (m < p.M && col < p.N) {
      const int src = m * 4 + j / 2;  // lane g = m, t = j / 2 holds column j in d[j % 2]
      float s = part[0][src][j % 2];
#pragma unroll
      for (int w = 1; w < WARPS; ++w) s = fadd(s, part[w][src][j % 2]);
      if (p.bias != nullptr) s = fadd(s, to_float(static_cast<const T*>(p.bias)[col]));
      static_cast<T*>(p.y)[int64_t(m) * p.N + col] = from_float<T>(s);
    }
  }
}

// Warps per block: 4 where the grid has >= 4 blocks a multiprocessor (they interleave there);
// for fewer tiles 8, and 16 where one wave of blocks leaves a multiprocessor one block (N = 1024:
// 128 blocks on 132 SMs), so that a block keeps up to 64 KB of weight loads in flight on its
// multiprocessor (16 warps x 8 loads x 512 bytes) instead of walking K in rounds.
inline int gemv_warps(int64_t blocks, int multiprocessors) {
  if (blocks >= 4 * int64_t(multiprocessors)) return 4;
  if (blocks > int64_t(multiprocessors)) return 8;
  return 16;
}

// The launch checks shared by the plain kernel and the prologue ones.
inline bool gemv_args_ok(const GemvParams& p) {
  return p.M >= 1 && p.M <= kMaxRows && p.N >= 1 && p.K >= 8 && p.K % 8 == 0 && p.ldx >= 0 &&
         p.ldx % 8 == 0;
}

template <typename T, class Pro>
inline ds_error_t launch_gemv_with(const GemvParams& p, const typename Pro::Params& pro,
                                   ds_stream_t stream) {
  int sms = 0;
  const ds_error_t err = multiprocessor_count(&sms);
  if (err != DS_SUCCESS) return err;
  const int64_t blocks = ceil_div(p.N, kTileCols);
  switch (gemv_warps(blocks, sms)) {
    case 4: return launch(gemv_kernel<T, 4, Pro>, blocks, 4 * kWarp, stream, Pdl::kOn, p, pro);
    case 8: return launch(gemv_kernel<T, 8, Pro>, blocks, 8 * kWarp, stream, Pdl::kOn, p, pro);
    default: return launch(gemv_kernel<T, 16, Pro>, blocks, 16 * kWarp, stream, Pdl::kOn, p, pro);
  }
}

template <typename T>
inline ds_error_t launch_gemv(const GemvParams& p, ds_stream_t stream) {
  if (!gemv_args_ok(p)) return DS_ERROR_INVALID_VALUE;
  return launch_gemv_with<T, NoPrologue>(p, NoPrologue::Params{}, stream);
}

}  // namespace gemv
}  // namespace ds
