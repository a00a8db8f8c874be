#!/usr/bin/env bash
# Compile every device-code header in csrc/kernels/ without torch:
#   1. each header on its own (self-contained) and all kernel templates instantiated, with nvcc
#      for sm_90 (device code only, -cubin);
#   2. the same instantiation for HIP gfx1151 (wave32) with Debian's clang-19
#      (--cuda-device-only -S, BUILD.md), installing clang-19 + HIP headers when missing;
#   3. tests/csrc/fastdiv_check.cu built for the host with nvcc and run (FastDiv against / and %);
#   4. tests/csrc/mma_check.cu built with the host compiler for the CPU emulation and run
#      (mma_16816's portable form against the fragment layout compat.cuh documents).
# Exits non-zero on any compile error. Idempotent; about a minute on 2 cores.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
NVCC="$CUDA_HOME/bin/nvcc"

# One TU that instantiates every kernel through its host launcher, for all storage types.
cat > "$WORK/all_kernels.cu" <<'CU'
#include "kernels/attention.cuh"
#include "kernels/conv1d.cuh"
#include "kernels/gdn_recurrent.cuh"
#include "kernels/gdn_replay.cuh"
#include "kernels/snapshot_copy.cuh"
#include "kernels/fused.cuh"
#include "kernels/gemv.cuh"
#include "kernels/gemv_prologue.cuh"
#include "kernels/moe_experts.cuh"

template <typename T>
static void instantiate_for() {
  ds::gdn::RecurrentParams rp{};
  ds::conv::ConvParams cp{};
  for (int k : {32, 64, 128, 256}) {
    (void)ds::gdn::launch_gdn_decode<T>(rp, k, nullptr);
    (void)ds::gdn::launch_gdn_verify<T>(rp, k, nullptr);
  }
  (void)ds::conv::launch_conv_step<T, 4>(cp, false, nullptr);
  (void)ds::conv::launch_conv_step<T, 4>(cp, true, nullptr);
  (void)ds::conv::launch_conv_commit<T, 4>(cp, nullptr);
  (void)ds::conv::launch_conv_prefill<T, 4>(cp, nullptr);
  using ds::fused::Gate;
  using ds::fused::Norm;
  ds::fused::NormParams np{};
  ds::fused::GateParams gp{};
  for (bool vec : {false, true}) {
    (void)ds::fused::launch_norm<T, Norm::kRms>(np, vec, nullptr);
    (void)ds::fused::launch_norm<T, Norm::kAddRms>(np, vec, nullptr);
    (void)ds::fused::launch_norm<T, Norm::kGated>(np, vec, nullptr);
    (void)ds::fused::launch_norm<T, Norm::kQkRope>(np, vec, nullptr);
    (void)ds::fused::launch_gate<T, Gate::kSigmoidMul>(gp, vec, nullptr);
    (void)ds::fused::launch_gate<T, Gate::kSiluMul>(gp, vec, nullptr);
  }
}

// Paged attention and KV append: 16-bit KV only; D 128 / 256 and 1, 2, 4 rows per warp are
// all reached through the launcher's dispatch.
template <typename T>
static void instantiate_attention_for() {
  ds::attn::PagedAttnParams ap{};
  ds::attn::KVAppendParams kp{};
  (void)ds::attn::launch_paged_attention<T>(ap, nullptr);
  (void)ds::attn::launch_kv_append<T>(kp, nullptr);
}

