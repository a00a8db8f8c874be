"""Token healing: back up the prompt's last token and make the output re-generate its text.

A prompt that ends in the middle of what the tokenizer would merge gets an unnatural last
token: byte-level BPE merges a newline with the indentation after it ("\\n" + 3 spaces is one
token), so a prompt ending with the "\\n" a user types ends with a lone "\\n" token that the
model rarely saw before code, and it answers at column 0. Healing (Guidance's "token healing";
Lundberg 2023) removes that last token when longer tokens extend its text, runs the shortened
prompt, and allows as the first output token only tokens whose bytes start with the removed
token's bytes, so the model itself picks the merged token ("\\n   " and what follows). The text
handed out skips the removed text, so it continues the user's prompt exactly.

`TokenHealer` holds the prefix table of one tokenizer (built once per engine): for each byte
string that begins some token, the ids of the tokens beginning with it. A last token is backed
up only when another token extends it, the prompt keeps at least one token, its bytes are
complete UTF-8 (its text must be a character string to skip) and, by default, its text is
whitespace: newline and indentation, or a space before a word. Healing any token also lets
the model re-open what the prompt closed: on the default model's evaluation openings
(scripts/eval_default_model.py) a docstring ending in `'''` was continued as `''')`, and
completions that parsed went from 15 to 12 of 20, while whitespace-only healing leaves those
prompts alone and makes the "+ newline" form complete exactly as the bare one.

The constraint is on the text, not on one token: the natural tokenization of what follows the
removed text may split it. A newline and 4 spaces before a docstring's opening quotes are
"\\n" + 3 spaces, then a space + the quotes: that first token is a proper prefix of the removed
"\\n" + 4 spaces and does not extend it, and when only extensions were allowed the model's best
pick was "\\n" + 8 spaces: an 8-space docstring under a column-0 `def`. So until the removed
text is covered each output token may extend what is left of it, or be a proper prefix of it
that the tokenizer itself puts first in that text followed by some word, digit, quote,
bracket or whitespace (TokenHealer.allowed): "\\n" + 3 spaces before " x", never a lone "\\n",
which leaves 4 spaces that only unnatural one-space tokens can produce (a fresh user's
"blank line, then indentation" prompts answered with nothing but spaces that way). A verify
step's rows walk their drafts the same way, as grammar masks do (Healing.remaining). The masks
use the structured-output bitmask op (ops/token_mask.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from deltaserve.core import Phase
from deltaserve.ops.token_mask import apply_token_bitmask

if TYPE_CHECKING:
    from deltaserve.core import Batch, Req


@dataclass(frozen=True, slots=True)
class Healing:
    """One request's healing: the prompt without its last token, that token's text (which the
    output's text starts with, and which is not handed out), the allowed first tokens as a
    bitmask row [ceil(V / 32)] int32 (xgrammar's layout, see ops/token_mask.py) and the
    healer that gives the masks of the later tokens while the removed text is not covered."""

    prompt_ids: list[int]
    removed_text: str
    allowed: torch.Tensor
    healer: TokenHealer
    removed: bytes  # removed_text's bytes
    _masks: dict[bytes, torch.Tensor] = field(default_factory=dict)

    def remaining(self, tokens: list[int]) -> bytes | None:
        """The bytes of the removed text still to come after output `tokens` (each a proper
        prefix of what was left), or None once a token covered it (or, never under the
        masks, left it)."""
        rest = self.removed
        for t in tokens:
            data = self.healer.token_bytes[t]
            if not (len(data) < len(rest) and rest.startswith(data)):
                return None
            rest = rest[len(data):]
        return rest

    def silent(self, tokens: list[int]) -> int:
        """How many of the output `tokens`, from the first, hand out no text: each lies within
        the removed text (a proper prefix of what was left, or all of it). They re-generate
        the prompt's own text, so they do not count against max_tokens (`Req.output_budget`)."""
        rest, n = self.removed, 0
        for t in tokens:
            data = self.healer.token_bytes[t]
            if not rest or not data or not rest.startswith(data):
                break
            rest, n = rest[len(data):], n + 1
        return n

    def mask(self, rest: bytes) -> torch.Tensor:
        """The bitmask row of the tokens allowed when `rest` is left (TokenHealer.allowed)."""
        row = self._masks.get(rest)
        if row is None:
            row = self._masks[rest] = bitmask_row(self.healer.allowed(rest),
                                                  self.healer.vocab_size)
        return row


def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-level alphabet (Radford et al. 2019, `bytes_to_unicode`):
    printable Latin-1 bytes stand for themselves, the other 68 bytes for U+0100 onwards."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


def token_bytes(tokenizer, vocab_size: int) -> list[bytes]:
    """The bytes each id in [0, vocab_size) stands for; b"" for special/added tokens and ids
    the tokenizer lacks (they never extend anything). Byte-level BPE vocabularies map exactly;
    other tokenizers fall back to decoding each token alone (tokens that are not complete
    UTF-8 on their own then map to b"")."""
    special = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    n = min(vocab_size, len(tokenizer))
    pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
    decoder = _byte_decoder()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    byte_level = backend is not None and type(backend.decoder).__name__ == "ByteLevel"
    out: list[bytes] = []
    for tid, piece in enumerate(pieces):
        if tid in special or piece is None:
            out.append(b"")
        elif byte_level and all(ch in decoder for ch in piece):
            out.append(bytes(decoder[ch] for ch in piece))
        else:
            text = tokenizer.decode([tid])
            out.append(b"" if "\ufffd" in text else text.encode("utf-8"))
    return out + [b""] * (vocab_size - n)


# what may follow the text left of a removed token, to find where the tokenizer splits it
FOLLOWERS = ("x", "X", "_", "1", '"', "'", "(", "[", "{", "#", "@", ".", ",", ":", "-", " ",
             "\n", "\t", "\u00e9")


class TokenHealer:
    """The prefix table of one tokenizer and the healing of prompts against it.

    tokenizer: a transformers tokenizer; vocab_size: the model's logits width (ids past the
    tokenizer's vocabulary are never allowed); whitespace_only: back up only whitespace
    tokens (module docstring: why). Building it walks every prefix of every token (17 k
    entries, 0.1 s for the default model's 8 k vocabulary).
    """

    def __init__(self, tokenizer, vocab_size: int, whitespace_only: bool = True) -> None:
        self.vocab_size = vocab_size
        self.whitespace_only = whitespace_only
        self.token_bytes = token_bytes(tokenizer, vocab_size)
        self.table: dict[bytes, list[int]] = {}
        for tid, data in enumerate(self.token_bytes):
            for end in range(1, len(data) + 1):
                self.table.setdefault(data[:end], []).append(tid)
        self.exact: dict[bytes, list[int]] = {}
        for tid, data in enumerate(self.token_bytes):
            if data:
                self.exact.setdefault(data, []).append(tid)
        self._encode = tokenizer.encode
        self._firsts: dict[bytes, set[int]] = {}  # _first_tokens, per text left

    def extending(self, data: bytes) -> list[int]:
        """Ids of the tokens whose bytes start with `data` (ascending)."""
        return self.table.get(data, [])

    def allowed(self, rest: bytes) -> list[int]:
        """Ids of the tokens that may come next while `rest` of the removed text is left: those
        that extend it, and those that are a proper prefix of it and the tokenizer's first
        token of `rest` followed by one of FOLLOWERS (ascending; module docstring: why)."""
        prefixes = [t for end in range(1, len(rest)) for t in self.exact.get(rest[:end], ())]
        if prefixes:
            firsts = self._first_tokens(rest)
            prefixes = [t for t in prefixes if t in firsts]
        return sorted(set(self.extending(rest)).union(prefixes))

    def _first_tokens(self, rest: bytes) -> set[int]:
        firsts = self._firsts.get(rest)
        if firsts is None:
            try:
                text = rest.decode("utf-8")
            except UnicodeDecodeError:  # a character cut in two: extensions only
                firsts = set()
            else:
                firsts = {ids[0] for c in FOLLOWERS
                          if (ids := self._encode(text + c, add_special_tokens=False))}
            self._firsts[rest] = firsts
        return firsts

    def heal(self, prompt_ids: list[int]) -> Healing | None:
        """The healing of `prompt_ids`, or None when its last token is left as it is."""
        if len(prompt_ids) < 2:
            return None
        data = self.token_bytes[prompt_ids[-1]]
        ids = self.extending(data)
        if len(ids) < 2:  # only the token itself: backing up changes nothing
            return None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return None
        if self.whitespace_only and not text.isspace():
            return None
        allowed = bitmask_row(self.allowed(data), self.vocab_size)
        return Healing(list(prompt_ids[:-1]), text, allowed, self, data, {data: allowed})


def bitmask_row(ids: list[int], vocab_size: int) -> torch.Tensor:
    """[ceil(vocab_size / 32)] int32 with bit t % 32 of word t // 32 set for each t in ids."""
    words = torch.zeros((vocab_size + 31) // 32, dtype=torch.int64)
    idx = torch.tensor(ids, dtype=torch.int64)
    words.index_add_(0, idx // 32, torch.ones_like(idx) << (idx % 32))  # ids distinct
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def mask_healing(logits: torch.Tensor, batch: Batch, owners: list[Req]) -> bool:
    """Mask `logits` [M, V] in place so that each row of a request whose healing is pending
    keeps to the removed text: owners[i] is row i's request (a verify batch: k+1 rows per
    request in order, row j after the committed output and drafts 1..j). Returns whether any
    row was masked."""
    rows: list[tuple[int, bytes]] = []
    if batch.phase is Phase.VERIFY:
        per = batch.rows_per_req
        pending = [i for i, r in enumerate(batch.reqs) if r.healing_pending()]
        drafts = batch.host_drafts() if pending else []
        for i in pending:
            req = batch.reqs[i]
            for j in range(batch.num_drafts[i] + 1):
                rest = req.healing.remaining(req.output_ids + drafts[i][:j])
                if rest is None:
                    break
                rows.append((i * per + j, rest))
    else:
        rows = [(i, rest) for i, req in enumerate(owners) if req.healing is not None
                and (rest := req.healing.remaining(req.output_ids)) is not None]
    if not rows:
        return False
    bitmask = torch.zeros((logits.shape[0], (logits.shape[1] + 31) // 32), dtype=torch.int32)
    for i, rest in rows:
        row = owners[i].healing.mask(rest)
        bitmask[i, : row.shape[0]] = row
    apply_token_bitmask(logits, bitmask, [i for i, _ in rows])
    return True
