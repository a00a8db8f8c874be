"""Input builders shared by the ops tests (CPU and GPU)."""

from __future__ import annotations

import torch


def gdn_inputs(n: int, r: int | None, h: int, hv: int, kd: int, vd: int, *, seed: int,
               dtype=torch.float32, device="cpu"):
    """Random q, k, v, a, b, A_log, dt_bias with realistic gate ranges; r=None -> decode shapes."""
    gen = torch.Generator().manual_seed(seed)
    lead = (n,) if r is None else (n, r)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    q = rnd(*lead, h, kd).to(dtype)
    k = rnd(*lead, h, kd).to(dtype)
    v = rnd(*lead, hv, vd).to(dtype)
    a = rnd(*lead, hv).to(dtype)
    b = rnd(*lead, hv).to(dtype)
    A_log = torch.log(torch.rand(hv, generator=gen) * 15 + 1).to(device)
    dt_bias = rnd(hv, scale=0.5)
    return q, k, v, a, b, A_log, dt_bias


def random_state(s: int, hv: int, vd: int, kd: int, *, seed: int, device="cpu", layers=None):
    """fp32 state pool, generated on `device` (large GPU pools stay fast to build)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (s, hv, vd, kd) if layers is None else (layers, s, hv, vd, kd)
    return torch.randn(*shape, generator=gen, device=device) * 0.1
