"""Test-only backends and helpers for the model tests.

`RefAttention` and `RefGDN` serve ONE sequence with contiguous per-layer state (no pages, no
slots), written from the math, not from transformers: causal softmax attention, and the gated
delta rule one token at a time (Yang et al. 2024, Gated Delta Networks, eq. 10):
    S <- exp(g)·S;  S <- S + beta·(v - S k) kᵀ;  o = S q / sqrt(K)
with q, k L2-normalised, g = -exp(A_log)·softplus(a + dt_bias), beta = sigmoid(b), after a causal
depthwise conv1d (width W) + SiLU over the mixed q|k|v channels.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from deltaserve.core import ForwardContext


class RefAttention:
    """Causal attention over everything this sequence fed so far (KV kept per layer_id)."""

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        if layer_id in self.k:
            k, v = torch.cat([self.k[layer_id], k]), torch.cat([self.v[layer_id], v])
        self.k[layer_id], self.v[layer_id] = k, v
        t, heads, d = q.shape
        past = k.shape[0] - t
        group = heads // k.shape[1]
        kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", q.float(), kk.float()) * d ** -0.5
        rows = torch.arange(t, device=q.device)[:, None] + past
        cols = torch.arange(k.shape[0], device=q.device)[None, :]
        scores = scores.masked_fill(cols > rows, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.einsum("hts,shd->thd", probs, vv.float()).to(q.dtype)


class RefGDN:
    """Conv window [W-1, D] and recurrent state S [HV, V, K] (fp32) per gdn_id."""

    def __init__(self) -> None:
        self.window: dict[int, torch.Tensor] = {}
        self.state: dict[int, torch.Tensor] = {}

    def forward(self, layer, mixed_qkv: torch.Tensor, a: torch.Tensor,
                b: torch.Tensor) -> torch.Tensor:
        gid = layer.gdn_id
        weight = layer.conv_weight.float()  # [D, W]
        d, w = weight.shape
        dev = mixed_qkv.device
        window = self.window.get(gid, torch.zeros(w - 1, d, device=dev))
        x = torch.cat([window, mixed_qkv.float()])  # [W-1+T, D]
        t = mixed_qkv.shape[0]
        y = torch.stack([(x[i:i + w] * weight.T).sum(0) for i in range(t)])
        y = F.silu(y)
        self.window[gid] = x[-(w - 1):]

        h, hv, kd, vd = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
        q, k, v = torch.split(y, [h * kd, h * kd, hv * vd], dim=-1)
        q, k, v = q.reshape(t, h, kd), k.reshape(t, h, kd), v.reshape(t, hv, vd)
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        head_of = torch.arange(hv, device=dev) // (hv // h)  # value head -> its key head
        g = -torch.exp(layer.A_log.float()) * F.softplus(a.float() + layer.dt_bias.float())
        beta = torch.sigmoid(b.float())
        s = self.state.get(gid, torch.zeros(hv, vd, kd, device=dev))
        out = []
        for i in range(t):
            qi, ki = q[i, head_of], k[i, head_of]  # [HV, K]
            s = torch.exp(g[i])[:, None, None] * s
            pred = torch.einsum("hvk,hk->hv", s, ki)
            s = s + beta[i][:, None, None] * torch.einsum("hv,hk->hvk", v[i] - pred, ki)
            out.append(torch.einsum("hvk,hk->hv", s, qi) * kd ** -0.5)
        self.state[gid] = s
        return torch.stack(out).to(mixed_qkv.dtype)


class Sequence:
    """One sequence fed through a model in calls of any size; tracks positions."""

    def __init__(self, model, hidden_sink=None) -> None:
        self.model, self.pos = model, 0
        self.attn, self.gdn = RefAttention(), RefGDN()
        self.hidden_sink = hidden_sink

    def context(self, n: int) -> ForwardContext:
        positions = torch.arange(self.pos, self.pos + n, device=self.model.device)
        return ForwardContext(positions, self.attn, self.gdn, self.hidden_sink)

    @torch.no_grad()
    def feed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [n] -> logits [n, vocab] fp32."""
        hidden = self.model(ids, self.context(len(ids)))
        self.pos += len(ids)
        return self.model.compute_logits(hidden)


def rewrite_checkpoint(path: Path, edit) -> None:
    """Apply edit(tensors: dict) in place to a single-file checkpoint."""
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def shard_checkpoint(path: Path, num_shards: int = 3) -> None:
    """Split model.safetensors into `num_shards` files plus model.safetensors.index.json."""
    file = path / "model.safetensors"
    tensors = load_file(file)
    file.unlink()
    keys = sorted(tensors)
    weight_map = {}
    for s in range(num_shards):
        name = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {k: tensors[k] for k in keys[s::num_shards]}
        save_file(part, path / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def fuse_experts(tensors: dict[str, torch.Tensor]) -> None:
    """Per-expert keys -> stacked `experts.gate_up_proj` / `experts.down_proj` (the Hub layout)."""
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for key in [k for k in tensors if ".mlp.experts." in k and k.endswith("_proj.weight")]:
        base, rest = key.split(".mlp.experts.")
        e, part, _ = rest.split(".")
        groups.setdefault(base, {}).setdefault(int(e), {})[part] = tensors.pop(key)
    for base, experts in groups.items():
        order = sorted(experts)
        tensors[f"{base}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]]) for e in order])
        tensors[f"{base}.mlp.experts.down_proj"] = torch.stack(
            [experts[e]["down_proj"] for e in order])
