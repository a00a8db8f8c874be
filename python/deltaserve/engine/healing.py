"""Token healing: back up the prompt's last token and make the first output token extend it.

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
The first token is constrained with the structured-output bitmask op (ops/token_mask.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deltaserve.ops.token_mask import apply_token_bitmask

if TYPE_CHECKING:
    from deltaserve.core import Req


@dataclass(frozen=True, slots=True)
class Healing:
    """One request's healing: the prompt without its last token, that token's text (which the
    first output token's text starts with, and which is not handed out) and the allowed first
    tokens as a bitmask row [ceil(V / 32)] int32 (xgrammar's layout, see ops/token_mask.py)."""

    prompt_ids: list[int]
    removed_text: str
    allowed: torch.Tensor


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

    def extending(self, data: bytes) -> list[int]:
        """Ids of the tokens whose bytes start with `data` (ascending)."""
        return self.table.get(data, [])

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
        return Healing(list(prompt_ids[:-1]), text, bitmask_row(ids, self.vocab_size))


def bitmask_row(ids: list[int], vocab_size: int) -> torch.Tensor:
    """[ceil(vocab_size / 32)] int32 with bit t % 32 of word t // 32 set for each t in ids."""
    words = torch.zeros((vocab_size + 31) // 32, dtype=torch.int64)
    idx = torch.tensor(ids, dtype=torch.int64)
    words.index_add_(0, idx // 32, torch.ones_like(idx) << (idx % 32))  # ids distinct
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def healing_rows(owners: list[Req]) -> list[int]:
    """Rows whose request is about to sample its first token with healing on."""
    return [i for i, req in enumerate(owners) if req.healing is not None and not req.output_ids]


def mask_first_tokens(logits: torch.Tensor, owners: list[Req], rows: list[int]) -> None:
    """Mask `logits` [M, V] in place so the first token of each healing row extends the
    removed text; `rows` from healing_rows(owners)."""
    bitmask = torch.zeros((logits.shape[0], (logits.shape[1] + 31) // 32), dtype=torch.int32)
    for i in rows:
        bitmask[i, : owners[i].healing.allowed.shape[0]] = owners[i].healing.allowed
    apply_token_bitmask(logits, bitmask, rows)
