"""Fixtures for the model tests: tiny checkpoints, made once per session and per variant."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from deltaserve.model.testing import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(model_type, **overrides) -> Path of a cached, read-only-by-convention
    checkpoint. Tests that edit a checkpoint take `editable_checkpoint` instead."""
    made: dict[str, Path] = {}

    def get(model_type: str, **overrides) -> Path:
        tag = model_type + json.dumps(overrides, sort_keys=True)
        if tag not in made:
            path = tmp_path_factory.mktemp(model_type)
            made[tag] = make_tiny_checkpoint(path, model_type, **overrides)
        return made[tag]

    return get


@pytest.fixture
def editable_checkpoint(tiny_checkpoint, tmp_path):
    """editable_checkpoint(model_type, **overrides) -> a private copy the test may modify."""

    def get(model_type: str, **overrides) -> Path:
        dst = tmp_path / "ckpt"
        shutil.copytree(tiny_checkpoint(model_type, **overrides), dst)
        return dst

    return get
