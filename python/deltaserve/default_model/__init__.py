"""The model deltaserve serves when no --model is given.

`default_model_path()` returns a Hugging Face folder (config.json, model.safetensors with
`mtp.*` tensors, tokenizer.json, tokenizer_config.json) that loads fully offline:
- the shipped trained model in `files/` when its weights are there (config.json and
  model.safetensors next to the tokenizer);
- otherwise a small random model of the same architecture, built deterministically on first
  use into a cache folder (see `build.py`).
See docs/default_model.md for the corpus, the tokenizer and the training recipe.
"""

from __future__ import annotations

import os

from deltaserve.default_model.build import FILES_DIR, random_model_path


def shipped_model_path() -> str | None:
    """The packaged trained model's folder, or None while only the tokenizer ships."""
    if (FILES_DIR / "config.json").is_file() and (FILES_DIR / "model.safetensors").is_file():
        return str(FILES_DIR)
    return None


def default_model_path(cache_dir: str | os.PathLike | None = None) -> str:
    """Folder of the default model: the shipped one, else the cached random one.

    cache_dir: where the random model is cached (default $DELTASERVE_CACHE or
    ~/.cache/deltaserve); building it takes a few seconds on the CPU, once.
    """
    return shipped_model_path() or random_model_path(cache_dir)


__all__ = ["default_model_path", "random_model_path", "shipped_model_path"]
