// One portability layer for the device code: CUDA (nvcc), HIP (clang, gfx1151 wave32) and the
// CPU emulation used by the tests (-DDS_EMU, a host compiler: csrc/emu/runtime.h).
// Shuffles, rounding-explicit float math, 16-bit float conversions, launch and error helpers.
// Device code elsewhere uses only what is defined here, never a vendor API directly.
#pragma once

#include <stdint.h>
#include <stdlib.h>

#include <map>
#include <mutex>
#include <utility>

#if defined(DS_EMU) && DS_EMU
#include "../emu/runtime.h"
#define DS_HIP 0
using ds_stream_t = void*;
using ds_error_t = int;
#define DS_SUCCESS 0
#define DS_ERROR_INVALID_VALUE 1
inline ds_error_t ds_get_last_error() { return DS_SUCCESS; }
inline ds_error_t ds_get_device(int* dev) { *dev = 0; return DS_SUCCESS; }
#elif defined(__HIP__) || defined(__HIPCC__)
#include <hip/hip_runtime.h>
#define DS_EMU 0
#define DS_HIP 1
using ds_stream_t = hipStream_t;
using ds_error_t = hipError_t;
#define DS_SUCCESS hipSuccess
#define DS_ERROR_INVALID_VALUE hipErrorInvalidValue
#define ds_get_last_error hipGetLastError
#define ds_get_device hipGetDevice
#else
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#define DS_EMU 0
#define DS_HIP 0
using ds_stream_t = cudaStream_t;
using ds_error_t = cudaError_t;
#define DS_SUCCESS cudaSuccess
#define DS_ERROR_INVALID_VALUE cudaErrorInvalidValue
#define ds_get_last_error cudaGetLastError
#define ds_get_device cudaGetDevice
#endif
#define DS_CUDA (!DS_HIP && !DS_EMU)  // the CUDA runtime's launch attributes and queries

// Everything below is device code or kernel launches: only for nvcc / clang-HIP compiles.
// Host-only files (csrc/ops/*.cpp) get the stream/error types above and nothing else.
#if defined(__CUDACC__) || defined(__HIP__) || DS_EMU

#define DS_DEVICE __device__ __forceinline__
// __launch_bounds__(threads, min blocks per SM) on CUDA. HIP reads a second argument as waves
// per EU, a different quantity, so there only the thread count is given.
#if DS_HIP
#define DS_LAUNCH_BOUNDS_MIN_BLOCKS(threads, blocks) __launch_bounds__(threads)
#else
#define DS_LAUNCH_BOUNDS_MIN_BLOCKS(threads, blocks) __launch_bounds__(threads, blocks)
#endif
#define DS_HOST_DEVICE __host__ __device__ __forceinline__

// Shared memory a kernel is given at launch (launch_dyn): `extern __shared__` on a GPU; the
// emulator, which runs one block at a time, gives a static buffer of kEmuDynamicSmem bytes.
#if DS_EMU
constexpr int kEmuDynamicSmem = 232448;  // the H100/H200's opt-in limit per block (227 KB)
#define DS_DYNAMIC_SHARED(name) \
  static unsigned char name[kEmuDynamicSmem] __attribute__((aligned(16)))
#else
#define DS_DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
#endif

