// Which in-place load/store pattern over an fp32 state pool reaches copy bandwidth, with no
// GDN math: the ceiling of gdn_decode's tile pattern at large batches (session 8, RESULTS.md).
// Standalone (no torch):
//   nvcc -O3 -arch=sm_90 -std=c++17 benchmarks/state_pattern.cu -o /tmp/state_pattern
//   /tmp/state_pattern
// Prints, for B = 64 / 256 / 512 requests of a Qwen3-Next layer state (32 x 128 x 128 fp32):
// cudaMemcpy, a flat float4 in-place sweep (one float4 per thread, as torch's mul_), the same
// grid-stride over 8 blocks per SM, then decode's layout (8 lanes per 128-float row, 16 rows
// per 128-thread block per row slot) with R rows per thread, T tiles per block, L2 prefetch of
// the next tile (pf), W rounds of 3 shuffles per row standing in for the row step, and the
// blocks per SM capped through dynamic shared memory (occ); "async" variants bring the next
// tile into shared memory with cp.async while the current one is written back. Times are
// medians of 25 eager launches (CUDA events), so they sit a little above bench_kernels' graphs.
#include <cuda_runtime.h>
#include <cstdio>
#include <vector>
#include <algorithm>
#include <cstdint>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("err %s line %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)

__device__ __forceinline__ void pf(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }
__device__ __forceinline__ void cp16(void* s, const void* g) {
  unsigned sa = static_cast<unsigned>(__cvta_generic_to_shared(s));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sa), "l"(g));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void cp_wait0() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

// flat in-place a = a * c + d, one float4 per thread per iteration (mul_-like)
__global__ void flat_k(float4* a, int64_t n4, float c, float d) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4; i += int64_t(gridDim.x) * blockDim.x) {
    float4 x = a[i];
    x.x = x.x * c + d; x.y = x.y * c + d; x.z = x.z * c + d; x.w = x.w * c + d;
    a[i] = x;
  }
}

// fake per-row work: W rounds of a group butterfly over 8 lanes on a dot (latency like step()).
template <int W>
__device__ __forceinline__ float work(const float (&s)[16]) {
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) acc = fmaf(s[i], 0.5f, acc);
#pragma unroll
  for (int w = 0; w < W; ++w) {
    acc += __shfl_xor_sync(0xffffffffu, acc, 4);
    acc += __shfl_xor_sync(0xffffffffu, acc, 2);
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
  }
  return acc * 1e-30f;
}

// decode's tile layout at K=128: 8 lanes per row (float4 j of lane l at (j * 8 + l) * 4), 16
// row groups per 128-thread block, ROWS rows per thread; tile rows r0 + m * 16 + group.
struct Rows {
  float* st;
  int lane, grp;
  __device__ Rows(float* st_) : st(st_), lane(threadIdx.x % 8), grp(threadIdx.x / 8) {}
  __device__ float* at(int64_t r0, int m, int j) const {
    return st + (r0 + m * 16 + grp) * 128 + (j * 8 + lane) * 4;
  }
  template <int ROWS>
  __device__ void load(int64_t r0, float (&s)[ROWS][16]) const {
#pragma unroll
    for (int m = 0; m < ROWS; ++m)
#pragma unroll
      for (int j = 0; j < 4; ++j) put(s[m], j, *reinterpret_cast<const float4*>(at(r0, m, j)));
  }
  template <int ROWS>
  __device__ void store(int64_t r0, const float (&s)[ROWS][16]) const {
#pragma unroll
    for (int m = 0; m < ROWS; ++m)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        *reinterpret_cast<float4*>(at(r0, m, j)) =
            make_float4(s[m][j * 4], s[m][j * 4 + 1], s[m][j * 4 + 2], s[m][j * 4 + 3]);
  }
  template <int ROWS>
  __device__ void prefetch(int64_t r0) const {
    for (int m = 0; m < ROWS; ++m)
      if (lane < 4) pf(st + (r0 + m * 16 + grp) * 128 + lane * 32);
  }
  __device__ static void put(float (&row)[16], int j, float4 p) {
    row[j * 4] = p.x; row[j * 4 + 1] = p.y; row[j * 4 + 2] = p.z; row[j * 4 + 3] = p.w;
  }
};

