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
from deltaserve.engine.preflight import LOWER_CACHES, describe_plan, plan_caches

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
    """Allocate the caches plan_caches sizes. Raises ValueError when they do not fit."""
    attn_layers = list(mc.attention_layer_ids)
    draft_layers = list(mc.mtp_layer_ids) if cfg.speculative_algorithm == "mtp" else []
    plan = plan_caches(cfg, mc, max_model_len, dtype)
    num_pages, num_slots = plan.n_pages, plan.n_state_slots
    try:
        kv = PagedKVCache(attn_layers, num_pages, cfg.page_size, mc.num_key_value_heads,
                          mc.head_dim, dtype, device)
        draft_kv = (PagedKVCache(draft_layers, num_pages, cfg.page_size,
                                 mc.num_key_value_heads, mc.head_dim, dtype, device)
                    if draft_layers else None)
        state_pool = GDNStatePool(
            mc.num_gdn_layers, num_slots, mc.linear_num_value_heads, mc.linear_value_head_dim,
            mc.linear_key_head_dim, mc.conv_dim, mc.linear_conv_kernel_dim, device, dtype)
        host_bank = (HostSnapshotBank.like(state_pool, plan.n_host_slots)
                     if plan.n_host_slots > 0 else None)
    except RuntimeError as e:  # torch.OutOfMemoryError on CUDA, an allocator error on CPU
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"the caches do not fit in memory: {describe_plan(plan, cfg)} "
                         f"({first[:200]}); {LOWER_CACHES}") from None
    page_pool = PagePool(num_pages, cfg.page_size)
    prefix_cache = PrefixCache(page_pool, state_pool, cfg.page_size,
                               grid=math.lcm(cfg.snapshot_grid, cfg.page_size),
                               key_fn=lookahead_keys if cfg.radix_lookahead else None,
                               host_bank=host_bank)
    return EngineCaches(kv, draft_kv, page_pool, state_pool, host_bank, prefix_cache)
