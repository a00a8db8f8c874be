"""The offline LLM after a failed step, and sampling values at the edge of fp32."""

from __future__ import annotations

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.model.testing import make_tiny_checkpoint
from drained import assert_drained

PROMPTS = [[5, 6, 7, 8] * 10, [9, 10, 11] * 7]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("m"), "qwen3_5_text", seed=0)
    return LLM(str(path), device="cpu", dtype="float32")


def test_a_failed_step_aborts_the_calls_requests_and_the_llm_keeps_working(llm, monkeypatch):
    # Found by a fresh user: the failed call's requests stayed queued, so every later
    # generate() on the same LLM ran them again and failed the same way.
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ref = [out.token_ids for out in llm.generate(PROMPTS, params)]
    real_step, calls = llm.engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected step failure")
        return real_step()

    monkeypatch.setattr(llm.engine, "step", failing_step)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(PROMPTS, params)
    assert not llm.engine.has_unfinished()
    assert [out.token_ids for out in llm.generate(PROMPTS, params)] == ref
    assert_drained(llm.engine)


def test_near_zero_temperature_is_greedy_and_near_zero_top_p_keeps_the_top_token(llm):
    # 1e-40 divided the logits to inf, and a top_p of 1e-50 rounds to 0 in fp32: both made
    # NaN probabilities, which failed the whole batch's step (HTTP 500 for every request).
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ref = [out.token_ids for out in llm.generate(PROMPTS, greedy)]
    for params in (SamplingParams(temperature=1e-40, max_tokens=6, ignore_eos=True, seed=1),
                   SamplingParams(top_p=1e-50, max_tokens=6, ignore_eos=True, seed=2)):
        assert [out.token_ids for out in llm.generate(PROMPTS, params)] == ref
    assert_drained(llm.engine)


def test_a_near_zero_repetition_penalty_does_not_fail_the_batch(llm):
    # 1e-300 is 0 in fp32: the prompt's tokens got inf logits, the probabilities NaN, and the
    # step failed for every request in it (a fresh user's run: HTTP 500 for four requests)
    outs = llm.generate(PROMPTS, [SamplingParams(repetition_penalty=1e-300, max_tokens=4,
                                                 ignore_eos=True, seed=3),
                                  SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)])
    assert set(outs[0].token_ids) <= set(PROMPTS[0])  # the boosted tokens, and only they
    assert len(outs[1].token_ids) == 4
    assert_drained(llm.engine)


def test_booleans_are_not_prompt_token_ids(llm):
    with pytest.raises(ValueError, match="prompt token ids must be integers"):
        llm.generate([[True, False]], SamplingParams(max_tokens=2))
    assert_drained(llm.engine)


@pytest.mark.parametrize(("prompts", "params", "message"), [
    (PROMPTS[:1], {"max_tokens": 4}, "sampling_params must be a SamplingParams"),
    ([None], None, "a prompt must be a string or a list of token ids, got NoneType"),
    ([3.5], None, "a prompt must be a string or a list of token ids, got float"),
    (5, None, "prompts must be a string, a list of token ids, or a list of strings"),
    ((p for p in ["a"]), None, "got generator"),
])
def test_bad_generate_arguments_raise_value_errors_and_queue_nothing(llm, prompts, params,
                                                                     message):
    # a fresh user's findings: an AttributeError and a TypeError from deep inside generate()
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, params)
    assert not llm.engine.has_unfinished()
    assert_drained(llm.engine)


def test_stop_token_ids_and_stop_strings_as_tuples_are_taken_as_lists():
    assert SamplingParams(stop_token_ids=(1, 2)).stop_token_ids == [1, 2]
    stop = SamplingParams(stop=("a", "bc"))
    stop.validate()
    assert stop.stop == ["a", "bc"]
    with pytest.raises(ValueError, match="stop_token_ids must be a list of non-negative"):
        SamplingParams(stop_token_ids=[1, -2]).validate()


def test_max_tokens_past_the_context_warns_and_stops_at_the_context(tmp_path):
    # a fresh user's finding: max_tokens=10**9 ran silently towards the 32k context
    path = make_tiny_checkpoint(tmp_path / "m", "qwen3_5_text", seed=0)
    small = LLM(str(path), device="cpu", dtype="float32", max_model_len=64)
    with pytest.warns(UserWarning, match="does not fit the context length 64 for 1 prompt"):
        (out,) = small.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=10**9,
                                                           ignore_eos=True))
    assert len(out.token_ids) == 61 and out.finish_reason == "length"
    assert_drained(small.engine)


