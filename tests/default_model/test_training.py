"""Training on the CPU: the loss goes down, and the script writes a loadable HF folder."""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import shutil
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from deltaserve.default_model.config import default_text_config
from deltaserve.default_model.corpus import default_stdlib_dir, prepare_corpus
from deltaserve.default_model.gdn_chunked import causal_conv1d_shift, chunk_gated_delta_rule_torch
from deltaserve.default_model.hf_reference import causal_conv_override, torch_gdn_reference
from deltaserve.default_model.training import (
    TrainModel,
    lr_at,
    make_optimizer,
    train_batches,
    train_step,
)

TINY = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16,
}
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_default_model.py"


def test_loss_is_finite_and_falls_on_a_repeated_batch():
    torch.manual_seed(0)
    model = TrainModel(default_text_config(**TINY))
    opt = make_optimizer(model, lr=3e-3, weight_decay=0.0)
    batch = torch.randint(3, 8192, (2, 32))
    losses = []
    with torch_gdn_reference():
        for _ in range(10):
            r = train_step(model, opt, batch, lr=3e-3, mtp_steps=2, mtp_weight=0.3,
                           grad_clip=1.0, autocast_dtype=None)
            assert math.isfinite(r.loss) and len(r.mtp) == 2
            losses.append(r)
    assert losses[-1].main < losses[0].main - 0.5
    assert losses[-1].mtp[0] < losses[0].mtp[0] - 0.5


def test_batches_cover_every_window_once_per_epoch_and_the_schedule_warms_then_decays():
    stream = torch.arange(101, dtype=torch.int32)
    it = train_batches(stream, batch_size=2, seq_len=10, seed=0)
    first = torch.cat([next(it) for _ in range(5)])
    assert sorted(first[:, 0].tolist()) == list(range(0, 100, 10))
    second = torch.cat([next(it) for _ in range(4)])  # 9 or 10 windows at shifted cut points
    starts = second[:, 0].tolist()
    assert len(set(starts)) == 8 and len({s % 10 for s in starts}) == 1
    assert all(row.diff().eq(1).all() for row in second)
    assert lr_at(0, 100, 1.0, 10, 0.1) == 0.1 and lr_at(9, 100, 1.0, 10, 0.1) == 1.0
    assert math.isclose(lr_at(100, 100, 1.0, 10, 0.1), 0.1)


