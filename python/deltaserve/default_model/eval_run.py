"""Running the default-model evaluation: greedy completions of the fixed openings, scored.

`evaluate_completions` generates every opening in both forms (evaluate.FORMS) in one batch with
deltaserve's `LLM` and scores them (evaluate.py has the rules); `mtp_acceptance` measures the
MTP head's acceptance length at k drafts on the same held-out openings and checks that
speculation changes no token. scripts/eval_default_model.py is the command line.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from deltaserve.core import SamplingParams
from deltaserve.default_model.evaluate import FORMS, score_completion, summarize

if TYPE_CHECKING:
    from deltaserve.llm import LLM

MAX_TOKENS = 96


def eval_params(max_tokens: int = MAX_TOKENS, repetition_penalty: float = 1.0,
                token_healing: bool = False) -> SamplingParams:
    """Greedy sampling as `deltaserve generate` does it, with the measured options."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens,
                          repetition_penalty=repetition_penalty, token_healing=token_healing)


def form_prompts(openings: list[dict]) -> list[tuple[str, dict, str]]:
    """(form, opening, prompt text) for every form and opening, form-major."""
    return [(form, o, o["text"] + suffix) for form, suffix in FORMS.items() for o in openings]


def evaluate_completions(llm: LLM, openings: list[dict], params: SamplingParams) -> dict:
    """Complete and score every opening in both forms; the report's "results" and "totals".

    openings: dicts with "path", "qualname" and "text" (openings.load_openings()). Returns
    {"results": [per completion: form, path, qualname, completion, finish_reason, n_tokens,
    and the Score fields], "totals": {form: evaluate.summarize(...)}, "seconds": wall time}.
    """
    items = form_prompts(openings)
    t0 = time.perf_counter()
    outs = llm.generate([p for _, _, p in items], params)
    seconds = time.perf_counter() - t0
    results, by_form = [], {form: [] for form in FORMS}
    for (form, o, _), out in zip(items, outs, strict=True):
        score = score_completion(o["text"], FORMS[form], out.text, out.finish_reason)
        by_form[form].append(score)
        results.append({"form": form, "path": o["path"], "qualname": o["qualname"],
                        "completion": out.text, "finish_reason": out.finish_reason,
                        "n_tokens": len(out.token_ids), **score.to_dict()})
    totals = {form: summarize(scores) for form, scores in by_form.items()}
    return {"results": results, "totals": totals, "seconds": round(seconds, 2),
            "tokens": [out.token_ids for out in outs]}


def mtp_acceptance(model: str | None, openings: list[dict], params: SamplingParams,
                   reference_tokens: list[list[int]], k: int = 3, device: str = "cpu") -> dict:
    """Acceptance length (tokens committed per verify step) of the model's MTP head at `k`
    drafts (fixed policy: every decode step verifies) over the same prompts as
    `evaluate_completions`, and how many requests' tokens equal `reference_tokens` (its
    speculation-off tokens, in form_prompts order; greedy output must not change)."""
    from deltaserve.llm import LLM

    llm = LLM(model, device=device, enable_prefix_cache=False, speculative_algorithm="mtp",
              speculative_num_steps=k, speculative_policy="fixed")
    outs = llm.generate([p for _, _, p in form_prompts(openings)], params)
    same = sum(o.token_ids == ref for o, ref in zip(outs, reference_tokens, strict=True))
    return {"k": k, "acceptance_length": llm.engine.acceptance_length,
            "same_tokens": same, "n": len(outs)}
