// The op library's namespace and the dispatch key its kernels register under: `deltaserve` on
// CUDA (and ROCm) tensors; the CPU emulation of the kernels (-DDS_EMU, csrc/emu/runtime.h, built
// by the tests) registers the same ops as `deltaserve_emu` on CPU tensors, so that both can be
// loaded in one process (a second TORCH_LIBRARY(deltaserve) aborts Python).
#pragma once

#include <torch/library.h>

#if defined(DS_EMU) && DS_EMU
#define DS_OPS_NAMESPACE deltaserve_emu
#define DS_OPS_KEY CPU
#else
#define DS_OPS_NAMESPACE deltaserve
#define DS_OPS_KEY CUDA
#endif
// TORCH_LIBRARY pastes its namespace argument unexpanded: one more level expands the macro.
#define DS_TORCH_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
