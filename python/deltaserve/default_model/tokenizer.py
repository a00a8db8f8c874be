"""The default model's tokenizer: byte-level BPE trained with the `tokenizers` library.

Byte-level means every string round-trips exactly (`decode(encode(s)) == s`): the 256 byte
symbols are always in the vocabulary, there is no normaliser and no prefix space. The
pre-tokenizer is `tokenizers`' ByteLevel split (letters, digits, punctuation and whitespace
runs; a whitespace run keeps its last space for the following word, so indentation becomes its
own tokens). Special tokens come first, so their ids are fixed: <|endoftext|> = 0 (documents
are separated by it in training, and it is the EOS token), <|im_start|> = 1, <|im_end|> = 2
(ChatML turns).

Training is deterministic for the same texts in the same order (see `train_tokenizer`).
`save_tokenizer` writes `tokenizer.json` and a `tokenizer_config.json` with a ChatML chat
template that `transformers.AutoTokenizer.from_pretrained(folder)` loads offline.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)
VOCAB_SIZE = 8192
MODEL_MAX_LENGTH = 32768

# Qwen-style ChatML: "<|im_start|>{role}\n{content}<|im_end|>\n" per message, and
# "<|im_start|>assistant\n" when add_generation_prompt is set. Content may be a string or a
# list of {"type": "text", "text": ...} parts (OpenAI style); other parts are rejected.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}"
    "{%- set content = message['content'] -%}"
    "{%- else -%}"
    "{%- set content = namespace(text='') -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] != 'text' -%}"
    "{{ raise_exception('only text content parts are supported') }}"
    "{%- endif -%}"
    "{%- set content.text = content.text + part['text'] -%}"
    "{%- endfor -%}"
    "{%- set content = content.text -%}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- endif -%}"
)


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = VOCAB_SIZE, min_frequency: int = 2
) -> Tokenizer:
    """Train a byte-level BPE tokenizer on `texts` (vocab_size includes the special tokens).

    Deterministic: `tokenizers`' BPE trainer counts words into a map but picks each merge by
    (count, then pair order), so the same texts in the same order give the same merges; the
    result is also independent of the number of threads (checked by the tests).
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_config() -> dict:
    """The `tokenizer_config.json` contents: special tokens, no BOS, the ChatML template."""
    added = {
        str(i): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tok: Tokenizer, folder: str | os.PathLike) -> None:
    """Write `tokenizer.json` and `tokenizer_config.json` into `folder` (created if needed)."""
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise ValueError(f"special token {t} must have id {i}, has {tok.token_to_id(t)}")
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"), pretty=False)
    cfg = json.dumps(tokenizer_config(), indent=2, ensure_ascii=False)
    (out / "tokenizer_config.json").write_text(cfg + "\n", encoding="utf-8")
