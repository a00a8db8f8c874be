// Skinny GEMM for decode projections (python/deltaserve/ops/linear.py holds the contract and the
// reference): y [M, N] = x [M, K] · W [N, K]ᵀ (+ b [N]), M <= 32 rows, K % 8 == 0, bf16 / fp16,
// fp32 accumulation, one rounding to T per output.
//
// At M <= 32 the GEMM is a weight stream: every weight element is used M times, so the kernel
// must read W once at copy bandwidth and nothing else matters. cuBLAS picks 64 x 8 tiles with
// split-K and a second reduce kernel for these shapes (0.7-1.4 TB/s on the H200, issue 27).
// Here one block owns kTileCols = 8 weight rows (output columns) over all of K, its warps split
// K, and a shared-memory sum of the warps' partials ends it: one launch, one write per (m, n).
//
// The math is warp-level 16 x 8 x 16 MMAs (mma_16816: tensor cores on sm_80+) per 16 k:
//   A [16 m][16 k] = x rows 16 j .. 16 j + 15 (M <= 8: rows 8..15 are zero, a[1] = a[3] = 0),
//   B [16 k][8 n]  = the block's 8 weight rows, column n = weight row n0 + n,
//   D [16 m][8 n]  = y[16 j + m][n0 + n] (M <= 8: d[0], d[1]; d[2], d[3] stay zero),
// one MMA per 16 rows of x (j): XR = ceil(M / 8) rows g + 8 i of x a lane loads (1, 2 or 4), and
// every weight register feeds XR / 2 MMAs (one at XR = 1). A row's sum is the same MMA chain
// whatever M is: a request's bits do not depend on the rows beside it.
// A fragment register's k index depends only on t = lane % 4, in A and in B alike, so the k of
// each register may be remapped freely as long as both use the same map. Lane (g = lane / 4, t)
// loads 16 bytes = 8 consecutive k, [32 c + 8 t, + 8) of chunk c, of weight row n0 + g and of x
// rows g + 8 i, and feeds words 0, 1 of both to one MMA and words 2, 3 to the next: no shuffles, no
// conversions, and the raw weight words go straight into the B registers. A warp load moves 8
// rows x 64 bytes; the kUnroll chunks a warp loads before its first MMA of a round are WARPS
// chunks apart, so the block's warps together read each weight row front to back.
//
// The weights are never written by the kernels of a forward (they are loaded once), so before
// grid_dependency_wait() (PDL) the block already moves its tile: into shared memory by the copy
// engine (kSmemW, tile_copy.cuh) or into L2 (one bulk prefetch); x, which the previous kernel
// writes, is read after the wait (docs/kernels.md, "Where the weights come from").
// No allocation, no host synchronisation: CUDA-graph capturable.
#pragma once

#include "compat.cuh"
#include "tile_copy.cuh"

