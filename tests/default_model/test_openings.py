"""The fixed evaluation openings: the selection rule and the stored eval_openings.json."""

from __future__ import annotations

import ast
import json

import pytest

from deltaserve.default_model.corpus import SourceFile, is_held_out
from deltaserve.default_model.openings import (
    N_OPENINGS,
    OPENINGS_PATH,
    build_openings_file,
    docs_sha256,
    file_candidates,
    held_out_docs,
    leaked_openings,
    load_openings,
    select_openings,
    validation_openings,
)

SAMPLE = '''\
class Box:
    def get(self, key):
        """Return the value for key.

        Missing keys give None.
        """
        return self.d.get(key)

    def put(self, key, value):
        """Store value (no return: not a candidate)."""
        self.d[key] = value

    @property
    def size(self):
        """Decorated: not a candidate."""
        return len(self.d)


def outer(xs):
    """Yield the doubled items."""
    def inner(x):
        """Inner doc."""
        return 2 * x
    for x in xs:
        yield inner(x)


def one_liner():
    """Docstring and code on one line."""; return 1


def only_nested():
    """The return belongs to the nested function only."""
    def g():
        return 1
    g()
'''


def test_candidates_follow_the_rule_and_are_dedented():
    cands = file_candidates(SourceFile("m.py", SAMPLE))
    assert [(c["qualname"], c["line"]) for c in cands] == [
        ("Box.get", 2), ("outer", 19), ("outer.<locals>.inner", 21)]
    assert cands[0]["text"] == (
        'def get(self, key):\n    """Return the value for key.\n\n'
        '    Missing keys give None.\n    """')
    assert cands[2]["text"] == 'def inner(x):\n    """Inner doc."""'


def test_selection_is_seeded_one_per_file_first_and_sorted():
    docs = [SourceFile(f"f{i}.py", SAMPLE) for i in range(4)]
    chosen = select_openings(docs, n=6, seed=1)
    assert chosen == select_openings(docs, n=6, seed=1)
    assert len({(c["path"], c["line"]) for c in chosen}) == 6
    counts = [sum(c["path"] == d.path for c in chosen) for d in docs]
    assert sorted(counts) == [1, 1, 2, 2]  # every file once before any file twice
    assert chosen == sorted(chosen, key=lambda c: (c["path"], c["line"]))
    with pytest.raises(ValueError, match="candidate"):
        select_openings(docs, n=4 * 3 + 1)


def test_validation_openings_are_every_other_candidate_in_source_order():
    docs = [SourceFile(f"f{i}.py", SAMPLE) for i in range(3)]
    fixed = select_openings(docs, n=4, seed=2)
    rest = validation_openings(docs, fixed)
    every = [c for d in docs for c in file_candidates(d)]
    assert len(rest) == len(every) - 4 == 5
    assert not {(o["path"], o["qualname"]) for o in fixed} & {(o["path"], o["qualname"])
                                                              for o in rest}
    assert sorted(rest + fixed, key=lambda c: (c["path"], c["line"])) == every


def test_stored_openings_are_held_out_function_openings():
    openings = load_openings()
    assert len(openings) == N_OPENINGS
    assert len({(o["path"], o["qualname"]) for o in openings}) == N_OPENINGS
    for o in openings:
        assert is_held_out(o["path"])
        text = o["text"]
        assert text.startswith(("def ", "async def ")) and text.endswith(('"""', "'''"))
        assert not text.endswith("\n")
        fn = ast.parse(text + "\n    pass\n").body[0]
        assert isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
        assert ast.get_docstring(fn, clean=False) is not None
        assert o["qualname"].rsplit(".", 1)[-1] == fn.name


def test_stored_openings_equal_the_rules_output_on_the_shipped_stdlib():
    stored = json.loads(OPENINGS_PATH.read_text(encoding="utf-8"))
    docs = held_out_docs()
    if docs_sha256(docs) != stored["heldout_sha256"]:
        pytest.skip(f"this stdlib's held-out files are not those of Python "
                    f"{stored['python_version']} that the openings were chosen from")
    rebuilt = build_openings_file()
    assert rebuilt["openings"] == stored["openings"]
    assert rebuilt["heldout_sha256"] == stored["heldout_sha256"]


def test_an_opening_copied_into_another_file_is_found_as_a_leak():
    openings = [
        {"path": "pickle.py", "qualname": "load", "text": 'def load(self):\n    """Read a '
         'pickled object representation from the open file.\n\n    Return the reconstituted '
         'object hierarchy specified in the file.\n    """'},
        {"path": "m.py", "qualname": "f", "text": 'def f():\n    """Short."""'},
    ]
    copy = SourceFile("torch/unpickler.py", "class U:\n    def load(self):\n        \"\"\"Read "
                      "a pickled object representation from the open file.\n\n        Return "
                      "the reconstituted object hierarchy specified in the file.\n        "
                      "\"\"\"\n        return 1\n")
    half = SourceFile("other.py", "# Read a pickled object representation from the open file.\n"
                      "Read a pickled object representation from the open file.\n")
    assert leaked_openings(openings, [half, copy]) == {"pickle.py:load": ["torch/unpickler.py"]}
    assert leaked_openings(openings, [half]) == {}  # every long line must be there
