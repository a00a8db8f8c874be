// MoE routing on the device for the grouped expert kernels (moe_experts.cuh); the contract and
// the pure-torch reference are in python/deltaserve/ops/moe_fused.py.
//
// One block does it all, for T <= kMaxTokens tokens, E <= kMaxExperts experts, top-k <= kMaxTopK:
// 1. top-k of each token's E router logits (a warp per token), ties to the lower expert index
//    (as a stable descending sort), and the k routing weights in fp32: the softmax of the k
//    chosen logits (norm_topk_prob: the renormalised top-k of a softmax is the softmax of the
//    top-k logits), else the chosen entries of the softmax over all E;
// 2. the (token, slot) pairs grouped by expert with static shapes: bit t of expert e's mask says
//    token t chose e (set with an integer atomic OR: the same bits in any order), so expert e
//    has popc(mask) rows and pair (t, e) is row first_row[e] + (number of tokens < t that chose
//    e): rows grouped by expert in ascending order, tokens ascending within an expert, the same
//    layout on every run;
// 3. the tile list the expert kernels walk: the shared expert's tiles first (token rows, a fixed
//    count: their weights can be prefetched before the routing is known), then each expert's
//    rows cut into tiles of kTileRows (the MMA's 16 rows);
// 4. the combine counters of moe_experts' down kernel set to zero.
// Nothing depends on T or E beyond the static bounds: no host synchronisation, CUDA-graph safe.
#pragma once

#include "compat.cuh"
#include "fused.cuh"

