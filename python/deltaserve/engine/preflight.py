"""Checks of the flags against config.json and the machine, run before the engine's modules
are imported and any weight loads.

A context longer than the model's, a page pool that cannot hold one request, or caches larger
than the device's whole memory are known from config.json and the flags alone: the CLI refuses
them in about the time `import torch` takes (the engine's own imports and the weights take
seconds to minutes more). The memory check is a lower bound, never a false refusal: the caches
alone against the device's total memory (weights, activations and what other processes hold
come on top, and are left to the allocation itself, which build_caches reports). This module
imports nothing heavier than torch itself, so that it stays cheap.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from deltaserve.config import EngineConfig
    from deltaserve.model.config import ModelConfig

LOWER_CACHES = ("lower --max-running-reqs, --num-pages / --kv-memory-gb, --num-snapshot-slots "
                "or --host-snapshot-slots")


class CachePlan(NamedTuple):
    """What build_caches allocates, sized from the config and config.json alone. Bytes are the
    whole model's (all heads: at tensor parallel size N each rank holds at least 1/N)."""

    n_pages: int  # KV pages, page 0 (padding) included
    n_snapshot_slots: int  # device GDN state slots for snapshots
    n_state_slots: int  # 1 padding + 2 per running request + n_snapshot_slots
    n_host_slots: int  # pinned host bank slots (0 without a bank)
    kv_bytes: int  # the KV pool, and the MTP draft KV with speculative_algorithm mtp
    state_bytes: int  # the GDN state pool
    host_bytes: int  # the host bank
    longest_request: int  # tokens the page pool can hold for one request (less verify rows)


def plan_caches(cfg: EngineConfig, mc: ModelConfig, max_model_len: int,
                dtype: torch.dtype) -> CachePlan:
    """The cache sizes: `cfg.num_pages` KV pages (else as many as `cfg.kv_memory_gb` holds,
    at most what every running request at `max_model_len` could use), a GDN state pool of 1
    padding + 2 per running request + the snapshot slots, and the host bank; the KV in
    `dtype` (k and v [layers, pages, page_size, Hkv, D]), the recurrent state in fp32 and the
    conv window in `dtype`, as build_caches allocates them."""
    elem = dtype.itemsize
    kv_layers = len(mc.attention_layer_ids)
    if cfg.speculative_algorithm == "mtp":  # the draft KV: a parallel pool, same page ids
        kv_layers += len(mc.mtp_layer_ids)
    per_page = 2 * kv_layers * cfg.page_size * mc.num_key_value_heads * mc.head_dim * elem
    if cfg.num_pages is not None:
        num_pages = cfg.num_pages
    else:
        num_pages = max(2, int(cfg.kv_memory_gb * 2**30) // max(per_page, 1))
        # never more than every running request at full length could use
        cap = cfg.max_running_reqs * -(-(max_model_len + cfg.decode_rows_per_req)
                                       // cfg.page_size) + 1
        num_pages = min(num_pages, cap)
    snapshot_slots = (cfg.num_snapshot_slots if cfg.num_snapshot_slots is not None
                      else 2 * cfg.max_running_reqs)
    num_slots = 1 + 2 * cfg.max_running_reqs + snapshot_slots
    per_slot = mc.num_gdn_layers * (
        mc.linear_num_value_heads * mc.linear_value_head_dim * mc.linear_key_head_dim * 4
        + (mc.linear_conv_kernel_dim - 1) * mc.conv_dim * elem)
    host_slots = cfg.host_snapshot_slots if cfg.enable_prefix_cache else 0
    longest = (num_pages - 1) * cfg.page_size - (cfg.decode_rows_per_req - 1)
    return CachePlan(num_pages, snapshot_slots, num_slots, host_slots, num_pages * per_page,
                     num_slots * per_slot, host_slots * per_slot, longest)


def describe_plan(plan: CachePlan, cfg: EngineConfig) -> str:
    """The caches of `plan` in words, with the flags that size them and their bytes."""
    return (f"{plan.n_pages} KV pages of {cfg.page_size} tokens ({_gib(plan.kv_bytes)}), "
            f"{plan.n_state_slots} GDN state slots (1 + 2 x --max-running-reqs "
            f"{cfg.max_running_reqs} + {plan.n_snapshot_slots} snapshot slots; "
            f"{_gib(plan.state_bytes)}), {plan.n_host_slots} host snapshot slots "
            f"({_gib(plan.host_bytes)})")


def resolve_device_dtype(cfg: EngineConfig) -> tuple[torch.device, torch.dtype]:
    """The device and dtype `cfg` asks for ("auto": cuda when available, bf16 there and fp32
    on a CPU). Raises ValueError for cuda without a CUDA device."""
    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} was asked for but no CUDA device is available; "
                         "use --device cpu")
    if cfg.dtype == "auto":
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    else:
        dtype = getattr(torch, cfg.dtype)
    return dev, dtype


