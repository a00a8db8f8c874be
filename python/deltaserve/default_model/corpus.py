"""The default model's corpus: the Python standard library's own source and tests.

The CPython standard library is distributed under the Python Software Foundation License
(PSF-2.0), which permits redistribution and derived works. It is present, offline, on every
machine that runs Python, so the corpus needs no download.

Collection is deterministic for a given stdlib directory: files are the `*.py` files below it
(minus installed third-party packages and build-configuration files), in sorted POSIX relative
path order, decoded as strict UTF-8 (the few deliberately non-UTF-8 test inputs are skipped).
A file is held out when the SHA-256 of its relative path falls in the first `held_out_per_10k`
of 10 000 buckets, so the split does not depend on which other files exist.

Shards are JSON Lines, one object per file: `{"path": <relative path>, "text": <source>}`.
`manifest.json` beside them records the Python version, stdlib path, counts, byte totals and a
SHA-256 digest of the whole corpus (paths and texts, in order), so two corpora can be compared.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

LICENSE = "PSF-2.0 (Python Software Foundation License Version 2)"
EXCLUDED_DIRS = ("site-packages", "dist-packages", "__pycache__", "lib-dynload")
SHARD_BYTES = 8 << 20  # ~8 MiB of source per shard
SPLITS = ("train", "heldout")
READ_SPLITS = (*SPLITS, "extra")  # "extra": more training text, see extra_corpus.py


@dataclass(frozen=True, slots=True)
class SourceFile:
    """One corpus document: its path relative to the stdlib directory and its text."""

    path: str
    text: str


def default_stdlib_dir() -> str:
    """The running interpreter's standard library directory (`sysconfig` 'stdlib')."""
    return sysconfig.get_paths()["stdlib"]


def _excluded(rel: Path) -> bool:
    """Third-party packages and machine-specific build files are not part of the corpus."""
    if any(part in EXCLUDED_DIRS or part.startswith("config-") for part in rel.parts[:-1]):
        return True
    return rel.name.startswith("_sysconfigdata")


def iter_source_files(stdlib_dir: str | os.PathLike) -> Iterator[SourceFile]:
    """Yield the corpus documents below `stdlib_dir` in sorted relative-path order.

    Files that are not valid UTF-8 are skipped; texts are kept byte-exact (no newline
    translation), so `text.encode()` equals the file's bytes.
    """
    root = Path(stdlib_dir)
    rels = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py") if p.is_file())
    for rel in rels:
        if _excluded(Path(rel)):
            continue
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        yield SourceFile(rel, text)


def is_held_out(rel_path: str, held_out_per_10k: int = 200) -> bool:
    """True when the document at `rel_path` belongs to the held-out split (default 2%)."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 10_000 < held_out_per_10k


class _ShardWriter:
    """Writes one split's JSON Lines shards of about SHARD_BYTES each."""

    def __init__(self, out_dir: Path, split: str):
        self.out_dir, self.split = out_dir, split
        self.paths: list[str] = []
        self.n_files = self.n_bytes = 0
        self._fh = None
        self._shard_bytes = 0

    def add(self, doc: SourceFile) -> None:
        if self._fh is None or self._shard_bytes >= SHARD_BYTES:
            self._open_next()
        line = json.dumps({"path": doc.path, "text": doc.text}, ensure_ascii=False)
        self._fh.write(line + "\n")
        size = len(doc.text.encode("utf-8"))
        self._shard_bytes += size
        self.n_bytes += size
        self.n_files += 1

    def _open_next(self) -> None:
        self.close()
        name = f"{self.split}-{len(self.paths):05d}.jsonl"
        self.paths.append(name)
        self._fh = open(self.out_dir / name, "w", encoding="utf-8", newline="\n")
        self._shard_bytes = 0

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def prepare_corpus(
    out_dir: str | os.PathLike,
    stdlib_dir: str | os.PathLike | None = None,
    held_out_per_10k: int = 200,
) -> dict:
    """Collect the stdlib corpus into `out_dir` (shards + manifest.json); return the manifest.

    Existing shards in `out_dir` are replaced. Deterministic for a given stdlib directory.
    """
    stdlib_dir = Path(stdlib_dir or default_stdlib_dir()).resolve()
    if not stdlib_dir.is_dir():
        raise FileNotFoundError(f"stdlib directory not found: {stdlib_dir}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.jsonl"):
        old.unlink()
    writers = {split: _ShardWriter(out, split) for split in SPLITS}
    digest = hashlib.sha256()
    for doc in iter_source_files(stdlib_dir):
        split = "heldout" if is_held_out(doc.path, held_out_per_10k) else "train"
        writers[split].add(doc)
        digest.update(doc.path.encode() + b"\0" + doc.text.encode() + b"\0")
    for w in writers.values():
        w.close()
    manifest = {
        "source": "Python standard library source and tests (*.py)",
        "license": LICENSE,
        "python_version": ".".join(map(str, sys.version_info[:3])),
        "stdlib_dir": str(stdlib_dir),
        "held_out_per_10k": held_out_per_10k,
        "sha256": digest.hexdigest(),
        "splits": {
            s: {"shards": w.paths, "n_files": w.n_files, "n_bytes": w.n_bytes}
            for s, w in writers.items()
        },
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def load_manifest(corpus_dir: str | os.PathLike) -> dict:
    """Read `manifest.json` of a prepared corpus (FileNotFoundError when absent)."""
    return json.loads((Path(corpus_dir) / "manifest.json").read_text())


def iter_split(corpus_dir: str | os.PathLike, split: str) -> Iterator[SourceFile]:
    """Yield the documents of one split ('train', 'heldout' or 'extra') in corpus order.

    Raises ValueError for another split name, KeyError for an 'extra' split the corpus lacks.
    """
    if split not in READ_SPLITS:
        raise ValueError(f"split must be one of {READ_SPLITS}, got {split!r}")
    manifest = load_manifest(corpus_dir)
    for name in manifest["splits"][split]["shards"]:
        with open(Path(corpus_dir) / name, encoding="utf-8") as fh:
            for line in fh:
                obj = json.loads(line)
                yield SourceFile(obj["path"], obj["text"])
