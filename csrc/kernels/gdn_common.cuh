// The GDN row step shared by gdn_decode, gdn_verify and gdn_replay.
//
// Thread layout: one value row of one head (S[row, :], K floats) is held by a group of
// LANES = K/16 consecutive lanes, 16 floats per lane. Lane i of a group owns the K indices
// (j * LANES + i) * 4 + e for j, e in 0..3, so each of its four float4 accesses is coalesced
// across the group. Every dot product over K is a fixed fma chain per lane (j, then e
// ascending) followed by a butterfly over the group: the same order in all three kernels, which
// is what makes replay bitwise equal to decode.
#pragma once

#include "compat.cuh"

namespace ds {
namespace gdn {

constexpr int kPerLane = 16;     // K elements per lane
constexpr int kThreads = 128;    // threads per block in every GDN kernel
constexpr float kL2Eps = 1e-6f;  // q, k L2 norm: x * rsqrt(sum(x^2) + eps)

template <int K>
struct Layout {
  static_assert(K == 64 || K == 128 || K == 256, "head_k_dim must be 64, 128 or 256");
  static constexpr int kLanes = K / kPerLane;                     // lanes per value row
  static constexpr int kRowsPerBlock = kThreads / kLanes;         // value rows per block
  DS_DEVICE static int group_lane() { return threadIdx.x % kLanes; }
  DS_DEVICE static int block_row() { return threadIdx.x / kLanes; }
  // Offset (elements) of the j-th 4-element piece this lane owns within a K-vector.
  DS_DEVICE static int piece(int lane, int j) { return (j * kLanes + lane) * 4; }
};

// Load this lane's 16 elements of a K-vector (any storage type) as floats.
template <int K, typename T>
DS_DEVICE void load_k(const T* __restrict__ row, int lane, float (&x)[kPerLane]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float part[4];
    load_vec<T, 4>(row + Layout<K>::piece(lane, j), part);
#pragma unroll
    for (int e = 0; e < 4; ++e) x[j * 4 + e] = part[e];
  }
}

template <int K>
DS_DEVICE void load_state(const float* __restrict__ row, int lane, float (&s)[kPerLane]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float4 p = *reinterpret_cast<const float4*>(row + Layout<K>::piece(lane, j));
    s[j * 4 + 0] = p.x; s[j * 4 + 1] = p.y; s[j * 4 + 2] = p.z; s[j * 4 + 3] = p.w;
  }
}

template <int K>
DS_DEVICE void store_state(float* __restrict__ row, int lane, const float (&s)[kPerLane]) {
#pragma unroll
  for (int j = 0; j < 4; ++j)
    *reinterpret_cast<float4*>(row + Layout<K>::piece(lane, j)) =
        make_float4(s[j * 4 + 0], s[j * 4 + 1], s[j * 4 + 2], s[j * 4 + 3]);
}

// Dot product of two lane-held K-vectors, summed over the group.
template <int K>
DS_DEVICE float dot(const float (&x)[kPerLane], const float (&y)[kPerLane]) {
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) acc = ffma(x[i], y[i], acc);
  return group_sum<Layout<K>::kLanes>(acc);
}

// x <- x * rsqrt(sum(x^2) + eps) * scale (scale 1 for k).
template <int K>
DS_DEVICE void l2_normalize(float (&x)[kPerLane], float scale) {
  const float inv = fmul(frsqrt(fadd(dot<K>(x, x), kL2Eps)), scale);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) x[i] = fmul(x[i], inv);
}

// g = -exp(A_log) * softplus(a + dt_bias) (softplus as torch: x > 20 -> x), beta = sigmoid(b).
DS_DEVICE float gate_g(float a, float A_log, float dt_bias) {
  const float x = fadd(a, dt_bias);
  const float sp = x > 20.f ? x : flog1p(fexp(x));
  return fmul(-fexp(A_log), sp);
}
DS_DEVICE float gate_beta(float b) { return fdiv(1.f, fadd(1.f, fexp(-b))); }

// One recurrence row on this lane's slice of S[row, :] (Yang et al. 2024, eq. 10):
//   S <- exp(g) S;  S <- S + beta (v - S k) k^T;  o = S q.
// Returns o (when WITH_OUTPUT) on every lane of the group.
template <int K, bool WITH_OUTPUT>
DS_DEVICE float step(float (&s)[kPerLane], const float (&k)[kPerLane],
                     const float (&q)[kPerLane], float v, float g, float beta) {
  const float decay = fexp(g);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) s[i] = fmul(s[i], decay);
  const float delta = fmul(fsub(v, dot<K>(s, k)), beta);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) s[i] = ffma(delta, k[i], s[i]);
  if constexpr (WITH_OUTPUT) return dot<K>(s, q);
  return 0.f;
}

}  // namespace gdn
}  // namespace ds
