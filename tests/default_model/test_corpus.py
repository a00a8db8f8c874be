"""Corpus collection: which files, in which order, which split, and a stable manifest."""

from __future__ import annotations

from deltaserve.default_model.corpus import (
    LICENSE,
    is_held_out,
    iter_source_files,
    iter_split,
    load_manifest,
    prepare_corpus,
)


def _fake_stdlib(root):
    files = {
        "os.py": "import sys\r\n",
        "json/__init__.py": "from .decoder import JSONDecoder\n",
        "json/decoder.py": "class JSONDecoder: ...\n",
        "test/test_os.py": "def test():\n    assert True\n",
        "site-packages/thirdparty/mod.py": "x = 1\n",
        "__pycache__/os.cpython-311.py": "compiled = True\n",
        "config-3.11-x86_64-linux-gnu/python-config.py": "flags = ''\n",
        "_sysconfigdata__linux_x86_64-linux-gnu.py": "build_time_vars = {}\n",
        "notes.txt": "not python\n",
    }
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text.encode())
    (root / "latin1.py").write_bytes("s = 'caf\xe9'\n".encode("latin-1"))
    return root


def test_collection_keeps_stdlib_python_sources_in_sorted_order_byte_exact(tmp_path):
    docs = list(iter_source_files(_fake_stdlib(tmp_path)))
    assert [d.path for d in docs] == [
        "json/__init__.py", "json/decoder.py", "os.py", "test/test_os.py",
    ]
    assert docs[2].text == "import sys\r\n"  # no newline translation


def test_held_out_split_depends_only_on_the_path():
    paths = [f"pkg/module_{i}.py" for i in range(5000)]
    held = [p for p in paths if is_held_out(p)]
    assert 50 <= len(held) <= 150  # ~2%
    assert held == [p for p in reversed(paths) if is_held_out(p)][::-1]
    assert not any(is_held_out(p, held_out_per_10k=0) for p in paths)
    assert all(is_held_out(p, held_out_per_10k=10_000) for p in paths)


def test_prepared_corpus_round_trips_and_its_manifest_is_reproducible(tmp_path):
    stdlib = _fake_stdlib(tmp_path / "lib")
    m1 = prepare_corpus(tmp_path / "a", stdlib, held_out_per_10k=5000)
    m2 = prepare_corpus(tmp_path / "b", stdlib, held_out_per_10k=5000)
    assert m1["sha256"] == m2["sha256"] and m1["license"] == LICENSE
    assert load_manifest(tmp_path / "a") == m1
    docs = list(iter_split(tmp_path / "a", "train")) + list(iter_split(tmp_path / "a", "heldout"))
    assert sorted(d.path for d in docs) == [d.path for d in iter_source_files(stdlib)]
    assert {d.path: d.text for d in docs}["os.py"] == "import sys\r\n"
    for split in ("train", "heldout"):
        names = [d.path for d in iter_split(tmp_path / "a", split)]
        assert all(is_held_out(p, 5000) == (split == "heldout") for p in names)
        assert m1["splits"][split]["n_files"] == len(names)
