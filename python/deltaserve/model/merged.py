"""One GEMM for several projections of the same input, merged at load time.

A checkpoint stores the projections separately (attention `q_proj` / `k_proj` / `v_proj`, GDN
`in_proj_qkv` / `in_proj_z` / `in_proj_b` / `in_proj_a`, MLP `gate_proj` / `up_proj`); the model
holds their weights stacked along the output dim in one parameter, so a layer reads its input
once and launches one GEMM (as vLLM's `MergedColumnParallelLinear` / `QKVParallelLinear` do).
The loader copies each checkpoint tensor into its row range (`MergedLinear.parts`); the files on
disk are unchanged.

Both `MergedLinear` and `Linear` (a single projection: o_proj, out_proj, down_proj, the router,
mtp.fc, lm_head) compute through `ops.linear.linear`: `F.linear` on the CPU, the gemv kernel for
decode-sized batches on the GPU.
"""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.ops.linear import linear


class MergedLinear(nn.Module):
    """y = x Wᵀ (+ b) with W = [W_part0; W_part1; ...] stacked along the output rows.

    parts: (checkpoint name of the projection, output rows) in output order; the name is that of
    a sibling module in the checkpoint (`q_proj` for `layers.3.self_attn.q_proj.weight`).
    weight [sum(rows), in_features] and bias [sum(rows)] (when bias=True) in the model dtype.
    x [..., in_features] -> y [..., sum(rows)]; `split(y)` gives one view per part (strided
    rows, last dim contiguous), no copy.
    """

    def __init__(self, in_features: int, parts: list[tuple[str, int]], bias: bool = False) -> None:
        super().__init__()
        if not parts or any(rows <= 0 for _, rows in parts):
            raise ValueError(f"MergedLinear needs parts with rows > 0, got {parts}")
        self.parts = tuple(parts)
        self.sizes = [rows for _, rows in parts]
        out_features = sum(self.sizes)
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """y [..., sum(rows)] -> one view [..., rows_i] per part, in `parts` order."""
        return torch.split(y, self.sizes, dim=-1)

    def row_ranges(self) -> dict[str, tuple[int, int]]:
        """Part name -> (first output row, rows) in the merged weight."""
        out, start = {}, 0
        for name, rows in self.parts:
            out[name] = (start, rows)
            start += rows
        return out

    def layout(self) -> str:
        """`q_proj 64 | k_proj 32 | v_proj 32` (for the loader's log line)."""
        return " | ".join(f"{name} {rows}" for name, rows in self.parts)


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same checkpoint keys) whose forward is
    `ops.linear.linear`: x [..., in_features] -> [..., out_features] in x's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def merged_parts(model: nn.Module) -> dict[str, tuple[str, int, int]]:
    """Where each merged projection's checkpoint tensors live in `model`: model-relative
    checkpoint name (`layers.3.self_attn.q_proj.weight`, `...q_proj.bias`) -> (merged parameter
    name, first row, rows). Used by the loader, and by tests to read a part back."""
    out: dict[str, tuple[str, int, int]] = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, MergedLinear):
            continue
        parent = prefix.rsplit(".", 1)[0] + "." if "." in prefix else ""
        for kind in ("weight", "bias"):
            if getattr(module, kind) is None:
                continue
            for part, (start, rows) in module.row_ranges().items():
                out[f"{parent}{part}.{kind}"] = (f"{prefix}.{kind}", start, rows)
    return out
