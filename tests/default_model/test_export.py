"""The model card's text: the command it gives and the corpus it names."""

from __future__ import annotations

from deltaserve.default_model.export import extra_corpus_text, run_command


def test_the_cards_command_drops_only_the_flags_that_split_a_run_over_calls():
    cmd = ("python scripts/train_default_model.py --out /tmp/r --max-steps 4000 --stop-minutes "
           "8.5 --final-seconds=90 --stop-step 7 --arch hidden_size=384 --resume --lr 3e-3")
    assert run_command(cmd) == ("python scripts/train_default_model.py --out /tmp/r "
                                "--max-steps 4000 --arch hidden_size=384 --lr 3e-3")


def _pkg(dist, version, lic):
    return {"dist": dist, "version": version, "license": lic}


def test_the_extra_split_is_named_package_by_package_under_each_license():
    corpus = {"splits": {"extra": {"n_files": 12, "n_bytes": 3_400_000}},
              "extra": {"packages": {"np": _pkg("numpy", "2.4", "BSD-3-Clause"),
                                     "fa": _pkg("fastapi", "0.1", "MIT"),
                                     "cl": _pkg("Click", "8.4", "BSD-3-Clause")},
                        "dropped": {"duplicate": 2, "held_out_overlap": 1},
                        "sha256": "ab" * 32}}
    text = extra_corpus_text(corpus)
    assert "3 permissively licensed packages (12 files / 3.4 MB" in text
    assert "files dropped: 2 duplicate, 1 held out overlap" in text
    assert "BSD-3-Clause: Click 8.4, numpy 2.4; MIT: fastapi 0.1." in text
    assert "ab" * 32 in text


def test_a_stdlib_only_corpus_has_no_extra_paragraph():
    assert extra_corpus_text({"splits": {"train": {}, "heldout": {}}}) == ""
