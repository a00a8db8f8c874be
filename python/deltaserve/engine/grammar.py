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
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from deltaserve.core import Phase
from deltaserve.ops.token_mask import apply_token_bitmask

if TYPE_CHECKING:
    from deltaserve.core import Batch, Req

logger = logging.getLogger("deltaserve.engine")

GrammarKind = Literal["json_object", "json_schema", "regex"]


# A grammar's source at most this long: xgrammar compiles in time and memory that grow with it
# (a 173 KB schema of 2,400 patterned strings took 22-38 s and 400 MB), and a compile cannot
# be interrupted; OpenAI bounds a schema's strings at 120,000 characters in all.
MAX_GRAMMAR_CHARS = 64 * 1024
# xgrammar's cache of compiled grammars (it keeps every one by default: unbounded memory)
GRAMMAR_CACHE_BYTES = 256 * 1024 * 1024
# JSON-schema keywords xgrammar 0.2 accepts but does not enforce (a violating output passes):
# refused, so that no output silently breaks its schema. allOf is refused with more than one
# subschema (xgrammar keeps only part of the conjunction).
UNENFORCED_KEYWORDS = ("not", "contains", "minContains", "maxContains", "if", "then", "else")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("items", "prefixItems", "additionalItems", "additionalProperties", "anyOf",
               "oneOf", "allOf", "propertyNames", "unevaluatedProperties", "unevaluatedItems")
MAX_SCHEMA_DEPTH = 64


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What the output must match: any JSON object ("json_object"), a JSON schema (`value`: the
    schema as a JSON string) or a regular expression (`value`: the pattern). `compiled`: the
    grammar already compiled for this engine's tokenizer (GrammarBackend.compile; the server
    compiles off the engine thread), not part of equality."""

    kind: GrammarKind
    value: str | None = None
    compiled: Any = field(default=None, compare=False, repr=False)

    def __reduce__(self):
        # a compiled grammar belongs to this process's compiler: another process (a tensor
        # parallel worker) compiles the source again
        return (GrammarSpec, (self.kind, self.value))


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
        self.stop_ids = sorted(stop_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1,
                                            cache_limit_bytes=GRAMMAR_CACHE_BYTES)

    def compile(self, spec: GrammarSpec):
        """`spec` compiled for this tokenizer (xgrammar's CompiledGrammar; a cache hit for a
        spec compiled before). Raises ValueError, message starting "structured output", for
        a source over MAX_GRAMMAR_CHARS, a schema keyword that would not be enforced, a grammar
        that cannot be compiled or one that no output can match."""
        what = f"structured output: the {spec.kind}"
        if spec.value is not None and len(spec.value) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"{what} is {len(spec.value)} characters; at most "
                             f"{MAX_GRAMMAR_CHARS} are accepted")
        # json_object is OpenAI's "any JSON object" (the builtin JSON grammar also takes
        # arrays); compact JSON: free whitespace lets a weak model pad for ever
        schema = spec.value if spec.kind == "json_schema" else '{"type": "object"}'
        if spec.kind in ("json_object", "json_schema"):
            try:
                parsed = json.loads(schema or "")
            except ValueError as e:
                raise ValueError(f"{what} cannot be compiled: {e}") from e
            if _has_non_finite(parsed):
                raise ValueError(f"{what} has a number that is not finite (NaN, Infinity, or "
                                 "past a double's range such as 1e400)")
            unenforced = _unenforced(parsed)
            if unenforced:
                raise ValueError(f"{what} uses {unenforced}, which the grammar cannot enforce "
                                 f"(the output would not be held to it)")
        elif spec.kind != "regex":
            raise ValueError(f"{what}: unknown grammar kind")
        try:
            compiled = (self.compiler.compile_regex(spec.value or "") if spec.kind == "regex"
                        else self.compiler.compile_json_schema(schema, any_whitespace=False))
        except Exception as e:  # xgrammar raises RuntimeError / its own errors on bad input
            raise ValueError(f"{what} cannot be compiled: {_client_message(e)}") from e
        first = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        self._xgr.GrammarMatcher(compiled).fill_next_token_bitmask(first, 0)
        if not bool(first.any()):
            raise ValueError(f"{what} matches no output (no token can start one)")
        return compiled

    def matcher(self, spec: GrammarSpec):
        """A fresh matcher for `spec` (compiled here unless spec.compiled is set). Raises
        ValueError as `compile`."""
        compiled = spec.compiled if spec.compiled is not None else self.compile(spec)
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
        self._end_dead_rows(bitmask, rows, owners)
        apply_token_bitmask(logits, bitmask, rows)

    def _end_dead_rows(self, bitmask: torch.Tensor, rows: list[int], owners: list[Req]) -> None:
        """A row whose grammar allows no token (a dead end the compile-time check cannot
        see) may only sample the first stop token, so the output ends there instead of
        with a token that breaks the grammar."""
        if not rows or not self.stop_ids:
            return
        allowed = bitmask[rows].any(dim=1).tolist()  # one op for every row (a CPU tensor)
        dead = [i for i, ok in zip(rows, allowed) if not ok]
        word, bit = divmod(self.stop_ids[0], 32)
        for i in dead:
            logger.warning("request %d: its grammar allows no token here; the output ends "
                           "with a stop token", owners[i].rid)
            bitmask[i, word] = -(1 << 31) if bit == 31 else 1 << bit

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


def _has_non_finite(value: Any) -> bool:
    """Whether a parsed JSON value holds a float that is NaN or infinite anywhere (Python's
    json reads NaN, Infinity and 1e400 so; xgrammar then fails on its own re-serialised
    schema). Iterative: the size is bounded by MAX_GRAMMAR_CHARS, the nesting is not."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            return True
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


def _unenforced(schema: Any, depth: int = 0) -> str | None:
    """The first keyword of a JSON schema (and its subschemas) that xgrammar would not
    enforce, named for the error message, or None. Property names are not keywords."""
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(f"structured output: the json_schema nests more than "
                         f"{MAX_SCHEMA_DEPTH} levels")
    if isinstance(schema, list):
        return next((u for s in schema if (u := _unenforced(s, depth + 1))), None)
    if not isinstance(schema, dict):
        return None
    for key in UNENFORCED_KEYWORDS:
        if key in schema:
            return f"'{key}'"
    for key in ("anyOf", "oneOf"):  # xgrammar matches an empty output ("" as JSON) for them
        if schema.get(key) == []:
            return f"an empty '{key}' (no value matches it)"
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):  # xgrammar reads no other document
        return f"'$ref' to {ref[:100]!r} (only references inside the schema, '#/...', resolve)"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return "'allOf' with more than one subschema"
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            found = _unenforced(list(value.values()), depth + 1)
        elif key in _SUBSCHEMAS:
            found = _unenforced(value, depth + 1)
        else:
            continue
        if found:
            return found
    return None


def _client_message(error: Exception) -> str:
    """xgrammar's error text without its log prefix ("[05:51:57] /project/cpp/x.cc:94: "): a
    timestamp and a path inside the library mean nothing to the client."""
    text = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", str(error).strip())
    # and its assertion's own wording ("Check failed: (val <= MAX_INT64_AS_DOUBLE) is false: ")
    return re.sub(r"^Check failed: \(.*?\) is false:\s*", "", text)
