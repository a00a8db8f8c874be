"""Shared test setup: the `gpu` marker skips where no CUDA device is present."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


import os as _os  # noqa: E402
import sys as _sys  # noqa: E402

# test-only helpers (the greedy oracle) live beside the tests
_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