void instantiate_all() {
  instantiate_for<ds::bf16>();
  instantiate_for<ds::f16>();
  instantiate_for<float>();
  instantiate_attention_for<ds::bf16>();
  instantiate_attention_for<ds::f16>();
  ds::moe::RouteParams mr{};
  ds::moe::ExpertsParams me{};
  (void)ds::moe::launch_route<ds::bf16>(mr, nullptr);
  (void)ds::moe::launch_route<ds::f16>(mr, nullptr);
  (void)ds::moe::launch_experts<ds::bf16, ds::moe::Stage::kGateUp>(me, nullptr);
  (void)ds::moe::launch_experts<ds::bf16, ds::moe::Stage::kDown>(me, nullptr);
  (void)ds::moe::launch_experts<ds::f16, ds::moe::Stage::kGateUp>(me, nullptr);
  (void)ds::moe::launch_experts<ds::f16, ds::moe::Stage::kDown>(me, nullptr);
  ds::gemv::GemvParams gv{};
  (void)ds::gemv::launch_gemv<ds::bf16>(gv, nullptr);
  (void)ds::gemv::launch_gemv<ds::f16>(gv, nullptr);
  ds::fused::GateParams gg{};
  ds::fused::NormParams gn{};
  (void)ds::gemv::launch_gemv_gate<ds::bf16, ds::fused::Gate::kSiluMul>(gv, gg, nullptr);
  (void)ds::gemv::launch_gemv_gate<ds::bf16, ds::fused::Gate::kSigmoidMul>(gv, gg, nullptr);
  (void)ds::gemv::launch_gemv_norm<ds::bf16, ds::fused::Norm::kGated>(gv, gn, nullptr);
  (void)ds::gemv::launch_gemv_norm<ds::bf16, ds::fused::Norm::kAddRms>(gv, gn, nullptr);
  (void)ds::gemv::launch_gemv_gate<ds::f16, ds::fused::Gate::kSiluMul>(gv, gg, nullptr);
  (void)ds::gemv::launch_gemv_gate<ds::f16, ds::fused::Gate::kSigmoidMul>(gv, gg, nullptr);
  (void)ds::gemv::launch_gemv_norm<ds::f16, ds::fused::Norm::kGated>(gv, gn, nullptr);
  (void)ds::gemv::launch_gemv_norm<ds::f16, ds::fused::Norm::kAddRms>(gv, gn, nullptr);
  ds::gdn::ReplayParams p{};
  for (int k : {32, 64, 128, 256}) (void)ds::gdn::launch_gdn_replay(p, k, nullptr);
  ds::snapshot::SnapshotCopyParams sp{};
  (void)ds::snapshot::launch_snapshot_copy(sp, nullptr);
}
CU

status=0
if [[ -x "$NVCC" ]]; then
  for header in "$ROOT"/csrc/kernels/*.cuh; do
    name="$(basename "$header" .cuh)"
    printf '#include "kernels/%s.cuh"\n' "$name" > "$WORK/h_$name.cu"
    "$NVCC" -std=c++17 -O3 -arch=sm_90 -cubin -I"$ROOT/csrc" "$WORK/h_$name.cu" \
      -o "$WORK/h_$name.cubin" || { echo "FAIL nvcc sm_90: $name.cuh"; status=1; }
  done
  "$NVCC" -std=c++17 -O3 -arch=sm_90 -cubin -Werror all-warnings -I"$ROOT/csrc" \
    "$WORK/all_kernels.cu" -o "$WORK/all_kernels.cubin" \
    && echo "ok   nvcc sm_90: all kernels" || { echo "FAIL nvcc sm_90: all kernels"; status=1; }
  "$NVCC" -std=c++17 -O2 -I"$ROOT/csrc" "$ROOT/tests/csrc/fastdiv_check.cu" \
    -o "$WORK/fastdiv_check" && "$WORK/fastdiv_check" \
    || { echo "FAIL FastDiv host check"; status=1; }
else
  echo "FAIL nvcc not found at $NVCC (set CUDA_HOME)"; status=1
fi

if command -v c++ > /dev/null; then
  c++ -x c++ -std=c++17 -O1 -DDS_EMU=1 -ffp-contract=off -Wno-unknown-pragmas -I"$ROOT/csrc" \
    "$ROOT/tests/csrc/mma_check.cu" -o "$WORK/mma_check" && "$WORK/mma_check" \
    || { echo "FAIL mma_16816 emulated check"; status=1; }
else
  echo "FAIL no host c++ compiler for tests/csrc/mma_check.cu"; status=1
fi

if ! command -v clang++-19 > /dev/null || [[ ! -f /usr/include/hip/hip_runtime.h ]]; then
  if [[ "$(id -u)" == 0 ]] && command -v apt-get > /dev/null; then
    apt-get install -y -qq --no-install-recommends clang-19 lld-19 libamdhip64-dev \
      rocm-device-libs > /dev/null
  fi
fi
if command -v clang++-19 > /dev/null; then
  cp "$WORK/all_kernels.cu" "$WORK/all_kernels.hip"
  clang++-19 -x hip --offload-arch=gfx1151 --rocm-path=/usr -nogpulib -O3 -std=c++17 \
    --cuda-device-only -Werror -I"$ROOT/csrc" -S "$WORK/all_kernels.hip" \
    -o "$WORK/all_kernels.s" \
    && echo "ok   clang-19 gfx1151 (wave32): all kernels" \
    || { echo "FAIL clang-19 gfx1151: all kernels"; status=1; }
else
  echo "FAIL clang++-19 not available (apt-get install clang-19 libamdhip64-dev, as root)"
  status=1
fi
exit $status
