"""The multi-token-prediction (MTP) head of a Qwen3.5-style checkpoint, for training and for
making random `mtp.*` weights.

Key names (as `MTPHead(...).state_dict()` under the prefix `mtp.`): `fc.weight`
[hidden, 2·hidden], `pre_fc_norm_embedding.weight`, `pre_fc_norm_hidden.weight`, `norm.weight`
(zero-centred RMSNorms) and `layers.0.*`: one full-attention decoder layer with the same keys as
`model.layers.<full-attention layer>.*`.

Draft for position i+2 (DESIGN.md, "MTP"): with h_i the target's hidden state at position
i after its final norm and e = embed(t_{i+1}),
    x = fc(concat[norm_e(e), norm_h(h_i)]);  x = layer(x) at position i;  h' = norm(x)
and logits = lm_head(h') (the target's lm_head, tied to the embeddings here). Drafting step
d > 1 feeds h' back as the hidden state together with the next token's embedding, one position
further on; `mtp_losses` trains those recursive steps too.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

if TYPE_CHECKING:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig


class MTPHead(nn.Module):
    """One MTP layer; parameters named like the checkpoint's `mtp.*` keys."""

    def __init__(self, config: Qwen3_5TextConfig):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        layer_config = copy.deepcopy(config)
        layer_config.num_hidden_layers = 1
        layer_config.layer_types = ["full_attention"]
        # sdpa with no mask is causal; eager with no mask would not be.
        layer_config._attn_implementation = "sdpa"
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, eps=eps)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(layer_config, 0)])
        self.norm = Qwen3_5RMSNorm(h, eps=eps)

    def forward(
        self,
        next_embeds: torch.Tensor,
        hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """Draft hidden states [B, T, hidden] (after `mtp.norm`), causal over T.

        next_embeds: embed(t_{i+1}) [B, T, hidden]; hidden: h_i [B, T, hidden];
        position_embeddings: (cos, sin) of the rows' positions, from the target's rotary_emb.
        """
        x = torch.cat(
            [self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1
        )
        x = self.fc(x)
        for layer in self.layers:
            x = layer(x, position_embeddings=position_embeddings, attention_mask=None)
        return self.norm(x)


def mtp_losses(
    model: Qwen3_5ForCausalLM,
    mtp: MTPHead,
    input_ids: torch.Tensor,
    hidden: torch.Tensor,
    num_steps: int = 1,
) -> list[torch.Tensor]:
    """Cross-entropy of each MTP drafting step on a batch (teacher-forced tokens).

    input_ids [B, T] int64; hidden [B, T, hidden]: the target's final-norm hidden states for
    input_ids. Step d (1-based) predicts t_{i+d+1} from embed(t_{i+d}) and the previous step's
    hidden (h_i for d = 1) at position i+d-1. Returns `num_steps` scalar losses (mean over the
    predicted tokens); needs T > num_steps + 1.
    """
    bsz, seq = input_ids.shape
    if seq <= num_steps + 1:
        raise ValueError(f"sequence length {seq} too short for {num_steps} MTP steps")
    embed = model.get_input_embeddings()
    rotary = model.model.rotary_emb
    losses = []
    h = hidden
    for d in range(1, num_steps + 1):
        n = seq - d - 1  # rows i = 0..n-1 predict t_{i+d+1}
        h = h[:, :n]
        nxt = embed(input_ids[:, d : d + n])
        h = mtp(nxt, h, rotary(h, text_positions(d - 1, n, bsz, input_ids.device)))
        logits = model.lm_head(h).float()
        target = input_ids[:, d + 1 : d + 1 + n]
        losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1)))
    return losses


def text_positions(start: int, n: int, bsz: int, device: torch.device) -> torch.Tensor:
    """Positions start..start+n-1 as the [3, bsz, n] int64 ids Qwen3.5's multimodal rotary
    embedding takes (its t/h/w sections equal for text); transformers 5.17 accepts only this
    shape, later versions also a [bsz, n] one."""
    return torch.arange(start, start + n, device=device).view(1, 1, n).expand(3, bsz, n)


@torch.no_grad()
def greedy_first_draft_agreement(
    model: Qwen3_5ForCausalLM, mtp: MTPHead, input_ids: torch.Tensor, hidden: torch.Tensor,
    main_logits: torch.Tensor,
) -> tuple[int, int]:
    """(agreeing rows, rows): how often the first MTP draft's argmax equals the target's own
    argmax at that position, on teacher-forced text — the greedy acceptance rate of draft 1.

    main_logits [B, T, vocab]: the target's logits for input_ids.
    """
    bsz, seq = input_ids.shape
    n = seq - 1
    pos = text_positions(0, n, bsz, input_ids.device)
    rotary = model.model.rotary_emb
    h = mtp(model.get_input_embeddings()(input_ids[:, 1:]), hidden[:, :-1], rotary(hidden, pos))
    draft = model.lm_head(h).argmax(-1)  # row i drafts t_{i+2}
    target = main_logits[:, 1:].argmax(-1)  # the target's prediction for t_{i+2}
    return int((draft == target).sum()), draft.numel()
