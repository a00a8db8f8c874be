// Fused row norms and element-wise gates of the decoder layers (python/deltaserve/ops/fused.py
// holds the contracts and the pure-torch references):
//   rms_norm        y = x * rsqrt(mean(x^2) + eps) * w              (w fp32, = 1 + w_checkpoint)
//   add_rms_norm    s = round(residual + x); y = rms_norm(s)
//   gated_rms_norm  y = round(round(w * round(x_hat)) * silu(z))    (w in the activation dtype)
//   qk_norm_rope    rms_norm of q (from q|gate) and k, rounded, then rotate-half RoPE on the
//                   first `rot` channels with the activation dtype's rounding after each op
//   sigmoid_gate_mul y = round(o * round(sigmoid(gate)))
//   silu_mul        y = round(round(silu(gate)) * up)
// Memory bound: each thread moves VEC elements a load (16 bytes where the views allow, else one
// element), sums in fp32, and rounds at the points the references round (so a 16-bit output
// differs from the reference only where the fp32 sum order moves a value across a rounding
// boundary). A norm row is held in registers (at most kChunks loads a thread) between the sum
// and the output; its threads are a lane group of 16 or 32 (short rows) or a block of 128 or 512.
// Launched with programmatic dependent launch (compat.cuh): each kernel lets the next one start
// at once and waits for the one before it before reading anything, so a projection that follows
// prefetches its weights during the norm instead of after it.
// No allocation, no host synchronisation: one launch per op, CUDA-graph capturable.
#pragma once

#include "compat.cuh"

namespace ds {
namespace fused {

constexpr int kChunks = 4;     // loads of VEC elements a thread holds per norm row, at most
constexpr int kMaxRot = 256;   // rotary channels qk_norm_rope stages in shared memory, at most
constexpr int kGateThreads = 256;
constexpr int kMaxBlockThreads = 512;  // a norm block (TPR 512) or a gemv prologue's (16 warps)

// A 16-byte load/store where N * sizeof(T) is a multiple of 16, else N scalar accesses (N = 1
// is the fallback path for misaligned views).
template <typename T, int N>
DS_DEVICE void load_n(const T* __restrict__ p, float (&out)[N]) {
  if constexpr ((N * sizeof(T)) % 16 == 0) {
    constexpr int kWords = N * sizeof(T) / 16;
    union { uint4 w[kWords]; T e[N]; } u;
#pragma unroll
    for (int i = 0; i < kWords; ++i) u.w[i] = reinterpret_cast<const uint4*>(p)[i];
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_float(u.e[i]);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_float(p[i]);
  }
}

template <typename T, int N>
DS_DEVICE void store_n(T* __restrict__ p, const float (&in)[N]) {
  if constexpr ((N * sizeof(T)) % 16 == 0) {
    constexpr int kWords = N * sizeof(T) / 16;
    union { uint4 w[kWords]; T e[N]; } u;
#pragma unroll
    for (int i = 0; i < N; ++i) u.e[i] = from_float<T>(in[i]);
#pragma unroll
    for (int i = 0; i < kWords; ++i) reinterpret_cast<uint4*>(p)[i] = u.w[i];
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) p[i] = from_float<T>(in[i]);
  }
}

// x rounded to T and back: the rounding point of one torch op in the activation dtype.
template <typename T>
DS_DEVICE float round_to(float x) { return to_float(from_float<T>(x)); }

DS_DEVICE float sigmoid(float x) { return fdiv(1.f, fadd(1.f, fexp(-x))); }
DS_DEVICE float silu(float x) { return fdiv(x, fadd(1.f, fexp(-x))); }

// Rows of a strided view: row r is at ptr + (r / inner) * s0 + (r % inner) * s1 (elements),
// its last dim dense. [T, H, D] views into merged projections have s0 = the projection's row.
struct RowView {
  const void* ptr;
  int64_t s0, s1;  // elements between outer rows / inner rows
  FastDiv inner;   // inner rows per outer row (>= 1)
  template <typename T>
  DS_DEVICE const T* row(int r) const {
    const int o = inner.div(r);
    return static_cast<const T*>(ptr) + o * s0 + (r - o * static_cast<int>(inner.d)) * s1;
  }
};

enum class Norm { kRms, kAddRms, kGated, kQkRope };

struct NormParams {
  RowView x;         // the rows normalised: [rows, D] (qk: the query half of q_gate [T, Hq])
  RowView x2;        // add: residual [rows, D]; gated: z [rows, D]; qk: k [T, Hkv] rows
  const void* w;     // [D]: fp32 (rms, add, qk query) or T (gated)
  const float* w2;   // qk: k_weight [D] fp32
  void* y;           // [rows, D] dense, T (qk: q [T, Hq, D])
  void* y2;          // add: s [rows, D] dense; qk: k [T, Hkv, D] dense
  const void* cos;   // qk: [T, rot] T, rows cs_stride apart
  const void* sin;   // qk: [T, rot] T, rows cs_stride apart
  int64_t cs_stride; // qk: elements between cos (and sin) rows
  int rows;          // rows of x (qk: T * Hq)
  int rows2;         // qk: rows of k (T * Hkv); else 0
  int D;             // row length (elements)
  int rot;           // qk: rotary channels (even, <= min(D, kMaxRot))
  float eps;
};

// Sum over the TPR threads of one row: a lane group (TPR <= 32) or TPR / 32 whole warps (every
// thread of the block must call it: it has a barrier). The block holds blockDim / TPR such rows
// side by side (a norm kernel one, a gemv prologue several); the warps' parts are added in warp
// order. A caller that sums again must pass a barrier first (the parts are reused).
template <int TPR>
DS_DEVICE float row_sum(float v) {
  if constexpr (TPR <= kWarp) {
    return group_sum<TPR>(v);
  } else {
    __shared__ float part[kMaxBlockThreads / kWarp];
    v = group_sum<kWarp>(v);
    const int warp = threadIdx.x / kWarp;
    if (threadIdx.x % kWarp == 0) part[warp] = v;
    __syncthreads();
    const int first = static_cast<int>(threadIdx.x) / TPR * (TPR / kWarp);
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < TPR / kWarp; ++i) total = fadd(total, part[first + i]);
    return total;
  }
}

