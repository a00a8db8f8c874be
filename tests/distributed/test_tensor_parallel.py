"""Tensor parallel on CPU (gloo): greedy tokens at TP = 2 and 4 equal TP = 1 in fp32 for tiny
dense, MoE and Qwen3-Next checkpoints, with a second turn that hits the prefix cache, with
n-gram and MTP speculation; every rank's pools are free after flush; a killed rank fails the
step cleanly. Each TP engine starts real worker processes (seconds on 2 cores): keep few."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from safetensors.torch import load_file, save_file

from deltaserve import LLM, SamplingParams
from deltaserve.distributed.worker import RankFailure
from deltaserve.model.testing import make_tiny_checkpoint
from drained import assert_drained
from token_ids import random_tokens

pytestmark = pytest.mark.slow  # worker processes: 4-9 s a test on 2 idle cores

MAX_NEW = 12
PROMPT_LENS = (7, 70, 150)
ENGINE = dict(device="cpu", dtype="float32", num_pages=256, page_size=16, chunk_size=64,
              host_snapshot_slots=4, num_snapshot_slots=2)


def prompts(seed: int) -> list[list[int]]:
    return [random_tokens(n, seed=seed + i) for i, n in enumerate(PROMPT_LENS)]


def two_turns(path: str, tp: int, **kw) -> tuple[list[list[int]], list[int], float | None]:
    """Both turns' greedy tokens (the second extends each first turn, so it hits the prefix
    cache), its cached token counts and the acceptance length; then the drain check on every
    rank."""
    llm = LLM(path, tensor_parallel_size=tp, **ENGINE, **kw)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        first_prompts = prompts(seed=11)
        first = llm.generate(first_prompts, params)
        second = llm.generate([p + o.token_ids + [5, 6] for p, o in zip(first_prompts, first)],
                              params)
        assert_drained(llm.engine)
        if tp > 1:  # every rank ran the same commands: all its pools are free too
            for report in llm.engine.rank_reports():
                assert report.error is None, report
                assert (report.pages_allocated, report.slots_allocated,
                        report.host_slots_allocated) == (0, 0, 0), report
        tokens = [o.token_ids for o in first + second]
        return tokens, [o.cached_tokens for o in second], llm.engine.acceptance_length
    finally:
        if tp > 1:
            llm.engine.close()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {kind: str(make_tiny_checkpoint(root / kind, kind, seed=2))
            for kind in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")}


@pytest.mark.parametrize("kind,tp", [
    ("qwen3_5_text", 2), ("qwen3_5_moe_text", 2), ("qwen3_next", 2),
    ("qwen3_5_text", 4), ("qwen3_5_moe_text", 4), ("qwen3_next", 4)])
def test_greedy_tokens_at_tp_equal_tp_1_with_a_prefix_cache_turn(checkpoints, kind, tp):
    # tiny dims: 4 query / 2 KV heads, GDN 4 value / 2 key heads, so TP 4 also replicates
    # the KV heads and the GDN key heads
    ref, ref_cached, _ = two_turns(checkpoints[kind], 1)
    ours, cached, _ = two_turns(checkpoints[kind], tp)
    assert ours == ref
    assert cached == ref_cached and all(c > 0 for c in cached[1:])  # [0]: under 64 tokens


def repeating_checkpoint(path, seed: int) -> str:
    """A tiny dense checkpoint whose greedy output repeats its last token (the residual
    stream is the token's embedding plus small layer outputs, the LM head the embedding) and
    whose MTP head drafts that repetition: drafts get accepted, so verify commits several
    rows (replay of n > 1 rows, KV of accepted drafts kept) on every rank."""
    make_tiny_checkpoint(path, "qwen3_5_text", seed=seed)
    file = os.path.join(path, "model.safetensors")
    w = load_file(file)
    embed = w["model.embed_tokens.weight"]
    w["lm_head.weight"] = embed.clone()
    for name in list(w):
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            w[name] = w[name] * 0.02
        if name.endswith(("model.norm.weight", "mtp.norm.weight", "pre_fc_norm_embedding.weight")):
            w[name] = w[name] * 0
    fc = w["mtp.fc.weight"]  # [hidden, 2·hidden]: pass the next token's embedding through
    fc.zero_()
    fc[:, :fc.shape[0]] = 5 * __import__("torch").eye(fc.shape[0])
    save_file(w, file, metadata={"format": "pt"})
    return str(path)


@pytest.mark.parametrize("algorithm", ["ngram", "mtp"])
def test_speculation_at_tp_2_equals_tp_1_with_accepted_drafts(tmp_path, algorithm):
    path = repeating_checkpoint(tmp_path / "m", seed=3)
    spec = dict(speculative_algorithm=algorithm, speculative_num_steps=3,
                speculative_policy="fixed")
    ref, ref_cached, ref_accept = two_turns(path, 1, **spec)
    ours, cached, accept = two_turns(path, 2, **spec)
    assert ref_accept is not None and ref_accept > 1.5, "the drafts should mostly be accepted"
    assert (ours, cached, accept) == (ref, ref_cached, ref_accept)


def test_an_adaptive_policy_chooses_the_same_k_on_every_rank(checkpoints):
    # each rank's policy sees rank 0's step times: tokens equal plain greedy, no rank hangs
    path = checkpoints["qwen3_5_text"]
    ref, _, _ = two_turns(path, 1)
    ours, _, _ = two_turns(path, 2, speculative_algorithm="ngram")
    assert ours == ref


def test_a_killed_rank_fails_the_step_and_every_later_call_says_why(checkpoints):
    llm = LLM(checkpoints["qwen3_5_text"], tensor_parallel_size=2, distributed_timeout_s=20,
              **ENGINE)
    engine = llm.engine
    try:
        rid = engine.add_request(random_tokens(40, seed=1),
                                 SamplingParams(temperature=0.0, max_tokens=50))
        engine.step()  # the prefill ran on both ranks
        worker = engine.workers.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        deadline = time.monotonic() + 30  # generous: a loaded 2-core CI machine
        while engine.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the watchdog notices the exit without any call
        # the watchdog names the rank when it sees the process exit; a step that hits the
        # broken channel first reports "a tensor-parallel rank exited" (seen on CI)
        assert engine.failure is not None and "rank" in engine.failure
        with pytest.raises(RankFailure, match="rank"):
            while engine.has_unfinished():
                engine.step()
        assert "rank" in engine.failure
        assert engine.abort(rid)  # frees rank 0's side, no hang on the dead rank
        with pytest.raises(RankFailure):
            engine.check_integrity()
        with pytest.raises(RankFailure):
            engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    finally:
        engine.close()


def test_a_model_whose_heads_do_not_split_is_refused_before_any_process_starts(checkpoints):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the 4"):
        LLM(checkpoints["qwen3_5_text"], tensor_parallel_size=3, **ENGINE)


def forks_and_an_abort(path: str, tp: int) -> dict[int, list[int]]:
    """Two choices of one prompt (prefilled once by a hidden parent), a request aborted after
    its first step, and one that runs to the end; the tokens by rid, then the drain check."""
    llm = LLM(path, tensor_parallel_size=tp, **ENGINE)
    engine = llm.engine
    try:
        sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_NEW, ignore_eos=True)
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        rids = engine.add_forks(random_tokens(100, seed=4), [greedy, sampled])
        doomed = engine.add_request(random_tokens(90, seed=5), greedy)
        kept = engine.add_request(random_tokens(30, seed=6), greedy)
        tokens: dict[int, list[int]] = {}
        engine.step()
        assert engine.abort(doomed)
        while engine.has_unfinished():
            for out in engine.step():
                tokens.setdefault(out.rid, []).extend(out.new_token_ids)
        assert sorted(tokens) == sorted([*rids, kept])
        assert_drained(engine)
        return tokens
    finally:
        if tp > 1:
            engine.close()


def test_forks_seeded_sampling_and_an_abort_stay_in_step_on_every_rank(checkpoints):
    path = checkpoints["qwen3_5_text"]
    assert forks_and_an_abort(path, 2) == forks_and_an_abort(path, 1)


def test_a_dummy_model_is_drawn_at_shard_size_on_each_rank(checkpoints):
    # what lets a model larger than one GPU be benchmarked: only the shard is ever allocated
    path = checkpoints["qwen3_5_moe_text"]
    whole = LLM(path, load_format="dummy", **ENGINE).engine.model
    llm = LLM(path, load_format="dummy", tensor_parallel_size=2, **ENGINE)
    try:
        shard = llm.engine.model
        n_whole = sum(p.numel() for p in whole.parameters())
        n_shard = sum(p.numel() for p in shard.parameters())
        assert n_shard < 0.55 * n_whole  # norms, router and MTP fc are replicated
        assert shard.embed_tokens.weight.shape[0] == whole.config.vocab_size // 2
        (out,) = llm.generate([random_tokens(80, seed=8)],
                              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        assert len(out.token_ids) == 6
        assert_drained(llm.engine)
    finally:
        llm.engine.close()


def test_a_worker_that_exits_during_the_grace_is_named():
    """A killed rank's sockets close before its exit is visible, so rank 0's collective can
    fail first: dead(grace) waits for the exit and names the rank, dead() cannot yet."""
    import multiprocessing

    from deltaserve.distributed.worker import Workers

    workers = Workers.__new__(Workers)
    proc = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(1.0,))
    proc.start()
    workers.procs, workers.conns, workers.stopped = [proc], [], False
    workers.reap_lock = threading.Lock()
    try:
        assert workers.dead() is None
        why = workers.dead(grace_s=30.0)
        assert why == f"tensor-parallel rank 1 (pid {proc.pid}) exited with code 0"
    finally:
        proc.join(5)
