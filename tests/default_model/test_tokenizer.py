"""The shipped tokenizer: exact round trips, special tokens, ChatML template, reproducibility."""

from __future__ import annotations

import hashlib
from itertools import islice

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from deltaserve.default_model.build import FILES_DIR
from deltaserve.default_model.corpus import (
    default_stdlib_dir,
    iter_source_files,
    iter_split,
    prepare_corpus,
)
from deltaserve.default_model.tokenizer import (
    EOS_TOKEN,
    IM_END,
    IM_START,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    save_tokenizer,
    train_tokenizer,
)

# corpus and files/tokenizer.json digests as made by scripts/prepare_corpus.py on CPython 3.11.7
SHIPPED_CORPUS_SHA256 = "d8d8bc31ed2b8afb778856bc3f2b4817cb560cf711e41ffc8d00d1c42d9bd2a4"
SHIPPED_SHA256 = "26796a6fb354212e95183d9c3bd3f9a764fc1d4b522f6bd62ddafa67c43240ee"
ODD_TEXTS = [
    "",
    "def f(x):\r\n\treturn x  # crlf, tab\r\n",
    "   leading spaces and trailing   \n\n\n",
    "s = 'ünïcödé ∑ 漢字 🐍'\n",
    "x = b'\\x00\\xff'  # escapes stay text\n",
    "<|im_start|> is a special token inside text<|im_end|>",
]


@pytest.fixture(scope="module")
def hf_tok():
    return AutoTokenizer.from_pretrained(str(FILES_DIR), local_files_only=True)


def test_shipped_tokenizer_has_the_documented_vocab_and_special_ids():
    tok = Tokenizer.from_file(str(FILES_DIR / "tokenizer.json"))
    assert tok.get_vocab_size() == VOCAB_SIZE == 8192
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    assert (FILES_DIR / "tokenizer.json").stat().st_size < 1_000_000


def test_stdlib_sources_and_odd_strings_round_trip_exactly(hf_tok):
    tok = Tokenizer.from_file(str(FILES_DIR / "tokenizer.json"))
    docs = [d.text for d in islice(iter_source_files(default_stdlib_dir()), 0, None, 60)]
    for text in docs + ODD_TEXTS:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert hf_tok.decode(hf_tok.encode(text, add_special_tokens=False)) == text
    # special tokens written in text are recognised as single tokens
    assert tok.encode(ODD_TEXTS[-1]).ids[0] == 1


def test_transformers_tokenizer_uses_endoftext_as_eos_and_adds_no_bos(hf_tok):
    assert hf_tok.eos_token == EOS_TOKEN and hf_tok.eos_token_id == 0
    assert hf_tok.bos_token is None
    assert hf_tok.encode("import os", add_special_tokens=True) == hf_tok.encode(
        "import os", add_special_tokens=False
    )
    assert len(hf_tok) == VOCAB_SIZE


def test_chat_template_renders_chatml_with_generation_prompt(hf_tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Write "}, {"type": "text",
                                                                             "text": "a loop."}]},
    ]
    text = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        f"{IM_START}system\nBe brief.{IM_END}\n"
        f"{IM_START}user\nWrite a loop.{IM_END}\n"
        f"{IM_START}assistant\n"
    )
    plain = hf_tok.apply_chat_template(messages[:1], tokenize=False)
    assert plain == f"{IM_START}system\nBe brief.{IM_END}\n"
    ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids[0] == 1 and ids.count(2) == 2 and hf_tok.decode(ids) == text


def test_training_is_deterministic_and_saves_a_loadable_folder(tmp_path):
    texts = [d.text for d in islice(iter_source_files(default_stdlib_dir()), 200)]
    a = train_tokenizer(texts, vocab_size=600)
    b = train_tokenizer(texts, vocab_size=600)
    assert a.to_str() == b.to_str()
    save_tokenizer(a, tmp_path)
    loaded = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert loaded.decode(loaded.encode(texts[0])) == texts[0]
    assert loaded.convert_ids_to_tokens([0, 1, 2]) == list(SPECIAL_TOKENS)


@pytest.mark.slow
def test_retraining_on_the_same_stdlib_reproduces_the_shipped_tokenizer(tmp_path):
    manifest = prepare_corpus(tmp_path / "corpus")
    if manifest["sha256"] != SHIPPED_CORPUS_SHA256:
        pytest.skip(f"this stdlib (Python {manifest['python_version']}) is not the shipped corpus")
    tok = train_tokenizer(d.text for d in iter_split(tmp_path / "corpus", "train"))
    save_tokenizer(tok, tmp_path)
    data = (tmp_path / "tokenizer.json").read_bytes()
    assert hashlib.sha256(data).hexdigest() == SHIPPED_SHA256
    assert data == (FILES_DIR / "tokenizer.json").read_bytes()
    assert (tmp_path / "tokenizer_config.json").read_bytes() == (
        FILES_DIR / "tokenizer_config.json"
    ).read_bytes()