template <int TPR>
struct RowBlock { static constexpr int kThreads = TPR < 128 ? 128 : TPR; };  // threads a block

// The first half of a norm row, shared by norm_kernel and the gemv prologues (gemv_prologue.cuh)
// so that both give the same bits: thread `lane` of the row's TPR loads elements
// [(c * TPR + lane) * N, + N) for chunks c < kChunks that fall inside the row into v (gated:
// z into g; add: the rounded sum residual + x into v, stored to `sum_out` + col unless null),
// and the row's 1 / rms comes back. Inactive threads load nothing and still reach the barrier.
template <typename T, int N, int TPR, Norm K>
DS_DEVICE float norm_load(const NormParams& p, const RowView& view, int r, int lane, bool active,
                          T* sum_out, float (&v)[kChunks][N], float (&g)[kChunks][N]) {
  const T* src = active ? view.row<T>(r) : nullptr;
  const T* src2 = nullptr;
  if constexpr (K == Norm::kAddRms || K == Norm::kGated)
    src2 = active ? p.x2.row<T>(r) : nullptr;
  float ss = 0.f;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int col = (c * TPR + lane) * N;
    if (active && col < p.D) {
      load_n<T, N>(src + col, v[c]);
      if constexpr (K == Norm::kGated) load_n<T, N>(src2 + col, g[c]);
      if constexpr (K == Norm::kAddRms) {
        float res[N];
        load_n<T, N>(src2 + col, res);
#pragma unroll
        for (int i = 0; i < N; ++i) v[c][i] = round_to<T>(fadd(res[i], v[c][i]));
        if (sum_out != nullptr) store_n<T, N>(sum_out + col, v[c]);
      }
#pragma unroll
      for (int i = 0; i < N; ++i) ss = ffma(v[c][i], v[c][i], ss);
    }
  }
  ss = row_sum<TPR>(ss);
  return frsqrt(fadd(fdiv(ss, static_cast<float>(p.D)), p.eps));
}

// The second half: v <- the normalised, weighted row (gated: times silu(g), rounded as the
// reference), stored to `out` + col unless null (qk_norm_rope stores after its rotation).
// w32: the fp32 weight (rms, add, qk); the gated norm reads p.w in T.
template <typename T, int N, int TPR, Norm K>
DS_DEVICE void norm_out(const NormParams& p, const float* w32, int lane, bool active,
                        float (&v)[kChunks][N], const float (&g)[kChunks][N], float inv, T* out) {
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int col = (c * TPR + lane) * N;
    if (!(active && col < p.D)) continue;
    float w[N];
    if constexpr (K == Norm::kGated) {
      load_n<T, N>(static_cast<const T*>(p.w) + col, w);
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const float xh = round_to<T>(fmul(v[c][i], inv));
        v[c][i] = fmul(round_to<T>(fmul(w[i], xh)), silu(g[c][i]));
      }
    } else {
      load_n<float, N>(w32 + col, w);
#pragma unroll
      for (int i = 0; i < N; ++i) v[c][i] = fmul(fmul(v[c][i], inv), w[i]);
    }
    if (out != nullptr) store_n<T, N>(out + col, v[c]);
  }
}