@pytest.mark.parametrize("field,value,says", [
    ("chunk_size", "big", "chunk_size must be an integer, got 'big'"),
    ("page_size", 16.5, "page_size must be an integer, got 16.5"),
    ("num_pages", True, "num_pages must be an integer, got True"),
    ("cuda_graphs", "yes", "cuda_graphs must be True or False, got 'yes'"),
    ("kv_memory_gb", "1", "kv_memory_gb must be a finite number, got '1'"),
    ("kv_memory_gb", float("inf"), "kv_memory_gb must be a finite number, got inf"),
    ("radix_lookahead", 1, "radix_lookahead must be True or False, got 1"),
    ("dtype", 32, "dtype must be a string, got 32"),
])
def test_an_engine_option_of_the_wrong_type_is_a_value_error_naming_it(tmp_path, field, value,
                                                                         says):
    # a fresh user's finding: LLM(chunk_size="big") raised a bare TypeError from a comparison
    path = make_tiny_checkpoint(tmp_path / "m", "qwen3_5_text", seed=0)
    with pytest.raises(ValueError) as e:
        LLM(str(path), **{"device": "cpu", "dtype": "float32", field: value})
    assert str(e.value) == says


def test_numpy_integers_are_taken_as_engine_options():
    import numpy as np

    from deltaserve.config import EngineConfig

    EngineConfig(num_pages=np.int64(100), chunk_size=np.int32(256)).validate()


def test_a_model_folder_given_as_a_path_is_loaded(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m", "qwen3_5_text", seed=0)  # a pathlib.Path
    llm = LLM(path, device="cpu", dtype="float32")
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=2,
                                                      ignore_eos=True))
    assert len(out.token_ids) == 2


def test_caches_that_do_not_fit_in_memory_are_a_value_error_naming_the_flags(tmp_path,
                                                                            monkeypatch):
    # a fresh user's finding: --max-running-reqs 100000000 ended in the allocator's traceback
    import deltaserve.engine.caches as caches

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 73.24 TiB")

    monkeypatch.setattr(caches, "GDNStatePool", out_of_memory)
    path = make_tiny_checkpoint(tmp_path / "m", "qwen3_5_text", seed=0)
    with pytest.raises(ValueError) as e:
        LLM(str(path), device="cpu", dtype="float32", max_running_reqs=1000, num_pages=64)
    says = str(e.value)
    assert says.startswith("the caches do not fit in memory: 64 KV pages of 16 tokens (")
    assert "4001 GDN state slots (1 + 2 x --max-running-reqs 1000 + 2000 snapshot" in says
    assert "Tried to allocate 73.24 TiB" in says and "lower --max-running-reqs" in says


def test_a_prompt_that_is_not_valid_text_is_a_value_error():
    # a fresh user's finding: a lone UTF-16 surrogate reached the tokenizer, whose TypeError
    # ("TextEncodeInput must be Union[...]") named nothing the user wrote
    llm = LLM(device="cpu")  # the embedded model: it has a tokenizer
    with pytest.raises(ValueError, match="not valid text: .* at character 3 .*surrogate"):
        llm.generate("abc\ud800", SamplingParams(max_tokens=2))
    assert_drained(llm.engine)


def test_a_file_given_as_the_model_is_named_as_a_file(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\0" * 8)
    with pytest.raises(FileNotFoundError, match="is a file, not a checkpoint folder"):
        LLM(str(weights), device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_device_without_cuda_is_named_as_given():
    from deltaserve.config import EngineConfig
    from deltaserve.engine.llm_engine import resolve_device_dtype

    with pytest.raises(ValueError, match="^device cuda:3 was asked for but no CUDA device"):
        resolve_device_dtype(EngineConfig(device="cuda:3"))


def test_a_one_token_prompt_past_the_context_says_token(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m", "qwen3_5_text", seed=0)
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=1)
    with pytest.raises(ValueError, match="the prompt has 1 token but the context length is 1"):
        llm.generate([[5]], SamplingParams(max_tokens=2))
