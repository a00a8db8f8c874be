"""Engine configuration: one dataclass, filled from CLI flags, `LLM(...)` keywords or tests."""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass, fields

DEFAULT_SPECULATIVE_STEPS = 3  # drafts per verify step when only the algorithm is given
SPECULATIVE_ALGORITHMS = ("mtp", "ngram")
SPECULATIVE_POLICIES = ("fixed", "adaptive")


def valid_seed(seed: object) -> bool:
    """An integer torch.manual_seed / torch.Generator.manual_seed take: [-2**63, 2**64)."""
    return isinstance(seed, int) and not isinstance(seed, bool) and -2**63 <= seed < 2**64


@dataclass
class EngineConfig:
    """Everything that sizes or switches the engine.

    Units: tokens unless named otherwise. `model=None` means the embedded default model.
    """

    model: str | None = None
    load_format: str = "auto"  # auto: the checkpoint's safetensors; dummy: random weights
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU), bfloat16, float16, float32
    device: str = "auto"  # auto (cuda when available), cpu, cuda
    seed: int = 0
    page_size: int = 16
    chunk_size: int = 2048  # prefill tokens per request per step
    max_num_batched_tokens: int = 8192  # prefill tokens per step, all requests together
    max_running_reqs: int = 64
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    num_pages: int | None = None  # KV pages; None: sized from kv_memory_gb
    kv_memory_gb: float = 1.0  # KV + GDN snapshot budget when num_pages is None
    num_snapshot_slots: int | None = None  # device GDN snapshot slots; None: 2 x max_running_reqs
    host_snapshot_slots: int = 0  # GDN snapshot slots in pinned host memory; 0 = no host bank
    enable_prefix_cache: bool = True
    snapshot_grid: int = 64
    max_prompt_snapshots: int = 64  # GDN snapshots per prompt at prefill chunk ends; 0 = off
    fork_snapshots: bool = True  # a snapshot where a prompt leaves a cached path (snapshots.py)
    decode_rows_per_req: int = 1  # k + 1 with speculative decoding
    speculative_algorithm: str | None = None  # mtp | ngram
    speculative_num_steps: int = 0  # drafts per verify step; 0: DEFAULT_SPECULATIVE_STEPS
    speculative_policy: str = "adaptive"  # fixed: always k drafts; adaptive: k or 0 per step
    radix_lookahead: bool | None = None  # lookahead radix keys; None: on exactly for mtp
    cuda_graphs: bool = True
    # decode: launch step n+1 before step n's tokens reach the host (engine/overlap.py); takes
    # effect with decode CUDA graphs at tensor_parallel_size 1 (with speculation: the plain
    # decode steps of the adaptive policy; verify steps stay synchronous)
    overlap_schedule: bool = True
    # verify: launch MTP verify step n+1 before step n's acceptance reaches the host
    # (engine/overlap_verify.py; greedy requests, CUDA graphs, the MTP proposer's graphs).
    # Off: exact on the GPU (tests/spec/test_gpu_overlap_verify.py), but no faster there (12-05,
    # H100: what bounds a verify step is not the round trip that chaining hides; RESULTS.md)
    overlap_verify: bool = False
    tensor_parallel_size: int = 1  # worker processes (one per GPU); > 1: deltaserve/distributed
    distributed_timeout_s: float = 120.0  # a collective or a rank's answer waits at most this
    # with cuda_graphs and the mtp proposer: the MTP catch-up + drafts as graphs too (the GPU
    # tests passed on 12-04, tests/spec/test_gpu_mtp_graph.py); False: the eager proposer
    mtp_cuda_graphs: bool = True
    # capture every batch bucket's graphs at start-up (vLLM, SGLang) instead of on first use,
    # which stalls the step that first meets a bucket
    capture_graphs_at_start: bool = True
    log_every: int = 0  # step log line every N steps; 0 = off

    def resolve_speculation(self) -> None:
        """Fill in what the speculation flags imply: k = DEFAULT_SPECULATIVE_STEPS when an
        algorithm is set without a step count, and decode_rows_per_req = k + 1."""
        if self.speculative_algorithm is None:
            return
        if self.speculative_num_steps == 0:
            self.speculative_num_steps = DEFAULT_SPECULATIVE_STEPS
        self.decode_rows_per_req = self.speculative_num_steps + 1

    def kv_pool_hint(self) -> str:
        """What enlarges the KV page pool, as the user sized it (for error messages)."""
        return ("raise --num-pages (num_pages)" if self.num_pages is not None
                else "raise --kv-memory-gb (kv_memory_gb) or set --num-pages")

    def validate(self) -> None:
        """Raise ValueError naming the first bad field (a wrong type first: `chunk_size="big"`
        or `page_size=16.5` used to surface as a TypeError from deep inside)."""
        # f.type is the annotation as written (a string: `from __future__ import annotations`)
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.type.endswith("| None"):
                continue
            kind = f.type.split(" |")[0]
            if kind == "int" and (not isinstance(value, numbers.Integral)
                                  or isinstance(value, bool)):
                raise ValueError(f"{f.name} must be an integer, got {value!r}")
            if kind == "bool" and not isinstance(value, bool):
                raise ValueError(f"{f.name} must be True or False, got {value!r}")
            if kind == "str" and not isinstance(value, str):
                raise ValueError(f"{f.name} must be a string, got {value!r}")
            if kind == "float" and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                                    or not math.isfinite(value)):
                raise ValueError(f"{f.name} must be a finite number, got {value!r}")
        if self.page_size < 1:
            raise ValueError("page_size must be >= 1")
        if self.snapshot_grid < 64 or self.snapshot_grid % 64:
            raise ValueError("snapshot_grid must be a multiple of 64 (the chunk grid)")
        if self.host_snapshot_slots < 0:
            raise ValueError("host_snapshot_slots must be >= 0 (0: no host snapshot bank)")
        if self.num_snapshot_slots is not None and self.num_snapshot_slots < 0:
            raise ValueError("num_snapshot_slots must be >= 0")
        if self.max_prompt_snapshots < 0:
            raise ValueError("max_prompt_snapshots must be >= 0 (0: no chunk snapshots)")
        if self.chunk_size < 1:
            raise ValueError("chunk_size must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1 (or unset: the model's own)")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError("num_pages must be >= 2 (page 0 is a padding sink, so "
                             "num_pages - 1 are usable)")
        if self.num_pages is None and not self.kv_memory_gb > 0:
            raise ValueError("kv_memory_gb must be > 0")
        if self.log_every < 0:
            raise ValueError("log_every must be >= 0 (0: no step log)")
        if not valid_seed(self.seed):
            raise ValueError("seed must be in [-2**63, 2**64) (torch.manual_seed's range)")
        if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", self.device):  # else torch's traceback
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, not {self.device!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        if not self.distributed_timeout_s > 0:
            raise ValueError("distributed_timeout_s must be > 0")
        if self.max_running_reqs < 1:
            raise ValueError("max_running_reqs must be >= 1")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError("load_format must be auto (the checkpoint's weights) or dummy "
                             "(random weights from config.json)")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError("dtype must be one of auto, bfloat16, float16, float32")
        if self.speculative_algorithm not in (None, *SPECULATIVE_ALGORITHMS):
            raise ValueError(f"speculative_algorithm must be one of "
                             f"{', '.join(SPECULATIVE_ALGORITHMS)}")
        if self.speculative_algorithm is not None and not 0 <= self.speculative_num_steps <= 8:
            raise ValueError("speculative_num_steps must be in 1..8 (or 0: the default, "
                             f"{DEFAULT_SPECULATIVE_STEPS}) with a speculative algorithm")
        if self.speculative_policy not in SPECULATIVE_POLICIES:
            raise ValueError(f"speculative_policy must be {' or '.join(SPECULATIVE_POLICIES)}")
        if self.speculative_algorithm is None and self.speculative_num_steps:
            raise ValueError("speculative_num_steps needs --speculative-algorithm")
