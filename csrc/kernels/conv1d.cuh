// Depthwise causal conv1d (width W) + SiLU with per-slot windows: prefill (varlen, two launches),
// update, verify (window untouched) and commit. One thread owns VEC consecutive channels.
// Window layout: conv_state [S, W-1, D], row 0 the oldest input. All math in fp32:
//   y = silu(bias + sum_w weight[c, w] * z[w])  (fma chain, w ascending), z = window ++ x.
#pragma once

#include "compat.cuh"

namespace ds {
namespace conv {

constexpr int kThreads = 128;
constexpr int kPrefillTile = 32;  // tokens per thread in the prefill output kernel

template <typename T>
struct Vec { static constexpr int kN = 16 / sizeof(T); };  // channels per thread (16 bytes)

struct ConvParams {
  const void* x;            // update [N, D] / verify, commit [N, R, D] / prefill [T, D]; dense rows
  const void* weight;       // [D, W] T
  const void* bias;         // [D] T or null
  void* conv_state;         // [S, W-1, D] T
  const int32_t* slots;     // [N]
  const int32_t* accepted;  // commit: [N] (0..R)
  const int32_t* cu_seqlens;     // prefill: [N+1]
  const int32_t* track_offsets;  // prefill: [N] or null
  const int32_t* track_slots;    // prefill: [N] or null (slot 0 = no tracking)
  void* y;                  // same shape as x, dense
  int64_t x_row_stride;     // elements between consecutive x rows (>= D)
  int N, R, T, D;
};

template <typename T, int W>
struct Channels {  // the VEC channels [c0, c0 + VEC) of one thread
  static constexpr int kN = Vec<T>::kN;
  float w[W][kN];
  float bias[kN];

  DS_DEVICE void load(const ConvParams& p, int c0) {
    float flat[kN * W];  // weight[c0:c0+kN, :] is kN * W contiguous elements
    load_vec<T, kN * W>(static_cast<const T*>(p.weight) + int64_t(c0) * W, flat);
#pragma unroll
    for (int c = 0; c < kN; ++c)
#pragma unroll
      for (int i = 0; i < W; ++i) w[i][c] = flat[c * W + i];
    if (p.bias != nullptr) {
      load_vec<T, kN>(static_cast<const T*>(p.bias) + c0, bias);
    } else {
#pragma unroll
      for (int c = 0; c < kN; ++c) bias[c] = 0.f;
    }
  }

