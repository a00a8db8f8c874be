"""Decides whether and how to build `deltaserve._C` (filled in by the kernels work)."""

from __future__ import annotations


def build_extensions():
    """Return (ext_modules, cmdclass) for setuptools; empty until kernels exist."""
    print("deltaserve: no CUDA kernels to build yet; installing the pure-torch path")
    return [], {}
