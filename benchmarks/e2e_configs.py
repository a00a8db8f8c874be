"""Named model configs for bench_e2e.py --config: config.json files written from transformers'
config defaults (dummy weights, `--load-format dummy`) and the rooflines each figure is set
beside (TARGETS.md, "End to end").

- qwen3.6-35b-a3b: `Qwen3_5MoeTextConfig()` (Qwen3.5/3.6-35B-A3B: hidden 2048, 40 layers,
  256 experts top-8, expert and shared width 512, GDN 16/32 × 128, attention 16/2 × 256,
  vocab 248,320).
- qwen3-next-80b-a3b: `Qwen3NextConfig()` (hidden 2048, 48 layers, 512 experts top-10,
  widths 512, vocab 151,936); its 80B parameters do not fit one H200 in bf16: pass --layers.

Rooflines (H200: 4,274 GB/s measured copy bandwidth, 989 TFLOP/s dense bf16):
- decode at batch B: the weights actually read per step ÷ bandwidth, where the weights read
  are every non-expert weight (the embedding: only B rows) plus, per MoE layer, the distinct
  experts the B tokens select. With dummy weights the router is close to uniform, so the
  expected count E·(1 − (1 − k/E)^B) is used (TARGETS.md's "≈ 160 of 256 at batch 32"); a
  second figure adds the GDN state read and written per request (fp32).
- prefill / TTFT of P tokens: the larger of the weight read (as decode at B = P) and
  2 · active parameters · P FLOPs at peak.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

COPY_GBS = 4274.0
PEAK_TFLOPS = 989.0
CONFIGS = ("qwen3.6-35b-a3b", "qwen3-next-80b-a3b")


def dense_config(hidden: int = 1024, layers: int = 24, vocab: int = 248320,
                 mtp_layers: int = 0):
    """The 0.8B config (TARGETS.md: Qwen3.5-0.8B's shapes, 3 GDN : 1 attention, tied
    embeddings) as a `Qwen3_5TextConfig`, at other sizes where given; `mtp_layers` MTP layers
    announced (with `--load-format dummy` they get random weights like the rest)."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 3.5),
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=65536,
        tie_word_embeddings=True, eos_token_id=vocab - 1, mtp_num_hidden_layers=mtp_layers,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                     for i in range(layers)])


def write_dense_config(folder: str | Path, mtp_layers: int = 1) -> None:
    """`folder/config.json` of the 0.8B config (bf16) with `mtp_layers` MTP layers, for a
    `load_format="dummy"` engine (bench_spec.py --config 0.8b)."""
    cfg = dense_config(mtp_layers=mtp_layers).to_dict()
    cfg["dtype"] = "bfloat16"
    Path(folder, "config.json").write_text(json.dumps(cfg, indent=2))


