"""Rebuild the default model's 20 evaluation openings (held-out stdlib function openings).

    python scripts/make_eval_openings.py            # writes default_model/eval_openings.json
    python scripts/make_eval_openings.py --check    # exit 1 when the stored file differs
    python scripts/make_eval_openings.py --leaks build/corpus  # exit 1 when a training
                                                    # split (train, extra) holds an opening

The selection rule is in python/deltaserve/default_model/openings.py. The shipped file was made
on CPython 3.11.7 (the stdlib the shipped corpus and tokenizer come from).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from deltaserve.default_model.corpus import iter_split, load_manifest
from deltaserve.default_model.openings import (
    OPENINGS_PATH,
    build_openings_file,
    leaked_openings,
    load_openings,
)


def check_leaks(corpus_dir: str) -> int:
    """Print the stored openings found in the corpus's training splits; 1 when any."""
    splits = [s for s in ("train", "extra") if s in load_manifest(corpus_dir)["splits"]]
    found = {}
    for split in splits:
        for name, paths in leaked_openings(load_openings(), iter_split(corpus_dir, split)).items():
            found.setdefault(name, []).extend(f"{split}:{p}" for p in paths)
    for name, paths in found.items():
        print(f"LEAK {name} in {', '.join(paths)}")
    print(f"{len(found)} of the openings found in {'+'.join(splits)} of {corpus_dir}")
    return 1 if found else 0


def main(argv: list[str] | None = None) -> int:
    """Parse flags; write or check the openings file; return the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stdlib", default=None, help="stdlib directory (default: this interpreter's)")
    ap.add_argument("--out", default=str(OPENINGS_PATH), help="JSON file to write")
    ap.add_argument("--check", action="store_true", help="compare with --out instead of writing")
    ap.add_argument("--leaks", metavar="CORPUS", default=None,
                    help="only look for the stored openings in CORPUS's training splits")
    args = ap.parse_args(argv)
    if args.leaks:
        return check_leaks(args.leaks)
    text = json.dumps(build_openings_file(args.stdlib), indent=1, ensure_ascii=False) + "\n"
    out = Path(args.out)
    if args.check:
        same = out.is_file() and out.read_text(encoding="utf-8") == text
        print(f"{out}: {'matches' if same else 'DIFFERS from'} the rule's output")
        return 0 if same else 1
    out.write_text(text, encoding="utf-8")
    print(f"wrote {len(json.loads(text)['openings'])} openings -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