namespace ds {
namespace gemv {

constexpr int kMaxRows = 32;       // rows of x: g + 8 i for lane group g, i < XR <= 4
constexpr int kMaxStagedRows = 8;  // rows of x a prologue makes (XR = 1: the stage's budget)
constexpr int kTileCols = 8;  // weight rows (output columns) per block: the MMA's n
constexpr int kChunk = 32;    // k per warp load of one weight row: 4 lanes x 8 elements
constexpr int kUnroll = 8;    // chunks a warp loads before it multiplies (loads in flight)

struct GemvParams {
  const void* x;     // [M, K] T, rows ldx elements apart, 16-byte aligned
  const void* w;     // [N, K] T dense, 16-byte aligned
  const void* bias;  // [N] T, or nullptr
  void* y;           // [M, N] T dense
  int64_t ldx;       // elements between rows of x (a multiple of 8; 0: one row broadcast)
  int M, N, K;       // 1 <= M <= kMaxRows (kMaxStagedRows with a prologue), K % 8 == 0
  int variant;       // gemv_variant(), set by the launch
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
constexpr int kStageElems = 8192 + 8 * kMaxStagedRows;  // 16.1 KB of 16-bit x a block, at most
DS_HOST_DEVICE constexpr int stage_ld(int K) { return K + 8; }  // + 16 bytes: no bank conflicts
DS_HOST_DEVICE constexpr bool stage_fits(int M, int K) {
  return int64_t(M) * stage_ld(K) <= kStageElems;
}

struct NoPrologue {
  static constexpr bool kStaged = false;
  struct Params {};
};

// Dynamic shared memory of a block, in bytes: [the weight tile, kTileCols rows stage_ld(K)
// apart, when the tile is copied in (kSmemW)][x staged by the prologue, M rows][mbarrier].
DS_HOST_DEVICE constexpr int64_t tile_smem(int K, bool smem_w) {
  return smem_w ? int64_t(kTileCols) * stage_ld(K) * 2 : 0;
}
DS_HOST_DEVICE constexpr int64_t bar_offset(int M, int K, bool smem_w, bool staged) {
  return tile_smem(K, smem_w) + (staged ? int64_t(M) * stage_ld(K) * 2 : 0);  // 16-byte multiple
}
DS_HOST_DEVICE constexpr int64_t dynamic_smem(int M, int K, bool smem_w, bool staged) {
  return smem_w || staged ? bar_offset(M, K, smem_w, staged) + (smem_w ? 16 : 0) : 0;
}

// kSmemW: the block's weight tile (rows n0..n0+7, contiguous in W) is copied into shared memory
// by the copy engine from the block's first instruction (tile_copy.cuh), before the wait for the
// kernel that writes x: the weight stream overlaps that kernel's tail, the launch and the
// prologue, and no register holds a weight load in flight. Else the tile is prefetched into L2
// by one bulk request, and the warps load it into registers after the prologue.
// XR: rows of x a lane loads (1, 2 or 4: M <= 8, 16 or 32).
template <typename T, int WARPS, class Pro, bool kSmemW, int XR>
__global__ void __launch_bounds__(WARPS * kWarp) gemv_kernel(const GemvParams p,
                                                             const typename Pro::Params pro) {
  static_assert(sizeof(T) == 2, "16-bit operands (the MMA's)");
  static_assert(XR == 1 || XR == 2 || XR == 4, "8, 16 or 32 rows of x");
  static_assert(!Pro::kStaged || XR == 1, "a prologue stages at most kMaxStagedRows rows");
  constexpr int kGroups = XR == 1 ? 1 : XR / 2;  // MMAs per weight register (16 rows each)
  const int warp = static_cast<int>(threadIdx.x) / kWarp;
  const int lane = static_cast<int>(threadIdx.x) % kWarp, g = lane / 4, t = lane % 4;
  const int n0 = static_cast<int>(blockIdx.x) * kTileCols;
  const int tile_rows = p.N - n0 < kTileCols ? p.N - n0 : kTileCols;
  const bool w_ok = g < tile_rows;  // a tile past the last column reads zeros
  const int ld = stage_ld(p.K);
  const int chunks = static_cast<int>(ceil_div(p.K, kChunk));

  DS_DYNAMIC_SHARED(smem);
  T* const wtile = reinterpret_cast<T*>(smem);
  T* const staged = reinterpret_cast<T*>(smem + tile_smem(p.K, kSmemW));
  const T* const wfirst_row = static_cast<const T*>(p.w) + int64_t(n0) * p.K;
  const TileCopy tile{reinterpret_cast<const unsigned char*>(wfirst_row), smem,
                      int64_t(p.K) * 2, ld * 2, tile_rows, p.K * 2,
                      reinterpret_cast<uint64_t*>(
                          smem + bar_offset(p.M, p.K, kSmemW, Pro::kStaged))};
  if constexpr (kSmemW) {
    tile_copy_start(tile);
    if (p.variant & 2) launch_dependents();
  } else if (threadIdx.x == 0) {
    prefetch_l2_bulk(wfirst_row, static_cast<uint32_t>(tile_rows * p.K * 2));
  }
  grid_dependency_wait();  // x (or what the prologue makes it from) comes from the kernel before

  const uint4 zero = {0u, 0u, 0u, 0u};
  // chunk c = base + u * WARPS: this lane's first element k = c * kChunk + 8 t, whose row
  // offset from `wfirst` (`xfirst`) is a constant per u: an immediate in the loads
  const T* wrow = kSmemW ? wtile + (w_ok ? g : 0) * ld + 8 * t
                         : wfirst_row + int64_t(w_ok ? g : 0) * p.K + 8 * t;
  uint4 wv[kUnroll];
  const auto load_round = [&](int base) {
    const int k0 = base * kChunk + 8 * t;
    const T* wfirst = wrow + int64_t(base) * kChunk;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const bool in = w_ok && k0 + u * WARPS * kChunk < p.K;
      if constexpr (kSmemW) wv[u] = in ? load16(wfirst + u * WARPS * kChunk) : zero;
      else wv[u] = in ? load_weight16(wfirst + u * WARPS * kChunk) : zero;
    }
  };
  // The prologue runs before the first weight loads: its row values and the loads' registers
  // would otherwise be live together (a norm prologue then takes 128 registers a thread, and a
  // 1024-block grid two waves). The weights are on their way meanwhile (copy or L2 prefetch).
  if constexpr (Pro::kStaged) Pro::template stage<T>(pro, staged, ld, p.M);
  if constexpr (kSmemW) tile_copy_wait(tile);
  load_round(warp);
  if (!(kSmemW && (p.variant & 2))) launch_dependents();  // the next kernel may start
                                                          // launching; it waits for our writes

