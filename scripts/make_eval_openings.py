"""Rebuild the default model's 20 evaluation openings (held-out stdlib function openings).

    python scripts/make_eval_openings.py            # writes default_model/eval_openings.json
    python scripts/make_eval_openings.py --check    # exit 1 when the stored file differs

The selection rule is in python/deltaserve/default_model/openings.py. The shipped file was made
on CPython 3.11.7 (the stdlib the shipped corpus and tokenizer come from).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from deltaserve.default_model.openings import OPENINGS_PATH, build_openings_file


def main(argv: list[str] | None = None) -> int:
    """Parse flags; write or check the openings file; return the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stdlib", default=None, help="stdlib directory (default: this interpreter's)")
    ap.add_argument("--out", default=str(OPENINGS_PATH), help="JSON file to write")
    ap.add_argument("--check", action="store_true", help="compare with --out instead of writing")
    args = ap.parse_args(argv)
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
