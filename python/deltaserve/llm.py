"""Offline API: `LLM(model).generate(prompts, sampling_params)`, as in vLLM."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, fields

from deltaserve.config import EngineConfig
from deltaserve.core import SamplingParams
from deltaserve.distributed import create_engine
from deltaserve.engine.logprobs import TokenLogprob


@dataclass
class CompletionOutput:
    """One finished request: generated token ids and text, why it stopped, cache reuse, and
    (when `SamplingParams.logprobs` is set) one TokenLogprob per generated token."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    cached_tokens: int
    logprobs: list[TokenLogprob] | None = None


class LLM:
    """Runs the engine to completion over a list of prompts.

    `model=None` serves the embedded default model; other keywords are EngineConfig fields
    (e.g. `page_size=16, chunk_size=512, enable_prefix_cache=False`). Unknown keywords raise
    TypeError.
    """

    def __init__(self, model: str | os.PathLike | None = None, **kwargs) -> None:
        known = {f.name for f in fields(EngineConfig)}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown engine options: {sorted(unknown)}")
        if isinstance(model, os.PathLike):  # a pathlib.Path folder is as good as its string
            model = os.fspath(model)
        self.engine = create_engine(EngineConfig(model=model, **kwargs))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 ) -> list[CompletionOutput]:
        """Generate for every prompt (text, or token id lists); outputs in prompt order.

        Raises ValueError for a bad prompt or bad sampling parameters before anything runs.
        A max_tokens past the context length is not an error (the request stops there, with
        finish_reason "length", as in vLLM's LLM; the server refuses it): a UserWarning says
        so. If a step fails, this call's requests are aborted (their pages and slots freed)
        and the error is raised; the LLM stays usable.
        """
        if not isinstance(prompts, (str, list, tuple)):
            raise ValueError("prompts must be a string, a list of token ids, or a list of "
                             f"strings or token id lists, got {type(prompts).__name__}")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if not isinstance(sampling_params, (list, tuple)) or not all(
                isinstance(sp, SamplingParams) for sp in sampling_params):
            raise ValueError("sampling_params must be a SamplingParams or a list of them, got "
                             f"{type(sampling_params).__name__}")
        if len(sampling_params) != len(prompts):
            raise ValueError("give one SamplingParams or one per prompt")
        id_lists = [self._encode(p) for p in prompts]
        rids = []
        try:
            for ids, params in zip(id_lists, sampling_params):
                rids.append(self.engine.add_request(ids, _copy(params)))
        except ValueError:
            for rid in rids:
                self.engine.abort(rid)
            raise
        limit = self.engine.max_model_len
        cut = sum(len(ids) + sp.max_tokens > limit for ids, sp in zip(id_lists, sampling_params))
        if cut:
            warnings.warn(f"max_tokens does not fit the context length {limit} for {cut} "
                          "prompt(s): they stop at the context length", stacklevel=2)
        results: dict[int, CompletionOutput] = {
            rid: CompletionOutput(ids, [], "", None, 0, [] if sp.logprobs is not None else None)
            for rid, ids, sp in zip(rids, id_lists, sampling_params)}
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    res = results[out.rid]
                    res.token_ids.extend(out.new_token_ids)
                    res.text += out.new_text
                    res.cached_tokens = out.cached_tokens
                    if out.new_logprobs:
                        res.logprobs.extend(out.new_logprobs)
                    if out.finished:
                        res.finish_reason = out.finish_reason
        except BaseException:
            # a failed step (or Ctrl-C) must not leave this call's requests queued: the next
            # generate() would run them again and fail the same way
            for rid in rids:
                self.engine.abort(rid)
            raise
        return [results[rid] for rid in rids]

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.engine.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token id lists")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:  # the tokenizer's own error is a TypeError
                raise ValueError(f"a prompt is not valid text: {e.reason} at character "
                                 f"{e.start} (a lone UTF-16 surrogate?)") from None
            return self.engine.tokenizer.encode(prompt, add_special_tokens=False)
        if not isinstance(prompt, (list, tuple)):  # the engine checks the ids themselves
            raise ValueError("a prompt must be a string or a list of token ids, got "
                             f"{type(prompt).__name__}")
        return list(prompt)


def _copy(params: SamplingParams) -> SamplingParams:
    return SamplingParams(**{f.name: getattr(params, f.name) for f in fields(SamplingParams)})
