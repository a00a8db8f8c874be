"""Gated DeltaNet layer: projections, backend call, gated RMSNorm, out_proj.

The conv1d, gates and the gated delta rule itself run in the engine's GDN backend
(`ctx.gdn.forward`), which owns the per-request states. Input projections use the Qwen3.5
layout (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`), merged into one weight; the loader
reorders Qwen3-Next's fused `in_proj_qkvz` / `in_proj_ba` into it once
(`split_qwen3_next_projections`), then copies each part into its rows.
Source: transformers' `Qwen3_5GatedDeltaNet` / `Qwen3NextGatedDeltaNet` (modeling_*.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from deltaserve.model.merged import Linear, MergedLinear
from deltaserve.model.norm import GatedRMSNorm
from deltaserve.ops.prologue import ProjectionInput

if TYPE_CHECKING:
    from deltaserve.core import ForwardContext
    from deltaserve.model.config import ModelConfig


class GatedDeltaNet(nn.Module):
    """One GDN token mixer. What the GDN backend reads:

    gdn_id (index among GDN layers), conv_weight [conv_dim, W] (depthwise, squeezed conv1d
    weight, model dtype), conv_bias (always None for these models), A_log [HV] and dt_bias [HV]
    (fp32 once `prepare()` ran: the kernels read them in fp32, so they are cast once at load,
    holding the model-dtype values of the checkpoint), num_k_heads (H), num_v_heads (HV),
    head_k_dim (K), head_v_dim (V). Channel order of mixed_qkv / conv_weight: q (H·K) | k (H·K)
    | v (HV·V), head-major.

    in_proj_qkv | in_proj_z | in_proj_b | in_proj_a are one `MergedLinear` (`in_proj`, rows
    [conv_dim | HV·V | HV | HV]), one GEMM; the backend gets views of its output.
    """

    conv_bias: torch.Tensor | None = None

    def __init__(self, config: ModelConfig, gdn_id: int) -> None:
        super().__init__()
        self.gdn_id = gdn_id
        self.num_k_heads = h = config.linear_num_key_heads
        self.num_v_heads = hv = config.linear_num_value_heads
        self.head_k_dim = k = config.linear_key_head_dim
        self.head_v_dim = v = config.linear_value_head_dim
        self.conv_dim = 2 * h * k + hv * v
        hidden = config.hidden_size
        self.in_proj = MergedLinear(hidden, [("in_proj_qkv", self.conv_dim),
                                             ("in_proj_z", hv * v), ("in_proj_b", hv),
                                             ("in_proj_a", hv)])
        self.conv_weight = nn.Parameter(torch.zeros(self.conv_dim, config.linear_conv_kernel_dim))
        self.A_log = nn.Parameter(torch.zeros(hv))
        self.dt_bias = nn.Parameter(torch.ones(hv))
        self.norm = GatedRMSNorm(v, config.rms_norm_eps)
        self.out_proj = Linear(hv * v, hidden, bias=False)

    def prepare(self) -> None:
        """A_log, dt_bias -> fp32 parameters (the unfused path cast them on every call)."""
        self.A_log = nn.Parameter(self.A_log.detach().float(), requires_grad=False)
        self.dt_bias = nn.Parameter(self.dt_bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor | ProjectionInput, ctx: ForwardContext) -> torch.Tensor:
        """x [T, hidden] (or the pre-norm in_proj makes) -> [T, hidden]; the gated norm runs
        in out_proj's kernel where it fits (`ops.prologue`)."""
        t = x.shape[0]
        mixed_qkv, z, b, a = self.in_proj.split(self.in_proj(x))
        o = ctx.gdn.forward(self, mixed_qkv, a, b)  # [T, HV, V]
        z = z.view(t, self.num_v_heads, self.head_v_dim)
        return self.out_proj(self.norm.deferred(o, z))


def split_qwen3_next_projections(
    qkvz: torch.Tensor, ba: torch.Tensor, num_k_heads: int, num_v_heads: int, head_k_dim: int,
    head_v_dim: int,
) -> dict[str, torch.Tensor]:
    """Reorder Qwen3-Next's fused projection weights into the Qwen3.5 layout.

    qkvz [H·(2K + 2·r·V), hidden] is grouped per key head h: [q_h (K) | k_h (K) | v_h (r·V) |
    z_h (r·V)] with r = HV / H; ba [H·2r, hidden] per key head: [b_h (r) | a_h (r)]
    (transformers' `Qwen3NextGatedDeltaNet.fix_query_key_value_ordering`). Returns the weights
    of in_proj_qkv [2HK + HV·V, hidden] (all q, all k, all v), in_proj_z [HV·V, hidden],
    in_proj_b [HV, hidden], in_proj_a [HV, hidden]; value head h·r + j keeps key head h.
    """
    h, k, v, r = num_k_heads, head_k_dim, head_v_dim, num_v_heads // num_k_heads
    hidden = qkvz.shape[-1]
    grouped = qkvz.reshape(h, 2 * k + 2 * r * v, hidden)
    q, kk, vv, z = torch.split(grouped, [k, k, r * v, r * v], dim=1)
    qkv = torch.cat([q.reshape(h * k, hidden), kk.reshape(h * k, hidden),
                     vv.reshape(h * r * v, hidden)], dim=0)
    b, a = torch.split(ba.reshape(h, 2 * r, hidden), [r, r], dim=1)
    return {
        "in_proj_qkv": qkv,
        "in_proj_z": z.reshape(h * r * v, hidden),
        "in_proj_b": b.reshape(h * r, hidden),
        "in_proj_a": a.reshape(h * r, hidden),
    }