namespace ds {

// Both targets run 32-lane groups: CUDA warps and RDNA wave32 (gfx11). Kernels assume it.
constexpr int kWarp = 32;

// ---- rounding-explicit arithmetic: the compiler may not contract or reorder these ----------
#if DS_HIP || DS_EMU
#if DS_HIP
#pragma clang fp contract(off)  // DS_EMU: -ffp-contract=off
#endif
DS_DEVICE float fmul(float a, float b) { return a * b; }
DS_DEVICE float fadd(float a, float b) { return a + b; }
DS_DEVICE float fsub(float a, float b) { return a - b; }
DS_DEVICE float ffma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
#else
DS_DEVICE float fmul(float a, float b) { return __fmul_rn(a, b); }
DS_DEVICE float fadd(float a, float b) { return __fadd_rn(a, b); }
DS_DEVICE float fsub(float a, float b) { return __fsub_rn(a, b); }
DS_DEVICE float ffma(float a, float b, float c) { return __fmaf_rn(a, b, c); }
#endif
DS_DEVICE float fexp(float x) { return expf(x); }
DS_DEVICE float flog1p(float x) { return log1pf(x); }
DS_DEVICE float frsqrt(float x) { return rsqrtf(x); }
DS_DEVICE float fdiv(float a, float b) { return a / b; }

// ---- shuffles ------------------------------------------------------------------------------
DS_DEVICE float shfl_xor(float v, int mask) {
#if DS_EMU
  return ds_emu::shfl_xor(v, mask);
#elif DS_HIP
  return __shfl_xor(v, mask, kWarp);
#else
  return __shfl_xor_sync(0xffffffffu, v, mask, kWarp);
#endif
}

// Lane `src` (0 .. LANES-1) of this thread's aligned group of LANES consecutive lanes.
template <int LANES>
DS_DEVICE float shfl_group(float v, int src) {
#if DS_EMU
  return ds_emu::shfl_idx(v, src, LANES);
#elif DS_HIP
  return __shfl(v, src, LANES);
#else
  return __shfl_sync(0xffffffffu, v, src, LANES);
#endif
}

// Sum over an aligned group of LANES consecutive lanes (butterfly: every lane gets the same
// bits, since each level adds the same two values in either order).
template <int LANES>
DS_DEVICE float group_sum(float v) {
#pragma unroll
  for (int off = LANES / 2; off > 0; off >>= 1) v = fadd(v, shfl_xor(v, off));
  return v;
}

// ---- 16-bit float storage types (bit patterns; no vendor header types at the interface) ----
struct bf16 { uint16_t bits; };
struct f16 { uint16_t bits; };

DS_DEVICE float to_float(float x) { return x; }
DS_DEVICE float to_float(bf16 x) { return __uint_as_float(uint32_t(x.bits) << 16); }
DS_DEVICE float to_float(f16 x) {
#if DS_HIP || DS_EMU
  return float(__builtin_bit_cast(_Float16, x.bits));
#else
  return __half2float(__ushort_as_half(x.bits));
#endif
}

template <typename T> DS_DEVICE T from_float(float x);
template <> DS_DEVICE float from_float<float>(float x) { return x; }
template <> DS_DEVICE bf16 from_float<bf16>(float x) {  // round to nearest even, quiet NaN
#if !DS_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  // One cvt instead of eight integer ops (the output store sits in the verify inner loop).
  // Same bits as the portable path below except the NaN payload (0x7fff, as torch on CUDA).
  uint16_t h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
  return bf16{h};
#else
  uint32_t u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t(0x7fc0)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{uint16_t(u >> 16)};
#endif
}
template <> DS_DEVICE f16 from_float<f16>(float x) {
#if DS_HIP || DS_EMU
  return f16{__builtin_bit_cast(uint16_t, static_cast<_Float16>(x))};
#else
  return f16{__half_as_ushort(__float2half_rn(x))};
#endif
}

// Load/store N consecutive elements (N * sizeof(T) a multiple of 8 bytes, pointer aligned).
// load_vec = load_words then words_to_float; the halves let a caller issue other loads before
// it converts (which waits for the data).
template <typename T, int N>
struct Words {
  static_assert((N * sizeof(T)) % 8 == 0, "vector loads move whole 8-byte words");
  static constexpr int kWords = N * sizeof(T) / 8;
  uint2 w[kWords];
};
template <typename T, int N>
DS_DEVICE Words<T, N> load_words(const T* __restrict__ p) {
  Words<T, N> u;
#pragma unroll
  for (int i = 0; i < Words<T, N>::kWords; ++i) u.w[i] = reinterpret_cast<const uint2*>(p)[i];
  return u;
}
template <typename T, int N>
DS_DEVICE void words_to_float(const Words<T, N>& words, float (&out)[N]) {
  union { uint2 w[Words<T, N>::kWords]; T e[N]; } u;
#pragma unroll
  for (int i = 0; i < Words<T, N>::kWords; ++i) u.w[i] = words.w[i];
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_float(u.e[i]);
}
template <typename T, int N>
DS_DEVICE void load_vec(const T* __restrict__ p, float (&out)[N]) {
  words_to_float<T, N>(load_words<T, N>(p), out);
}

template <typename T, int N>
DS_DEVICE void store_vec(T* __restrict__ p, const float (&in)[N]) {
  static_assert((N * sizeof(T)) % 8 == 0, "vector stores move whole 8-byte words");
  constexpr int kWords = N * sizeof(T) / 8;
  union { uint2 w[kWords]; T e[N]; } u;
#pragma unroll
  for (int i = 0; i < N; ++i) u.e[i] = from_float<T>(in[i]);
#pragma unroll
  for (int i = 0; i < kWords; ++i) reinterpret_cast<uint2*>(p)[i] = u.w[i];
}

// ---- 16 x 8 x 16 matrix multiply-accumulate (tensor cores on sm_80+) -------------------------
// Two 16-bit elements of a row (or column) in one 32-bit register, the lower index in the low half.
template <typename T>
DS_DEVICE uint32_t pack2(T lo, T hi) { return uint32_t(lo.bits) | (uint32_t(hi.bits) << 16); }
template <typename T>
DS_DEVICE uint32_t load_pair(const T* p) { return *reinterpret_cast<const uint32_t*>(p); }
template <typename T>
DS_DEVICE void store_pair(T* p, uint32_t w) { *reinterpret_cast<uint32_t*>(p) = w; }

// Four 8 x 8 matrices of 16-bit elements from shared memory, rows `pitch` elements apart (each
// row 16-byte aligned), matrix m at rows 8 (m % 2), columns 8 (m / 2) of `base` (kQuarters: the
// quarters of a 16 x 16 block) or at columns 8 m (kRow: one 8 x 32 block). Lane 4 g + t gets in
// d[m] row g's elements 2t, 2t+1 of matrix m, or with Trans column g's elements in rows 2t,
// 2t+1: an mma_16816 operand fragment, A from kQuarters, or with Trans B (rows = k) for two
// n-tiles. Ldsm on sm_75+: one ldmatrix.x4 (each lane passes one row's address); else (and on
// HIP, in the emulation) the same registers from direct 32- or 16-bit loads, so the emulated
// kernels check the layout.
enum class Mat4 { kQuarters, kRow };

template <bool Trans, Mat4 L, bool Ldsm = true, typename T>
DS_DEVICE void load_matrix_x4(uint32_t (&d)[4], const T* base, int pitch) {
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
#if !DS_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  if constexpr (Ldsm) {
    const int m = lane / 8;
    const int row = lane % 8 + (L == Mat4::kQuarters ? 8 * (m % 2) : 0);
    const int col = L == Mat4::kQuarters ? 8 * (m / 2) : 8 * m;
    const uint32_t addr =
        static_cast<uint32_t>(__cvta_generic_to_shared(base + row * pitch + col));
    if constexpr (Trans) {
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                   : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]) : "r"(addr));
    } else {
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                   : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]) : "r"(addr));
    }
    return;
  }