  bool x_ok[XR];
  const T* xrow[XR];
#pragma unroll
  for (int i = 0; i < XR; ++i) {
    const int r = g + 8 * i;
    x_ok[i] = r < p.M;
    xrow[i] = Pro::kStaged ? staged + (x_ok[i] ? r : 0) * ld + 8 * t
                           : static_cast<const T*>(p.x) + (x_ok[i] ? r : 0) * p.ldx + 8 * t;
  }
  float d[kGroups][4] = {};
  for (int base = warp; base < chunks; base += kUnroll * WARPS) {
    if (base != warp) load_round(base);
    const int k0 = base * kChunk + 8 * t;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * WARPS >= chunks) break;  // warp-uniform: every lane runs each MMA
      const bool k_in = k0 + u * WARPS * kChunk < p.K;
      uint4 xv[XR];
#pragma unroll
      for (int i = 0; i < XR; ++i)
        xv[i] = x_ok[i] && k_in ? load16(xrow[i] + int64_t(base) * kChunk + u * WARPS * kChunk)
                                : zero;
      const uint32_t b0[2] = {wv[u].x, wv[u].y}, b1[2] = {wv[u].z, wv[u].w};
#pragma unroll
      for (int j = 0; j < kGroups; ++j) {  // rows 16 j + g (register 0, 2), + 8 (1, 3)
        const uint4 lo = xv[XR == 1 ? 0 : 2 * j], hi = XR == 1 ? zero : xv[2 * j + 1];
        const uint32_t a0[4] = {lo.x, hi.x, lo.y, hi.y}, a1[4] = {lo.z, hi.z, lo.w, hi.w};
        mma_16816<T>(d[j], a0, b0);
        mma_16816<T>(d[j], a1, b1);
      }
    }
  }

