// A block's copy of a tile of rows from global to shared memory, in two halves so that the copy
// can run while the block waits for the kernel before it (PDL) and computes whatever comes first:
//   tile_copy_start  may run before grid_dependency_wait(), so the source must be memory that
//                    no kernel of the forward writes (weights);
//   tile_copy_wait   every thread of the block calls it (it is a barrier); once it returns the
//                    tile is in shared memory for all of them.
// sm_90 (CUDA): thread 0 issues one bulk copy per row (the copy engine, cp.async.bulk) that
// completes on an mbarrier in shared memory, so the rows stream in with no thread's registers
// or instructions spent on them. Elsewhere (older GPUs, HIP, the CPU emulation) start does
// nothing and wait copies the rows with 16-byte loads and stores: the same tile, later.
#pragma once

#include "compat.cuh"

namespace ds {

#if !DS_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define DS_BULK_COPY 1
#else
#define DS_BULK_COPY 0
#endif

// rows x row_bytes from src (rows src_ld bytes apart) to dst (rows dst_ld bytes apart). row_bytes,
// src_ld, dst_ld and both addresses 16-byte multiples; rows * row_bytes < 2^20 (the mbarrier's
// transaction count). `bar`: 8 bytes of shared memory, 8-byte aligned, for sm_90's mbarrier.
struct TileCopy {
  const unsigned char* src;
  unsigned char* dst;
  int64_t src_ld;
  int dst_ld, rows, row_bytes;
  uint64_t* bar;
};

#if DS_BULK_COPY
DS_DEVICE uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
#endif

DS_DEVICE void tile_copy_start(const TileCopy& c) {
#if DS_BULK_COPY
  if (threadIdx.x == 0) {
    const uint32_t bar = shared_address(c.bar);
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar),
                 "r"(c.rows * c.row_bytes) : "memory");
    for (int r = 0; r < c.rows; ++r)
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
          ::"r"(shared_address(c.dst + r * c.dst_ld)), "l"(c.src + r * c.src_ld),
          "r"(c.row_bytes), "r"(bar) : "memory");
  }
#else
  (void)c;
#endif
}

DS_DEVICE void tile_copy_wait(const TileCopy& c) {
#if DS_BULK_COPY
  __syncthreads();  // thread 0's mbarrier.init is seen by every thread before it polls
  const uint32_t bar = shared_address(c.bar);
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], 0;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(bar) : "memory");
#else
  const int per_row = c.row_bytes / 16;
  for (int i = static_cast<int>(threadIdx.x); i < c.rows * per_row;
       i += static_cast<int>(blockDim.x)) {
    const int r = i / per_row, o = 16 * (i - r * per_row);
    *reinterpret_cast<uint4*>(c.dst + r * c.dst_ld + o) =
        *reinterpret_cast<const uint4*>(c.src + r * c.src_ld + o);
  }
  __syncthreads();
#endif
}

}  // namespace ds