#endif
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const T* mat = base + (L == Mat4::kQuarters ? 8 * (m % 2) * pitch + 8 * (m / 2) : 8 * m);
    if constexpr (Trans)
      d[m] = pack2(mat[2 * t * pitch + g], mat[(2 * t + 1) * pitch + g]);
    else
      d[m] = load_pair(mat + g * pitch + 2 * t);
  }
}

DS_DEVICE uint32_t shfl_u32(uint32_t v, int src) {
#if DS_EMU
  return __float_as_uint(ds_emu::shfl_idx(__uint_as_float(v), src, kWarp));  // bits moved, no math
#elif DS_HIP
  return static_cast<uint32_t>(__shfl(static_cast<int>(v), src, kWarp));
#else
  return __shfl_sync(0xffffffffu, v, src, kWarp);
#endif
}

// d += A B for one warp: A 16 x 16 (row-major), B 16 x 8 (column-major), T bf16 or f16, fp32
// accumulators. Fragments as the PTX ISA's "Matrix Fragments for mma.m16n8k16 with floating
// point type": lane = 4 g + t holds
//   a[0] = A[g][2t, 2t+1], a[1] = A[g+8][2t, 2t+1],
//   a[2] = A[g][2t+8, 2t+9], a[3] = A[g+8][2t+8, 2t+9]
//   b[0] = B[2t, 2t+1][g], b[1] = B[2t+8, 2t+9][g]
//   d[0], d[1] = D[g][2t, 2t+1], d[2], d[3] = D[g+8][2t, 2t+1]
// (pairs packed by pack2). Every lane of the warp calls it. sm_80+ CUDA: one mma.sync. Elsewhere
// (HIP, the CPU emulation, older CUDA) the same product from shuffles and fp32 FMAs: correct and
// slow (products of 16-bit floats are exact in fp32; only the order of the sums differs).
template <typename T>
DS_DEVICE void mma_16816_portable(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  const auto lo = [](uint32_t w) { return to_float(T{uint16_t(w & 0xffffu)}); };
  const auto hi = [](uint32_t w) { return to_float(T{uint16_t(w >> 16)}); };
  const int lane = static_cast<int>(threadIdx.x) % kWarp, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int s = 0; s < 4; ++s) {  // k = 2s, 2s+1 (register 0) and 2s+8, 2s+9 (register 1)
    uint32_t ar[4], b0[2], b1[2];
#pragma unroll
    for (int i = 0; i < 4; ++i) ar[i] = shfl_u32(a[i], 4 * g + s);  // rows g, g + 8
#pragma unroll
    for (int c = 0; c < 2; ++c) {  // columns 2t + c
      b0[c] = shfl_u32(b[0], 4 * (2 * t + c) + s);
      b1[c] = shfl_u32(b[1], 4 * (2 * t + c) + s);
    }
#pragma unroll
    for (int c = 0; c < 2; ++c) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {  // row g + 8r: registers r (k 2s..) and r + 2 (k 2s+8..)
        float acc = d[2 * r + c];
        acc = ffma(lo(ar[r]), lo(b0[c]), acc);
        acc = ffma(hi(ar[r]), hi(b0[c]), acc);
        acc = ffma(lo(ar[r + 2]), lo(b1[c]), acc);
        acc = ffma(hi(ar[r + 2]), hi(b1[c]), acc);
        d[2 * r + c] = acc;
      }
    }
  }
}

