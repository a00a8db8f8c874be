"""The projection-prologue kernels on the GPU (`-m gpu`, the device machine): at the decode
shapes of the 0.8B config, Qwen3.6-35B-A3B and the default model, M = 1, 2, 4, 8 rows, bf16 and
fp16, fresh random inputs, each fused projection equals the stand-alone op followed by gemv
bit for bit (ops/prologue.py's contract; prologue_inputs.check), and a model gives the same
tokens and logprobs with the prologues on and off (DS_GEMV_PROLOGUE's switch). The emulated kernels
(test_prologue_emu.py) cover block shapes and fallbacks on any machine."""

from __future__ import annotations

import pytest
import torch
from prologue_inputs import check, make

from deltaserve.ops import prologue

pytestmark = pytest.mark.gpu

# kind -> [((heads, head_dim) of K, N)]: 0.8B (hidden 1024), 35B-A3B (hidden 2048), default (256)
SHAPES = {
    "silu_mul": [((1, 3584), 1024), ((1, 512), 2048), ((1, 1024), 256)],
    "sigmoid_gate_mul": [((8, 256), 1024), ((16, 256), 2048), ((4, 64), 256)],
    "gated_rms_norm": [((16, 128), 1024), ((32, 128), 2048), ((8, 32), 256)],
    "add_rms_norm": [((1, 1024), 8224), ((1, 1024), 7168), ((1, 2048), 12352), ((1, 256), 784)],
}


@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", sorted(SHAPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_prologue_equals_the_op_then_gemv(kind, m, dtype):
    ran = 0
    for i, (k_shape, n) in enumerate(SHAPES[kind]):
        if m * (k_shape[0] * k_shape[1] + 8) > prologue.STAGE_ELEMS:
            continue
        gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
        inp, w, b = make(kind, m, k_shape, n, dtype, gen, device="cuda", bias=i == 0)
        check(inp, w, b)
        ran += 1
    assert ran


def test_gpu_model_tokens_and_logprobs_are_the_same_with_prologues_off(monkeypatch, tmp_path):
    """A tiny Qwen3.5 checkpoint (every layer's norms, gates and projections at decode sizes,
    CUDA graphs on) generates the same tokens with the same logprobs, bit for bit, with the
    prologue kernels on and off: the fused projections change no result in the model."""
    from deltaserve import LLM, SamplingParams
    from deltaserve.model.testing import make_tiny_checkpoint, random_tokens

    ckpt = str(make_tiny_checkpoint(tmp_path / "m", "qwen3_5_text", seed=3))
    prompts = [random_tokens(n, seed=n) for n in (7, 30, 55)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    runs = []
    for on in (True, False):
        monkeypatch.setattr(prologue, "PROLOGUE_ON", on)
        llm = LLM(ckpt, device="cuda", dtype="bfloat16")
        runs.append([(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)])
        del llm
    assert runs[0] == runs[1]
