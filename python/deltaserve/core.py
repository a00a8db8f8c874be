"""The engine's vocabulary: sampling parameters, requests, batches, the forward context.

Request lengths obey `cached_len <= device_len <= len(all_ids) <= max_len` at all times:
- `cached_len`: prompt tokens whose KV and GDN state came from the prefix cache (reported as
  `usage.prompt_tokens_details.cached_tokens`);
- `device_len`: tokens already run through the model (their KV is in pages, the live GDN slot
  holds the state after exactly these tokens);
- `all_ids`: prompt + committed output tokens; the next forward feeds `all_ids[device_len:]`.
They change only through `Req` methods.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from deltaserve.config import valid_seed

if TYPE_CHECKING:
    import torch


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # client gone or engine shutdown


class Phase(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    VERIFY = "verify"


# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): logits divided by 1e-38 or less
# overflow fp32 to inf, and the softmax then has no valid distribution.
SAMPLING_EPS = 1e-5
# At most this many stop strings of at most this many characters: the stop check and the
# hold-back of text that may start a stop string run over every stop string for every token
# (100,000 stop strings slowed every other request in the batch tenfold).
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 512
# OpenAI's bound on top_logprobs (chat) and logprobs (completions)
MAX_LOGPROBS = 20


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


FP32_MAX = 3.4028234663852886e38  # the largest finite float32


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling and stopping rules (the OpenAI / vLLM fields).

    `temperature` below SAMPLING_EPS (0 included), or `top_k == 1`, is greedy. `top_k <= 0`
    disables top-k. `stop` may be one string or a list of them (as in the OpenAI API); None
    means none.
    Penalties follow vLLM: presence/frequency are subtracted from logits of generated tokens,
    repetition (> 1 penalises) divides positive / multiplies negative logits of prompt and
    generated tokens (CTRL, Keskar et al. 2019, eq. 2).
    Raises ValueError naming the first bad field when built (`validate`); a request checks its
    params again when it is added, so fields changed after construction are checked too.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # None: no logprobs; N >= 0: the sampled token's logprob and the N most likely tokens'
    # (log-softmax of the raw model logits of the row that produced the token)
    logprobs: int | None = None
    # a deltaserve.engine.grammar.GrammarSpec: output constrained by a token bitmask
    structured: Any = None
    # back up the prompt's last token when it is whitespace that longer tokens extend (a lone
    # "\n" before indentation) and make the first output token extend it; the output text
    # still starts right after the prompt (engine/healing.py)
    token_healing: bool = False

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        self.validate()  # as vLLM's: a bad value fails where it is written

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    def validate(self) -> None:
        """Raise ValueError naming the first bad field (a wrong type included)."""
        num = _is_number
        checks = [
            (lambda: _is_int(self.max_tokens) and self.max_tokens >= 1,
             "max_tokens must be an integer >= 1"),
            # sampling runs in fp32: a larger temperature would be inf there
            (lambda: num(self.temperature) and 0.0 <= self.temperature <= FP32_MAX,
             "temperature must be a finite number >= 0 (at most 3.4e38, fp32's largest)"),
            # fp32 sampling: a top_p that rounds to 0 there still keeps the most likely token
            (lambda: num(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (lambda: _is_int(self.top_k) and self.top_k >= -1, "top_k must be -1, 0 or >= 1"),
            (lambda: num(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (lambda: num(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
             "presence_penalty must be in [-2, 2]"),
            (lambda: num(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
             "frequency_penalty must be in [-2, 2]"),
            (lambda: num(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
             "repetition_penalty must be in (0, 10]"),
            (lambda: self.seed is None or valid_seed(self.seed),
             "seed must be an integer in [-2**63, 2**64) (torch.Generator's range)"),
            (lambda: isinstance(self.stop, list)
             and all(isinstance(s, str) and s for s in self.stop),
             "stop must be a non-empty string or a list of them"),
            (lambda: len(self.stop) <= MAX_STOP_STRINGS
             and all(len(s) <= MAX_STOP_CHARS for s in self.stop),
             f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
             "characters"),
            (lambda: isinstance(self.stop_token_ids, list)
             and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids must be a list of non-negative integers"),
            (lambda: isinstance(self.ignore_eos, bool), "ignore_eos must be true or false"),
            (lambda: isinstance(self.token_healing, bool),
             "token_healing must be true or false"),
            (lambda: not (self.token_healing and self.structured is not None),
             "token_healing cannot be combined with structured output"),
            (lambda: self.logprobs is None
             or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
             f"logprobs must be an integer in [0, {MAX_LOGPROBS}]"),
        ]
        for ok, message in checks:
            if not ok():
                raise ValueError(message)


@dataclass(eq=False)
class Req:
    """One generation request as the scheduler sees it.

    Mutated only by the scheduler through the methods below. `slot` is the live GDN state slot,
    `page_table[i]` the page holding positions [i*page_size, (i+1)*page_size).
    """

    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    max_len: int
    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    finish_reason: FinishReason | None = None
    cached_len: int = 0
    device_len: int = 0
    pending: int = 0
    # steps launched past device_len whose tokens the host has not processed yet: decode
    # rows (overlap scheduling, engine/overlap.py: positions run this far ahead) or a chained
    # verify step (engine/overlap_verify.py); while > 0 the KV and the live GDN state may be
    # past device_len: release keeps no end snapshot, rollback_tail frees no pages
    ahead: int = 0
    slot: int | None = None
    page_table: list[int] = field(default_factory=list)
    prefix_node: Any = None
    snapshots: dict[int, int] = field(default_factory=dict)
    host_snapshots: dict[int, int] = field(default_factory=dict)  # depth -> host bank slot
    sample_seed: int = 0  # engine/sampling_rng.py's seed: params.seed, else drawn at admission
    detok: Any = None
    grammar: Any = None  # a grammar matcher at the committed output (structured output)
    healing: Any = None  # an engine.healing.Healing: the first output token is constrained
    text_offsets: Any = None  # an engine.logprobs.TextOffsets (logprobs requested)
    arrival_time: float = 0.0
    first_token_time: float | None = None

    def __post_init__(self) -> None:
        assert len(self.prompt_ids) >= 1, "a request needs at least one prompt token"
        self._check()

    def _check(self) -> None:
        assert 0 <= self.cached_len <= self.device_len <= self.num_tokens <= self.max_len, (
            self.cached_len, self.device_len, self.num_tokens, self.max_len)

    @property
    def all_ids(self) -> list[int]:
        """prompt + output (a new list: O(length); hot paths use `tokens` / `num_tokens`)."""
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """all_ids[start:end] without copying the whole sequence (0 <= start <= end)."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p:end - p]
        return self.prompt_ids[start:] + self.output_ids[:end - p]

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def in_prefill(self) -> bool:
        return self.device_len < self.prompt_len

    @property
    def finished(self) -> bool:
        return self.status is ReqStatus.FINISHED

    def output_budget(self) -> int:
        """The output tokens this request may have: max_tokens, plus the token-healing tokens
        that only re-generated the prompt text healing removed (engine/healing.py,
        `Healing.silent`): they hand out no text, so a request for one token still gets one
        token of new text."""
        if self.healing is None:
            return self.params.max_tokens
        return self.params.max_tokens + self.healing.silent(self.output_ids)

    def healing_pending(self) -> bool:
        """Whether the next output token is still constrained by token healing (some of the
        removed prompt text is still to come); once not, `output_budget` stays fixed."""
        return self.healing is not None and self.healing.remaining(self.output_ids) is not None

    def admit(self, cached_len: int, slot: int, page_table: list[int], prefix_node: Any) -> None:
        """WAITING -> RUNNING with `cached_len` prompt tokens restored from the prefix cache."""
        assert self.status is ReqStatus.WAITING
        assert cached_len < self.prompt_len, "the last prompt token is always recomputed"
        self.status = ReqStatus.RUNNING
        self.cached_len = self.device_len = cached_len
        self.slot, self.page_table, self.prefix_node = slot, page_table, prefix_node
        self._check()

    def schedule_chunk(self, budget: int) -> int:
        """Number of prompt tokens the next prefill chunk feeds (at most `budget`)."""
        assert self.in_prefill and budget >= 1
        return min(budget, self.prompt_len - self.device_len)

    def complete_step(self, n_tokens: int) -> None:
        """`n_tokens` more tokens are now in KV and in the live GDN state."""
        self.device_len += n_tokens
        self._check()

    def append_output(self, token: int) -> None:
        self.output_ids.append(token)
        self._check()

    def extend_output(self, tokens: list[int]) -> None:
        """append_output of each token (the caller has checked that none finishes early)."""
        self.output_ids.extend(tokens)
        self._check()

    def launch_ahead(self) -> None:
        """An overlapped decode row was launched before the host processed this request's
        previous ones: it feeds the token the last of them samples, at position device_len +
        ahead (the count before this call)."""
        self.ahead += 1

    def land_ahead(self) -> None:
        """The oldest launched row's token reached the host (committed by the scheduler unless
        the request finished meanwhile; then the row is discarded)."""
        assert self.ahead > 0
        self.ahead -= 1

    def widen_pending(self, k: int) -> None:
        """A verify step runs k provisional rows past the pending token (not yet committed)."""
        assert self.pending == 0 and k >= 0
        self.pending = k

    def commit_pending(self, n: int) -> None:
        """Keep n of the k+1 verify rows (the pending token plus n-1 accepted drafts)."""
        assert 1 <= n <= self.pending + 1
        self.pending = 0
        self.complete_step(n)

    def finish(self, reason: FinishReason) -> None:
        self.status = ReqStatus.FINISHED
        self.finish_reason = reason


