// Host check of ds::FastDiv (compat.cuh) against the / and % operators, compiled and run by
// .ci/compile_kernels.sh: every divisor up to 4096 with every n below 2^16, the n next to
// 2^31, and divisors the kernels never use (primes, powers of two, up to 2^31 - 1). This runs
// the host branch of div(); the device branch (__umulhi) is the same product, and the GPU tests
// of tests/ops/test_gdn_gpu.py run it (V=100 at K=128: 7 row tiles per value head).
#include <cstdint>
#include <cstdio>

#include "kernels/compat.cuh"

static long check(int d, int n) {
  const ds::FastDiv f(d);
  return f.div(n) != n / d || f.mod(n) != n % d;
}

int main() {
  long bad = 0, tried = 0;
  for (int d = 1; d <= 4096; ++d) {
    for (int n = 0; n < (1 << 16); ++n, ++tried) bad += check(d, n);
    for (int n = 0x7fffffff; n > 0x7fffffff - 4096; --n, ++tried) bad += check(d, n);
  }
  const int wide[] = {65521, 65536, 1 << 20, 1000003, 0x40000001, 0x7ffffffe, 0x7fffffff};
  for (int d : wide)
    for (int64_t n = 0; n <= 0x7fffffff; n += 104729, ++tried) bad += check(d, int(n));
  std::printf("FastDiv: %ld of %ld quotients wrong\n", bad, tried);
  return bad == 0 ? 0 : 1;
}
