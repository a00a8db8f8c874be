"""The fixed evaluation openings: 20 function openings from the held-out stdlib files.

An *opening* is a function's `def` line(s) plus its docstring, ending right after the
docstring's closing line (no final newline), dedented so the `def` is at column 0 -- what a user
types before asking the model for the body. They are chosen before any retraining, from the
held-out split only (corpus.is_held_out), so no training run has seen their files.

Selection rule (deterministic for a given stdlib; `select_openings()`):
1. Held-out files in corpus order (sorted relative path, strict UTF-8), parsed with `ast`
   (files that do not parse under this interpreter are skipped).
2. Candidates: every `def` / `async def` (top level, method, or nested; no decorator) whose
   first statement is a triple-quoted string docstring on lines of its own, followed by at
   least one more statement starting on a later line; whose own body (not nested functions,
   classes or lambdas) has a `return <value>`, `yield` or `yield from`; and which spans at most
   MAX_FUNCTION_LINES lines from the `def` line to its last line. Every line of the opening
   must be indented at least as far as the `def` (so dedenting is exact), and its docstring at
   most MAX_DOCSTRING_LINES lines.
3. Files with candidates are shuffled with `random.Random(SEED)`; each file in that order gives
   one candidate (drawn with the same generator) until N_OPENINGS are chosen; when fewer files
   than N_OPENINGS have candidates, further rounds draw second (third, ...) candidates from the
   files in the same order. The chosen openings are returned sorted by (path, line).

`python scripts/make_eval_openings.py` rebuilds eval_openings.json from this rule; the test
checks the stored file equals the rule's output when the local stdlib is the shipped corpus's.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import random
from collections.abc import Iterable
from pathlib import Path

from deltaserve.default_model.corpus import SourceFile, is_held_out, iter_source_files

N_OPENINGS = 20
SEED = 33  # issue 33
MAX_FUNCTION_LINES = 30
MAX_DOCSTRING_LINES = 12
OPENINGS_PATH = Path(__file__).resolve().parent / "eval_openings.json"
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)


def _own_nodes(fn: ast.AST) -> Iterable[ast.AST]:
    """The nodes of a function's body, not descending into nested scopes."""
    stack = [n for n in fn.body if not isinstance(n, _SCOPES)]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(c for c in ast.iter_child_nodes(node) if not isinstance(c, _SCOPES))


def _returns_or_yields(fn: ast.AST) -> bool:
    return any(
        (isinstance(n, ast.Return) and n.value is not None)
        or isinstance(n, (ast.Yield, ast.YieldFrom))
        for n in _own_nodes(fn)
    )


def _qualified_defs(tree: ast.Module) -> Iterable[tuple[str, ast.AST]]:
    """(qualified name, node) of every function in source order, as `__qualname__` spells it."""
    def walk(body, prefix):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield prefix + node.name, node
                yield from walk(node.body, f"{prefix}{node.name}.<locals>.")
            elif isinstance(node, ast.ClassDef):
                yield from walk(node.body, f"{prefix}{node.name}.")
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    sub = getattr(node, field, None)
                    if isinstance(sub, list):
                        yield from walk([s for s in sub if isinstance(s, ast.AST)], prefix)

    yield from walk(tree.body, "")


def _opening(lines: list[str], fn: ast.AST) -> str | None:
    """The dedented opening text of `fn`, or None when `fn` is not a candidate."""
    if fn.decorator_list or len(fn.body) < 2:
        return None
    doc = fn.body[0]
    if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
            and isinstance(doc.value.value, str)):
        return None
    if fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES:
        return None
    if doc.end_lineno - doc.lineno + 1 > MAX_DOCSTRING_LINES:
        return None
    if fn.body[1].lineno <= doc.end_lineno or doc.lineno <= fn.lineno:
        return None
    if not _returns_or_yields(fn):
        return None
    first = lines[doc.lineno - 1][doc.col_offset:]
    last = lines[doc.end_lineno - 1].encode("utf-8")  # ast column offsets count UTF-8 bytes
    if not first.lstrip("rRuU").startswith(('"""', "'''")):
        return None
    if last.rstrip() != last[: doc.end_col_offset]:  # something follows the closing quotes
        return None
    col = fn.col_offset
    out = []
    for line in lines[fn.lineno - 1: doc.end_lineno]:
        body = line.rstrip("\r\n")
        if body.strip() and not body[:col].isspace() and col:
            return None
        out.append(body[col:] if body.strip() else "")
    return "\n".join(out).rstrip()