template <typename T>
DS_DEVICE void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);
template <>
DS_DEVICE void mma_16816<bf16>(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if !DS_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  mma_16816_portable<bf16>(d, a, b);
#endif
}
template <>
DS_DEVICE void mma_16816<f16>(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if !DS_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  mma_16816_portable<f16>(d, a, b);
#endif
}

// ---- integer atomics, bit counts, fences ---------------------------------------------------
// Integers only: a float atomic add would make a sum depend on the order blocks arrive in. The
// emulation runs a block's threads one at a time between barriers and its blocks in turn, so
// a plain read-modify-write is atomic there and a fence has nothing to order.
DS_DEVICE int popc(uint32_t v) {
#if DS_EMU
  return __builtin_popcount(v);
#else
  return __popc(v);
#endif
}
DS_DEVICE void atomic_or(uint32_t* p, uint32_t v) {  // shared or global memory
#if DS_EMU
  *p |= v;
#else
  atomicOr(reinterpret_cast<unsigned int*>(p), static_cast<unsigned int>(v));
#endif
}
DS_DEVICE int atomic_add(int* p, int v) {  // returns the old value
#if DS_EMU
  const int old = *p;
  *p = old + v;
  return old;
#else
  return atomicAdd(p, v);
#endif
}
// Orders this thread's global memory accesses before and after it, as seen from the device.
DS_DEVICE void thread_fence() {
#if !DS_EMU
  __threadfence();
#endif
}
// A load another block of the running grid may have written (after a fence and an atomic that
// say it did): from L2, never a stale L1 line. Volatile on HIP (glc: past the L0/L1 caches).
DS_DEVICE float load_coherent(const float* p) {
#if DS_EMU
  return *p;
#elif DS_HIP
  return *static_cast<const volatile float*>(p);
#else
  return __ldcg(p);
#endif
}