@dataclass
class Batch:
    """The requests one forward runs and the rows each contributes.

    `extend_lens[i]` rows of `reqs[i]` start at position `reqs[i].device_len`; a decode batch has
    one row per request, a verify batch `rows_per_req` (k+1) rows per request: the pending token
    then `draft_ids[i]` (k tokens; only the first `num_drafts[i]` are real proposals, the rest
    pad the row count and are never accepted). A proposer that drafts on the device leaves
    `draft_tensor` (int64 [N, k]) and no `draft_ids` until `host_drafts` copies them.
    A prefill batch's `tracks[i]`, when set, is (offset, slot): a track snapshot depth lies
    `offset` rows into request i's chunk (0 < offset < extend_lens[i]); the forward writes the
    GDN state at that depth to `slot` (scheduler/snapshots.py).
    """

    phase: Phase
    reqs: list[Req]
    extend_lens: list[int]
    rows_per_req: int = 1
    draft_ids: list[list[int]] | None = None
    num_drafts: list[int] | None = None
    draft_tensor: torch.Tensor | None = None
    tracks: list[tuple[int, int] | None] | None = None

    def __post_init__(self) -> None:
        assert len(self.reqs) == len(self.extend_lens) and self.reqs
        if self.tracks is not None:
            assert self.phase is Phase.PREFILL and len(self.tracks) == len(self.reqs)
            assert all(t is None or 0 < t[0] < n for t, n in zip(self.tracks, self.extend_lens))
        if self.phase is Phase.VERIFY:
            assert self.rows_per_req > 1, "a verify batch must set rows_per_req"
        if self.phase is not Phase.PREFILL:
            assert all(n == self.rows_per_req for n in self.extend_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    @property
    def size(self) -> int:
        return len(self.reqs)

    def host_drafts(self) -> list[list[int]]:
        """draft_ids, copied once from `draft_tensor` when the drafts are on the device (that
        copy waits for the device: the paths that need the drafts on the host call this)."""
        if self.draft_ids is None and self.draft_tensor is not None:
            self.draft_ids = self.draft_tensor.tolist()
        return self.draft_ids


class AttentionBackend(Protocol):
    """What a full-attention layer calls; the engine provides it per forward."""

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (RoPE applied) -> o [T, Hq, D].

        Writes k/v of the batch's new rows into the paged KV cache, then attends causally over
        each request's cached positions plus its new rows.
        """
        ...


class GDNBackend(Protocol):
    """What a GDN layer calls; the engine provides it per forward."""

    def forward(self, layer: Any, mixed_qkv: torch.Tensor, a: torch.Tensor,
                b: torch.Tensor) -> torch.Tensor:
        """mixed_qkv [T, conv_dim], a/b [T, HV] -> core output o [T, HV, V] (before gated norm).

        mixed_qkv, a and b may be strided views (rows of the merged input projection, last dim
        contiguous). `layer` exposes `gdn_id` (index among GDN layers), `conv_weight`
        [conv_dim, W], `A_log` [HV] and `dt_bias` [HV] (fp32), `num_k_heads`, `num_v_heads`,
        `head_k_dim`, `head_v_dim`.
        Runs conv1d + SiLU, splits q/k/v, gates, the gated delta rule, and reads/writes the
        per-request GDN state (conv window + recurrent state) in its slot.
        """
        ...


@dataclass
class ForwardContext:
    """Passed to `model.forward`; never a module global.

    positions [T] int64: absolute position of each row. `hidden_sink`, when set, is called with
    the final hidden states [T, hidden] (after the final norm), for MTP proposers.
    """

    positions: torch.Tensor
    attn: AttentionBackend
    gdn: GDNBackend
    hidden_sink: Any = None