def file_candidates(doc: SourceFile) -> list[dict]:
    """Candidate openings of one file, in source order (empty when it does not parse)."""
    try:
        tree = ast.parse(doc.text)
    except (SyntaxError, ValueError):
        return []
    lines = doc.text.splitlines(keepends=True)
    found = []
    for qualname, fn in _qualified_defs(tree):
        text = _opening(lines, fn)
        if text is not None:
            found.append({"path": doc.path, "qualname": qualname, "line": fn.lineno,
                          "text": text})
    return found


def select_openings(
    docs: Iterable[SourceFile] | None = None, n: int = N_OPENINGS, seed: int = SEED
) -> list[dict]:
    """Apply the module's selection rule; returns `n` dicts {path, qualname, line, text}.

    docs: the held-out documents in corpus order (default: this interpreter's stdlib, filtered
    by `is_held_out`). Raises ValueError when fewer than `n` candidates exist.
    """
    if docs is None:
        docs = held_out_docs()
    per_file = [c for c in (file_candidates(d) for d in docs) if c]
    rng = random.Random(seed)
    rng.shuffle(per_file)
    chosen: list[dict] = []
    while len(chosen) < n and any(per_file):
        for cands in per_file:
            if cands and len(chosen) < n:
                chosen.append(cands.pop(rng.randrange(len(cands))))
    if len(chosen) < n:
        raise ValueError(f"only {len(chosen)} candidate openings, need {n}")
    return sorted(chosen, key=lambda c: (c["path"], c["line"]))


def validation_openings(docs: Iterable[SourceFile] | None = None,
                        fixed: list[dict] | None = None) -> list[dict]:
    """Every candidate opening of the held-out files except the fixed ones, sorted by (path,
    line): generation settings (a repetition penalty) are chosen on these, so the fixed 20
    stay a test set. docs: as in select_openings; fixed: default load_openings()."""
    if docs is None:
        docs = held_out_docs()
    taken = {(o["path"], o["qualname"]) for o in (load_openings() if fixed is None else fixed)}
    return [c for d in docs for c in file_candidates(d) if (c["path"], c["qualname"]) not in taken]


def _stdlib() -> str:
    from deltaserve.default_model.corpus import default_stdlib_dir

    return default_stdlib_dir()


def held_out_docs(stdlib_dir: str | os.PathLike | None = None) -> list[SourceFile]:
    """The held-out documents of a stdlib directory (default: this interpreter's), in order."""
    return [d for d in iter_source_files(stdlib_dir or _stdlib()) if is_held_out(d.path)]


def docs_sha256(docs: Iterable[SourceFile]) -> str:
    """SHA-256 over (path, text) of `docs`, hashed as corpus.prepare_corpus hashes a corpus."""
    digest = hashlib.sha256()
    for doc in docs:
        digest.update(doc.path.encode() + b"\0" + doc.text.encode() + b"\0")
    return digest.hexdigest()


def build_openings_file(stdlib_dir: str | os.PathLike | None = None) -> dict:
    """The content of eval_openings.json for a stdlib directory: the rule's output + provenance."""
    import sys

    docs = held_out_docs(stdlib_dir)
    return {
        "rule": "deltaserve.default_model.openings.select_openings "
                f"(seed {SEED}, n {N_OPENINGS}, <= {MAX_FUNCTION_LINES} function lines)",
        "python_version": ".".join(map(str, sys.version_info[:3])),
        "heldout_sha256": docs_sha256(docs),
        "openings": select_openings(docs),
    }


LEAK_LINE = 30  # opening lines at least this long (stripped) identify it in other text


def leaked_openings(openings: list[dict], docs: Iterable[SourceFile]) -> dict[str, list[str]]:
    """Openings whose text appears in `docs` (e.g. a training split): "path:qualname" -> paths
    of the documents that hold every line of the opening of at least LEAK_LINE characters
    (stripped). Openings without such a line are not checked."""
    keys = {f"{o['path']}:{o['qualname']}": {s for s in (ln.strip() for ln in
                                                        o["text"].splitlines())
                                            if len(s) >= LEAK_LINE} for o in openings}
    keys = {k: v for k, v in keys.items() if v}
    found: dict[str, list[str]] = {}
    for doc in docs:
        lines = {ln.strip() for ln in doc.text.splitlines()}
        for name, need in keys.items():
            if need <= lines:
                found.setdefault(name, []).append(doc.path)
    return found


def load_openings(path: str | os.PathLike = OPENINGS_PATH) -> list[dict]:
    """The stored openings: a list of {path, qualname, line, text} (see eval_openings.json)."""
    return json.loads(Path(path).read_text(encoding="utf-8"))["openings"]