// ---- programmatic dependent launch (sm_90+; no-ops elsewhere and on HIP) ---------------------
// A kernel launched with `launch(..., Pdl::kOn, ...)` may start while the kernel before it in the
// stream is still running, once each block of that kernel has called launch_dependents() (any
// one of its threads) or exited; its grid_dependency_wait() still waits for the whole of that
// kernel and its writes, wherever the trigger came. Before
// grid_dependency_wait() it must not read anything that kernel may write: it only prefetches
// (prefetch_l2 never returns data, so a stale address costs bandwidth, never a wrong bit) and
// reads indices that only aim those prefetches, or aim loads after the wait that are checked
// against the index read again after it (gdn_decode's slot).
// After the wait every write of the previous kernel is visible (PTX ISA, griddepcontrol).
DS_DEVICE void grid_dependency_wait() {
#if !DS_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
DS_DEVICE void launch_dependents() {
#if !DS_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
DS_DEVICE void prefetch_l2(const void* p) {
#if !DS_HIP && defined(__CUDA_ARCH__)
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#else
  (void)p;
#endif
}
// Prefetch `bytes` contiguous bytes (16-byte aligned start, a multiple of 16) into L2 with one
// bulk request (sm_90's copy engine), issued by one thread; elsewhere a no-op.
DS_DEVICE void prefetch_l2_bulk(const void* p, uint32_t bytes) {
#if !DS_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#else
  (void)p;
  (void)bytes;
#endif
}
// A slot index read before the wait, for aiming prefetches: it may be stale or garbage, so it
// is clamped into the pool's [0, S) (S >= 1).
DS_DEVICE int64_t clamp_slot(int64_t slot, int64_t S) {
  return slot < 0 ? 0 : (slot >= S ? S - 1 : slot);
}

// ---- launch ----------------------------------------------------------------------------------
enum class Pdl { kOff, kOn };

// `query(dev, &value)` for the current device `dev` and `key`, cached: launch heuristics ask the
// runtime for attributes on every launch, and those calls cost microseconds. A failed query (or
// device lookup) is returned, not cached (it may be an error left over from an earlier
// asynchronous launch), and cleared from the runtime's last error so that the next launch's
// check does not report it. Each caller's query (its own lambda type) has its own cache.
template <typename Key, typename Value, typename Query>
inline ds_error_t cached_per_device(const Key& key, Value* value, Query query) {
  static std::mutex mu;
  static std::map<std::pair<int, Key>, Value> cache;
  int dev = 0;
  ds_error_t err = ds_get_device(&dev);
  if (err == DS_SUCCESS) {
    const std::lock_guard<std::mutex> lock(mu);
    const auto it = cache.find(std::make_pair(dev, key));
    if (it != cache.end()) {
      *value = it->second;
      return DS_SUCCESS;
    }
    err = query(dev, value);
    if (err == DS_SUCCESS) {
      cache.emplace(std::make_pair(dev, key), *value);
      return DS_SUCCESS;
    }
  }
  (void)ds_get_last_error();
  return err;
}

// Whether `kernel` may be launched with programmatic dependent launch on the current device:
// only if it was compiled from sm_90+ PTX, since only then does it contain griddepcontrol.wait
// (and such an image only loads on an sm_90+ device, so this also answers "does the GPU have
// PDL"). A build whose PTX targets an older architecture (say TORCH_CUDA_ARCH_LIST=8.0 run on an
// H100) would otherwise start early without waiting and read its inputs before the previous
// kernel wrote them. DS_PDL=0 in the environment turns PDL off (A/B runs).
#if DS_CUDA
inline bool pdl_ready(const void* kernel) {
  static const bool env_off = [] {
    const char* e = std::getenv("DS_PDL");
    return e != nullptr && e[0] == '0';
  }();
  bool ready = false;
  return !env_off && cached_per_device(kernel, &ready, [kernel](int, bool* r) {
           cudaFuncAttributes attr{};
           const cudaError_t err = cudaFuncGetAttributes(&attr, kernel);
           *r = attr.ptxVersion >= 90;
           return err;
         }) == cudaSuccess && ready;
}
#endif

// Multiprocessors of the current device (CUDA: SMs; HIP: what the runtime reports, which on
// RDNA in WGP mode is WGPs of 2 CUs each, 20 on gfx1151), for launch heuristics stated in blocks
// per multiprocessor.
inline ds_error_t multiprocessor_count(int* count) {
  return cached_per_device(0, count, [](int dev, int* n) {
#if DS_EMU
    (void)dev;
    *n = 132;  // an H100/H200's SMs, so launch heuristics take the paths they take there
    return DS_SUCCESS;
#elif DS_HIP
    return hipDeviceGetAttribute(n, hipDeviceAttributeMultiprocessorCount, dev);
#else
    return cudaDeviceGetAttribute(n, cudaDevAttrMultiProcessorCount, dev);
#endif
  });
}

#if DS_CUDA
// Dynamic shared memory, unused by `kernel`, that keeps at most `blocks_per_sm` of its blocks of
// `threads` threads resident per multiprocessor. 0 where its registers and static shared memory
// already do (cudaOccupancyMaxActiveBlocksPerMultiprocessor); else a block is given just over
// 1 / (blocks_per_sm + 1) of the multiprocessor's shared memory (+128 bytes, the allocation
// unit), so one more block does not fit even with all of it given to shared memory, while
// blocks_per_sm = 5 still fit the H100/H200's 196 KB carveout as well as its 228 KB. 0 too where
// an attribute cannot be read or the pad would pass the default dynamic limit (48 KB per block
// less the static part). The key is the kernel alone: one launcher passes the same counts.
inline size_t occupancy_pad_bytes(const void* kernel, int threads, int blocks_per_sm) {
  size_t pad = 0;
  const auto query = [=](int dev, size_t* out) {
    int per_sm = 0, reserved = 0, active = 0;
    cudaFuncAttributes attr{};
    cudaError_t err = cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor,
                                             dev);
    if (err == cudaSuccess)
      err = cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev);
    if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, kernel);
    if (err == cudaSuccess)
      err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&active, kernel, threads, 0);
    const int64_t share = int64_t(per_sm) / (blocks_per_sm + 1) + 128;
    const int64_t bytes = share - int64_t(attr.sharedSizeBytes) - reserved;
    *out = active > blocks_per_sm && bytes > 0 && bytes <= attr.maxDynamicSharedSizeBytes
               ? size_t(bytes) : 0;
    return err;
  };
  return blocks_per_sm >= 1 && cached_per_device(kernel, &pad, query) == cudaSuccess ? pad : 0;
}
#endif

