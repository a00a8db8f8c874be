"""Build script: the Python package, plus the optional `deltaserve._C` extension.

The extension logic lives in `cmake/extension.py` so this file stays a thin entry point.
`DELTASERVE_BUILD_EXT=0|1` forces the extension off/on; unset, it is built where a CUDA
toolkit (or a ROCm torch) is found and skipped with one clear line elsewhere.
"""

from __future__ import annotations

import os
import sys

from setuptools import setup

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "cmake"))
from extension import build_extensions  # noqa: E402

ext_modules, cmdclass = build_extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
