"""The tensor-parallel process group: the collectives the sharded model calls.

One `TPGroup` per rank wraps a torch.distributed process group object (gloo for CPU tensors,
NCCL for CUDA tensors) built directly from a TCPStore, so no global default group is created
and a process may hold several engines one after another (tests). Every collective is bounded
by `timeout_s`: a rank that died makes the others raise instead of waiting for ever.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

# NVLink multicast (NVLS, symmetric-memory multicast) can take a shared host's GPUs out of
# service; it is forced off before any NCCL communicator exists (issue 31).
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
LOOPBACK = "127.0.0.1"  # every rank runs on this host (one worker process per local GPU)


class TPGroup:
    """rank r of `size` ranks. Tensors passed to the collectives are on the group's device
    (CPU: gloo, CUDA: NCCL) and contiguous; the ops are in place unless said otherwise."""

    def __init__(self, pg, rank: int, size: int, timeout_s: float) -> None:
        self.pg, self.rank, self.size, self.timeout_s = pg, rank, size, timeout_s

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x [...] (any float dtype) -> x, summed over the ranks in place (row-parallel
        projections, the vocab-parallel embedding). Raises RuntimeError (from the backend)
        when a peer is gone or the timeout passes."""
        if not x.is_contiguous():
            raise ValueError("all_reduce needs a contiguous tensor")
        self.pg.allreduce([x]).wait()
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., n] on every rank -> [..., size·n], rank r's x at columns [r·n, (r+1)·n)
        (the vocab-parallel LM head's logits). Every rank gets the same tensor."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.pg.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)


def make_store(rank: int, size: int, port: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0 opens the store on a free loopback port (port 0: the OS picks; read it back from
    `.port`), the other ranks connect to that port."""
    return dist.TCPStore(LOOPBACK, port, size, rank == 0, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def make_group(store: dist.Store, rank: int, size: int, device: torch.device,
               timeout_s: float) -> TPGroup:
    """The process group over `store` for tensors on `device`: gloo bound to the loopback
    interface on a CPU, NCCL (multicast off, see NO_MULTICAST_ENV) on CUDA."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        os.environ.update(NO_MULTICAST_ENV)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, size, opts)
    else:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
        pg = dist.ProcessGroupGloo(store, rank, size, opts)
    return TPGroup(pg, rank, size, timeout_s)
