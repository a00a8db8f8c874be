"""The batched sampler on a CUDA device: uniforms and penalties bit-identical to the CPU,
distributions equal to the reference's, seeds reproducible whatever the batch, at the real
vocabulary size (248,320)."""

from __future__ import annotations

import random

import pytest
import torch
from sampling_cases import batched_probs, chi2_critical, chi_square, random_params, random_row

from deltaserve.core import SamplingParams
from deltaserve.engine.sampling import (
    SamplingRow,
    SamplingTensors,
    apply_penalties,
    sample,
    sample_rows,
)
from deltaserve.engine.sampling_ref import apply_penalties_ref, sample_rows_ref, truncated_probs_ref
from deltaserve.engine.sampling_rng import row_uniforms

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
VOCAB = 248_320


def test_uniforms_are_bit_identical_on_the_gpu():
    gen = torch.Generator().manual_seed(0)
    seeds = torch.randint(-2**63, 2**63 - 1, (4096,), generator=gen)
    pos = torch.randint(0, 1 << 30, (4096,), generator=gen)
    assert torch.equal(row_uniforms(seeds, pos), row_uniforms(seeds.to(CUDA), pos.to(CUDA)).cpu())


def test_gpu_penalties_equal_the_cpu_reference_exactly():
    rng = random.Random(1)
    rows = [random_row(rng, VOCAB, replace_penalty(random_params(rng, VOCAB)))
            for _ in range(16)]
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(1)) * 4
    st = SamplingTensors.build(rows, VOCAB, CUDA)
    got = apply_penalties(logits.to(CUDA)[st.penalty_idx], st).cpu()
    want = torch.stack([apply_penalties_ref(logits[i], r) for i, r in enumerate(rows)])
    assert torch.equal(got, want)


def replace_penalty(p: SamplingParams) -> SamplingParams:
    from dataclasses import replace

    return replace(p, repetition_penalty=1.5, frequency_penalty=0.3)


def test_gpu_probabilities_and_greedy_rows_match_the_reference_at_the_full_vocab():
    rng = random.Random(2)
    rows = [random_row(rng, VOCAB, random_params(rng, VOCAB, greedy_share=0.0))
            for _ in range(12)]
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    want = torch.stack([truncated_probs_ref(apply_penalties_ref(logits[i], r), r.params)
                        for i, r in enumerate(rows)])
    got = batched_probs(logits.to(CUDA), rows).cpu()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)
    greedy = [random_row(rng, VOCAB, random_params(rng, VOCAB, greedy_share=1.0))
              for _ in range(12)]
    assert sample_rows(logits.to(CUDA), greedy) == sample_rows_ref(logits, greedy)


def test_gpu_draws_follow_the_reference_distribution():
    vocab, n = 10, 20000
    params = SamplingParams(temperature=0.9, top_p=0.95, min_p=0.02, presence_penalty=0.5)
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3))
    rows = [SamplingRow(params, [1, 2], [3, 3], seed) for seed in range(n)]
    tokens = torch.tensor(sample_rows(logits.repeat(n, 1).to(CUDA), rows))
    want = truncated_probs_ref(apply_penalties_ref(logits, rows[0]), params)
    counts = torch.bincount(tokens, minlength=vocab)
    assert int(counts[want == 0].sum()) == 0
    stat, df = chi_square(counts, want)
    assert stat < chi2_critical(df)


@pytest.mark.parametrize("batch", [1, 32, 128])
def test_gpu_tokens_are_reproducible_and_independent_of_the_batch(batch):
    rng = random.Random(4)
    gen = torch.Generator(device=CUDA).manual_seed(4)
    mine = [random_row(rng, VOCAB, random_params(rng, VOCAB, greedy_share=0.0))
            for _ in range(min(batch, 4))]
    my_logits = torch.randn(len(mine), VOCAB, device=CUDA, generator=gen) * 2
    alone = [sample_rows(my_logits[i:i + 1], [r])[0] for i, r in enumerate(mine)]
    others = [random_row(rng, VOCAB) for _ in range(batch - len(mine))]
    logits = torch.cat([torch.randn(len(others), VOCAB, device=CUDA, generator=gen), my_logits])
    rows = others + mine
    first = sample_rows(logits, rows)
    assert first == sample_rows(logits, rows)
    assert first[len(others):] == alone


def test_the_sampler_captures_in_a_cuda_graph_and_replays_the_eager_tokens():
    # no host sync inside `sample`: a graph over fixed SamplingTensors replays the same draw
    rng = random.Random(5)
    rows = [random_row(rng, VOCAB, random_params(rng, VOCAB, greedy_share=0.3))
            for _ in range(32)]
    logits = torch.randn(len(rows), VOCAB, device=CUDA) * 2
    st = SamplingTensors.build(rows, VOCAB, CUDA)
    eager = sample(logits, st)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sample(logits, st)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sample(logits, st)
    graph.replay()
    assert torch.equal(out, eager)
