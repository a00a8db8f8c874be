"""Reproducible random prompts for the tests (the rule lives in deltaserve.model.testing, where
scripts/bisect_ops.py reaches it too)."""

from deltaserve.model.testing import random_tokens

__all__ = ["random_tokens"]