template <int ROWS, int W>
__device__ __forceinline__ void compute(float (&s)[ROWS][16], float c) {
#pragma unroll
  for (int m = 0; m < ROWS; ++m) {
    const float dd = work<W>(s[m]);
#pragma unroll
    for (int i = 0; i < 16; ++i) s[m][i] = s[m][i] * c + dd;
  }
}

// TPB tiles per block in turn, the next one prefetched into L2 (PF) while the current computes.
template <int ROWS, int TPB, bool PF, int W>
__global__ void __launch_bounds__(128) tile_k(float* st, float c) {
  constexpr int BR = 16 * ROWS;
  const Rows rows(st);
  const int64_t base = int64_t(blockIdx.x) * TPB * BR;
  if (PF) rows.prefetch<ROWS>(base);
  for (int t = 0; t < TPB; ++t) {
    const int64_t r0 = base + t * BR;
    float s[ROWS][16];
    rows.load(r0, s);
    if (PF && t + 1 < TPB) rows.prefetch<ROWS>(r0 + BR);
    compute<ROWS, W>(s, c);
    rows.store(r0, s);
  }
}

// The same, the next tile brought into shared memory by cp.async while the current one computes
// (each thread copies and later reads only its own pieces: no barrier).
template <int ROWS, int TPB, int W>
__global__ void __launch_bounds__(128) async_k(float* st, float c) {
  constexpr int BR = 16 * ROWS;
  extern __shared__ float4 buf[];  // [ROWS * 4][128]
  const Rows rows(st);
  const int64_t base = int64_t(blockIdx.x) * TPB * BR;
  const auto issue = [&](int64_t r0) {
#pragma unroll
    for (int m = 0; m < ROWS; ++m)
#pragma unroll
      for (int j = 0; j < 4; ++j) cp16(&buf[(m * 4 + j) * 128 + threadIdx.x], rows.at(r0, m, j));
    cp_commit();
  };
  float s[ROWS][16];
  rows.load(base, s);
  if (TPB > 1) issue(base + BR);
  for (int t = 0; t < TPB; ++t) {
    const int64_t r0 = base + t * BR;
    compute<ROWS, W>(s, c);
    rows.store(r0, s);
    if (t + 1 < TPB) {
      cp_wait0();
#pragma unroll
      for (int m = 0; m < ROWS; ++m)
#pragma unroll
        for (int j = 0; j < 4; ++j) Rows::put(s[m], j, buf[(m * 4 + j) * 128 + threadIdx.x]);
      if (t + 2 < TPB) issue(r0 + 2 * BR);
    }
  }
}

static int nsm;
template <typename F>
float timeit(F launch) {
  cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) launch();
  std::vector<float> ts;
  for (int i = 0; i < 25; ++i) {
    CK(cudaEventRecord(a)); launch(); CK(cudaEventRecord(b)); CK(cudaEventSynchronize(b));
    float ms; CK(cudaEventElapsedTime(&ms, a, b)); ts.push_back(ms * 1000.f);
  }
  CK(cudaGetLastError());
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

// dynamic smem that caps the blocks per SM at cap (0: no cap)
template <typename K>
int cap_smem(K kern, int cap, int need) {
  if (cap == 0) return need;
  int smem = (228 * 1024) / (cap + 1) - 1024 + 64;
  if (smem < need) smem = need;
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  return smem;
}