#if DS_CUDA
// One cudaLaunchKernelEx with programmatic stream serialization (PDL) on.
template <typename... KArgs, typename... Args>
inline cudaError_t launch_pdl(void (*kernel)(KArgs...), dim3 grid, int threads, size_t smem,
                              ds_stream_t stream, Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, static_cast<KArgs>(args)...);
  const cudaError_t last = cudaGetLastError();  // as after <<<>>>: nothing left pending
  return err != cudaSuccess ? err : last;
}
#endif

// Every kernel goes through here: one place for launch attributes and the error check.
// `smem`: dynamic shared memory per block (bytes), which only PDL launches pass on (it pads
// their occupancy, occupancy_pad_bytes). Should the runtime refuse the launch for its
// configuration (it should not: the pad is kept under the default dynamic limit), nothing was
// enqueued and it is launched once more without.
template <typename... KArgs, typename... Args>
inline ds_error_t launch_smem(void (*kernel)(KArgs...), dim3 grid, int threads, size_t smem,
                              ds_stream_t stream, Pdl pdl, Args... args) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return DS_SUCCESS;
#if DS_EMU
  (void)pdl;
  (void)smem;
  (void)stream;
  ds_emu::run_grid(grid, dim3(threads), [&] { kernel(static_cast<KArgs>(args)...); });
  return DS_SUCCESS;
#else
#if DS_CUDA
  if (pdl == Pdl::kOn && pdl_ready(reinterpret_cast<const void*>(kernel))) {
    cudaError_t err = launch_pdl(kernel, grid, threads, smem, stream, args...);
    if (smem > 0 && (err == cudaErrorInvalidValue || err == cudaErrorInvalidConfiguration ||
                     err == cudaErrorLaunchOutOfResources))
      err = launch_pdl(kernel, grid, threads, 0, stream, args...);
    return err;
  }
#endif
  (void)pdl;
  (void)smem;
  kernel<<<grid, dim3(threads), 0, stream>>>(args...);
  return ds_get_last_error();
#endif
}