// One row per TPR threads; a block holds block_threads / TPR rows. Thread `lane` of a row owns
// elements [(c * TPR + lane) * N, + N) for chunks c < kChunks that fall inside the row.
template <typename T, int N, int TPR, Norm K>
__global__ void __launch_bounds__(RowBlock<TPR>::kThreads) norm_kernel(const NormParams p) {
  constexpr int kRowsPerBlock = RowBlock<TPR>::kThreads / TPR;
  const int sub = threadIdx.x / TPR, lane = threadIdx.x % TPR;
  const int row = blockIdx.x * kRowsPerBlock + sub;
  const bool is_k = K == Norm::kQkRope && row >= p.rows;
  const int r = is_k ? row - p.rows : row;
  const bool active = row < p.rows + p.rows2;  // inactive threads still reach the barriers
  const int64_t out_off = int64_t(r) * p.D;
  // PDL: the next kernel (a projection) may launch now and pull its weights into L2 while this
  // one waits for its input and runs; it reads this kernel's output only after its own wait.
  launch_dependents();
  grid_dependency_wait();

  float v[kChunks][N], g[kChunks][N];  // g: gated's z (loaded with x)
  T* sum_out = K == Norm::kAddRms ? static_cast<T*>(p.y2) + out_off : nullptr;
  const float inv = norm_load<T, N, TPR, K>(p, is_k ? p.x2 : p.x, r, lane, active, sum_out, v, g);
  T* out = static_cast<T*>(is_k ? p.y2 : p.y) + out_off;
  norm_out<T, N, TPR, K>(p, is_k ? p.w2 : static_cast<const float*>(p.w), lane, active, v, g, inv,
                         K == Norm::kQkRope ? nullptr : out);
  if constexpr (K == Norm::kQkRope) {
    // Rotate-half pairs channel i with i +- rot/2, held by another thread: the normalised
    // (rounded) rotary channels of each row go through shared memory.
    __shared__ float staged[kRowsPerBlock][kMaxRot];
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int col = (c * TPR + lane) * N;
#pragma unroll
      for (int i = 0; i < N; ++i) {
        v[c][i] = round_to<T>(v[c][i]);
        if (active && col + i < p.rot) staged[sub][col + i] = v[c][i];
      }
    }
    __syncthreads();
    const int t = active ? (is_k ? p.x2.inner.div(r) : p.x.inner.div(r)) : 0;
    const T* cos_row = static_cast<const T*>(p.cos) + t * p.cs_stride;
    const T* sin_row = static_cast<const T*>(p.sin) + t * p.cs_stride;
    const int half = p.rot / 2;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int col = (c * TPR + lane) * N;
      if (!(active && col < p.D)) continue;
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const int j = col + i;
        if (j >= p.rot) continue;
        const float rotated = j < half ? -staged[sub][j + half] : staged[sub][j - half];
        const float a = round_to<T>(fmul(v[c][i], to_float(cos_row[j])));
        const float b = round_to<T>(fmul(rotated, to_float(sin_row[j])));
        v[c][i] = fadd(a, b);
      }
      store_n<T, N>(out + col, v[c]);
    }
  }
}

// The lane count of a row: the fewest of 16, 32, 128, 512 threads holding the row's loads in
// kChunks each (a lane group takes up to 16 or 128 loads, a block 512 or 2048).
inline int norm_threads_per_row(int64_t loads) {
  if (loads <= 16) return 16;
  if (loads <= kWarp * kChunks) return kWarp;
  if (loads <= 128 * kChunks) return 128;
  if (loads <= 512 * kChunks) return 512;
  return 0;
}

// Rows longer than this many elements (at N elements a load) are not supported.
inline int64_t norm_max_row(int n) { return int64_t(512) * kChunks * n; }

