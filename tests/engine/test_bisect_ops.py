"""scripts/bisect_ops.py: its switches reach the references and leave the modules as found, and on
the CPU in fp32 every configuration gives transformers' first token and logprobs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from deltaserve.ops import _ext, chunk_prefill, fused

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bisect_ops.py"


@pytest.fixture(scope="module")
def bisect():
    spec = importlib.util.spec_from_file_location("bisect_ops", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_switches_turn_the_extension_off_and_restore_the_modules(bisect):
    x = torch.zeros(2, device="meta")
    with bisect.kernels_off(bisect.OPS_MODULES):
        assert fused._ext is not _ext and not fused._ext.use_extension(x)
        assert fused._ext.KERNEL_DTYPES == _ext.KERNEL_DTYPES
    assert fused._ext is _ext
    orig = chunk_prefill.gdn_chunk_prefill
    with bisect.fla_off():
        assert chunk_prefill.gdn_chunk_prefill is not orig
    assert chunk_prefill.gdn_chunk_prefill is orig


def test_cpu_fp32_configurations_match_the_reference(bisect, tmp_path):
    out = tmp_path / "b.json"
    assert bisect.main(["--tiny", "qwen3_5_text", "--seed", "3", "--dtype", "float32",
                        "--device", "cpu", "--prompt-len", "40", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert len(report["rows"]) == 1 + len(bisect.OPS_MODULES)
    for row in report["rows"]:
        assert row["token"] == report["reference"]["token"], row
        assert row["max_err"] < 1e-4, row
        assert abs(row["margin"] - report["reference"]["margin"]) < 1e-4, row