template <int ROWS, int TPB, bool PF, int W>
void run_tile(float* st, int64_t rows, double bytes, float ref, int cap) {
  auto kern = tile_k<ROWS, TPB, PF, W>;
  const int smem = cap_smem(kern, cap, 0);
  int occ; CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kern, 128, smem));
  const int64_t blocks = rows / (16 * ROWS * TPB);
  float t = timeit([&] { kern<<<blocks, 128, smem>>>(st, 1.0f); });
  printf("  tile R%d T%d pf%d W%d occ%2d: %8.1f us  %6.0f GB/s  %5.1f%% of flat\n", ROWS, TPB, PF, W, occ, t, bytes / t * 1e-3, 100.f * ref / t);
}

template <int ROWS, int TPB, int W>
void run_async(float* st, int64_t rows, double bytes, float ref, int cap) {
  auto kern = async_k<ROWS, TPB, W>;
  const int need = ROWS * 4 * 128 * 16;
  const int smem = cap_smem(kern, cap, need);
  int occ; CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kern, 128, smem));
  const int64_t blocks = rows / (16 * ROWS * TPB);
  float t = timeit([&] { kern<<<blocks, 128, smem>>>(st, 1.0f); });
  printf("  async R%d T%d W%d occ%2d: %8.1f us  %6.0f GB/s  %5.1f%% of flat\n", ROWS, TPB, W, occ, t, bytes / t * 1e-3, 100.f * ref / t);
}

int main() {
  CK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0));
  const int Bs[] = {64, 256, 512};
  const int64_t per_req = 32LL * 128 * 128;  // floats
  float* st; CK(cudaMalloc(&st, 512 * per_req * 4)); CK(cudaMemset(st, 0, 512 * per_req * 4));
  float* cpy; CK(cudaMalloc(&cpy, 512 * per_req * 4));
  for (int B : Bs) {
    const int64_t n = B * per_req, rows = n / 128;
    const double bytes = 2.0 * n * 4;
    float tc = timeit([&] { CK(cudaMemcpyAsync(cpy, st, n * 4, cudaMemcpyDeviceToDevice)); });
    float tf = timeit([&] { flat_k<<<(n / 4 + 255) / 256, 256>>>(reinterpret_cast<float4*>(st), n / 4, 1.0f, 0.f); });
    float tg = timeit([&] { flat_k<<<nsm * 8, 256>>>(reinterpret_cast<float4*>(st), n / 4, 1.0f, 0.f); });
    printf("B=%d  memcpy %.1f us (%.0f GB/s)  flat %.1f us (%.0f GB/s)  flat-gridstride %.1f us\n", B, tc, bytes / tc * 1e-3, tf, bytes / tf * 1e-3, tg);
    const float ref = tf;
    run_tile<2, 2, true, 0>(st, rows, bytes, ref, 4);
    run_tile<2, 2, true, 0>(st, rows, bytes, ref, 0);
    run_tile<2, 2, false, 0>(st, rows, bytes, ref, 4);
    run_tile<2, 1, true, 0>(st, rows, bytes, ref, 4);
    run_tile<2, 4, true, 0>(st, rows, bytes, ref, 4);
    run_tile<1, 2, true, 0>(st, rows, bytes, ref, 8);
    run_tile<1, 2, true, 0>(st, rows, bytes, ref, 0);
    run_tile<4, 1, true, 0>(st, rows, bytes, ref, 4);
    run_tile<2, 2, true, 2>(st, rows, bytes, ref, 4);
    run_tile<2, 2, true, 2>(st, rows, bytes, ref, 6);
    run_async<2, 2, 0>(st, rows, bytes, ref, 4);
    run_async<2, 4, 0>(st, rows, bytes, ref, 4);
    run_async<2, 8, 0>(st, rows, bytes, ref, 4);
    run_async<2, 4, 2>(st, rows, bytes, ref, 4);
    run_async<2, 8, 2>(st, rows, bytes, ref, 4);
    run_async<1, 4, 2>(st, rows, bytes, ref, 8);
    run_async<1, 8, 2>(st, rows, bytes, ref, 8);
  }
  return 0;
}
