"""More training text for the default model: the Python source of permissively licensed packages.

The stdlib corpus (corpus.py) is 8.5 M training tokens, which a 20 M parameter model over-fits
within a few epochs. This module adds an `extra` split, training only, of the `*.py` files of
packages installed on the machine whose licenses allow redistribution and derived works (BSD,
MIT, Apache-2.0; each checked against the package's own METADATA at collection time). The
held-out split stays the stdlib's own, so held-out loss keeps measuring the same thing.

Filters, all deterministic: no vendored copies (`_vendor`, `vendored`, `extern`, `_distutils`
directories: their licenses are the vendored projects'), no generator or conversion script
(SKIPPED_PREFIXES), files of at most MAX_FILE_BYTES, no line longer than MAX_LINE_CHARS
(generated tables), strict UTF-8, no exact duplicate of an earlier document (stdlib included),
and no file that shares more than LEAK_SHARE of its distinct long lines with the held-out split
(backports and copies of stdlib modules would otherwise leak held-out text into training), nor
one that holds every long line of one of the 20 evaluation openings (eval_openings.json: torch's
`_weights_only_unpickler.py` repeats pickle's `load` docstring while sharing only 5 % of its long
lines with the held-out split).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from deltaserve.default_model.corpus import (
    EXCLUDED_DIRS,
    SourceFile,
    _ShardWriter,
    iter_split,
    load_manifest,
)
from deltaserve.default_model.openings import LEAK_LINE, load_openings

# import name -> (distribution name, SPDX id as stated by the distribution's METADATA)
PACKAGES: dict[str, tuple[str, str]] = {
    "sympy": ("sympy", "BSD-3-Clause"),
    "scipy": ("scipy", "BSD-3-Clause"),
    "numpy": ("numpy", "BSD-3-Clause"),
    "networkx": ("networkx", "BSD-3-Clause"),
    "mpmath": ("mpmath", "BSD-3-Clause"),
    "torch": ("torch", "BSD-3-Clause"),
    "IPython": ("ipython", "BSD-3-Clause"),
    "traitlets": ("traitlets", "BSD-3-Clause"),
    "prompt_toolkit": ("prompt_toolkit", "BSD-3-Clause"),
    "pygments": ("pygments", "BSD-2-Clause"),
    "werkzeug": ("werkzeug", "BSD-3-Clause"),
    "jinja2": ("jinja2", "BSD-3-Clause"),
    "flask": ("flask", "BSD-3-Clause"),
    "setuptools": ("setuptools", "MIT"),
    "pydantic": ("pydantic", "MIT"),
    "jedi": ("jedi", "MIT"),
    "parso": ("parso", "MIT"),
    "_pytest": ("pytest", "MIT"),
    "libcst": ("libcst", "MIT"),
    "urllib3": ("urllib3", "MIT"),
    "trio": ("trio", "MIT OR Apache-2.0"),
    "botocore": ("botocore", "Apache-2.0"),
    "boto3": ("boto3", "Apache-2.0"),
    "transformers": ("transformers", "Apache-2.0"),
    # added for the second retraining (issue 33): its longer run needs more distinct text
    "moto": ("moto", "Apache-2.0"),
    "openai": ("openai", "Apache-2.0"),
    "cfnlint": ("cfn_lint", "MIT-0"),
    "fla": ("fla_core", "MIT"),
    "schemathesis": ("schemathesis", "MIT"),
    "huggingface_hub": ("huggingface_hub", "Apache-2.0"),
    "awscli": ("awscli", "Apache-2.0"),
    "triton": ("triton", "MIT"),
    "rich": ("rich", "MIT"),
    "samtranslator": ("aws_sam_translator", "Apache-2.0"),
    "pip": ("pip", "MIT"),
    "fastapi": ("fastapi", "MIT"),
    "fsspec": ("fsspec", "BSD-3-Clause"),
    "graphql": ("graphql_core", "MIT"),
    "filelock": ("filelock", "MIT"),
    "anyio": ("anyio", "MIT"),
    "docker": ("docker", "Apache-2.0"),
    "pyparsing": ("pyparsing", "MIT"),
    "typer": ("typer", "MIT"),
    "click": ("click", "BSD-3-Clause"),
    "cryptography": ("cryptography", "Apache-2.0 OR BSD-3-Clause"),
    "jsonschema": ("jsonschema", "MIT"),
    "idna": ("idna", "BSD-3-Clause"),
    "s3transfer": ("s3transfer", "Apache-2.0"),
    "httpx": ("httpx", "BSD-3-Clause"),
    "uvicorn": ("uvicorn", "BSD-3-Clause"),
    "starlette": ("starlette", "BSD-3-Clause"),
    "markdown_it": ("markdown_it_py", "MIT"),
    "dateutil": ("python_dateutil", "Apache-2.0 OR BSD-3-Clause"),
    "packaging": ("packaging", "Apache-2.0 OR BSD-2-Clause"),
    "cffi": ("cffi", "MIT"),
    "pyasn1": ("pyasn1", "BSD-2-Clause"),
    "wcwidth": ("wcwidth", "MIT"),
    "antlr4": ("antlr4_python3_runtime", "BSD-3-Clause"),
}
# words any of which the METADATA's license fields must contain for each SPDX family
_LICENSE_WORDS = {"BSD": ("bsd",), "MIT": ("mit",), "Apache": ("apache",)}
VENDORED_DIRS = ("_vendor", "vendored", "extern", "_distutils")
# transformers' `modular_*` files generate its `modeling_*` files (near copies), and the
# checkpoint `convert_*` scripts are one-off boilerplate: both would only add repetition
SKIPPED_PREFIXES = ("modular_", "convert_")
MAX_FILE_BYTES = 128 << 10
MAX_LINE_CHARS = 400
LONG_LINE = 40  # lines at least this long (stripped) count for the leak check
LEAK_SHARE = 0.10


def _dist_info(site: Path, dist: str) -> Path | None:
    norm = re.sub(r"[-_.]+", "_", dist).lower()
    for p in sorted(site.glob("*.dist-info")):
        name = p.name.removesuffix(".dist-info").rsplit("-", 1)[0]
        if re.sub(r"[-_.]+", "_", name).lower() == norm:
            return p
    return None


def package_license(site: Path, name: str) -> dict:
    """The installed version and METADATA license text of package `name` in `site`.

    Raises ValueError when the METADATA's license fields do not name the family that
    PACKAGES states (the installed copy might be relicensed or a fork).
    """
    dist, spdx = PACKAGES[name]
    info = _dist_info(site, dist)
    if info is None:
        raise FileNotFoundError(f"no dist-info for {dist} in {site}")
    meta = (info / "METADATA").read_text(encoding="utf-8", errors="replace")
    header = meta.split("\n\n", 1)[0]
    fields = [ln for ln in header.splitlines()
              if ln.startswith(("License:", "License-Expression:", "Classifier: License"))]
    text = " ".join(fields).lower()
    families = [fam for fam in _LICENSE_WORDS if fam in spdx]
    if fields and not any(w in text for fam in families for w in _LICENSE_WORDS[fam]):
        raise ValueError(f"{dist}: METADATA license {fields} does not name {spdx}")
    version = re.search(r"^Version: (.+)$", header, re.M)
    return {"dist": dist, "version": version.group(1) if version else "?", "license": spdx,
            "metadata_license": fields}


def _long_lines(text: str) -> set[str]:
    return {s for s in (ln.strip() for ln in text.splitlines()) if len(s) >= LONG_LINE}


def iter_package_files(site: Path, name: str) -> Iterator[SourceFile]:
    """The package's `*.py` files that pass the size, line-length, vendoring and UTF-8 filters,
    in sorted path order; paths are `name/...` relative to `site`."""
    root = site / name
    rels = sorted(p.relative_to(site).as_posix() for p in root.rglob("*.py") if p.is_file())
    for rel in rels:
        parts = rel.split("/")[:-1]
        if any(p in EXCLUDED_DIRS or p in VENDORED_DIRS for p in parts):
            continue
        if rel.rsplit("/", 1)[-1].startswith(SKIPPED_PREFIXES):
            continue
        path = site / rel
        if path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        if not text.strip() or max(map(len, text.splitlines()), default=0) > MAX_LINE_CHARS:
            continue
        yield SourceFile(rel, text)


def add_extra_split(corpus_dir: str | os.PathLike, site_dirs: Iterable[str | os.PathLike],
                    packages: Iterable[str] = tuple(PACKAGES)) -> dict:
    """Collect the `extra` split into a prepared stdlib corpus; update and return its manifest.

    Each package is taken from the first of `site_dirs` that holds it; a package found in none
    is skipped (the manifest lists what was used, with versions and licenses).
    """
    corpus = Path(corpus_dir)
    manifest = load_manifest(corpus)
    for old in corpus.glob("extra-*.jsonl"):
        old.unlink()
    opening_lines = [need for need in (
        {t for t in (ln.strip() for ln in o["text"].splitlines()) if len(t) >= LEAK_LINE}
        for o in load_openings()) if need]
    seen = {hashlib.sha256(d.text.encode()).digest() for s in ("train", "heldout")
            for d in iter_split(corpus, s)}
    held_lines: set[str] = set()
    for d in iter_split(corpus, "heldout"):
        held_lines |= _long_lines(d.text)
    writer = _ShardWriter(corpus, "extra")
    digest, used = hashlib.sha256(), {}
    dropped = {"duplicate": 0, "held_out_overlap": 0, "eval_opening": 0}
    sites = [Path(s) for s in site_dirs]
    for name in packages:
        site = next((s for s in sites if (s / name).is_dir()), None)
        if site is None:
            continue
        lic = package_license(site, name)
        n_files = n_bytes = 0
        for doc in iter_package_files(site, name):
            h = hashlib.sha256(doc.text.encode()).digest()
            if h in seen:
                dropped["duplicate"] += 1
                continue
            seen.add(h)
            lines = _long_lines(doc.text)
            if lines and len(lines & held_lines) > LEAK_SHARE * len(lines):
                dropped["held_out_overlap"] += 1
                continue
            stripped = {ln.strip() for ln in doc.text.splitlines()}
            if any(need <= stripped for need in opening_lines):
                dropped["eval_opening"] += 1
                continue
            writer.add(doc)
            digest.update(doc.path.encode() + b"\0" + doc.text.encode() + b"\0")
            n_files += 1
            n_bytes += len(doc.text.encode())
        used[name] = {**lic, "site": str(site), "n_files": n_files, "n_bytes": n_bytes}
    writer.close()
    manifest["splits"]["extra"] = {"shards": writer.paths, "n_files": writer.n_files,
                                   "n_bytes": writer.n_bytes}
    manifest["extra"] = {"packages": used, "dropped": dropped, "sha256": digest.hexdigest(),
                         "filters": {"max_file_bytes": MAX_FILE_BYTES,
                                     "max_line_chars": MAX_LINE_CHARS,
                                     "vendored_dirs": list(VENDORED_DIRS),
                                     "skipped_prefixes": list(SKIPPED_PREFIXES),
                                     "leak_share": LEAK_SHARE, "long_line": LONG_LINE}}
    (corpus / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
