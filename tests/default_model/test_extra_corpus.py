"""The extra training split: which package files it keeps, and the license check."""

from __future__ import annotations

import pytest

from deltaserve.default_model import extra_corpus
from deltaserve.default_model.corpus import is_held_out, iter_split, prepare_corpus
from deltaserve.default_model.openings import load_openings

HELD_LINES = [f"held_out_value_{i} = compute_something_long(argument_{i}, other_{i})" for i in
              range(10)]


def _held_out_name() -> str:
    return next(f"mod{i}.py" for i in range(100_000) if is_held_out(f"mod{i}.py"))


def _corpus(tmp_path):
    std = tmp_path / "stdlib"
    std.mkdir()
    (std / "train_mod.py").write_text("def train():\n    return 1\n")
    (std / _held_out_name()).write_text("\n".join(HELD_LINES) + "\n")
    prepare_corpus(tmp_path / "corpus", std)
    return tmp_path / "corpus"


def _site(tmp_path, license_line="License: MIT"):
    site = tmp_path / "site"
    pkg = site / "fakepkg"
    files = {
        "__init__.py": "x = 1\n",
        "core.py": "def f(a):\n    return a + 1\n",
        "_vendor/six.py": "y = 2\n",
        "modular_llama.py": "z = 3\n",
        "copy_of_stdlib.py": "def train():\n    return 1\n",
        "leak.py": "\n".join(HELD_LINES[:5]) + "\nkept_line = 1\n",
        "table.py": "T = [" + "1, " * 200 + "]\n",
        "big.py": "a = 1\n" * (extra_corpus.MAX_FILE_BYTES // 6 + 1),
        "opening.py": load_openings()[0]["text"] + "\n    return None\n",
    }
    for rel, text in files.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    info = site / "fakepkg-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fakepkg\nVersion: 1.0\n"
                                   f"{license_line}\n\nA long description mentioning GPL.\n")
    return site


def test_extra_split_keeps_only_clean_package_sources(tmp_path, monkeypatch):
    monkeypatch.setitem(extra_corpus.PACKAGES, "fakepkg", ("fakepkg", "MIT"))
    corpus = _corpus(tmp_path)
    manifest = extra_corpus.add_extra_split(corpus, [_site(tmp_path)], packages=["fakepkg"])
    kept = [d.path for d in iter_split(corpus, "extra")]
    assert kept == ["fakepkg/__init__.py", "fakepkg/core.py"]
    assert manifest["extra"]["dropped"] == {"duplicate": 1, "held_out_overlap": 1,
                                            "eval_opening": 1}
    pkg = manifest["extra"]["packages"]["fakepkg"]
    assert pkg["version"] == "1.0" and pkg["license"] == "MIT" and pkg["n_files"] == 2
    # the stdlib splits are untouched
    assert [d.path for d in iter_split(corpus, "train")] == ["train_mod.py"]


def test_a_package_whose_metadata_names_another_license_is_refused(tmp_path, monkeypatch):
    monkeypatch.setitem(extra_corpus.PACKAGES, "fakepkg", ("fakepkg", "MIT"))
    corpus = _corpus(tmp_path)
    site = _site(tmp_path, license_line="License: GPL-3.0-only")
    with pytest.raises(ValueError, match="does not name MIT"):
        extra_corpus.add_extra_split(corpus, [site], packages=["fakepkg"])


def test_a_package_missing_from_every_site_is_skipped(tmp_path, monkeypatch):
    corpus = _corpus(tmp_path)
    manifest = extra_corpus.add_extra_split(corpus, [tmp_path / "nowhere"], packages=["sympy"])
    assert manifest["extra"]["packages"] == {} and manifest["splits"]["extra"]["n_files"] == 0
