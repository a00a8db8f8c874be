"""Scoring completions of the evaluation openings: the cut at the function's end, the checks,
the totals against issue 33's thresholds, and a run of the harness on the random model."""

from __future__ import annotations

import pytest

from deltaserve.default_model.evaluate import (
    FORMS,
    criteria_lines,
    cut_function,
    has_return_or_yield,
    max_line_repeats,
    score_completion,
    summarize,
)

OPENING = 'def add(a, b):\n    """Return a + b."""'


def test_the_function_ends_at_the_first_line_at_the_defs_column():
    text = "\n    x = a + b\n\n    return x\n\n# a comment at column 0\ndef g():\n    pass\n"
    assert cut_function(text, "length") == ("\n    x = a + b\n\n    return x\n", False)
    # the rest of the opening's last line is never a statement of its own
    assert cut_function("  # tail\n    return a\nprint(1)", "stop") == (
        "  # tail\n    return a", False)


def test_a_completion_cut_by_the_token_limit_loses_its_last_line_only():
    assert cut_function("\n    x = 1\n    return fo", "length") == ("\n    x = 1\n", True)
    assert cut_function("\n    return (a +\n            b", "length") == (
        "\n    return (a +\n", True)
    assert cut_function("\n    return a + b", "stop") == ("\n    return a + b", False)
    assert cut_function("  # no newline at all", "length") == ("", True)


def test_return_or_yield_counts_as_code_only():
    assert has_return_or_yield(OPENING + "\n    return a + b\n")
    assert has_return_or_yield("def f():\n    yield 1\n")
    assert not has_return_or_yield('def f():\n    """return this."""\n    # return\n    x = 1\n')
    # an unfinished bracket: the tokens before the error still count
    assert has_return_or_yield("def f():\n    return (1,\n")
    assert not has_return_or_yield("def f():\n    x = (1,\n")


def test_line_repeats_compare_stripped_non_blank_lines():
    assert max_line_repeats("\n\n") == 0
    assert max_line_repeats("    x = 1\n  x = 1  \n\n\ny = 2\n        x = 1") == 3
    assert max_line_repeats("a\nb\n") == 1


def test_scores_of_both_forms():
    good = score_completion(OPENING, FORMS["bare"], "\n    return a + b\n\n\ndef g():", "length")
    assert good.parses and good.returns and not good.truncated and good.max_line_repeats == 1
    assert good.function == "\n    return a + b\n\n"
    # the newline form: the typed "\n" is part of the source, a column-0 line ends the body
    empty = score_completion(OPENING, FORMS["newline"], "# noise\n# noise\n", "length")
    assert empty.function == "" and empty.parses and not empty.returns
    assert empty.max_line_repeats == 0
    broken = score_completion(OPENING, FORMS["newline"], "    return a +\n    x", "length")
    assert broken.truncated and not broken.parses and broken.returns


def test_totals_and_criteria_lines_apply_the_issues_thresholds():
    ok = score_completion(OPENING, "", "\n    return a + b\n", "stop")
    bad = score_completion(OPENING, "", "\n    x = 1\n    x = 1\n    x = 1\n", "stop")
    assert bad.parses and not bad.returns and bad.max_line_repeats == 3
    passing = summarize([ok] * 14 + [bad.__class__(bad.function, False, False, False, 2)] * 6)
    assert passing["parses"] == 14 and passing["returns"] == 14
    assert passing["pass_parses"] and passing["pass_returns"] and passing["pass_repeats"]
    failing = summarize([ok] * 11 + [bad] * 9)
    assert failing["returns"] == 11 and not failing["pass_returns"]
    assert failing["max_line_repeats"] == 3 and failing["over_repeated"] == 9
    assert failing["pass_parses"] and not failing["pass_repeats"]
    lines = criteria_lines({"bare": passing, "newline": failing})
    assert [line.split()[0] for line in lines] == ["PASS"] * 3 + ["PASS", "FAIL", "FAIL"]
    assert "11/20" in lines[4]


@pytest.fixture(scope="module")
def random_llm(tmp_path_factory):
    from deltaserve import LLM
    from deltaserve.default_model import random_model_path

    return LLM(random_model_path(tmp_path_factory.mktemp("dm")), device="cpu", dtype="float32")


def test_the_harness_completes_both_forms_in_one_batch_and_scores_them(random_llm):
    from deltaserve.default_model.eval_run import eval_params, evaluate_completions
    from deltaserve.default_model.openings import load_openings

    openings = load_openings()[:3]
    params = eval_params(max_tokens=8)
    report = evaluate_completions(random_llm, openings, params)
    assert [r["form"] for r in report["results"]] == ["bare"] * 3 + ["newline"] * 3
    assert report["totals"]["bare"]["n"] == report["totals"]["newline"]["n"] == 3
    alone = random_llm.generate(openings[1]["text"] + "\n", params)[0]
    row = report["results"][4]
    assert row["qualname"] == openings[1]["qualname"] and row["completion"] == alone.text
    assert report["tokens"][4] == alone.token_ids
    rescored = score_completion(openings[1]["text"], "\n", alone.text, alone.finish_reason)
    assert row["function"] == rescored.function and row["parses"] == rescored.parses