// Shared memory of a multiprocessor and the most one block may have (its opt-in limit), in
// bytes, for launch heuristics; 0 and 0 on HIP (its kernels here keep to static shared memory).
inline ds_error_t shared_memory_limits(int* per_sm, int* per_block) {
#if DS_EMU
  *per_sm = 233472;  // an H100/H200's
  *per_block = 232448;
  return DS_SUCCESS;
#elif DS_HIP
  *per_sm = *per_block = 0;
  return DS_SUCCESS;
#else
  std::pair<int, int> v{0, 0};
  const ds_error_t err = cached_per_device(0, &v, [](int dev, std::pair<int, int>* out) {
    cudaError_t e = cudaDeviceGetAttribute(&out->first,
                                           cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev);
    if (e == cudaSuccess)
      e = cudaDeviceGetAttribute(&out->second, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    return e;
  });
  *per_sm = v.first;
  *per_block = v.second;
  return err;
#endif
}

// A launch of a kernel that needs `smem` bytes of dynamic shared memory (DS_DYNAMIC_SHARED), at
// most shared_memory_limits' per_block less the kernel's static shared memory: the kernel is
// first allowed all of that (once per kernel and device; the runtime refuses a limit that counts
// the static part twice). Any dynamic amount asks for it: the default 48 KB bounds the static
// and the dynamic part together (a gemv of 32 rows: 16 KB static, 33 KB dynamic at K = 2048).
template <typename... KArgs, typename... Args>
inline ds_error_t launch_dyn(void (*kernel)(KArgs...), int64_t blocks, int threads, size_t smem,
                             ds_stream_t stream, Pdl pdl, Args... args) {
  if (blocks <= 0) return DS_SUCCESS;
  if (blocks > 0x7fffffffLL) return DS_ERROR_INVALID_VALUE;
  const dim3 grid(static_cast<unsigned>(blocks));
#if DS_EMU
  if (smem > size_t(kEmuDynamicSmem)) return DS_ERROR_INVALID_VALUE;
  return launch_smem(kernel, grid, threads, 0, stream, pdl, args...);
#else
#if DS_CUDA
  if (smem > 0) {
    int allowed = 0;
    const ds_error_t err = cached_per_device(
        reinterpret_cast<const void*>(kernel), &allowed, [kernel](int dev, int* out) {
          cudaFuncAttributes attr{};
          cudaError_t e = cudaDeviceGetAttribute(out, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                                 dev);
          if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, kernel);
          *out -= static_cast<int>(attr.sharedSizeBytes);
          if (e == cudaSuccess)
            e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, *out);
          return e;
        });
    if (err != DS_SUCCESS) return err;
  }
  if (pdl == Pdl::kOn && pdl_ready(reinterpret_cast<const void*>(kernel)))
    return launch_pdl(kernel, grid, threads, smem, stream, args...);
#endif
  (void)pdl;
  kernel<<<grid, dim3(threads), smem, stream>>>(args...);
  return ds_get_last_error();
#endif
}

template <typename... KArgs, typename... Args>
inline ds_error_t launch(void (*kernel)(KArgs...), dim3 grid, int threads, ds_stream_t stream,
                         Pdl pdl, Args... args) {
  return launch_smem(kernel, grid, threads, 0, stream, pdl, args...);
}

// A 1-D grid of `blocks` blocks (at most 2^31 - 1).
template <typename... KArgs, typename... Args>
inline ds_error_t launch(void (*kernel)(KArgs...), int64_t blocks, int threads,
                         ds_stream_t stream, Pdl pdl, Args... args) {
  if (blocks <= 0) return DS_SUCCESS;
  if (blocks > 0x7fffffffLL) return DS_ERROR_INVALID_VALUE;
  return launch(kernel, dim3(static_cast<unsigned>(blocks)), threads, stream, pdl, args...);
}

DS_HOST_DEVICE int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// n / d and n % d for a divisor fixed at launch (tiles per head, heads, block splits), as a
// multiply-high, an add and a shift: the "round-up" method of Granlund & Montgomery, "Division
// by invariant integers using multiplication" (PLDI 1994), section 4, with the magic number
// computed on the host. An integer division by a run-time value is ~25 dependent instructions,
// and gdn_verify ran three per tile (ncu, session 9, RESULTS.md).
// Exact for 1 <= d < 2^31 and 0 <= n < 2^31.
struct FastDiv {
  uint32_t d = 1, magic = 1, shift = 0;  // the default divides by 1
  FastDiv() = default;
  explicit FastDiv(int64_t divisor) : d(static_cast<uint32_t>(divisor)) {
    while ((uint64_t(1) << shift) < d) ++shift;  // shift = ceil(log2(d))
    // magic = floor(2^32 (2^shift - d) / d) + 1 < 2^32, since 2^shift - d < d
    magic = static_cast<uint32_t>(((uint64_t(1) << 32) * ((uint64_t(1) << shift) - d)) / d + 1);
  }
  DS_HOST_DEVICE int div(int n) const {
    const uint32_t u = static_cast<uint32_t>(n);
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
    const uint32_t hi = __umulhi(u, magic);
#else
    const uint32_t hi = static_cast<uint32_t>((uint64_t(u) * magic) >> 32);
#endif
    return static_cast<int>((hi + u) >> shift);  // hi + u < 2^32: hi <= u < 2^31
  }
  DS_HOST_DEVICE int mod(int n) const { return n - div(n) * static_cast<int>(d); }
};

}  // namespace ds

#endif  // defined(__CUDACC__) || defined(__HIP__)
