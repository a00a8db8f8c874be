"""Collect the default model's corpus (Python stdlib source + tests) and optionally train the
tokenizer on its training split.

    python scripts/prepare_corpus.py --out build/corpus
    python scripts/prepare_corpus.py --out build/corpus --stdlib /usr/lib/python3.11 \
        --tokenizer-out python/deltaserve/default_model/files
    python scripts/prepare_corpus.py --out build/corpus \
        --extra-site "$(python -c 'import site; print(site.getsitepackages()[0])')"

The corpus is licensed PSF-2.0 (see docs/default_model.md). The shipped tokenizer in
python/deltaserve/default_model/files/ was made by the second command on CPython 3.11.7.
"""

from __future__ import annotations

import argparse
import hashlib
import time
from pathlib import Path

from deltaserve.default_model.corpus import default_stdlib_dir, iter_split, prepare_corpus
from deltaserve.default_model.extra_corpus import add_extra_split
from deltaserve.default_model.tokenizer import VOCAB_SIZE, save_tokenizer, train_tokenizer


def main(argv: list[str] | None = None) -> None:
    """Parse flags, write the shards and manifest, train/save the tokenizer when asked."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="build/corpus", help="output directory for the shards")
    ap.add_argument("--stdlib", default=None,
                    help=f"stdlib directory (default: this interpreter's, {default_stdlib_dir()})")
    ap.add_argument("--held-out-per-10k", type=int, default=200,
                    help="held-out share in 1/10000 of files, by path hash (default 200 = 2%%)")
    ap.add_argument("--tokenizer-out", default=None,
                    help="also train the BPE tokenizer on the train split and save it here")
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    ap.add_argument("--extra-site", action="append", default=[], metavar="DIR",
                    help="site-packages folder to take the `extra` training split from "
                         "(repeatable; the packages and licenses are in extra_corpus.py)")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    manifest = prepare_corpus(args.out, args.stdlib, args.held_out_per_10k)
    for split, info in manifest["splits"].items():
        print(f"{split}: {info['n_files']} files, {info['n_bytes'] / 1e6:.1f} MB, "
              f"{len(info['shards'])} shards")
    print(f"corpus sha256 {manifest['sha256']} (Python {manifest['python_version']}, "
          f"{time.perf_counter() - t0:.1f}s) -> {args.out}")
    if args.extra_site:
        t0 = time.perf_counter()
        manifest = add_extra_split(args.out, args.extra_site)
        info = manifest["splits"]["extra"]
        print(f"extra: {info['n_files']} files, {info['n_bytes'] / 1e6:.1f} MB from "
              f"{len(manifest['extra']['packages'])} packages, dropped "
              f"{manifest['extra']['dropped']} ({time.perf_counter() - t0:.1f}s)")
    if args.tokenizer_out:
        t0 = time.perf_counter()
        tok = train_tokenizer((d.text for d in iter_split(args.out, "train")), args.vocab_size)
        save_tokenizer(tok, args.tokenizer_out)
        path = Path(args.tokenizer_out) / "tokenizer.json"
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        print(f"tokenizer: vocab {tok.get_vocab_size()}, {path.stat().st_size / 1e3:.0f} kB, "
              f"sha256 {digest} ({time.perf_counter() - t0:.1f}s) -> {args.tokenizer_out}")


if __name__ == "__main__":
    main()