def model_config(cfg: EngineConfig) -> ModelConfig:
    """config.json of `cfg.model`, or of the embedded model when it is None (ModelConfig's
    errors: ValueError, FileNotFoundError)."""
    from deltaserve.model.config import ModelConfig

    path = cfg.model
    if path is None:
        from deltaserve.default_model import default_model_path

        path = default_model_path()
    return ModelConfig.from_pretrained(path)


def check_config(cfg: EngineConfig) -> None:
    """check_before_load for a validated `cfg` on its checkpoint's config.json, before the
    engine is built (the CLI's check; LLMEngine checks again itself)."""
    check_before_load(cfg, model_config(cfg), *resolve_device_dtype(cfg))


def check_before_load(cfg: EngineConfig, mc: ModelConfig, device: torch.device,
                      dtype: torch.dtype) -> int:
    """The context length (cfg.max_model_len, else the model's) of `cfg` on the model `mc`
    describes, once checked. Raises ValueError (the CLI shows a leading field name as its
    flag): a max_model_len past the model's max_position_embeddings; a page pool that cannot
    hold a 2-token request; caches that exceed the device's memory (memory_refusal)."""
    if cfg.max_model_len and cfg.max_model_len > mc.max_position_embeddings:
        raise ValueError(f"max_model_len {cfg.max_model_len} exceeds the model's "
                         f"max_position_embeddings {mc.max_position_embeddings}")
    max_model_len = cfg.max_model_len or mc.max_position_embeddings
    plan = plan_caches(cfg, mc, max_model_len, dtype)
    if plan.longest_request < 2:  # a one-token prompt and one output token
        raise ValueError(f"num_pages: the KV page pool cannot hold even a 2-token request "
                         f"({max(plan.longest_request, 0)} tokens fit); {cfg.kv_pool_hint()}")
    refusal = memory_refusal(plan, cfg, device, host_memory_bytes())
    if refusal is not None:
        raise ValueError(refusal)
    return max_model_len


def memory_refusal(plan: CachePlan, cfg: EngineConfig, device: torch.device,
                   host_bytes: int | None) -> str | None:
    """Why the caches of `plan` cannot fit, or None when they may. On CUDA the device caches
    against one GPU's total memory (at tensor parallel size N each rank holds at least 1/N
    of them) and the host bank against `host_bytes` (the machine's memory; None: unknown, not
    checked); on a CPU all of them, every rank's, against `host_bytes`."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        need = (plan.kv_bytes + plan.state_bytes) // cfg.tensor_parallel_size
        where = f"the {_gib(total)} of {device}"
        if cfg.tensor_parallel_size > 1:
            where += f" (at least 1/{cfg.tensor_parallel_size} of them on each GPU)"
        if need <= total:
            if host_bytes is None or plan.host_bytes <= host_bytes:
                return None
            return (f"host_snapshot_slots {plan.n_host_slots}: the host snapshot bank needs "
                    f"{_gib(plan.host_bytes)} of pinned host memory, more than this "
                    f"machine's {_gib(host_bytes)}; lower --host-snapshot-slots")
    else:
        need = plan.kv_bytes + plan.state_bytes + plan.host_bytes
        if host_bytes is None or need <= host_bytes:
            return None
        where = f"this machine's {_gib(host_bytes)} of memory"
    return (f"the caches do not fit in memory: they alone need {_gib(need)}, more than "
            f"{where}: {describe_plan(plan, cfg)}; {LOWER_CACHES}")


def host_memory_bytes() -> int | None:
    """The machine's physical memory in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _gib(n_bytes: int) -> str:
    return f"{n_bytes / 2**30:,.2f} GiB"