template <typename T, int N, Norm K>
inline ds_error_t launch_norm_n(const NormParams& p, ds_stream_t stream) {
  const int64_t rows = int64_t(p.rows) + p.rows2;
  const auto go = [&](auto kernel, int tpr) {
    const int threads = tpr < 128 ? 128 : tpr;
    return launch(kernel, ceil_div(rows, threads / tpr), threads, stream, Pdl::kOn, p);
  };
  switch (norm_threads_per_row(ceil_div(p.D, N))) {
    case 16: return go(norm_kernel<T, N, 16, K>, 16);
    case kWarp: return go(norm_kernel<T, N, kWarp, K>, kWarp);
    case 128: return go(norm_kernel<T, N, 128, K>, 128);
    case 512: return go(norm_kernel<T, N, 512, K>, 512);
    default: return DS_ERROR_INVALID_VALUE;
  }
}

// `vec`: every view's start and strides (and D) allow 16-byte accesses; else element accesses.
template <typename T, Norm K>
inline ds_error_t launch_norm(const NormParams& p, bool vec, ds_stream_t stream) {
  if (K == Norm::kQkRope && (p.rot % 2 != 0 || p.rot > kMaxRot || p.rot > p.D))
    return DS_ERROR_INVALID_VALUE;
  return vec ? launch_norm_n<T, 16 / sizeof(T), K>(p, stream) : launch_norm_n<T, 1, K>(p, stream);
}

enum class Gate { kSigmoidMul, kSiluMul };

// y[t, c] = f(a[t, c], b[t, c]) over [T, cols]; column c of row t of a view sits at
// ptr + t * s0 + (c / block) * s1 + c % block (block = inner row length, e.g. a head's D).
struct GateParams {
  const void* a;  // sigmoid: o (the product's other factor); silu: gate
  const void* b;  // sigmoid: gate; silu: up
  int64_t a_s0, a_s1, b_s0, b_s1;  // elements
  void* y;        // [T, cols] dense
  FastDiv block;  // elements of one inner row (a multiple of N)
  int T, cols;
};

// y[c .. c + N) of row t (shared by gate_kernel and the gemv prologues: the same bits).
template <typename T, int N, Gate G>
DS_DEVICE void gate_values(const GateParams& p, int t, int c, float (&y)[N]) {
  const int h = p.block.div(c), i = c - h * static_cast<int>(p.block.d);
  float a[N], b[N];
  load_n<T, N>(static_cast<const T*>(p.a) + t * p.a_s0 + h * p.a_s1 + i, a);
  load_n<T, N>(static_cast<const T*>(p.b) + t * p.b_s0 + h * p.b_s1 + i, b);
#pragma unroll
  for (int e = 0; e < N; ++e) {
    if constexpr (G == Gate::kSigmoidMul) y[e] = fmul(a[e], round_to<T>(sigmoid(b[e])));
    else y[e] = fmul(round_to<T>(silu(a[e])), b[e]);
  }
}

template <typename T, int N, Gate G>
__global__ void __launch_bounds__(kGateThreads) gate_kernel(const GateParams p) {
  launch_dependents();  // as norm_kernel: the next projection prefetches while this runs
  grid_dependency_wait();
  const int t = blockIdx.x;
  const int c = (blockIdx.y * blockDim.x + threadIdx.x) * N;
  if (c >= p.cols) return;
  float y[N];
  gate_values<T, N, G>(p, t, c, y);
  store_n<T, N>(static_cast<T*>(p.y) + int64_t(t) * p.cols + c, y);
}

template <typename T, int N, Gate G>
inline ds_error_t launch_gate_n(const GateParams& p, ds_stream_t stream) {
  const int64_t loads = ceil_div(p.cols, N);
  const int threads = static_cast<int>(loads < kGateThreads ? ceil_div(loads, kWarp) * kWarp
                                                            : kGateThreads);
  const int64_t col_blocks = ceil_div(loads, threads);
  if (col_blocks > 65535) return DS_ERROR_INVALID_VALUE;
  if (p.T == 0 || p.cols == 0) return DS_SUCCESS;
  return launch(gate_kernel<T, N, G>, dim3(p.T, static_cast<unsigned>(col_blocks)), threads,
                stream, Pdl::kOn, p);
}

template <typename T, Gate G>
inline ds_error_t launch_gate(const GateParams& p, bool vec, ds_stream_t stream) {
  return vec ? launch_gate_n<T, 16 / sizeof(T), G>(p, stream) : launch_gate_n<T, 1, G>(p, stream);
}

}  // namespace fused
}  // namespace ds
