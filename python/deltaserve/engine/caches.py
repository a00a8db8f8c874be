"""The engine's device caches, sized from the config: paged KV, GDN state pool, prefix cache."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

from deltaserve.cache.host_bank import HostSnapshotBank
from deltaserve.cache.lookahead import lookahead_keys
from deltaserve.cache.page_pool import PagePool
from deltaserve.cache.prefix_cache import PrefixCache
from deltaserve.cache.state_pool import GDNStatePool
from deltaserve.engine.attention import PagedKVCache

if TYPE_CHECKING:
    import torch

    from deltaserve.config import EngineConfig
    from deltaserve.model.config import ModelConfig


class EngineCaches(NamedTuple):
    kv: PagedKVCache
    draft_kv: PagedKVCache | None  # the MTP head's draft KV (speculative_algorithm mtp)
    page_pool: PagePool
    state_pool: GDNStatePool
    host_bank: HostSnapshotBank | None  # where evicted device snapshots go (if any slots)
    prefix_cache: PrefixCache


def build_caches(cfg: EngineConfig, mc: ModelConfig, max_model_len: int, device: torch.device,
                 dtype: torch.dtype) -> EngineCaches:
    """Allocate the caches: `cfg.num_pages` KV pages (else as many as `cfg.kv_memory_gb`
    holds, at most what every running request at `max_model_len` could use), a GDN state
    pool of 1 padding + 2 per running request + the snapshot slots, and the host bank."""
    attn_layers = list(mc.attention_layer_ids)
    # the MTP head's draft KV: a parallel pool indexed by the target's page ids
    draft_layers = list(mc.mtp_layer_ids) if cfg.speculative_algorithm == "mtp" else []
    if cfg.num_pages is not None:
        num_pages = cfg.num_pages
    else:
        per_page = PagedKVCache.bytes_per_page(len(attn_layers) + len(draft_layers),
                                               cfg.page_size, mc.num_key_value_heads,
                                               mc.head_dim, dtype)
        num_pages = max(2, int(cfg.kv_memory_gb * 2**30) // per_page)
        # never more than every running request at full length could use
        cap = cfg.max_running_reqs * -(-(max_model_len + cfg.decode_rows_per_req)
                                       // cfg.page_size) + 1
        num_pages = min(num_pages, cap)
    snapshot_slots = (cfg.num_snapshot_slots if cfg.num_snapshot_slots is not None
                      else 2 * cfg.max_running_reqs)
    num_slots = 1 + 2 * cfg.max_running_reqs + snapshot_slots
    try:
        kv = PagedKVCache(attn_layers, num_pages, cfg.page_size, mc.num_key_value_heads,
                          mc.head_dim, dtype, device)
        draft_kv = (PagedKVCache(draft_layers, num_pages, cfg.page_size,
                                 mc.num_key_value_heads, mc.head_dim, dtype, device)
                    if draft_layers else None)
        state_pool = GDNStatePool(
            mc.num_gdn_layers, num_slots, mc.linear_num_value_heads, mc.linear_value_head_dim,
            mc.linear_key_head_dim, mc.conv_dim, mc.linear_conv_kernel_dim, device, dtype)
        host_bank = (HostSnapshotBank.like(state_pool, cfg.host_snapshot_slots)
                     if cfg.host_snapshot_slots > 0 and cfg.enable_prefix_cache else None)
    except RuntimeError as e:  # torch.OutOfMemoryError on CUDA, an allocator error on CPU
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"the caches do not fit in memory: {num_pages} KV pages of {cfg.page_size} "
            f"tokens, {num_slots} GDN state slots (1 + 2 x --max-running-reqs "
            f"{cfg.max_running_reqs} + {snapshot_slots} snapshot slots), "
            f"{cfg.host_snapshot_slots} host snapshot slots ({first[:200]}); lower "
            "--max-running-reqs, --num-pages / --kv-memory-gb, --num-snapshot-slots or "
            "--host-snapshot-slots") from None
    page_pool = PagePool(num_pages, cfg.page_size)
    prefix_cache = PrefixCache(page_pool, state_pool, cfg.page_size,
                               grid=math.lcm(cfg.snapshot_grid, cfg.page_size),
                               key_fn=lookahead_keys if cfg.radix_lookahead else None,
                               host_bank=host_bank)
    return EngineCaches(kv, draft_kv, page_pool, state_pool, host_bank, prefix_cache)
