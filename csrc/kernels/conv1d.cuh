// Depthwise causal conv1d (width W) + SiLU with per-slot windows: prefill (varlen, two launches),
// update, verify (window untouched) and commit. One thread owns VEC consecutive channels.
// Window layout: conv_state [S, W-1, D], row 0 the oldest input. All math in fp32:
//   y = silu(bias + sum_w weight[c, w] * z[w])  (fma chain, w ascending), z = window ++ x.
// The GDN prefill form (ConvParams.plane1/plane2/norm_*) also stores its output as the three
// blocks q | k | v, each [T, width] and contiguous, with q and k L2-normalised per head: what
// the chunked delta rule reads, with no copy or norm kernel between (issue 27).
#pragma once

#include "compat.cuh"

namespace ds {
namespace conv {

constexpr int kThreads = 128;
constexpr int kPrefillTile = 32;  // tokens per thread in the prefill output kernel

template <typename T>
struct Vec { static constexpr int kN = 16 / sizeof(T); };  // channels per thread (16 bytes)

// N consecutive elements of T kept as they sit in memory, in 32-bit words (two 16-bit values a
// word): windows, inputs and weights stay packed in registers until an fma needs them, which
// halves their registers for bf16/f16 and makes window shifts and commits plain word moves.
// Held as floats, bf16 update took 78 registers (6 blocks per SM), packed 60 (8); verify 90 and
// 87 (5 blocks per SM either way: the launch caps it where that matters; session 8).
template <typename T, int N>
struct Packed {
  static_assert((N * sizeof(T)) % 8 == 0, "packed rows move whole 8-byte words");
  static constexpr int kWords = N * sizeof(T) / 4;
  uint32_t w[kWords];

  DS_DEVICE void load(const T* __restrict__ p) {
#pragma unroll
    for (int i = 0; i < kWords / 2; ++i) {
      const uint2 x = reinterpret_cast<const uint2*>(p)[i];
      w[2 * i] = x.x;
      w[2 * i + 1] = x.y;
    }
  }
  DS_DEVICE void store(T* __restrict__ p) const {
#pragma unroll
    for (int i = 0; i < kWords / 2; ++i)
      reinterpret_cast<uint2*>(p)[i] = make_uint2(w[2 * i], w[2 * i + 1]);
  }
  // Element i as float: the same value load_vec gives (to_float of the stored bits).
  DS_DEVICE float get(int i) const {
    if constexpr (sizeof(T) == 4) {
      return __uint_as_float(w[i]);
    } else {
      T e;
      e.bits = static_cast<uint16_t>(i % 2 ? w[i / 2] >> 16 : w[i / 2] & 0xffffu);
      return to_float(e);
    }
  }
};

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
  int64_t S;                // slots in conv_state
  int rows_per_thread;      // update / verify: rows one thread runs (1..R; the launch sets it)
  int trigger_late;         // update / verify: PDL dependents launch after the wait (launch sets)
  int N, R, T, D;
  // prefill only. plane1 < plane2 (multiples of VEC): y holds channels [0, plane1), [plane1,
  // plane2) and [plane2, D) as three [T, width] blocks, one after the other (0, 0: y is [T, D]).
  int plane1, plane2;
  // prefill only: channels [0, norm_channels) are L2-normalised in groups of norm_group
  // (a power-of-two multiple of VEC, at most 32 VECs): y = u * rsqrt(sum(u^2) + norm_eps) in
  // fp32 from u, the conv output rounded to T as it would be stored. 0: none.
  int norm_channels, norm_group;
  float norm_eps;
  int tile;  // prefill: tokens per thread in the output kernel (the launch sets it)
};

template <typename T, int W>
using Window = Packed<T, Vec<T>::kN>[W - 1];  // rows 0 .. W-2 (oldest first) of VEC channels

// silu(x) = x / (1 + exp(-x)) with the hardware exponential and reciprocal (CUDA's documented
// bounds: __expf 2 + 1.17 |x| ulp, __fdividef 2 ulp; exp(-x) = inf gives -0, the limit). The
// accurate expf and IEEE division were ~25 instructions per output; this one change took conv
// update at B = 1 / 8 / 64 from 1.56 / 1.71 / 3.78 to 1.37 / 1.44 / 3.35 us and verify at
// B = 256 / 512 from 21.5 / 39.3 to 18.6 / 33.9 (H200, session 11, RESULTS.md). Every conv
// kernel goes through this one function, so update, verify, commit and prefill agree bit for
// bit; the torch reference is matched to within one ulp of a 16-bit output
// (tests/ops/test_conv1d_gpu.py).
DS_DEVICE float silu(float x) { return __fdividef(x, fadd(1.f, __expf(-x))); }

template <typename T, int W>
struct Channels {  // the VEC channels [c0, c0 + VEC) of one thread
  static constexpr int kN = Vec<T>::kN;
  Packed<T, kN * W> w;  // weight[c0:c0+kN, :], as stored: channel c's tap i at c * W + i
  Packed<T, kN> bias;
  bool has_bias;

