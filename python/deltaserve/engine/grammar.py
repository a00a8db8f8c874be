"""Structured output: a grammar matcher per request masks the logits the sampler draws from.

The grammar library is xgrammar (0.2.x; vLLM's and SGLang's default): it compiles a JSON schema,
free JSON or a regex against the tokenizer's vocabulary once, keeps one matcher per request, and
fills a token bitmask ([rows, ceil(V / 32)] int32, bit t of a row set = token t allowed) on the
CPU, which ops/token_mask.py applies to the logits (disallowed tokens -> -inf) on their device.
The mask is applied to the logits after the forward (after a CUDA graph's replay, to its output
buffer), so graphs never see it.

A matcher always stands at its request's committed output. A verify step masks row j with the
matcher after drafts[:j] (the drafts are accepted into the matcher one by one; a draft the
grammar refuses ends the masking: that row's target is masked away from the draft, so no later
row can be reached), then rolls the drafts back; the committed tokens are accepted afterwards.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from deltaserve.core import Phase
from deltaserve.ops.token_mask import apply_token_bitmask

if TYPE_CHECKING:
    from deltaserve.core import Batch, Req

logger = logging.getLogger("deltaserve.engine")

GrammarKind = Literal["json_object", "json_schema", "regex"]


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What the output must match: any JSON object ("json_object"), a JSON schema (`value`: the
    schema as a JSON string) or a regular expression (`value`: the pattern)."""

    kind: GrammarKind
    value: str | None = None


class GrammarBackend:
    """Compiles GrammarSpecs for one tokenizer and masks / advances the requests' matchers.

    tokenizer: a transformers tokenizer; vocab_size: the model's logits width (>= the
    tokenizer's; ids past it are never allowed); stop_ids: tokens that end a request (the
    grammar allows them once complete).
    """

    def __init__(self, tokenizer, vocab_size: int, stop_ids: set[int]) -> None:
        import xgrammar as xgr  # deferred: only requests with structured output need it

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_ids))
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)

    def matcher(self, spec: GrammarSpec):
        """A fresh matcher for `spec`. Raises ValueError naming what is wrong with it."""
        try:
            if spec.kind in ("json_object", "json_schema"):
                # json_object is OpenAI's "any JSON object" (the builtin JSON grammar also
                # takes arrays); compact JSON: free whitespace lets a weak model pad for ever
                schema = spec.value if spec.kind == "json_schema" else '{"type": "object"}'
                json.loads(schema or "")
                compiled = self.compiler.compile_json_schema(schema, any_whitespace=False)
            elif spec.kind == "regex":
                compiled = self.compiler.compile_regex(spec.value or "")
            else:
                raise ValueError(f"unknown grammar kind {spec.kind!r}")
        except Exception as e:  # xgrammar raises RuntimeError / its own errors on bad input
            raise ValueError(f"structured output: the {spec.kind} cannot be compiled: {e}") \
                from e
        return self._xgr.GrammarMatcher(compiled)  # 0.2.x: rollback is unbounded

    def mask(self, batch: Batch, logits: torch.Tensor, owners: list[Req]) -> None:
        """Mask `logits` [M, V] in place for the rows of requests with a grammar.

        owners[i] is row i's request (a verify batch: k+1 rows per request, in order). Each
        matcher is back at its committed output afterwards.
        """
        bitmask = self._xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)
        rows: list[int] = []
        if batch.phase is Phase.VERIFY:
            per, all_drafts = batch.rows_per_req, batch.host_drafts()
            for i, req in enumerate(batch.reqs):
                if _live(req):
                    drafts = all_drafts[i][:batch.num_drafts[i]]
                    rows += self._fill_verify(req.grammar, bitmask, i * per, drafts)
        else:
            for i, req in enumerate(owners):
                if _live(req):
                    req.grammar.fill_next_token_bitmask(bitmask, i)
                    rows.append(i)
        apply_token_bitmask(logits, bitmask, rows)

    @staticmethod
    def _fill_verify(matcher, bitmask: torch.Tensor, base: int, drafts: list[int]) -> list[int]:
        rows, accepted = [], 0
        for j in range(len(drafts) + 1):
            matcher.fill_next_token_bitmask(bitmask, base + j)
            rows.append(base + j)
            if j == len(drafts) or not matcher.accept_token(drafts[j]):
                break
            accepted += 1
            if matcher.is_terminated():  # the draft was a stop token: no row after it
                break
        if accepted:
            matcher.rollback(accepted)
        return rows

    @staticmethod
    def advance(req: Req, tokens: list[int]) -> None:
        """Accept `req`'s newly committed tokens into its matcher."""
        for token in tokens:
            if req.grammar.is_terminated():
                return
            if not req.grammar.accept_token(token):  # cannot happen for a masked row
                logger.warning("request %d: token %d does not match its grammar; output no "
                               "longer constrained", req.rid, token)
                req.grammar = None
                return


def _live(req: Req) -> bool:
    return req.grammar is not None and not req.finished and not req.grammar.is_terminated()
