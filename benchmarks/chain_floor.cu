// The floor of gdn_decode's memory traffic where its targets are set: an in-place pass over B
// requests' fp32 state (32 x 128 x 128 per request, Qwen3-Next) with no GDN math, timed as
// bench_kernels times decode: a CUDA graph of 32 chained launches on distinct buffers, µs per
// launch (median of 25 graph replays). It asks whether any access pattern reaches the decode
// targets at B = 8 (<= 9 µs) and 64 (<= 68 µs) in that form (session 17, RESULTS.md):
//   flat      one float4 per thread, 256-thread blocks (torch's in-place mul_ is this kind)
//   flat4     four float4 per thread, all loaded before any is stored
//   (flat and flat4 pdl: dependents released at the start, one L2 prefetch per 128-byte line
//   of the thread's data before the grid-dependency wait; session 18)
//   tile      decode's pattern: 8 lanes per 128-float row, 2 rows per thread, 2 tiles of 32 rows
//             per 128-thread block, the second prefetched into L2, 4 blocks per SM (decode's
//             register cap, held here by dynamic shared memory); pdl: programmatic dependent
//             launch as decode does it (dependents released at the start, first tile prefetched
//             into L2 before the grid-dependency wait); variants (session 18): pf-all, every
//             tile of the block prefetched before the wait; tile4 / tile8, 4 / 8 tiles a block;
//             no-next-pf, the second tile not prefetched; tile1, one tile a block; (8/SM) the
//             shared-memory cap at 8 blocks per SM instead of 4
//   wtile     decode's layout in blocks of 1, 2 or 4 warps (8 rows a warp), 1 or 2 tiles a block,
//             PDL, occupancy left to the registers (fla-core's unit of work: one warp, 8 rows)
//   bulk      every tile of the block brought into shared memory by one TMA bulk copy each
//             (cp.async.bulk, mbarrier completion) after the wait, then read by the threads in
//             decode's layout and stored from registers; T tiles per block
//   bulk+st   the same, the result written back to shared memory and stored by bulk copies
// Standalone (sm_90, no torch):
//   nvcc -O3 -arch=sm_90 -std=c++17 benchmarks/chain_floor.cu -o /tmp/chain_floor && /tmp/chain_floor
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                        \
  do {                                                                               \
    cudaError_t e = (x);                                                             \
    if (e != cudaSuccess) {                                                          \
      printf("CUDA error %s at line %d\n", cudaGetErrorString(e), __LINE__);         \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

constexpr int64_t kPerReq = 32LL * 128 * 128;  // floats per request
constexpr int kChain = 32;
constexpr int kTileRows = 32;                  // rows of 128 floats: 16 KB
constexpr int kTileBytes = kTileRows * 128 * 4;

__device__ __forceinline__ void pdl_release() { asm volatile("griddepcontrol.launch_dependents;"); }
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// fake row work: a 16-long fma chain and 2 rounds of a 3-level group butterfly (a row step's
// latency), then every element rewritten
__device__ __forceinline__ void work(float (&s)[16], float c) {
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) acc = fmaf(s[i], 0.5f, acc);
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    acc += __shfl_xor_sync(0xffffffffu, acc, 4);
    acc += __shfl_xor_sync(0xffffffffu, acc, 2);
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
  }
  acc *= 1e-30f;
#pragma unroll
  for (int i = 0; i < 16; ++i) s[i] = s[i] * c + acc;
}

// PDL: dependents released at the start, the thread's 128-byte line (one thread in 8) or its
// four float4 prefetched into L2 before the grid-dependency wait
template <bool PDL>
__global__ void flat_k(float4* a, int64_t n4, float c) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (PDL) {
    pdl_release();
    if (i < n4 && i % 8 == 0) prefetch_l2(a + i);
    pdl_wait();
  }
  if (i >= n4) return;
  float4 x = a[i];
  x.x *= c; x.y *= c; x.z *= c; x.w *= c;
  a[i] = x;
}

template <bool PDL>
__global__ void flat4_k(float4* a, int64_t n4, float c) {
  const int64_t base = blockIdx.x * int64_t(blockDim.x) * 4 + threadIdx.x;
  if (PDL) {
    pdl_release();
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int64_t i = base + u * blockDim.x;
      if (i < n4 && i % 8 == 0) prefetch_l2(a + i);
    }
    pdl_wait();
  }
  float4 x[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const int64_t i = base + u * blockDim.x;
    if (i < n4) x[u] = a[i];
  }
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const int64_t i = base + u * blockDim.x;
    x[u].x *= c; x[u].y *= c; x[u].z *= c; x[u].w *= c;
    if (i < n4) a[i] = x[u];
  }
}