  DS_DEVICE void load(const ConvParams& p, int c0) {
    w.load(static_cast<const T*>(p.weight) + int64_t(c0) * W);
    has_bias = p.bias != nullptr;
    if (has_bias) bias.load(static_cast<const T*>(p.bias) + c0);
  }

  // z the window (oldest first), xn the new input -> y; the one arithmetic path.
  DS_DEVICE void point(const Window<T, W>& z, const Packed<T, kN>& xn, float (&y)[kN]) const {
#pragma unroll
    for (int c = 0; c < kN; ++c) {
      float acc = has_bias ? bias.get(c) : 0.f;
#pragma unroll
      for (int i = 0; i < W - 1; ++i) acc = ffma(z[i].get(c), w.get(c * W + i), acc);
      acc = ffma(xn.get(c), w.get(c * W + W - 1), acc);
      y[c] = silu(acc);
    }
  }
};

template <typename T, int W>
DS_DEVICE void shift_in(Window<T, W>& z, const Packed<T, Vec<T>::kN>& xn) {
#pragma unroll
  for (int i = 0; i < W - 2; ++i) z[i] = z[i + 1];
  z[W - 2] = xn;
}

template <typename T, int W>
DS_DEVICE T* window_row(const ConvParams& p, int64_t slot, int i, int c0) {
  return static_cast<T*>(p.conv_state) + (slot * (W - 1) + i) * int64_t(p.D) + c0;
}

// Input i of request n's sequence (window ++ x): window row i for i < W-1, else x row i-(W-1).
template <typename T, int W>
DS_DEVICE const T* input_row(const ConvParams& p, int64_t slot, int n, int i, int c0) {
  if (i < W - 1) return window_row<T, W>(p, slot, i, c0);
  return static_cast<const T*>(p.x) + (int64_t(n) * p.R + (i - (W - 1))) * p.x_row_stride + c0;
}

// update (R = 1, window written) and verify (R rows, window read only). A thread owns VEC
// channels of rows [r0, r0 + rows_per_thread) of one request: verify's rows depend only on the
// inputs (window ++ x), not on each other, so with few requests they are split over threads
// (row r's window is inputs r .. r+W-2): at B = 1 and R = 4, one thread running all R rows'
// fma chains and divisions in turn took 4.33 us, one row per thread 2.04 (session 8). A thread
// loads the inputs of AHEAD rows at once (below); MIN_BLOCKS is its launch bound's blocks per
// SM (launch_conv_step says which shape runs where).
// Grid (1-D): (request, row split, channel chunk), chunks fastest.
template <typename T, int W, bool VERIFY, int AHEAD, int MIN_BLOCKS>
__global__ void DS_LAUNCH_BOUNDS_MIN_BLOCKS(kThreads, MIN_BLOCKS)
    step_kernel(const ConvParams p) {
  // gdn_decode / gdn_verify follow this kernel in a model step; they are launched with PDL and
  // prefetch their state rows while it runs (from its start, or for a small grid from its wait:
  // kLateTriggerBlocksPerSm).
  if (!p.trigger_late) launch_dependents();
  constexpr int kN = Vec<T>::kN;
  const int64_t idx = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const int per_row = p.D / kN;
  const int R = VERIFY ? p.R : 1, rows = VERIFY ? p.rows_per_thread : 1;
  const int splits = VERIFY ? static_cast<int>(ceil_div(R, rows)) : 1;
  if (idx >= int64_t(p.N) * splits * per_row) return;
  const int c0 = static_cast<int>(idx % per_row) * kN;
  const int64_t ns = idx / per_row;
  const int n = static_cast<int>(ns / splits);
  const int r0 = static_cast<int>(ns % splits) * rows;
  const int r1 = r0 + rows < R ? r0 + rows : R;
  // This kernel is launched with PDL too: the weights (written when the model loads, never by a
  // kernel of a step) are read while the previous kernel finishes, and the window rows are
  // prefetched into L2 from the slot read now (clamped: it may be stale, compat.cuh); the slot
  // is read again, and windows and x are read, after the wait.
  Channels<T, W> ch;
  ch.load(p, c0);
  const int64_t guess = clamp_slot(p.slots[n], p.S);
  for (int i = r0; i < W - 1; ++i) {
    const T* row = window_row<T, W>(p, guess, i, c0);
    // one prefetch per 128-byte line: by the thread whose 16 bytes start it
    if (reinterpret_cast<uintptr_t>(row) % 128 == 0) prefetch_l2(row);
  }
  grid_dependency_wait();
  if (p.trigger_late) launch_dependents();
  // The inputs of up to AHEAD rows are loaded before the slot lookup and the window loads that
  // wait on it, and before any output is stored: y may alias x as far as the compiler knows, so
  // a row's input loaded after the previous row's store waits for that store.
  Packed<T, kN> xs[AHEAD];
  const auto load_inputs = [&](int r) {
#pragma unroll
    for (int j = 0; j < AHEAD; ++j)
      if (r + j < r1) xs[j].load(input_row<T, W>(p, 0, n, r + j + W - 1, c0));
  };
  // Verify loads the window from the slot read before the wait, beside the slot read after it,
  // and loads it again only if the two differ: the slot read is then off the path to the window,
  // as in gdn_decode (what is read after the wait is current whichever slot it came from). H200,
  // Qwen3-Next shapes, R = 4 (session 17, RESULTS.md): verify 0.82 / 0.84 / 0.97 / 0.96 / 0.93x
  // the time at B = 1 / 8 / 64 / 256 / 512. Update keeps slot, then window: written the same way
  // there, ptxas merged the two window loads into one from the slot read after the wait (the
  // write-back needs that slot anyway), so nothing moved off the path (SASS, session 17).
  load_inputs(r0);
  Window<T, W> z;
  const int64_t slot = VERIFY ? guess : p.slots[n];  // update: the slot it writes back to
#pragma unroll
  for (int i = 0; i < W - 1; ++i) z[i].load(input_row<T, W>(p, slot, n, r0 + i, c0));
  if constexpr (VERIFY) {
    const int64_t real = p.slots[n];
    if (real != slot) {
#pragma unroll
      for (int i = 0; i < W - 1; ++i) z[i].load(input_row<T, W>(p, real, n, r0 + i, c0));
    }
  }
#pragma unroll 1
  for (int r = r0; r < r1; r += AHEAD) {
    if (r > r0) load_inputs(r);
#pragma unroll
    for (int j = 0; j < AHEAD; ++j) {
      if (r + j >= r1) break;
      float y[kN];
      ch.point(z, xs[j], y);
      store_vec<T, kN>(static_cast<T*>(p.y) + (int64_t(n) * p.R + r + j) * p.D + c0, y);
      shift_in<T, W>(z, xs[j]);
    }
  }
  if constexpr (!VERIFY) {
#pragma unroll
    for (int i = 0; i < W - 1; ++i) z[i].store(window_row<T, W>(p, slot, i, c0));
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
  Window<T, W> z;
#pragma unroll
  for (int i = 0; i < W - 1; ++i) z[i].load(input_row<T, W>(p, slot, n, m + i, c0));
#pragma unroll
  for (int i = 0; i < W - 1; ++i) z[i].store(window_row<T, W>(p, slot, i, c0));
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
                          Packed<T, Vec<T>::kN>& out) {
  if (pos >= start) {
    out.load(static_cast<const T*>(p.x) + int64_t(pos) * p.x_row_stride + c0);
  } else {
    out.load(window_row<T, W>(p, p.slots[seq], (W - 1) - (start - pos), c0));
  }
}

// Where channel c0 of token t goes in y: its block (ConvParams.plane1/plane2), row t.
template <typename T>
DS_DEVICE T* prefill_out(const ConvParams& p, int t, int c0) {
  int64_t base = 0;
  int width = p.D, c = c0;
  if (p.plane2 > 0) {
    if (c0 < p.plane1) {
      width = p.plane1;
    } else if (c0 < p.plane2) {
      base = int64_t(p.T) * p.plane1;
      width = p.plane2 - p.plane1;
      c = c0 - p.plane1;
    } else {
      base = int64_t(p.T) * p.plane2;
      width = p.D - p.plane2;
      c = c0 - p.plane2;
    }
  }
  return static_cast<T*>(p.y) + base + int64_t(t) * width + c;
}

// The L2 norm of the prefill form: every lane of the warp takes part in the reduction (the
// lanes of one group hold one head's VEC-channel pieces, consecutive and aligned), lanes past
// norm_channels keep their values. Needs the whole warp here together: the launch checks that a
// warp never spans two tiles (D / VEC a multiple of 32), so every branch before is uniform.
template <typename T, int kN>
DS_DEVICE void l2_normalize(const ConvParams& p, int c0, float (&y)[kN]) {
  float ss = 0.f;
#pragma unroll
  for (int c = 0; c < kN; ++c) {
    y[c] = to_float(from_float<T>(y[c]));  // as stored in x's dtype, then normalised
    ss = ffma(y[c], y[c], ss);
  }
  for (int off = p.norm_group / kN / 2; off > 0; off >>= 1) ss = fadd(ss, shfl_xor(ss, off));
  if (c0 < p.norm_channels) {
    const float r = frsqrt(fadd(ss, p.norm_eps));
#pragma unroll
    for (int c = 0; c < kN; ++c) y[c] = fmul(y[c], r);
  }
}

// prefill, launch 1: outputs only (windows read, never written). Thread: VEC channels x a tile
// of p.tile packed tokens.
template <typename T, int W>
__global__ void __launch_bounds__(kThreads) prefill_out_kernel(const ConvParams p) {
  constexpr int kN = Vec<T>::kN;
  const int64_t idx = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const int per_row = p.D / kN;
  const int tiles = static_cast<int>(ceil_div(p.T, p.tile));
  if (idx >= int64_t(tiles) * per_row) return;
  const int c0 = static_cast<int>(idx % per_row) * kN;
  const int t0 = static_cast<int>(idx / per_row) * p.tile;
  const int t1 = min(t0 + p.tile, p.T);
  Channels<T, W> ch;
  ch.load(p, c0);
  int seq = find_sequence(p.cu_seqlens, p.N, t0);
  int start = p.cu_seqlens[seq], end = p.cu_seqlens[seq + 1];
  Window<T, W> z;
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
    Packed<T, kN> xn;
    float y[kN];
    xn.load(static_cast<const T*>(p.x) + int64_t(t) * p.x_row_stride + c0);
    ch.point(z, xn, y);
    if (p.norm_channels > 0) l2_normalize<T, kN>(p, c0, y);
    store_vec<T, kN>(prefill_out<T>(p, t, c0), y);
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
  Window<T, W> fin, trk;
#pragma unroll
  for (int i = 0; i < W - 1; ++i) {
    load_input<T, W>(p, seq, start, end - (W - 1) + i, c0, fin[i]);
    load_input<T, W>(p, seq, start, tracked_end - (W - 1) + i, c0, trk[i]);
  }
  const int64_t slot = p.slots[seq];
#pragma unroll
  for (int i = 0; i < W - 1; ++i) fin[i].store(window_row<T, W>(p, slot, i, c0));
  if (track) {
    const int64_t tslot = p.track_slots[seq];
#pragma unroll
    for (int i = 0; i < W - 1; ++i) trk[i].store(window_row<T, W>(p, tslot, i, c0));
  }
}

// Programmatic dependent launch: update and verify grids of at most kLateTriggerBlocksPerSm
// blocks per multiprocessor let the next kernel launch only after their own grid-dependency wait
// (as one-tile gdn_decode / gdn_verify grids do, gdn_recurrent.cuh), larger ones at their start.
// H200, 32-call chains, one run each (session 10, RESULTS.md), early -> late: update B=1
// 1.61 -> 1.53 µs, B=8 1.78 -> 1.71; verify B=1 1.98 -> 1.90, B=8 2.75 -> 2.50. Larger grids
// differed by no more than two runs of the same placement did (update 0.76 µs, verify 1.1 at
// B=256), so they keep the early trigger. One run each: thin evidence, but in the same direction
// at all four small points.
constexpr int kLateTriggerBlocksPerSm = 2;
// Verify's launch shapes, measured on the H200 at D = 8192, R = 4, bf16 (RESULTS.md):
//  - rows split over threads (rows_per_thread 1) while the unsplit grid has under a quarter of a
//    block per multiprocessor (B <= 4 here): B = 1 took 1.82 us split, 2.25 not; from B = 8 the
//    unsplit kernel below was as fast or faster (B = 8 / 16 / 32: 2.38 / 3.18 / 3.75 against
//    2.69 / 3.11 / 6.06 split; session 11, B = 2-7 not measured). Session 8 had split up to 2
//    blocks per multiprocessor, measured against a thread that loaded each row's input after
//    storing the previous row;
//  - up to 4 blocks per multiprocessor, each thread loads kVerifyAhead rows' inputs at once,
//    held at 4 blocks per SM (128 registers, no spill): B = 64 6.11 -> 5.46 us (session 11);
//  - over 4 blocks per multiprocessor, one row's input at a time, capped at 8 blocks per SM
//    (64 registers): B = 256 / 512 took 20.9 / 38.8 us capped, 27.8 / 50.3 not (session 8);
//    loading 4 rows ahead there, at 4 blocks per SM, cost 5-12% (18.5 -> 20.5 us at B = 256,
//    session 11) with the fast silu, 22-26% without.
// Every shape is correct for any grid, so if the multiprocessor count cannot be read the
// launch takes the large-grid one. DS_CONV_SPLIT=0|1 forces the split (tuning runs). Update
// needs none of this: one row, ~60 registers unforced.
constexpr int kVerifyAhead = 4;
template <typename T, int W>
inline ds_error_t launch_conv_step(ConvParams p, bool verify, ds_stream_t stream) {
  const int64_t chunks = int64_t(p.N) * (p.D / Vec<T>::kN);  // threads with all rows each
  int sms = 0;
  if (multiprocessor_count(&sms) != DS_SUCCESS) sms = 0;
  int64_t blocks = ceil_div(chunks, kThreads);
  p.rows_per_thread = 1;
  if (verify) {
    bool split = 4 * blocks < int64_t(sms);
    if (const char* forced = std::getenv("DS_CONV_SPLIT")) split = forced[0] == '1';  // tuning
    if (!split) p.rows_per_thread = p.R > 0 ? p.R : 1;
    blocks = ceil_div(chunks * ceil_div(p.R, p.rows_per_thread), kThreads);
  }
  p.trigger_late = blocks <= kLateTriggerBlocksPerSm * int64_t(sms);
  const auto go = [&](auto kernel) {
    return launch(kernel, blocks, kThreads, stream, Pdl::kOn, p);
  };
  if (!verify) return go(step_kernel<T, W, false, 1, 1>);
  if (p.rows_per_thread == 1) return go(step_kernel<T, W, true, 1, 1>);
  if (blocks > 4 * int64_t(sms)) return go(step_kernel<T, W, true, 1, 8>);
  return go(step_kernel<T, W, true, kVerifyAhead, 4>);
}

template <typename T, int W>
inline ds_error_t launch_conv_commit(const ConvParams& p, ds_stream_t stream) {
  const int64_t blocks = ceil_div(int64_t(p.N) * (p.D / Vec<T>::kN), kThreads);
  return launch(commit_kernel<T, W>, blocks, kThreads, stream, Pdl::kOff, p);
}

// Prefill tiles: kPrefillTile tokens a thread, halved (down to kMinPrefillTile) while the grid
// has fewer than two blocks per multiprocessor. A 256-token prompt at D = 6144 had 48 blocks of
// 32-token threads on 132 SMs: 18 us a layer on the H200 profile (issue 27), latency-bound.
constexpr int kMinPrefillTile = 4;
template <typename T>
inline int prefill_tile(const ConvParams& p) {
  int sms = 0;
  if (multiprocessor_count(&sms) != DS_SUCCESS) sms = 0;
  const int64_t per_row = p.D / Vec<T>::kN, want = int64_t(2) * kThreads * sms;
  int tile = kPrefillTile;
  while (tile > kMinPrefillTile && ceil_div(p.T, tile) * per_row < want) tile /= 2;
  return tile;
}

template <typename T, int W>
inline ds_error_t launch_conv_prefill(ConvParams p, ds_stream_t stream) {
  const int per_row = p.D / Vec<T>::kN;
  const int lanes = p.norm_group / Vec<T>::kN;  // lanes of one normalised group
  if (p.norm_channels > 0 && (per_row % kWarp != 0 || p.norm_group % Vec<T>::kN != 0 ||
                              lanes < 1 || lanes > kWarp || (lanes & (lanes - 1)) != 0 ||
                              p.norm_channels % p.norm_group != 0))
    return DS_ERROR_INVALID_VALUE;  // l2_normalize needs whole warps and groups inside one
  p.tile = prefill_tile<T>(p);
  const int64_t out_blocks = ceil_div(ceil_div(p.T, p.tile) * per_row, kThreads);
  ds_error_t err = launch(prefill_out_kernel<T, W>, out_blocks, kThreads, stream, Pdl::kOff, p);
  if (err != DS_SUCCESS) return err;
  const int64_t win_blocks = ceil_div(int64_t(p.N) * per_row, kThreads);
  return launch(prefill_windows_kernel<T, W>, win_blocks, kThreads, stream, Pdl::kOff, p);
}

}  // namespace conv
}  // namespace ds