def write_config(folder: str | Path, name: str, layers: int | None) -> dict:
    """Write `folder/config.json` for config `name` (cut to the first `layers` layers when
    given); returns the dict written. Raises ValueError for an unknown name."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3NextConfig

    if name not in CONFIGS:
        raise ValueError(f"--config must be one of {', '.join(CONFIGS)}, got {name!r}")
    cfg = (Qwen3_5MoeTextConfig() if name == "qwen3.6-35b-a3b" else Qwen3NextConfig()).to_dict()
    if layers is not None:
        cfg["num_hidden_layers"] = layers
        cfg["layer_types"] = cfg["layer_types"][:layers]
    cfg["eos_token_id"] = cfg["vocab_size"] - 1
    cfg["dtype"] = "bfloat16"
    Path(folder, "config.json").write_text(json.dumps(cfg, indent=2))
    return cfg


def weight_bytes(model) -> dict[str, float]:
    """Bytes of the loaded model's weights by kind: `expert` (one routed expert of one layer),
    `non_expert` (everything else except the embedding), `embed_row`, plus the MoE shape."""
    from deltaserve.model.mlp import SparseMoE

    moe = [m for m in model.modules() if isinstance(m, SparseMoE)]
    experts = sum(p.numel() * p.element_size() for m in moe for p in m.experts.parameters())
    embed = model.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    n_exp = moe[0].experts.num_experts if moe else 0
    tied = model.lm_head is None  # a tied head reads the whole embedding as the head
    return {
        "moe_layers": len(moe), "num_experts": n_exp, "top_k": moe[0].top_k if moe else 0,
        "expert": experts / max(1, len(moe) * n_exp),
        "non_expert": total - experts - (0 if tied else embed.numel() * embed.element_size()),
        "embed_row": embed.shape[1] * embed.element_size(),
    }


def state_bytes_per_request(model) -> float:
    """GDN recurrent (fp32) + conv state bytes of one request, all GDN layers."""
    c = model.config
    rec = c.linear_num_value_heads * c.linear_value_head_dim * c.linear_key_head_dim * 4
    conv = (c.linear_conv_kernel_dim - 1) * c.conv_dim * model.dtype.itemsize
    return c.num_gdn_layers * (rec + conv)


def distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts that `tokens` uniformly routed tokens select in one layer."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens) if num_experts else 0.0


def step_bytes(w: dict[str, float], tokens: int) -> float:
    """Weight bytes one forward of `tokens` tokens reads (see the module docstring)."""
    chosen = distinct_experts(w["num_experts"], w["top_k"], tokens)
    return w["non_expert"] + tokens * w["embed_row"] + w["moe_layers"] * chosen * w["expert"]


def rooflines(model, prefill_tokens: int, ttft_tokens: int) -> dict[str, float]:
    """The roofline of each figure bench_e2e reports for a --config run (tok/s, or s)."""
    w = weight_bytes(model)
    state = state_bytes_per_request(model)
    out: dict[str, float] = {"weights_gb": (w["non_expert"] + w["moe_layers"] * w["num_experts"]
                                            * w["expert"]) / 1e9}
    for b in (1, 32):
        t = step_bytes(w, b) / (COPY_GBS * 1e9)
        out[f"roofline_decode_b{b}_tok_s"] = b / t
        out[f"roofline_decode_b{b}_with_state_tok_s"] = b / (t + 2 * b * state / (COPY_GBS * 1e9))
        out[f"read_gb_decode_b{b}"] = step_bytes(w, b) / 1e9
    active = (w["non_expert"] + w["moe_layers"] * w["top_k"] * w["expert"]) / 2  # bf16 params
    for key, n in (("prefill", prefill_tokens), ("ttft", ttft_tokens)):
        t = max(step_bytes(w, n) / (COPY_GBS * 1e9), 2 * active * n / (PEAK_TFLOPS * 1e12))
        out[f"roofline_{key}_s"] = t
    out["roofline_prefill_tok_s"] = prefill_tokens / out["roofline_prefill_s"]
    return out


def engine_kwargs(folder: str | Path, max_running_reqs: int = 32, reserve_gb: float = 12.0,
                  snapshot_slots: int = 32) -> dict:
    """LLM(...) keywords for a dummy-weight run on the current GPU: bf16, the state pool for
    `max_running_reqs` requests and `snapshot_slots` snapshots, and the KV budget from what is
    left after the weights, the state pool and `reserve_gb` GiB for activations and graphs
    (the 35B-A3B config fits an 80 GB H100 with 4 snapshot slots and 6 GiB reserved).
    Raises ValueError when less than 1 GiB is left."""
    from deltaserve.config import EngineConfig
    from deltaserve.engine.preflight import plan_caches
    from deltaserve.model.config import ModelConfig
    from deltaserve.model.qwen3_5 import Model

    config = ModelConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = Model(config, num_mtp_layers=0).to(torch.bfloat16)
    weights = sum(p.numel() * 2 for p in model.parameters())
    # the engine's own sizing of the GDN state pool (the KV pool left out: num_pages=2)
    states = plan_caches(EngineConfig(max_running_reqs=max_running_reqs, num_pages=2,
                                      num_snapshot_slots=snapshot_slots),
                         config, 1, torch.bfloat16).state_bytes
    free, _ = torch.cuda.mem_get_info()
    left = free - weights - states - reserve_gb * 2**30
    if left < 2**30:
        raise ValueError(f"{weights / 1e9:.1f} GB of weights leave {left / 2**30:.1f} GiB for "
                         "the KV pool on this GPU: pass fewer --layers, or a smaller "
                         "--reserve-gb / --snapshot-slots")
    return dict(load_format="dummy", device="cuda", dtype="bfloat16", page_size=16,
                chunk_size=8192, max_num_batched_tokens=8192, max_running_reqs=max_running_reqs,
                num_snapshot_slots=snapshot_slots, kv_memory_gb=left / 2**30)


def report(res: dict) -> None:
    """Print each --config figure beside its roofline."""
    pairs = (("prefill_tok_s", "roofline_prefill_tok_s"),
             ("decode_b1_tok_s", "roofline_decode_b1_tok_s"),
             ("decode_b32_tok_s", "roofline_decode_b32_tok_s"),
             ("ttft_256_s", "roofline_ttft_s"))
    print(f"weights {res['weights_gb']:.1f} GB; read per decode step: "
          f"{res['read_gb_decode_b1']:.2f} GB at b1, {res['read_gb_decode_b32']:.2f} GB at b32")
    for got, bound in pairs:
        if got in res:
            share = (res[got] / res[bound] if got.endswith("tok_s")
                     else res[bound] / res[got])
            print(f"{got:18s} {res[got]:10.4g}   roofline {res[bound]:10.4g}   "
                  f"({100 * share:.0f}% of it)", flush=True)
    for b in (1, 32):
        print(f"decode b{b} roofline with the GDN state read+write: "
              f"{res[f'roofline_decode_b{b}_with_state_tok_s']:.4g} tok/s")
