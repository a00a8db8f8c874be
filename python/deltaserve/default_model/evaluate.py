"""Scoring the default model's completions of the fixed openings (issue 33's criteria).

Each opening (openings.py: a `def` + docstring at column 0) is completed greedily in two forms:
`bare` (the opening as stored, ending right after the docstring's closing quotes) and
`newline` (the opening + "\\n", the newline a user types next). A completion is judged on the
function it completes:

- **Cut at the function's end**: the first non-blank line of the completion, after the line
  that holds the end of the opening, indented at or left of the `def` (column 0) ends the
  function; that line and everything after it are dropped. Without such a line the function
  runs to the end of the text.
- **Cut mid-statement**: when the function did not end and generation stopped at the token
  limit (`finish_reason == "length"`), the last line is treated as cut by the limit: the text
  after the completion's last newline is dropped. Nothing else is forgiven, so a statement
  that spans the cut (an open bracket) still fails to parse. A completion that ended with EOS
  or a stop string is kept whole.
- **parses**: `ast.parse(opening + cut completion)` succeeds.
- **returns**: the function contains a `return` or `yield` keyword as code (a NAME token, not
  in a string or comment; from `tokenize`, up to the first tokenizing error when it does not
  parse).
- **max_line_repeats**: the largest number of times one non-blank line (compared stripped of
  surrounding whitespace) occurs in the cut completion.
Thresholds (issue 33, per form): parses >= 14 of 20, returns >= 12 of 20, no line > 2 times.
"""

from __future__ import annotations

import ast
import io
import tokenize
from collections import Counter
from dataclasses import asdict, dataclass

FORMS = {"bare": "", "newline": "\n"}
MIN_PARSES = 14
MIN_RETURNS = 12
MAX_LINE_REPEATS = 2


@dataclass(frozen=True, slots=True)
class Score:
    """One completion's verdict; `function` is the cut completion (what is judged)."""

    function: str
    truncated: bool  # the function did not end before the token limit (last line dropped)
    parses: bool
    returns: bool
    max_line_repeats: int

    def to_dict(self) -> dict:
        return asdict(self)


def cut_function(completion: str, finish_reason: str | None) -> tuple[str, bool]:
    """The part of `completion` that belongs to the function and whether it hit the limit.

    completion: text generated after a column-0 opening (the form's suffix included, as the
    user typed it). Returns (cut text, truncated) per the module's rules.
    """
    lines = completion.split("\n")
    kept = [lines[0]]  # continues the opening's last line: never a new statement
    for line in lines[1:]:
        if line.strip() and not line[:1].isspace():
            return "\n".join(kept), False
        kept.append(line)
    text = "\n".join(kept)
    if finish_reason == "length":
        return text[: text.rfind("\n") + 1] if "\n" in text else "", True
    return text, False


def has_return_or_yield(source: str) -> bool:
    """True when `source` has `return` or `yield` as a keyword token (strings and comments
    do not count; tokens before the first tokenizing error are used)."""
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.NAME and tok.string in ("return", "yield"):
                return True
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    return False


def max_line_repeats(text: str) -> int:
    """Occurrences of the most frequent non-blank line of `text` (stripped); 0 when none."""
    counts = Counter(s for s in (line.strip() for line in text.split("\n")) if s)
    return max(counts.values(), default=0)


def score_completion(opening: str, form_suffix: str, completion: str,
                     finish_reason: str | None) -> Score:
    """Judge one completion of `opening` + `form_suffix` (module docstring for the rules)."""
    function, truncated = cut_function(form_suffix + completion, finish_reason)
    source = opening + function
    try:
        ast.parse(source)
        parses = True
    except (SyntaxError, ValueError):
        parses = False
    return Score(function, truncated, parses, has_return_or_yield(source),
                 max_line_repeats(function))


def summarize(scores: list[Score]) -> dict:
    """Totals of one form and its pass/fail against the issue's thresholds."""
    n_parse = sum(s.parses for s in scores)
    n_ret = sum(s.returns for s in scores)
    worst = max((s.max_line_repeats for s in scores), default=0)
    return {
        "n": len(scores), "parses": n_parse, "returns": n_ret,
        "truncated": sum(s.truncated for s in scores), "max_line_repeats": worst,
        "over_repeated": sum(s.max_line_repeats > MAX_LINE_REPEATS for s in scores),
        "pass_parses": n_parse >= MIN_PARSES, "pass_returns": n_ret >= MIN_RETURNS,
        "pass_repeats": worst <= MAX_LINE_REPEATS,
    }


def criteria_lines(totals: dict[str, dict]) -> list[str]:
    """The issue's criteria as PASS/FAIL lines, one per criterion and form."""
    out = []
    for form, t in totals.items():
        out.append(f"{'PASS' if t['pass_parses'] else 'FAIL'} [{form}] parses with ast: "
                   f"{t['parses']}/{t['n']} (need >= {MIN_PARSES})")
        out.append(f"{'PASS' if t['pass_returns'] else 'FAIL'} [{form}] contains return/yield: "
                   f"{t['returns']}/{t['n']} (need >= {MIN_RETURNS})")
        out.append(f"{'PASS' if t['pass_repeats'] else 'FAIL'} [{form}] most repeats of one "
                   f"line: {t['max_line_repeats']} (need <= {MAX_LINE_REPEATS}; "
                   f"{t['over_repeated']} completions over)")
    return out