// decode's layout within a tile of 32 rows: thread (group g = tid / 8, lane l = tid % 8) holds
// rows g and g + 16, float4 j of a row at (j * 8 + l) * 4
__device__ __forceinline__ int64_t piece(int m, int j) {
  const int g = threadIdx.x / 8, l = threadIdx.x % 8;
  return (m * 16 + g) * 128 + (j * 8 + l) * 4;
}

__device__ __forceinline__ void load_rows(const float* tile, float (&s)[2][16]) {
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float4 p = *reinterpret_cast<const float4*>(tile + piece(m, j));
      s[m][j * 4] = p.x; s[m][j * 4 + 1] = p.y; s[m][j * 4 + 2] = p.z; s[m][j * 4 + 3] = p.w;
    }
}
__device__ __forceinline__ void store_rows(float* tile, const float (&s)[2][16]) {
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int j = 0; j < 4; ++j)
      *reinterpret_cast<float4*>(tile + piece(m, j)) =
          make_float4(s[m][j * 4], s[m][j * 4 + 1], s[m][j * 4 + 2], s[m][j * 4 + 3]);
}

// decode's layout in blocks of WARPS warps (a tile of WARPS * 8 rows: group g = tid / 8 holds
// rows g and g + WARPS * 4), T tiles a block, the next prefetched while the current computes:
// small units of work in the manner of fla-core's fused_recurrent (one warp, 8 value rows a
// program), which beat gdn_decode by 1.7% at B=64 in session 18's bench_kernels
template <int WARPS, int T>
__global__ void wtile_k(float* st, float c) {
  constexpr int kRows = WARPS * 8, kHalf = WARPS * 4;
  float* base = st + int64_t(blockIdx.x) * T * kRows * 128;
  pdl_release();
  const int g = threadIdx.x / 8, l = threadIdx.x % 8;
  const auto prefetch = [&](int t) {
    if (l < 4) {
      prefetch_l2(base + t * kRows * 128 + g * 128 + l * 32);
      prefetch_l2(base + t * kRows * 128 + (kHalf + g) * 128 + l * 32);
    }
  };
  prefetch(0);
  pdl_wait();
  for (int t = 0; t < T; ++t) {
    float* tile = base + t * kRows * 128;
    float s[2][16];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float4 p = *reinterpret_cast<const float4*>(tile + (m * kHalf + g) * 128 +
                                                          (j * 8 + l) * 4);
        s[m][j * 4] = p.x; s[m][j * 4 + 1] = p.y; s[m][j * 4 + 2] = p.z; s[m][j * 4 + 3] = p.w;
      }
    if (t + 1 < T) prefetch(t + 1);
#pragma unroll
    for (int m = 0; m < 2; ++m) work(s[m], c);
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        *reinterpret_cast<float4*>(tile + (m * kHalf + g) * 128 + (j * 8 + l) * 4) =
            make_float4(s[m][j * 4], s[m][j * 4 + 1], s[m][j * 4 + 2], s[m][j * 4 + 3]);
  }
}

// T tiles per block; PF_ALL: all of them prefetched before the wait (else the first, and each
// next one while the current one computes, unless NO_NEXT)
template <bool PDL, bool PF_ALL = false, int T = 2, bool NO_NEXT = false>
__global__ void __launch_bounds__(128) tile_k(float* st, float c) {
  float* base = st + int64_t(blockIdx.x) * T * kTileRows * 128;
  if (PDL) pdl_release();
  const int g = threadIdx.x / 8, l = threadIdx.x % 8;
  const auto prefetch_tile = [&](int t) {
    if (l < 4) {
      prefetch_l2(base + t * kTileRows * 128 + g * 128 + l * 32);
      prefetch_l2(base + t * kTileRows * 128 + (16 + g) * 128 + l * 32);
    }
  };
  for (int t = 0; t < (PF_ALL ? T : 1); ++t) prefetch_tile(t);
  if (PDL) pdl_wait();
  for (int t = 0; t < T; ++t) {
    float* tile = base + t * kTileRows * 128;
    float s[2][16];
    load_rows(tile, s);
    if (!PF_ALL && !NO_NEXT && t + 1 < T) prefetch_tile(t + 1);
#pragma unroll
    for (int m = 0; m < 2; ++m) work(s[m], c);
    store_rows(tile, s);
  }
}

