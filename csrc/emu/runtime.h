// A CPU emulation of the slice of the CUDA device runtime that csrc/kernels/ uses, so that the
// kernels (and their torch bindings) compile with a host C++ compiler (-DDS_EMU) and run on the
// CPU: tests/ops/test_kernels_emu.py checks their contracts (bitwise verify == decode, replay ==
// decode steps, windows untouched, against the pure-torch references) on any machine, CI
// included, where the GPU tests skip. It checks logic and indexing, never speed, and its float
// bits are the host's (libm's expf/log1pf, 1/sqrtf), not a GPU's.
//
// Model: the blocks of a grid run one after another; the threads of a block are ucontext
// fibers on one OS thread, switched only at __syncthreads() and at warp shuffles (both
// barriers: a shuffle is "write my lane's value, wait for the warp, read the partner's, wait
// again"). So `__shared__` is a static (one block at a time), memory is coherent, and a barrier
// that some threads of a block never reach is reported as a deadlock instead of hanging.
#pragma once

#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint3 {
  unsigned x, y, z;
};
struct __attribute__((aligned(16))) float4 {
  float x, y, z, w;
};
struct __attribute__((aligned(8))) uint2 {
  unsigned x, y;
};
struct __attribute__((aligned(16))) uint4 {
  unsigned x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
inline float __uint_as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline uint32_t __float_as_uint(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline int64_t min(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t max(int64_t a, int64_t b) { return a > b ? a : b; }

namespace ds_emu {

constexpr int kWarp = 32;
constexpr size_t kStackBytes = 256 * 1024;  // per thread: kernels keep small register arrays

// One block's threads and their barriers.
struct Runtime {
  struct Thread {
    ucontext_t ctx;
    uint3 idx;
    bool done;
    const uint64_t* wait_gen;  // waiting at a barrier until this generation counter moves on
    uint64_t wait_from;
  };
  struct Barrier {
    int arrived = 0;
    uint64_t generation = 0;
    const char* site = nullptr;  // where this generation's first thread arrived
  };
  ucontext_t scheduler;
  std::vector<Thread> threads;
  std::vector<char> stacks;
  std::vector<Barrier> warp_barriers;  // one per warp
  std::vector<float> warp_slots;       // one float per thread: shuffle exchange
  Barrier block_barrier;
  int current = 0, live = 0;
  uint64_t progress = 0;  // barrier releases and thread exits: the deadlock check
  const std::function<void()>* body = nullptr;
  bool reverse = false;  // DS_EMU_REVERSE=1: threads resumed last to first (see run_grid)
  uint3 block_idx{0, 0, 0};
  dim3 grid_dim, block_dim;
};

inline Runtime& runtime() {
  static thread_local Runtime rt;
  return rt;
}

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "deltaserve emulator: %s\n", what);
  std::abort();
}

inline void release(Runtime::Barrier& b) {
  b.arrived = 0;
  ++b.generation;
  ++runtime().progress;
}

// Wait until `expected` threads have arrived at `b` (the last one releases the others). The
// scheduler resumes a waiting thread only once its barrier's generation has moved on.
inline void arrive_and_wait(Runtime::Barrier& b, int expected) {
  Runtime& rt = runtime();
  if (++b.arrived == expected) return release(b);
  Runtime::Thread& th = rt.threads[rt.current];
  th.wait_gen = &b.generation;
  th.wait_from = b.generation;
  swapcontext(&th.ctx, &rt.scheduler);
  th.wait_gen = nullptr;
}

// Every thread of the block must reach the same __syncthreads() (CUDA leaves divergent barriers
// undefined; counted from any call site, they would pass here).
inline void syncthreads(const char* site) {
  Runtime& rt = runtime();
  Runtime::Barrier& b = rt.block_barrier;
  if (b.arrived == 0) b.site = site;
  else if (std::strcmp(b.site, site) != 0) fail("threads of one block wait at different __syncthreads()");
  arrive_and_wait(b, rt.live);
}

// Lane `lane ^ mask` of this thread's warp: every lane of the warp must call it (as CUDA's
// full-mask __shfl_xor_sync requires).
inline float shfl_xor(float v, int mask) {
  Runtime& rt = runtime();
  const int tid = rt.current, warp = tid / kWarp, base = warp * kWarp;
  const int lanes = static_cast<int>(rt.threads.size()) - base < kWarp
                        ? static_cast<int>(rt.threads.size()) - base : kWarp;
  const int src = base + ((tid - base) ^ mask);
  if (mask < 0 || src >= base + lanes) fail("a shuffle names a lane outside the block");
  rt.warp_slots[tid] = v;
  arrive_and_wait(rt.warp_barriers[warp], lanes);
  const float out = rt.warp_slots[src];
  arrive_and_wait(rt.warp_barriers[warp], lanes);
  return out;
}

// Lane `src` of this thread's aligned group of `width` lanes (CUDA's __shfl_sync with a width):
// every lane of the warp must call it.
inline float shfl_idx(float v, int src, int width) {
  Runtime& rt = runtime();
  const int tid = rt.current, warp = tid / kWarp, base = warp * kWarp;
  const int lanes = static_cast<int>(rt.threads.size()) - base < kWarp
                        ? static_cast<int>(rt.threads.size()) - base : kWarp;
  if (width <= 0 || width > kWarp || (width & (width - 1)) != 0 || src < 0 || src >= width)
    fail("a shuffle with a lane or width CUDA does not define");
  const int from = base + ((tid - base) & ~(width - 1)) + src;
  if (from >= base + lanes) fail("a shuffle names a lane outside the block");
  rt.warp_slots[tid] = v;
  arrive_and_wait(rt.warp_barriers[warp], lanes);
  const float out = rt.warp_slots[from];
  arrive_and_wait(rt.warp_barriers[warp], lanes);
  return out;
}

inline void thread_entry() {
  Runtime& rt = runtime();
  (*rt.body)();
  rt.threads[rt.current].done = true;
  --rt.live;
  ++rt.progress;
  // an exit while others wait at __syncthreads() is a divergent barrier too
  if (rt.block_barrier.arrived > 0) fail("a thread exits while others wait at __syncthreads()");
}  // returns to rt.scheduler (uc_link)

// Run `body` once per thread of every block of `grid` x `block`.
inline void run_grid(dim3 grid, dim3 block, const std::function<void()>& body) {
  Runtime& rt = runtime();
  const int n = static_cast<int>(block.x * block.y * block.z);
  if (n <= 0 || n > 1024) fail("block size out of range");
  const char* order = std::getenv("DS_EMU_REVERSE");
  rt.reverse = order != nullptr && order[0] == '1';
  rt.grid_dim = grid;
  rt.block_dim = block;
  rt.body = &body;
  rt.threads.assign(n, Runtime::Thread{});
  if (rt.stacks.size() < size_t(n) * kStackBytes) rt.stacks.resize(size_t(n) * kStackBytes);
  rt.warp_barriers.assign((n + kWarp - 1) / kWarp, Runtime::Barrier{});
  rt.warp_slots.assign(n, 0.f);
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        rt.block_idx = uint3{bx, by, bz};
        rt.block_barrier = Runtime::Barrier{};
        for (int t = 0; t < n; ++t) {
          Runtime::Thread& th = rt.threads[t];
          th.done = false;
          th.wait_gen = nullptr;
          th.idx = uint3{unsigned(t) % block.x, unsigned(t) / block.x % block.y,
                         unsigned(t) / (block.x * block.y)};
          getcontext(&th.ctx);
          th.ctx.uc_stack.ss_sp = rt.stacks.data() + size_t(t) * kStackBytes;
          th.ctx.uc_stack.ss_size = kStackBytes;
          th.ctx.uc_link = &rt.scheduler;
          makecontext(&th.ctx, thread_entry, 0);
        }
        rt.live = n;
        while (rt.live > 0) {
          const uint64_t before = rt.progress;
          // Between barriers threads run one at a time, in thread order (or its reverse): a
          // read of another thread's shared-memory write with no barrier between passes in one
          // of the two orders, so the tests can be run in both.
          for (int i = 0; i < n; ++i) {
            const int t = rt.reverse ? n - 1 - i : i;
            const Runtime::Thread& th = rt.threads[t];
            if (th.done || (th.wait_gen != nullptr && *th.wait_gen == th.wait_from)) continue;
            rt.current = t;
            swapcontext(&rt.scheduler, &rt.threads[t].ctx);
          }
          // A round without a release or an exit leaves every live thread waiting at a barrier
          // that no one else will reach (on a GPU this launch would hang).
          if (rt.live > 0 && rt.progress == before) fail("deadlock: a barrier never completes");
        }
      }
  rt.body = nullptr;
}

}  // namespace ds_emu

#define threadIdx (::ds_emu::runtime().threads[::ds_emu::runtime().current].idx)
#define blockIdx (::ds_emu::runtime().block_idx)
#define blockDim (::ds_emu::runtime().block_dim)
#define gridDim (::ds_emu::runtime().grid_dim)
#define DS_EMU_STR2(x) #x
#define DS_EMU_STR(x) DS_EMU_STR2(x)
#define __syncthreads() ::ds_emu::syncthreads(__FILE__ ":" DS_EMU_STR(__LINE__))
