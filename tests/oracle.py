"""The transformers greedy oracle and the near-tie rule (DESIGN.md, "Exactness").

Two greedy runs may part ways only where the reference's top-2 logit gap is below `eps`
(a near tie, where fp rounding legitimately decides). `assert_same_greedy` finds the first
divergence, reports a near tie with a warning (never silently) and fails otherwise.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

NEAR_TIE_EPS = 1e-4


class NearTieWarning(UserWarning):
    """Two greedy runs diverged at a near tie of the reference logits."""


@dataclass
class Reference:
    tokens: list[int]
    gaps: list[float]  # top-2 logit gap of the reference at each generated position


_MODELS: dict[str, torch.nn.Module] = {}


def reference_model(path: str):
    if path not in _MODELS:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        _MODELS[path] = model.eval()
    return _MODELS[path]


@torch.inference_mode()
def reference_greedy(path: str, prompt: list[int], max_new_tokens: int) -> Reference:
    """Greedy continuation by transformers (fp32, CPU), with the top-2 gap of every step."""
    from deltaserve.model.testing import transformers_torch_kernels

    model = reference_model(path)
    ids = torch.tensor([prompt])
    with transformers_torch_kernels():
        out = model.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    tokens = out.sequences[0, len(prompt):].tolist()
    gaps = []
    for step_logits in out.logits:
        top2 = torch.topk(step_logits[0].float(), 2).values
        gaps.append(float(top2[0] - top2[1]))
    return Reference(tokens, gaps)


def assert_same_greedy(ours: list[int], ref: Reference, what: str,
                       eps: float = NEAR_TIE_EPS) -> None:
    """Fail unless `ours` equals the reference tokens up to a reported near tie."""
    n = min(len(ours), len(ref.tokens))
    for i in range(n):
        if ours[i] != ref.tokens[i]:
            if ref.gaps[i] < eps:
                warnings.warn(NearTieWarning(
                    f"{what}: diverged at generated token {i} on a near tie "
                    f"(reference top-2 gap {ref.gaps[i]:.2e} < {eps:.0e})"), stacklevel=2)
                return
            raise AssertionError(
                f"{what}: token {i} is {ours[i]}, reference {ref.tokens[i]} "
                f"(reference top-2 gap {ref.gaps[i]:.3e}, not a near tie)\n"
                f"ours {ours}\nref  {ref.tokens}")
    assert len(ours) == len(ref.tokens), f"{what}: {len(ours)} tokens vs {len(ref.tokens)}"


def assert_same_runs(a: list[int], b: list[int], ref: Reference, what: str,
                     eps: float = NEAR_TIE_EPS) -> None:
    """Two deltaserve runs must agree with each other exactly unless both are explained by the
    reference's near tie at the point they part."""
    if a == b:
        return
    i = next(j for j in range(min(len(a), len(b))) if a[j] != b[j])
    if i < len(ref.gaps) and ref.gaps[i] < eps and a[:i] == ref.tokens[:i]:
        warnings.warn(NearTieWarning(f"{what}: runs part at token {i} on a near tie"),
                      stacklevel=2)
        return
    raise AssertionError(f"{what}: runs differ at token {i}\n{a}\n{b}")


@torch.inference_mode()
def router_margin(path: str, prompt: list[int]) -> float:
    """The smallest gap, over the MoE layers of the transformers model at `path` (fp32), between
    the k-th and (k+1)-th router logit of the prompt's last token: below bf16 noise (about 0.04
    at the router's input) a bf16 run may pick another expert there, and one expert swapped at
    the last token moved the next token's top-2 logit gap by 0.9 in a tiny MoE model."""
    from deltaserve.model.testing import transformers_torch_kernels

    model = reference_model(path)
    k = model.config.num_experts_per_tok
    with transformers_torch_kernels():
        out = model(torch.tensor([prompt]), output_router_logits=True)
    gaps = []
    for logits in out.router_logits:
        top = torch.sort(logits[-1].float(), descending=True).values
        gaps.append(float(top[k - 1] - top[k]))
    return min(gaps)