namespace ds {
namespace moe {

constexpr int kTileRows = 16;     // rows of one expert tile: the MMA's m
constexpr int kMaxExperts = 512;  // E (Qwen3.5-397B, Qwen3-Next: 512)
constexpr int kMaxTopK = 16;      // k: slot j's weight is held by lane j
constexpr int kMaxTokens = 256;   // T (tokens, verify rows included) of one routing block
constexpr int kRouteThreads = 512;
constexpr int kRouteWarps = kRouteThreads / kWarp;
constexpr int kMaskWords = kMaxTokens / 32;
static_assert(kRouteThreads >= kMaxExperts, "one thread per expert in the grouping");

struct RouteParams {
  const void* logits;   // [T, ldl] T: the E router logits, then (shared_scale set) the shared
                        // expert's gate logit at column E
  int64_t ldl;          // elements between rows of logits
  float* weight;        // [T, k] routing weights, slot order (descending logit)
  int* expert;          // [T, k] the chosen experts
  int* pair_row;        // [T, k] grouped row of each (token, slot) pair
  int* row_token;       // [T * k] token of each grouped row
  int* tiles;           // [>= max_tiles(T, E, k, shared), 4]: (expert, first row, rows, 0);
                        // expert E = the shared expert, whose rows are the tokens
  int* n_tiles;         // [2]: the shared expert's tiles, all tiles
  float* shared_scale;  // [T] sigmoid(shared gate logit), or nullptr: no shared expert
  int* counters;        // [n_counters] set to 0 (moe_experts' combine counts arrivals in them)
  int64_t n_counters;
  int T, E, k;
  bool norm_topk_prob;
};

// Tiles of the shared expert, then an upper bound on the routed ones: each expert's rows in
// tiles of 16, at most min(E, T k) experts hit and sum_e ceil(c_e / 16) <= hit + (T k) / 16.
DS_HOST_DEVICE int shared_tiles(int T, bool shared) {
  return shared ? static_cast<int>(ceil_div(T, kTileRows)) : 0;
}
DS_HOST_DEVICE int max_tiles(int T, int E, int k, bool shared) {
  const int pairs = T * k;
  return shared_tiles(T, shared) + (E < pairs ? E : pairs) + pairs / kTileRows;
}

// An unsigned key whose order is the logit's (-0 as +0; ties broken by the lower expert): the
// 16-bit float's sign-magnitude bits made monotonic, the expert in the low half. Real keys are
// > 0 (E <= 0xffff), so 0 pads a lane's missing experts.
template <typename T>
DS_DEVICE uint32_t topk_key(T v, int e) {
  uint32_t b = v.bits;
  if ((b & 0x7fffu) == 0) b = 0;
  const uint32_t ord = (b & 0x8000u) != 0 ? (~b & 0xffffu) : (b | 0x8000u);
  return (ord << 16) | static_cast<uint32_t>(0xffff - e);
}
template <typename T>
DS_DEVICE float key_logit(uint32_t key) {
  const uint32_t ord = key >> 16;
  const uint32_t b = (ord & 0x8000u) != 0 ? (ord & 0x7fffu) : (~ord & 0xffffu);
  return to_float(T{static_cast<uint16_t>(b)});
}
DS_DEVICE int key_expert(uint32_t key) { return 0xffff - static_cast<int>(key & 0xffffu); }

DS_DEVICE uint32_t warp_max(uint32_t v) {
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) {
    const uint32_t o = shfl_u32(v, lane ^ off);
    v = o > v ? o : v;
  }
  return v;
}

DS_DEVICE uint32_t warp_inclusive_sum(uint32_t v) {
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
#pragma unroll
  for (int off = 1; off < kWarp; off <<= 1) {
    const uint32_t o = shfl_u32(v, lane >= off ? lane - off : lane);
    if (lane >= off) v += o;
  }
  return v;
}

// Step 1 for token t (one warp): the top-k, its weights, and the token's bits in the masks.
template <typename T>
DS_DEVICE void route_token(const RouteParams& p, int t, int words, uint32_t* mask,
                           uint16_t* chosen) {
  constexpr int kKeys = kMaxExperts / kWarp;
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const T* row = static_cast<const T*>(p.logits) + t * p.ldl;
  uint32_t key[kKeys], best = 0;
#pragma unroll
  for (int i = 0; i < kKeys; ++i) {
    const int e = lane + kWarp * i;
    key[i] = e < p.E ? topk_key(row[e], e) : 0u;
    best = key[i] > best ? key[i] : best;
  }
  uint32_t top = 0, mine = 0;  // the largest key; lane j: slot j's key
  for (int j = 0; j < p.k; ++j) {
    const uint32_t w = warp_max(best);
    if (j == 0) top = w;
    if (lane == j) mine = w;
    const int e = key_expert(w);
    if (e % kWarp == lane) {  // the winner's lane drops it and finds its next best
      best = 0;
#pragma unroll
      for (int i = 0; i < kKeys; ++i) {
        if (lane + kWarp * i == e) key[i] = 0;
        best = key[i] > best ? key[i] : best;
      }
    }
  }
  const float m = key_logit<T>(top);
  const float num = lane < p.k ? fexp(fsub(key_logit<T>(mine), m)) : 0.f;
  float sum = 0.f;
  if (p.norm_topk_prob) {
    sum = num;
  } else {
    for (int e = lane; e < p.E; e += kWarp) sum = fadd(sum, fexp(fsub(to_float(row[e]), m)));
  }
  sum = group_sum<kWarp>(sum);  // butterfly: every lane the same bits
  if (lane < p.k) {
    const int e = key_expert(mine);
    p.weight[t * p.k + lane] = fdiv(num, sum);
    p.expert[t * p.k + lane] = e;
    chosen[t * p.k + lane] = static_cast<uint16_t>(e);
    atomic_or(&mask[e * words + t / 32], 1u << (t % 32));
  }
  if (p.shared_scale != nullptr && lane == 0)
    p.shared_scale[t] = fused::sigmoid(to_float(row[p.E]));
}

template <typename T>
__global__ void __launch_bounds__(kRouteThreads) route_kernel(const RouteParams p) {
  __shared__ uint32_t mask[kMaxExperts * kMaskWords];  // [E][words]: bit t = token t chose e
  __shared__ uint16_t chosen[kMaxTokens * kMaxTopK];   // [T][k] experts
  __shared__ int first_row[kMaxExperts];
  __shared__ uint32_t warp_sums[kRouteWarps];
  const int tid = static_cast<int>(threadIdx.x), warp = tid / kWarp, lane = tid % kWarp;
  const int words = static_cast<int>(ceil_div(p.T, 32));
  for (int i = tid; i < p.E * words; i += kRouteThreads) mask[i] = 0u;
  // Global memory only after the wait: a buffer of this call may be one the kernel before it
  // (which PDL lets run on) still reads.
  grid_dependency_wait();
  launch_dependents();
  for (int64_t i = tid; i < p.n_counters; i += kRouteThreads) p.counters[i] = 0;
  __syncthreads();
  for (int t = warp; t < p.T; t += kRouteWarps) route_token<T>(p, t, words, mask, chosen);
  __syncthreads();

  // Step 2: rows and tiles of expert `tid`, packed (rows << 16 | tiles) so that one block-wide
  // prefix sum gives both first rows and first tiles (both totals < 2^16: T k <= 4096).
  uint32_t rows = 0;
  if (tid < p.E)
    for (int w = 0; w < words; ++w) rows += static_cast<uint32_t>(popc(mask[tid * words + w]));
  const uint32_t packed = (rows << 16) | static_cast<uint32_t>(ceil_div(rows, kTileRows));
  const uint32_t incl = warp_inclusive_sum(packed);
  if (lane == kWarp - 1) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const uint32_t s = warp_inclusive_sum(lane < kRouteWarps ? warp_sums[lane] : 0u);
    if (lane < kRouteWarps) warp_sums[lane] = s;
  }
  __syncthreads();
  const uint32_t excl = incl - packed + (warp > 0 ? warp_sums[warp - 1] : 0u);
  const int first_tile = shared_tiles(p.T, p.shared_scale != nullptr);
  if (tid < p.E) {
    first_row[tid] = static_cast<int>(excl >> 16);
    for (uint32_t i = 0; i * kTileRows < rows; ++i) {
      int* tile = p.tiles + 4 * (first_tile + static_cast<int>(excl & 0xffffu) + static_cast<int>(i));
      tile[0] = tid;
      tile[1] = static_cast<int>(excl >> 16) + static_cast<int>(i) * kTileRows;
      tile[2] = static_cast<int>(rows - i * kTileRows < kTileRows ? rows - i * kTileRows
                                                                   : kTileRows);
      tile[3] = 0;
    }
  }
  if (tid < first_tile) {
    int* tile = p.tiles + 4 * tid;
    tile[0] = p.E;
    tile[1] = tid * kTileRows;
    tile[2] = p.T - tid * kTileRows < kTileRows ? p.T - tid * kTileRows : kTileRows;
    tile[3] = 0;
  }
  if (tid == 0) {
    p.n_tiles[0] = first_tile;
    p.n_tiles[1] = first_tile + static_cast<int>(warp_sums[kRouteWarps - 1] & 0xffffu);
  }
  __syncthreads();  // first_row

  // Step 3: each pair's row.
  for (int q = tid; q < p.T * p.k; q += kRouteThreads) {
    const int t = q / p.k, e = chosen[q];
    const uint32_t* m = mask + e * words;
    int rank = popc(m[t / 32] & ((1u << (t % 32)) - 1u));
    for (int w = 0; w < t / 32; ++w) rank += popc(m[w]);
    const int r = first_row[e] + rank;
    p.pair_row[q] = r;
    p.row_token[r] = t;
  }
}

template <typename T>
inline ds_error_t launch_route(const RouteParams& p, ds_stream_t stream) {
  if (p.T < 1 || p.T > kMaxTokens || p.E < 1 || p.E > kMaxExperts || p.k < 1 ||
      p.k > kMaxTopK || p.k > p.E || p.ldl < p.E + (p.shared_scale != nullptr ? 1 : 0) ||
      p.n_counters < 0)
    return DS_ERROR_INVALID_VALUE;
  return launch(route_kernel<T>, 1, kRouteThreads, stream, Pdl::kOn, p);
}

}  // namespace moe
}  // namespace ds