def tiny_run(tmp_path: Path):
    """(the training script as a module, --arch flags of the tiny model), with a corpus of a
    few real stdlib files (small and fast) prepared in tmp_path / "corpus"."""
    lib = tmp_path / "lib"
    lib.mkdir()
    for name in ("argparse.py", "bisect.py", "colorsys.py", "heapq.py", "textwrap.py"):
        shutil.copyfile(Path(default_stdlib_dir()) / name, lib / name)
    prepare_corpus(tmp_path / "corpus", lib, held_out_per_10k=4000)
    spec = importlib.util.spec_from_file_location("train_default_model", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script, [f"--arch={k}={v}" for k, v in TINY.items()]


def test_the_script_trains_two_steps_and_saves_a_folder_transformers_loads(tmp_path):
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM

    script, arch = tiny_run(tmp_path)
    out = tmp_path / "model"
    final = script.main([
        "--corpus", str(tmp_path / "corpus"), "--out", str(out), "--max-steps", "2",
        "--batch-size", "2", "--seq-len", "64", "--warmup", "1", "--eval-tokens", "256", *arch,
    ])
    assert math.isfinite(final["loss"]) and len(final["mtp_loss"]) == 3
    log = json.loads((out / "train_log.json").read_text())
    assert [r["step"] for r in log["train"]] == [2] and log["final"] == final
    assert "PSF-2.0" in (out / "README.md").read_text()
    with safe_open(out / "model.safetensors", "pt") as f:
        assert "mtp.layers.0.self_attn.q_proj.weight" in f.keys()
    model = Qwen3_5ForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert model.config.hidden_size == 64 and tok.eos_token_id == 0


@pytest.mark.parametrize("solve,conv", [("trsm", "conv1d"), ("blocked", "shift")])
def test_compiled_forward_traces_without_graph_breaks_and_matches_eager(solve, conv):
    """--compile: dynamo captures the whole training forward (GDN chunk rule, MTP steps) as
    one graph, and the traced step's losses equal the eager ones (backend "eager": tracing
    only, no code generation, so the test stays fast on a CPU)."""
    import torch._dynamo

    torch.manual_seed(0)
    model = TrainModel(default_text_config(**TINY), mtp_fraction=0.5)
    batch = torch.randint(0, 8000, (2, 96), generator=torch.Generator().manual_seed(1))
    chunk_fn = functools.partial(chunk_gated_delta_rule_torch, solve=solve)
    with ExitStack() as stack, torch.no_grad():
        stack.enter_context(torch_gdn_reference(chunk_fn=chunk_fn))
        if conv == "shift":
            stack.enter_context(causal_conv_override(causal_conv1d_shift, model))
        want = model(batch, 3)
        explained = torch._dynamo.explain(model.forward)(batch, 3)
        got = torch.compile(model.forward, backend="eager")(batch, 3)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    for a, b in zip([want[0], *want[1]], [got[0], *got[1]]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_profile_steps_write_the_op_table_and_stop(tmp_path):
    script, arch = tiny_run(tmp_path)
    out = tmp_path / "model"
    got = script.main(["--corpus", str(tmp_path / "corpus"), "--out", str(out),
                       "--max-steps", "50", "--batch-size", "2", "--seq-len", "64",
                       "--profile-steps", "2", "--compile", "eager", *arch])
    table = (out / "profile.txt").read_text()
    assert table.startswith("2 steps profiled") and "aten::mm" in table
    assert got["step_s"] > 0
    assert not (out / "model.safetensors").exists()  # stopped before training ended


def test_a_run_stopped_and_resumed_saves_the_weights_of_an_uninterrupted_run(tmp_path):
    """--stop-step writes a checkpoint and returns; --resume goes on from it (model, AdamW
    state, schedule, data order) and ends with the same bytes as a run never stopped; a
    checkpoint of another run is refused."""
    script, arch = tiny_run(tmp_path)
    flags = ["--corpus", str(tmp_path / "corpus"), "--max-steps", "4", "--batch-size", "2",
             "--seq-len", "64", "--warmup", "1", "--eval-tokens", "256", "--eval-every", "3",
             "--log-every", "1", "--mtp-fraction", "0.5", *arch]
    script.main(["--out", str(tmp_path / "whole"), *flags])
    got = script.main(["--out", str(tmp_path / "split"), "--stop-step", "2", *flags])
    assert got == {"checkpoint": str(tmp_path / "split" / "checkpoint.pt"), "step": 2}
    assert not (tmp_path / "split" / "model.safetensors").exists()
    try:
        script.main(["--out", str(tmp_path / "split"), "--resume", *flags, "--lr", "1e-3"])
    except ValueError as e:
        assert "another run's checkpoint" in str(e) and "'lr'" in str(e)
    else:
        raise AssertionError("a checkpoint of another learning rate was resumed")
    script.main(["--out", str(tmp_path / "split"), "--resume", *flags])
    assert not (tmp_path / "split" / "checkpoint.pt").exists()
    with safe_open(tmp_path / "whole" / "model.safetensors", "pt") as a, \
            safe_open(tmp_path / "split" / "model.safetensors", "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for key in a.keys():
            assert torch.equal(a.get_tensor(key), b.get_tensor(key)), key
    logs = [json.loads((tmp_path / d / "train_log.json").read_text()) for d in ("whole", "split")]
    assert [r["loss"] for r in logs[0]["train"]] == [r["loss"] for r in logs[1]["train"]]
    assert [r["step"] for r in logs[1]["eval"]] == [3, 4] and logs[1]["resumed_at"] == [2]
    assert logs[0]["final"] == logs[1]["final"]


def test_tokenize_split_reuses_its_cache_and_a_changed_shard_misses_it(tmp_path, monkeypatch):
    from deltaserve.default_model import training
    from deltaserve.default_model.build import FILES_DIR

    tiny_run(tmp_path)  # its corpus
    corpus, cache, tok = tmp_path / "corpus", tmp_path / "cache", FILES_DIR / "tokenizer.json"
    want = training.tokenize_split(tok, str(corpus), "train")
    assert torch.equal(training.tokenize_split(tok, str(corpus), "train", cache), want)
    assert len(list(cache.glob("tokens-train-*.pt"))) == 1
    real = training.Tokenizer

    class Refuse:
        @staticmethod
        def from_file(path):
            raise AssertionError("encoded again despite the cache")

    monkeypatch.setattr(training, "Tokenizer", Refuse)
    assert torch.equal(training.tokenize_split(tok, str(corpus), "train", cache), want)
    monkeypatch.setattr(training, "Tokenizer", real)
    shard = sorted(corpus.glob("train-*.jsonl"))[0]
    shard.write_text(shard.read_text().splitlines()[0] + "\n")  # one document left
    fewer = training.tokenize_split(tok, str(corpus), "train", cache)
    assert fewer.numel() < want.numel() and len(list(cache.glob("tokens-train-*.pt"))) == 2


def test_checkpoint_due_stops_at_the_time_or_before_a_last_step_whose_save_would_not_fit():
    spec = importlib.util.spec_from_file_location("train_default_model", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    due = script.checkpoint_due
    assert not due(5, 10, call_s=1e9, step_s=1.0, stop_s=0.0, final_s=0.0)  # no --stop-minutes
    assert due(5, 10, call_s=100.5, step_s=1.0, stop_s=100.0, final_s=0.0)
    assert not due(5, 10, call_s=99.0, step_s=1.0, stop_s=100.0, final_s=50.0)
    # before the last step: it ends at 61 s, its save needs 40 more, past the stop at 100 s
    assert due(9, 10, call_s=60.0, step_s=1.0, stop_s=100.0, final_s=40.0)
    assert not due(9, 10, call_s=58.0, step_s=1.0, stop_s=100.0, final_s=40.0)


def test_a_run_whose_final_save_cannot_fit_checkpoints_before_its_last_step(tmp_path):
    script, arch = tiny_run(tmp_path)
    flags = ["--corpus", str(tmp_path / "corpus"), "--out", str(tmp_path / "m"), "--max-steps",
             "3", "--batch-size", "2", "--seq-len", "64", "--warmup", "1", "--eval-tokens", "256",
             *arch]
    got = script.main([*flags, "--stop-minutes", "60", "--final-seconds", "7200"])
    assert got == {"checkpoint": str(tmp_path / "m" / "checkpoint.pt"), "step": 2}
    assert "loss" in script.main([*flags, "--resume"])
    assert (tmp_path / "m" / "model.safetensors").exists()
