"""A stand-in for LLMEngine while the real one is being written (same interface, no model).

Deterministic "model": the next token is a function of the previous one. Pages and slots are
counted like the real engine does (a live slot per running request, pages per page_size
positions) and a prompt prefix seen before is "cached" at the 64-token grid.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from deltaserve.core import SamplingParams

CHAT_TEMPLATE = (
    "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{%- endfor -%}{%- if add_generation_prompt -%}"
    "{{ '<|im_start|>assistant\\n' }}{%- endif -%}")


def byte_tokenizer() -> PreTrainedTokenizerFast:
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(specials + alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE)


@dataclass
class RequestOutput:
    rid: int
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class _Req:
    rid: int
    prompt: list[int]
    params: SamplingParams
    cached: int
    out: list[int] = field(default_factory=list)


class FakeEngine:
    def __init__(self, max_model_len: int = 512, page_size: int = 16, num_pages: int = 129,
                 max_running: int = 4) -> None:
        self.tokenizer = byte_tokenizer()
        self.model_name, self.max_model_len, self.page_size = "fake", max_model_len, page_size
        self.pages_total, self.slots_total = num_pages - 1, 3 * max_running
        self._reqs: dict[int, _Req] = {}
        self._cached: dict[tuple[int, ...], int] = {}  # grid prefix -> pages it holds
        self.hit_tokens = 0

    def add_request(self, prompt_ids, params: SamplingParams, rid: int | None = None) -> int:
        params.validate()
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens but the context length "
                             f"is {self.max_model_len}")
        if any(t < 0 or t >= len(self.tokenizer) for t in prompt_ids):
            raise ValueError("prompt token ids must be integers in the vocabulary")
        cached = max([len(k) for k in self._cached
                      if len(k) < len(prompt_ids) and tuple(prompt_ids[:len(k)]) == k],
                     default=0)
        self.hit_tokens += cached
        self._reqs[rid] = _Req(rid, list(prompt_ids), params, cached)
        return rid

    def step(self) -> list[RequestOutput]:
        time.sleep(0.002)
        outputs = []
        for req in list(self._reqs.values()):
            last = (req.prompt + req.out)[-1]
            tok = 3 + (last * 31 + 7) % 90  # printable ASCII byte symbols
            req.out.append(tok)
            done = len(req.out) >= req.params.max_tokens or (
                len(req.prompt) + len(req.out) >= self.max_model_len)
            if done:
                del self._reqs[req.rid]
                grid = len(req.prompt) // 64 * 64
                if grid:
                    self._cached[tuple(req.prompt[:grid])] = grid // self.page_size
            outputs.append(RequestOutput(
                req.rid, [tok], self.tokenizer.decode([tok]), done, "length" if done else None,
                len(req.prompt), len(req.out), req.cached))
        return outputs

    def abort(self, rid: int) -> bool:
        return self._reqs.pop(rid, None) is not None

    def has_unfinished(self) -> bool:
        return bool(self._reqs)

    def flush_cache(self) -> None:
        self._cached.clear()

    def cache_status(self) -> dict:
        cached = sum(self._cached.values())
        live = sum(-(-(len(r.prompt) + len(r.out)) // self.page_size) for r in self._reqs.values())
        return {"page_size": self.page_size, "pages_total": self.pages_total,
                "pages_free": self.pages_total - cached - live, "pages_cached": cached,
                "slots_total": self.slots_total, "slots_free": self.slots_total - len(self._reqs),
                "slots_snapshot": 0, "running_requests": len(self._reqs), "waiting_requests": 0,
                "hit_tokens": self.hit_tokens}

    def metrics(self) -> dict[str, float]:
        return {"running_requests": float(len(self._reqs))}