  // z[0..W-2] the window (oldest first), xn the new input -> y; the one arithmetic path.
  DS_DEVICE void point(const float (&z)[W - 1][kN], const float (&xn)[kN], float (&y)[kN]) const {
#pragma unroll
    for (int c = 0; c < kN; ++c) {
      float acc = bias[c];
#pragma unroll
      for (int i = 0; i < W - 1; ++i) acc = ffma(z[i][c], w[i][c], acc);
      acc = ffma(xn[c], w[W - 1][c], acc);
      y[c] = fdiv(acc, fadd(1.f, fexp(-acc)));  // silu
    }
  }
};

template <typename T, int W>
DS_DEVICE void shift_in(float (&z)[W - 1][Vec<T>::kN], const float (&xn)[Vec<T>::kN]) {
#pragma unroll
  for (int i = 0; i < W - 2; ++i)
#pragma unroll
    for (int c = 0; c < Vec<T>::kN; ++c) z[i][c] = z[i + 1][c];
#pragma unroll
  for (int c = 0; c < Vec<T>::kN; ++c) z[W - 2][c] = xn[c];
}

template <typename T, int W>
DS_DEVICE T* window_row(const ConvParams& p, int64_t slot, int i, int c0) {
  return static_cast<T*>(p.conv_state) + (slot * (W - 1) + i) * int64_t(p.D) + c0;
}

// update (R = 1, window written) and verify (R rows, window read only).
template <typename T, int W, bool VERIFY>
__global__ void __launch_bounds__(kThreads) step_kernel(const ConvParams p) {
  // gdn_decode / gdn_verify follow this kernel in a model step; they are launched with PDL and
  // prefetch their state rows while it runs (compat.cuh).
  launch_dependents();
  constexpr int kN = Vec<T>::kN;
  const int64_t idx = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const int per_row = p.D / kN;
  if (idx >= int64_t(p.N) * per_row) return;
  const int n = static_cast<int>(idx / per_row);
  const int c0 = static_cast<int>(idx % per_row) * kN;
  // This kernel is launched with PDL too: the weights (written when the model loads, never by a
  // kernel of a step) are read while the previous kernel finishes; slots, windows and x after.
  Channels<T, W> ch;
  ch.load(p, c0);
  grid_dependency_wait();
  // The first input row is loaded before the slot lookup and the window loads that wait on it.
  // (Loading verify's rows four ahead instead lost 5-20%, more registers: session 5.)
  const auto x_row = [&](int r) {
    return static_cast<const T*>(p.x) + (int64_t(n) * p.R + r) * p.x_row_stride + c0;
  };
  float xn[kN];
  if (p.R > 0) load_vec<T, kN>(x_row(0), xn);
  const int64_t slot = p.slots[n];
  float z[W - 1][kN];
#pragma unroll
  for (int i = 0; i < W - 1; ++i) load_vec<T, kN>(window_row<T, W>(p, slot, i, c0), z[i]);
  for (int r = 0; r < p.R; ++r) {
    if (r > 0) load_vec<T, kN>(x_row(r), xn);
    float y[kN];
    ch.point(z, xn, y);
    store_vec<T, kN>(static_cast<T*>(p.y) + (int64_t(n) * p.R + r) * p.D + c0, y);
    shift_in<T, W>(z, xn);
  }
  if constexpr (!VERIFY) {
#pragma unroll
    for (int i = 0; i < W - 1; ++i) store_vec<T, kN>(window_row<T, W>(p, slot, i, c0), z[i]);
  }
}

// commit: window <- last W-1 rows of (window ++ x[n, :accepted[n]]). Pure data movement.
template <typename T, int W>
__global__ void __launch_bounds__(kThreads) commit_kernel(const ConvParams p) {
  constexpr int kN = Vec<T>::kN;
  const int64_t idx = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const int per_row = p.D / kN;
  if (idx >= int64_t(p.N) * per_row) return;
  const int n = static_cast<int>(idx / per_row);
  const int c0 = static_cast<int>(idx % per_row) * kN;
  int m = p.accepted[n];
  m = m < 0 ? 0 : (m > p.R ? p.R : m);
  if (m == 0) return;
  const int64_t slot = p.slots[n];
  float z[W - 1][kN];
#pragma unroll
  for (int i = 0; i < W - 1; ++i) {
    const int src = m + i;  // index into window ++ x
    if (src < W - 1) {
      load_vec<T, kN>(window_row<T, W>(p, slot, src, c0), z[i]);
    } else {
      const int64_t xr = int64_t(n) * p.R + (src - (W - 1));
      load_vec<T, kN>(static_cast<const T*>(p.x) + xr * p.x_row_stride + c0, z[i]);
    }
  }
#pragma unroll
  for (int i = 0; i < W - 1; ++i) store_vec<T, kN>(window_row<T, W>(p, slot, i, c0), z[i]);
}

// Sequence holding packed token t: the last i with cu_seqlens[i] <= t (skips empty sequences).
DS_DEVICE int find_sequence(const int32_t* cu, int n, int t) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (cu[mid] <= t) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Input at position pos (start - (W-1) <= pos) of sequence seq: from x, or from its window.
template <typename T, int W>
DS_DEVICE void load_input(const ConvParams& p, int seq, int start, int pos, int c0,
                          float (&out)[Vec<T>::kN]) {
  if (pos >= start) {
    load_vec<T, Vec<T>::kN>(static_cast<const T*>(p.x) + int64_t(pos) * p.x_row_stride + c0, out);
  } else {
    load_vec<T, Vec<T>::kN>(window_row<T, W>(p, p.slots[seq], (W - 1) - (start - pos), c0), out);
  }
}

// prefill, launch 1: outputs only (windows read, never written). Thread: VEC channels x a tile
// of kPrefillTile packed tokens.
template <typename T, int W>
__global__ void __launch_bounds__(kThreads) prefill_out_kernel(const ConvParams p) {
  constexpr int kN = Vec<T>::kN;
  const int64_t idx = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const int per_row = p.D / kN;
  const int tiles = static_cast<int>(ceil_div(p.T, kPrefillTile));
  if (idx >= int64_t(tiles) * per_row) return;
  const int c0 = static_cast<int>(idx % per_row) * kN;
  const int t0 = static_cast<int>(idx / per_row) * kPrefillTile;
  const int t1 = min(t0 + kPrefillTile, p.T);
  Channels<T, W> ch;
  ch.load(p, c0);
  int seq = find_sequence(p.cu_seqlens, p.N, t0);
  int start = p.cu_seqlens[seq], end = p.cu_seqlens[seq + 1];
  float z[W - 1][kN];
#pragma unroll
  for (int i = 0; i < W - 1; ++i) load_input<T, W>(p, seq, start, t0 - (W - 1) + i, c0, z[i]);
  for (int t = t0; t < t1; ++t) {
    if (t >= end) {  // next non-empty sequence: its history comes from its own window
      while (p.cu_seqlens[seq + 1] <= t) ++seq;
      start = p.cu_seqlens[seq];
      end = p.cu_seqlens[seq + 1];
#pragma unroll
      for (int i = 0; i < W - 1; ++i) load_input<T, W>(p, seq, start, t - (W - 1) + i, c0, z[i]);
    }
    float xn[kN], y[kN];
    load_vec<T, kN>(static_cast<const T*>(p.x) + int64_t(t) * p.x_row_stride + c0, xn);
    ch.point(z, xn, y);
    store_vec<T, kN>(static_cast<T*>(p.y) + int64_t(t) * p.D + c0, y);
    shift_in<T, W>(z, xn);
  }
}

// prefill, launch 2: final window (and tracked window) per sequence; each thread reads what it
// needs of the old window before writing.
template <typename T, int W>
__global__ void __launch_bounds__(kThreads) prefill_windows_kernel(const ConvParams p) {
  constexpr int kN = Vec<T>::kN;
  const int64_t idx = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const int per_row = p.D / kN;
  if (idx >= int64_t(p.N) * per_row) return;
  const int seq = static_cast<int>(idx / per_row);
  const int c0 = static_cast<int>(idx % per_row) * kN;
  const int start = p.cu_seqlens[seq], end = p.cu_seqlens[seq + 1];
  const bool track = p.track_slots != nullptr && p.track_slots[seq] != 0;
  const int tracked_end = track ? start + p.track_offsets[seq] : end;
  float fin[W - 1][kN], trk[W - 1][kN];
#pragma unroll
  for (int i = 0; i < W - 1; ++i) {
    load_input<T, W>(p, seq, start, end - (W - 1) + i, c0, fin[i]);
    load_input<T, W>(p, seq, start, tracked_end - (W - 1) + i, c0, trk[i]);
  }
  const int64_t slot = p.slots[seq];
#pragma unroll
  for (int i = 0; i < W - 1; ++i) store_vec<T, kN>(window_row<T, W>(p, slot, i, c0), fin[i]);
  if (track) {
    const int64_t tslot = p.track_slots[seq];
#pragma unroll
    for (int i = 0; i < W - 1; ++i) store_vec<T, kN>(window_row<T, W>(p, tslot, i, c0), trk[i]);
  }
}

template <typename T, int W>
inline ds_error_t launch_conv_step(const ConvParams& p, bool verify, ds_stream_t stream) {
  const int64_t blocks = ceil_div(int64_t(p.N) * (p.D / Vec<T>::kN), kThreads);
  return verify ? launch(step_kernel<T, W, true>, blocks, kThreads, stream, Pdl::kOn, p)
                : launch(step_kernel<T, W, false>, blocks, kThreads, stream, Pdl::kOn, p);
}

template <typename T, int W>
inline ds_error_t launch_conv_commit(const ConvParams& p, ds_stream_t stream) {
  const int64_t blocks = ceil_div(int64_t(p.N) * (p.D / Vec<T>::kN), kThreads);
  return launch(commit_kernel<T, W>, blocks, kThreads, stream, Pdl::kOff, p);
}

template <typename T, int W>
inline ds_error_t launch_conv_prefill(const ConvParams& p, ds_stream_t stream) {
  const int per_row = p.D / Vec<T>::kN;
  const int64_t out_blocks = ceil_div(ceil_div(p.T, kPrefillTile) * per_row, kThreads);
  ds_error_t err = launch(prefill_out_kernel<T, W>, out_blocks, kThreads, stream, Pdl::kOff, p);
  if (err != DS_SUCCESS) return err;
  const int64_t win_blocks = ceil_div(int64_t(p.N) * per_row, kThreads);
  return launch(prefill_windows_kernel<T, W>, win_blocks, kThreads, stream, Pdl::kOff, p);
}

}  // namespace conv
}  // namespace ds