  // d[j][2 h + c] = this warp's part of y[g + 8 (2 j + h)][n0 + 2t + c], kept at
  // part[warp][lane][2 i + c] for x row i = 2 j + h; summed over the warps in warp order (fixed:
  // the same bits on every run).
  __shared__ float part[WARPS][kWarp][2 * XR];
#pragma unroll
  for (int i = 0; i < XR; ++i) {
    part[warp][lane][2 * i] = d[i / 2][2 * (i % 2)];
    part[warp][lane][2 * i + 1] = d[i / 2][2 * (i % 2) + 1];
  }
  __syncthreads();
  for (int out = static_cast<int>(threadIdx.x); out < 8 * XR * kTileCols; out += WARPS * kWarp) {
    const int m = out / kTileCols, j = out % kTileCols, col = n0 + j;
    if (m < p.M && col < p.N) {
      // lane g = m % 8, t = j / 2 holds column j of row m in its x row i = m / 8, word j % 2
      const int src = (m % 8) * 4 + j / 2, e = 2 * (m / 8) + j % 2;
      float s = part[0][src][e];
#pragma unroll
      for (int w = 1; w < WARPS; ++w) s = fadd(s, part[w][src][e]);
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

// DS_GEMV_VARIANT (A/B runs): bit 1 = the copied-tile kernel (kSmemW) where it fits, bit 2 =
// the dependents triggered before the wait instead of after the first loads, bit 4 = the
// register path for more than 8 rows whatever bit 1 says (a guess to measure: with no tile in
// shared memory, L1 keeps the whole of x for the blocks of an SM). The default, 3 (bits 1 and
// 2), took 2-3% off the 0.8B config's batch-1 step against 0 (the tile in registers
// everywhere) in two same-call A/Bs on H100s (docs/kernels.md).
constexpr int kDefaultGemvVariant = 3;
inline int gemv_variant() {
  static const int v = [] {
    const char* e = std::getenv("DS_GEMV_VARIANT");
    return e != nullptr && e[0] != '\0' ? atoi(e) : kDefaultGemvVariant;  // unset or empty
  }();
  return v;
}

// Rows of x a lane loads for M rows (1, 2 or 4).
DS_HOST_DEVICE constexpr int x_rows_per_lane(int M) { return M <= 8 ? 1 : M <= 16 ? 2 : 4; }

template <typename T, class Pro, bool kSmemW, int XR>
inline ds_error_t launch_gemv_shape(const GemvParams& p, const typename Pro::Params& pro,
                                    int64_t blocks, int warps, ds_stream_t stream) {
  const size_t smem = static_cast<size_t>(dynamic_smem(p.M, p.K, kSmemW, Pro::kStaged));
  switch (warps) {
    case 4:
      return launch_dyn(gemv_kernel<T, 4, Pro, kSmemW, XR>, blocks, 4 * kWarp, smem, stream,
                        Pdl::kOn, p, pro);
    case 8:
      return launch_dyn(gemv_kernel<T, 8, Pro, kSmemW, XR>, blocks, 8 * kWarp, smem, stream,
                        Pdl::kOn, p, pro);
    default:
      return launch_dyn(gemv_kernel<T, 16, Pro, kSmemW, XR>, blocks, 16 * kWarp, smem, stream,
                        Pdl::kOn, p, pro);
  }
}

template <typename T, class Pro, bool kSmemW>
inline ds_error_t launch_gemv_rows(const GemvParams& p, const typename Pro::Params& pro,
                                   int64_t blocks, int warps, ds_stream_t stream) {
  if constexpr (Pro::kStaged) {
    return launch_gemv_shape<T, Pro, kSmemW, 1>(p, pro, blocks, warps, stream);
  } else {
    switch (x_rows_per_lane(p.M)) {
      case 1: return launch_gemv_shape<T, Pro, kSmemW, 1>(p, pro, blocks, warps, stream);
      case 2: return launch_gemv_shape<T, Pro, kSmemW, 2>(p, pro, blocks, warps, stream);
      default: return launch_gemv_shape<T, Pro, kSmemW, 4>(p, pro, blocks, warps, stream);
    }
  }
}

// The copied-tile kernel runs where its shared memory still lets as many blocks share a
// multiprocessor as one wave of the grid needs (up to 8: a grid of more waves keeps 8 tiles in
// flight per multiprocessor). Else (M = 8 at N >= 4 blocks per SM: x's stage and the tile
// would take two waves) the tile is prefetched into L2 and loaded into registers.
template <typename T, class Pro>
inline ds_error_t launch_gemv_with(GemvParams p, const typename Pro::Params& pro,
                                   ds_stream_t stream) {
  p.variant = gemv_variant();
  int sms = 0, per_sm = 0, per_block = 0;
  ds_error_t err = multiprocessor_count(&sms);
  if (err == DS_SUCCESS) err = shared_memory_limits(&per_sm, &per_block);
  if (err != DS_SUCCESS) return err;
  const int64_t blocks = ceil_div(p.N, kTileCols);
  const int warps = gemv_warps(blocks, sms);
  int64_t want = ceil_div(blocks, sms);
  want = want < 8 ? want : 8;
  const int64_t smem = dynamic_smem(p.M, p.K, true, Pro::kStaged);
  const int64_t partials =  // the static part[][][] sums
      int64_t(warps) * kWarp * 2 * (Pro::kStaged ? 1 : x_rows_per_lane(p.M)) * 4;
  const int64_t block_smem = smem + partials + 1024;  // + what the runtime reserves a block
  const bool rows_in_registers = (p.variant & 4) && !Pro::kStaged && x_rows_per_lane(p.M) > 1;
  if ((p.variant & 1) && !rows_in_registers && smem + partials <= per_block &&
      want * block_smem <= per_sm)
    return launch_gemv_rows<T, Pro, true>(p, pro, blocks, warps, stream);
  return launch_gemv_rows<T, Pro, false>(p, pro, blocks, warps, stream);
}

template <typename T>
inline ds_error_t launch_gemv(const GemvParams& p, ds_stream_t stream) {
  if (!gemv_args_ok(p)) return DS_ERROR_INVALID_VALUE;
  return launch_gemv_with<T, NoPrologue>(p, NoPrologue::Params{}, stream);
}

}  // namespace gemv
}  // namespace ds