__device__ __forceinline__ void mbar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)));
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, int bytes, uint64_t* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes) : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
  asm volatile(
      "{\n .reg .pred p;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra WAIT;\n}\n" ::"r"(smem_addr(bar)), "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk_store(void* dst, const void* src, int bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
               "r"(smem_addr(src)), "r"(bytes) : "memory");
}

template <int T, bool PDL, bool BULK_STORE>
__global__ void __launch_bounds__(128) bulk_k(float* st, float c) {
  extern __shared__ __align__(128) float buf[];  // [T][32 * 128]
  __shared__ __align__(8) uint64_t bar[T];
  float* base = st + int64_t(blockIdx.x) * T * kTileRows * 128;
  if (PDL) pdl_release();
  if (threadIdx.x == 0) {
    for (int t = 0; t < T; ++t) mbar_init(&bar[t]);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (PDL && threadIdx.x < 32) prefetch_l2(base + threadIdx.x * 128);  // a first touch only
  __syncthreads();
  if (PDL) pdl_wait();
  if (threadIdx.x == 0)
    for (int t = 0; t < T; ++t)
      bulk_load(buf + t * kTileRows * 128, base + t * kTileRows * 128, kTileBytes, &bar[t]);
  for (int t = 0; t < T; ++t) {
    mbar_wait(&bar[t], 0);
    float* sm = buf + t * kTileRows * 128;
    float s[2][16];
    load_rows(sm, s);
#pragma unroll
    for (int m = 0; m < 2; ++m) work(s[m], c);
    float* out = BULK_STORE ? sm : base + t * kTileRows * 128;
    store_rows(out, s);
    if (BULK_STORE) {
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      __syncthreads();
      if (threadIdx.x == 0) {
        bulk_store(base + t * kTileRows * 128, sm, kTileBytes);
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      }
    }
  }
  if (BULK_STORE && threadIdx.x == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}

// µs per launch of a graph of kChain launches, launch(i) enqueueing call i on the stream
template <typename F>
float chained(cudaStream_t s, F launch) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < kChain; ++i) launch(i);
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(ge, s));
  std::vector<float> ts;
  for (int i = 0; i < 25; ++i) {
    CK(cudaEventRecord(a, s));
    CK(cudaGraphLaunch(ge, s));
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    ts.push_back(ms * 1000.f / kChain);
  }
  CK(cudaGetLastError());
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

// one launch with or without programmatic dependent launch
template <typename... KArgs, typename... Args>
void launch_any(cudaStream_t s, void (*kern)(KArgs...), int64_t blocks, int threads, int smem,
                bool pdl, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(blocks));
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  CK(cudaLaunchKernelEx(&cfg, kern, args...));
}
template <typename Kern>
void launch_ex(cudaStream_t s, Kern kern, int64_t blocks, int smem, bool pdl, float* st) {
  launch_any(s, kern, blocks, 128, smem, pdl, st, 1.0f);
}
void launch_flat(cudaStream_t s, void (*kern)(float4*, int64_t, float), int64_t blocks, bool pdl,
                 float* st, int64_t n4) {
  launch_any(s, kern, blocks, 256, 0, pdl, reinterpret_cast<float4*>(st), n4, 1.0f);
}

// dynamic shared memory that holds a kernel to `cap` blocks per SM (at least `need`)
template <typename Kern>
int cap_smem(Kern kern, int cap, int need) {
  int smem = cap > 0 ? (228 * 1024) / cap - 1024 - 256 : need;
  if (smem < need) smem = need;
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  return smem;
}

