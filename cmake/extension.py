"""Decides whether and how to build `deltaserve._C` (CUDA or HIP) for setup.py.

`DELTASERVE_BUILD_EXT=0|1` forces the extension off/on. Unset, it is built when a CUDA toolkit
(CUDA_HOME, or /usr/local/cuda) or a ROCm build of torch is found, and skipped with one line
otherwise. Archs: TORCH_CUDA_ARCH_LIST (default "8.0;8.6;8.9;9.0+PTX"); ROCm:
PYTORCH_ROCM_ARCH (default gfx1151). Sources: csrc/ops/*.cu / *.cpp, device code in
csrc/kernels/*.cuh (header only, so each op file is one compile).
"""

from __future__ import annotations

import glob
import os
import shutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CUDA_ARCHS = "8.0;8.6;8.9;9.0+PTX"
DEFAULT_ROCM_ARCHS = "gfx1151"


def _find_cuda_home() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
        return home
    if os.path.exists("/usr/local/cuda/bin/nvcc"):
        # /usr/local/bin/nvcc may be a wrapper script; torch would then guess CUDA_HOME=/usr/local.
        return "/usr/local/cuda"
    nvcc = shutil.which("nvcc")
    if nvcc:
        home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
        if os.path.isdir(os.path.join(home, "include")):
            return home
    return None


def _decide() -> tuple[bool, str]:
    forced = os.environ.get("DELTASERVE_BUILD_EXT")
    if forced not in (None, "", "0", "1"):
        raise SystemExit(f"DELTASERVE_BUILD_EXT must be 0 or 1, got {forced!r}")
    try:
        import torch
    except ImportError:
        if forced == "1":
            raise SystemExit("DELTASERVE_BUILD_EXT=1 but torch is not importable") from None
        return False, "torch not importable at build time"
    rocm = getattr(torch.version, "hip", None)
    if forced == "0":
        return False, "DELTASERVE_BUILD_EXT=0"
    if rocm:
        return True, f"ROCm torch (HIP {rocm})"
    if torch.version.cuda is None:
        if forced == "1":
            raise SystemExit("DELTASERVE_BUILD_EXT=1 but this torch has no CUDA support")
        return False, "this torch build has no CUDA support"
    home = _find_cuda_home()
    if home is None:
        if forced == "1":
            raise SystemExit("DELTASERVE_BUILD_EXT=1 but no CUDA toolkit (set CUDA_HOME)")
        return False, "no CUDA toolkit found (set CUDA_HOME)"
    os.environ["CUDA_HOME"] = home
    os.environ.setdefault("CUDACXX", os.path.join(home, "bin", "nvcc"))
    return True, f"CUDA toolkit at {home}"


def build_extensions():
    """Return (ext_modules, cmdclass) for setuptools."""
    build, why = _decide()
    if not build:
        print(f"deltaserve: not building the CUDA/HIP extension ({why}); pure-torch ops only")
        return [], {}
    import torch

    if getattr(torch.version, "hip", None):
        os.environ.setdefault("PYTORCH_ROCM_ARCH", DEFAULT_ROCM_ARCHS)
    else:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    sources = sorted(glob.glob(os.path.join("csrc", "ops", "*.cu")) +
                     glob.glob(os.path.join("csrc", "ops", "*.cpp")))
    archs = os.environ.get("PYTORCH_ROCM_ARCH") or os.environ["TORCH_CUDA_ARCH_LIST"]
    print(f"deltaserve: building deltaserve._C ({why}; archs {archs}; {len(sources)} sources)")
    ext = CUDAExtension(
        name="deltaserve._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args={
            "cxx": ["-O3"],  # torch adds the C++ standard it needs
            "nvcc": ["-O3"],
        },
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}
