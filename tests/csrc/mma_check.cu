// mma_16816 (csrc/kernels/compat.cuh) against a plain matrix product, fragments loaded and
// stored by the layout compat.cuh documents (the PTX ISA's for mma.m16n8k16). Built two ways:
//   host compiler, -DDS_EMU=1 (.ci/compile_kernels.sh): the portable shuffle form, which the
//     emulated kernel tests run, realises that layout;
//   nvcc on a GPU (sm_80+): the tensor cores agree with it, so the emulated attention tests
//     speak for the GPU kernel's indexing:
//       nvcc -std=c++17 -arch=sm_90 -Icsrc tests/csrc/mma_check.cu -o /tmp/mma && /tmp/mma
// Small integers in, so every product and sum is exact and the check is equality. Exits 1 on
// any difference.
#include <cstdio>
#include <cstring>

#include "kernels/compat.cuh"

namespace {

// Small integers (|v| <= 8) as 16-bit float bits.
uint16_t bf16_bits(int v) {
  const float f = static_cast<float>(v);
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return static_cast<uint16_t>(u >> 16);  // exact: a small integer has 8 significant bits
}
uint16_t f16_bits(int v) {
  if (v == 0) return 0;
  const uint16_t sign = v < 0 ? 0x8000 : 0;
  int a = v < 0 ? -v : v, e = 0;
  while ((a >> (e + 1)) != 0) ++e;  // 2^e <= a < 2^(e+1)
  const int mant = ((a - (1 << e)) << 10) >> e;
  return static_cast<uint16_t>(sign | ((e + 15) << 10) | mant);
}

template <typename T>
__global__ void mma_kernel(const T* a, const T* b, float* d) {  // a [16][16], b [16][8], d [16][8]
  const int lane = static_cast<int>(threadIdx.x) % ds::kWarp, g = lane / 4, t = lane % 4;
  const auto A = [&](int r, int k) { return ds::pack2(a[r * 16 + k], a[r * 16 + k + 1]); };
  const auto B = [&](int k, int n) { return ds::pack2(b[k * 8 + n], b[(k + 1) * 8 + n]); };
  const uint32_t fa[4] = {A(g, 2 * t), A(g + 8, 2 * t), A(g, 2 * t + 8), A(g + 8, 2 * t + 8)};
  const uint32_t fb[2] = {B(2 * t, g), B(2 * t + 8, g)};
  float acc[4];
  for (int e = 0; e < 4; ++e) acc[e] = d[(g + 8 * (e / 2)) * 8 + 2 * t + e % 2];  // C in
  ds::mma_16816<T>(acc, fa, fb);
  for (int e = 0; e < 4; ++e) d[(g + 8 * (e / 2)) * 8 + 2 * t + e % 2] = acc[e];
}

template <typename T>
int check(const char* name, uint16_t (*bits)(int)) {
  T a[16 * 16], b[16 * 8];
  float c[16 * 8], d[16 * 8], want[16 * 8];
  int ai[16 * 16], bi[16 * 8];
  for (int i = 0; i < 16 * 16; ++i) ai[i] = (i * 7 + i / 16 * 3) % 17 - 8;
  for (int i = 0; i < 16 * 8; ++i) bi[i] = (i * 5 + i / 8) % 13 - 6;
  for (int i = 0; i < 16 * 16; ++i) a[i].bits = bits(ai[i]);
  for (int i = 0; i < 16 * 8; ++i) b[i].bits = bits(bi[i]);
  for (int i = 0; i < 16 * 8; ++i) c[i] = static_cast<float>(i % 9 - 4);
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 8; ++n) {
      int s = 0;
      for (int k = 0; k < 16; ++k) s += ai[m * 16 + k] * bi[k * 8 + n];
      want[m * 8 + n] = c[m * 8 + n] + static_cast<float>(s);
    }
  std::memcpy(d, c, sizeof d);
#if DS_EMU
  const ds_error_t err = ds::launch(mma_kernel<T>, dim3(1), ds::kWarp, nullptr, ds::Pdl::kOff,
                                    static_cast<const T*>(a), static_cast<const T*>(b), d);
#else
  T *da = nullptr, *db = nullptr;
  float* dd = nullptr;
  cudaMalloc(&da, sizeof a);
  cudaMalloc(&db, sizeof b);
  cudaMalloc(&dd, sizeof d);
  cudaMemcpy(da, a, sizeof a, cudaMemcpyHostToDevice);
  cudaMemcpy(db, b, sizeof b, cudaMemcpyHostToDevice);
  cudaMemcpy(dd, d, sizeof d, cudaMemcpyHostToDevice);
  ds_error_t err = ds::launch(mma_kernel<T>, dim3(1), ds::kWarp, nullptr, ds::Pdl::kOff,
                              static_cast<const T*>(da), static_cast<const T*>(db), dd);
  if (err == DS_SUCCESS) err = cudaMemcpy(d, dd, sizeof d, cudaMemcpyDeviceToHost);
  cudaFree(da);
  cudaFree(db);
  cudaFree(dd);
#endif
  if (err != DS_SUCCESS) {
    std::printf("mma_16816 %s: launch failed (%d)\n", name, static_cast<int>(err));
    return 1;
  }
  int wrong = 0;
  for (int i = 0; i < 16 * 8; ++i) wrong += d[i] != want[i];
  std::printf("mma_16816 %s: %d of 128 outputs wrong\n", name, wrong);
  return wrong != 0;
}

}  // namespace

int main() {
  const int bad = check<ds::bf16>("bf16", bf16_bits) + check<ds::f16>("f16", f16_bits);
  return bad != 0 ? 1 : 0;
}
