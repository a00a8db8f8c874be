"""Evaluate the default model on the 20 fixed held-out openings (issue 33's criteria).

    python scripts/eval_default_model.py                      # the shipped model, CPU
    python scripts/eval_default_model.py --model /tmp/dm --out build/eval.json
    python scripts/eval_default_model.py --token-healing --repetition-penalty 1.1
    python scripts/eval_default_model.py --mtp-k 0            # skip the MTP acceptance run
    python scripts/eval_default_model.py --openings validation --repetition-penalty 1.1
                                        # the 72 other held-out candidates: choose settings

Greedy completions of --max-tokens (96) tokens for each opening, bare and + "\\n", cut at the
function's end and scored (python/deltaserve/default_model/evaluate.py has the rules); prints
one line per completion, the totals, the issue's criteria as PASS/FAIL lines, and writes a JSON
report. With --mtp-k K > 0 it also reports the MTP head's acceptance length at K drafts over
the same prompts (for held-out corpus prompts see benchmarks/bench_spec.py --workload heldout).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from deltaserve.default_model.eval_run import (
    MAX_TOKENS,
    eval_params,
    evaluate_completions,
    mtp_acceptance,
)
from deltaserve.default_model.evaluate import criteria_lines
from deltaserve.default_model.openings import load_openings, validation_openings


def main(argv: list[str] | None = None) -> int:
    """Run the evaluation; exit status 0 when every criterion passes, 1 otherwise."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF folder (default: the embedded model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--token-healing", action="store_true",
                    help="back up the prompt's last token and constrain the first one")
    ap.add_argument("--mtp-k", type=int, default=3, help="MTP drafts for the acceptance "
                    "length run (0: skip it)")
    ap.add_argument("--out", default="build/eval_default_model.json", help="JSON report")
    ap.add_argument("--show", action="store_true", help="print every cut completion")
    ap.add_argument("--openings", choices=("fixed", "validation"), default="fixed",
                    help="fixed: the 20 test openings; validation: the other held-out "
                    "candidates (72 on CPython 3.11.7), for choosing settings such as "
                    "--repetition-penalty (totals only: the issue's thresholds count out of "
                    "the 20)")
    args = ap.parse_args(argv)

    from deltaserve.llm import LLM

    openings = load_openings() if args.openings == "fixed" else validation_openings()
    params = eval_params(args.max_tokens, args.repetition_penalty, args.token_healing)
    llm = LLM(args.model, device=args.device)
    report = evaluate_completions(llm, openings, params)
    for r in report["results"]:
        print(f"[{r['form']:7s}] {r['path'] + ':' + r['qualname']:58s} "
              f"parse={'y' if r['parses'] else 'n'} ret={'y' if r['returns'] else 'n'} "
              f"rep={r['max_line_repeats']} {r['finish_reason']}"
              f"{' truncated' if r['truncated'] else ''}")
        if args.show:
            print("    | " + r["function"].replace("\n", "\n    | "))
    for form, t in report["totals"].items():
        print(f"{form}: parses {t['parses']}/{t['n']}, return/yield {t['returns']}/{t['n']}, "
              f"max line repeats {t['max_line_repeats']}, truncated {t['truncated']}")
    if args.mtp_k > 0:
        report["mtp"] = mtp_acceptance(args.model, openings, params, report["tokens"],
                                       args.mtp_k, args.device)
        m = report["mtp"]
        print(f"MTP k={m['k']}: acceptance length {m['acceptance_length']:.2f}, "
              f"{m['same_tokens']}/{m['n']} requests with the same tokens as without")
    # the thresholds count out of the fixed 20; the validation set reports totals only
    lines = criteria_lines(report["totals"]) if args.openings == "fixed" else []
    print("\n".join(lines))
    report.pop("tokens")
    report["args"] = vars(args)
    report["model"] = llm.engine.model_path
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"report -> {out}")
    return 0 if all(line.startswith("PASS") for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