int main() {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const int Bs[] = {1, 8, 64, 256};
  const int64_t most = 256 * kPerReq;
  float* pool;
  CK(cudaMalloc(&pool, most * 4 * kChain));
  CK(cudaMemset(pool, 0, most * 4 * kChain));
  const auto buf = [&](int i, int64_t n) { return pool + int64_t(i) * n; };
  for (int B : Bs) {
    const int64_t n = B * kPerReq, n4 = n / 4;
    const double bytes = 2.0 * n * 4;
    const double ideal = bytes / 4274e3;  // µs at the copy bandwidth of TARGETS.md
    printf("B=%d (ideal %.2f us at 4,274 GB/s)\n", B, ideal);
    const auto report = [&](const char* name, float us) {
      printf("  %-28s %8.2f us  %6.0f GB/s\n", name, us, bytes / us * 1e-3);
    };
    for (int pdl = 0; pdl < 2; ++pdl) {
      report(pdl ? "flat pdl" : "flat", chained(s, [&](int i) {
        launch_flat(s, pdl ? flat_k<true> : flat_k<false>, (n4 + 255) / 256, pdl, buf(i, n), n4);
      }));
      report(pdl ? "flat4 pdl" : "flat4", chained(s, [&](int i) {
        launch_flat(s, pdl ? flat4_k<true> : flat4_k<false>, (n4 + 1023) / 1024, pdl, buf(i, n),
                    n4);
      }));
    }
    const int64_t tiles = n / (kTileRows * 128);
    for (int pdl = 0; pdl < 2; ++pdl) {
      auto kern = pdl ? tile_k<true> : tile_k<false>;
      const int smem = cap_smem(kern, 4, 0);
      report(pdl ? "tile pdl (4/SM)" : "tile (4/SM)", chained(s, [&](int i) {
        launch_ex(s, kern, tiles / 2, smem, pdl, buf(i, n));
      }));
    }
    const auto tile_pf = [&](auto kern, int T, int cap, const char* name) {
      const int smem = cap_smem(kern, cap, 0);
      report(name, chained(s, [&](int i) {
        launch_ex(s, kern, tiles / T, smem, true, buf(i, n));
      }));
    };
    tile_pf(tile_k<true, true, 2>, 2, 4, "tile pdl pf-all (4/SM)");
    tile_pf(tile_k<true, true, 2>, 2, 8, "tile pdl pf-all (8/SM)");
    tile_pf(tile_k<true, false, 2>, 2, 8, "tile pdl (8/SM)");
    tile_pf(tile_k<true, false, 2, true>, 2, 4, "tile pdl no-next-pf (4/SM)");
    tile_pf(tile_k<true, false, 1>, 1, 8, "tile1 pdl (8/SM)");
    tile_pf(tile_k<true, false, 4>, 4, 4, "tile4 pdl (4/SM)");
    tile_pf(tile_k<true, true, 4>, 4, 4, "tile4 pdl pf-all (4/SM)");
    tile_pf(tile_k<true, true, 4>, 4, 8, "tile4 pdl pf-all (8/SM)");
    tile_pf(tile_k<true, true, 8>, 8, 4, "tile8 pdl pf-all (4/SM)");
    const auto wtile = [&](auto kern, int warps, int T, const char* name) {
      const int64_t blocks = n / (int64_t(warps) * 8 * 128 * T);
      int occ;
      CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kern, warps * 32, 0));
      char label[64];
      snprintf(label, sizeof label, "%s (%d/SM)", name, occ);
      report(label, chained(s, [&](int i) {
        launch_any(s, kern, blocks, warps * 32, 0, true, buf(i, n), 1.0f);
      }));
    };
    wtile(wtile_k<1, 1>, 1, 1, "wtile 1 warp, 1 tile");
    wtile(wtile_k<1, 2>, 1, 2, "wtile 1 warp, 2 tiles");
    wtile(wtile_k<2, 1>, 2, 1, "wtile 2 warps, 1 tile");
    wtile(wtile_k<2, 2>, 2, 2, "wtile 2 warps, 2 tiles");
    wtile(wtile_k<4, 2>, 4, 2, "wtile 4 warps, 2 tiles");
    const auto bulk = [&](auto kern, int T, bool pdl, int cap, const char* name) {
      if (tiles % T) return;
      const int smem = cap_smem(kern, cap, T * kTileBytes);
      int occ;
      CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kern, 128, smem));
      char label[64];
      snprintf(label, sizeof label, "%s T%d (%d/SM)", name, T, occ);
      report(label, chained(s, [&](int i) { launch_ex(s, kern, tiles / T, smem, pdl, buf(i, n)); }));
    };
    bulk(bulk_k<1, true, false>, 1, true, 0, "bulk pdl");
    bulk(bulk_k<2, true, false>, 2, true, 0, "bulk pdl");
    bulk(bulk_k<2, true, false>, 2, true, 4, "bulk pdl");
    bulk(bulk_k<4, true, false>, 4, true, 0, "bulk pdl");
    bulk(bulk_k<2, false, false>, 2, false, 0, "bulk");
    bulk(bulk_k<2, true, true>, 2, true, 0, "bulk+st pdl");
    bulk(bulk_k<4, true, true>, 4, true, 0, "bulk+st pdl");
  }
  return 0;
}
