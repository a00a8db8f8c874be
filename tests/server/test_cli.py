"""The `deltaserve` command: engine flags map 1:1 onto EngineConfig; generate prints text;
serve answers over HTTP and stops on SIGINT."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from deltaserve.config import EngineConfig
from deltaserve.server.cli import add_engine_flags, build_parser, engine_config, main


def parse(*argv: str) -> EngineConfig:
    return engine_config(build_parser().parse_args(["serve", *argv]))


def test_no_flags_give_the_engine_defaults_and_the_embedded_model():
    assert parse() == EngineConfig()
    assert parse().model is None


def test_every_engine_flag_sets_its_config_field():
    cfg = parse("--model", "/m", "--dtype", "float32", "--device", "cpu", "--page-size", "64",
                "--chunk-size", "128", "--max-running-reqs", "3", "--max-model-len", "1000",
                "--num-pages", "99", "--kv-memory-gb", "0.5", "--num-snapshot-slots", "7",
                "--host-snapshot-slots", "11", "--max-prompt-snapshots", "8",
                "--disable-prefix-cache", "--speculative-algorithm", "ngram",
                "--speculative-num-steps", "3", "--disable-cuda-graphs", "--log-every", "10",
                "--seed", "5", "--load-format", "dummy")
    assert cfg == EngineConfig(
        model="/m", load_format="dummy", dtype="float32", device="cpu", page_size=64,
        chunk_size=128, max_running_reqs=3, max_model_len=1000, num_pages=99, kv_memory_gb=0.5,
        num_snapshot_slots=7, host_snapshot_slots=11, max_prompt_snapshots=8,
        enable_prefix_cache=False, speculative_algorithm="ngram",
        speculative_num_steps=3, decode_rows_per_req=4, cuda_graphs=False, log_every=10, seed=5)


@pytest.mark.parametrize("algo", ["ngram", "mtp"])
def test_a_speculative_algorithm_alone_drafts_the_default_number_of_tokens(algo):
    cfg = parse("--speculative-algorithm", algo)
    assert cfg.speculative_num_steps == 3 and cfg.decode_rows_per_req == 4
    with pytest.raises(ValueError, match="--speculative-num-steps"):
        parse("--speculative-algorithm", algo, "--speculative-num-steps", "9")


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_a_port_outside_0_to_65535_is_a_usage_error_before_the_model_loads(port, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--port", port])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--port" in err and f"port must be an integer in 0..65535, got '{port}'" in err


def test_serve_on_a_port_in_use_fails_before_loading_the_model_naming_it(capsys, monkeypatch):
    import socket

    import deltaserve.server.cli as cli

    def load(args):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(cli, "_make_engine", load)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port), "--device", "cpu"]) == 1
    assert f"--host / --port: cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_serve_that_cannot_listen_does_not_warn_about_listening_without_a_key(capsys, caplog,
                                                                           monkeypatch):
    import socket

    import deltaserve.server.cli as cli

    monkeypatch.setattr(cli, "_make_engine", lambda args: pytest.fail("the model was loaded"))
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--host", "0.0.0.0", "--port", str(port)]) == 1
    assert "cannot listen on 0.0.0.0" in capsys.readouterr().err
    assert not [r for r in caplog.records if "without --api-key" in r.getMessage()]


def test_every_config_field_has_a_flag():
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    dests = {a.dest for a in parser._actions}
    missing = {f.name for f in dataclasses.fields(EngineConfig)} - dests - {"decode_rows_per_req"}
    assert not missing


def test_a_bad_flag_value_exits_with_a_clear_message():
    with pytest.raises(ValueError, match="dtype"):
        parse("--dtype", "int3")
    with pytest.raises(ValueError, match="seed must be in"):  # was torch's "Overflow ..."
        parse("--seed", str(2**64))
    assert parse("--seed", str(2**64 - 1)).seed == 2**64 - 1


@pytest.mark.parametrize("flag", ["--host-snapshot-slots", "--max-prompt-snapshots",
                                  "--num-snapshot-slots"])
def test_a_negative_snapshot_slot_count_is_refused_at_startup_naming_the_flag(flag):
    with pytest.raises(ValueError, match=f"^{flag} must be >= 0"):
        parse(flag, "-1")
    with pytest.raises(SystemExit, match=f"deltaserve: error: {flag}"):  # one line, no trace
        main(["generate", flag, "-2", "hi"])


@pytest.mark.parametrize("device", ["cuda:abc", "cuda:", "cuda:-1", "cpu:abc", "cpu:1", "gpu"])
def test_a_malformed_device_is_a_one_line_error_naming_the_flag(device):
    """torch's own parse of these ('Invalid device string') came as a traceback, after the
    model's files were read."""
    with pytest.raises(ValueError, match=f"^--device must be auto, cpu, cuda or cuda:N, not "
                                         f"{re.escape(repr(device))}$"):
        parse("--device", device)
    assert parse("--device", "cuda:1").device == "cuda:1"


@pytest.mark.parametrize("argv,message", [
    (["--page-size", "0"], "--page-size must be >= 1"),
    (["--chunk-size", "0"], "--chunk-size must be >= 1"),
    (["--max-model-len", "0"], "--max-model-len must be >= 1"),
    (["--speculative-num-steps", "2"], "--speculative-num-steps needs --speculative-algorithm"),
    (["--speculative-algorithm", "mtp", "--speculative-num-steps", "9"],
     "--speculative-num-steps must be in 1..8"),
])
def test_a_config_error_names_the_flag_the_user_typed_not_the_config_field(argv, message):
    with pytest.raises(ValueError) as e:
        parse(*argv)
    assert str(e.value).startswith(message), str(e.value)


def test_an_unknown_log_level_is_a_usage_error_and_case_does_not_matter(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--log-level", "LOUD", "generate", "x"])
    assert e.value.code == 2
    assert "--log-level" in capsys.readouterr().err
    assert build_parser().parse_args(["--log-level", "debug", "generate", "x"]).log_level == "DEBUG"


@pytest.mark.parametrize("argv,level", [
    (["generate", "x", "--log-level", "debug"], "DEBUG"),  # after the command too
    (["--log-level", "error", "serve"], "ERROR"),           # kept when given only before it
    (["--log-level", "error", "serve", "--log-level", "warning"], "WARNING"),
    (["serve"], "INFO"),
])
def test_the_log_level_is_accepted_before_or_after_the_command(argv, level):
    assert build_parser().parse_args(argv).log_level == level


@pytest.mark.parametrize("flag,value,message", [("--max-tokens", "0",
                                                 "--max-tokens must be an integer >= 1"),
                                                ("--top-p", "0", "--top-p must be in"),
                                                ("--temperature", "-1", "--temperature must")])
def test_a_bad_sampling_flag_is_refused_before_the_model_loads(flag, value, message,
                                                               monkeypatch):
    import deltaserve.server.cli as cli

    def load(args):
        raise AssertionError("the model was loaded before the sampling flags were checked")

    monkeypatch.setattr(cli, "_make_engine", load)
    with pytest.raises(SystemExit, match=f"deltaserve: error: {re.escape(message)}"):
        main(["generate", flag, value, "hi"])


@pytest.mark.parametrize("prompts,stdin,message", [
    (["hi", ""], b"", "prompt 1 is empty"),
    (["\udcff"], b"", "prompt 0 is not valid UTF-8 (byte b'\\xff' at character 0)"),
    ([], b"def f():\nx\xfe\n", "prompt 1 is not valid UTF-8 (byte b'\\xfe' at character 1)"),
])
def test_an_empty_or_undecodable_prompt_is_refused_before_the_model_loads(
        prompts, stdin, message, monkeypatch):
    """Bytes that are not UTF-8 reach Python as lone surrogates (argv and stdin decode with
    surrogateescape); the tokenizer would fail on them with a TypeError after loading."""
    import io

    import deltaserve.server.cli as cli

    def load(args):
        raise AssertionError("the model was loaded before the prompts were checked")

    monkeypatch.setattr(cli, "_make_engine", load)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    with pytest.raises(SystemExit, match=f"deltaserve: error: {re.escape(message)}"):
        main(["generate", *prompts])


def test_stdin_prompts_are_its_non_blank_lines_without_a_crlf_files_carriage_return():
    from deltaserve.server.cli import stdin_prompts

    data = "a = 1\r\n\r\n  \nb\x0c = 2\nc\r\rd\xe9\n".encode() + b"\xff"
    assert stdin_prompts(data) == ["a = 1", "b\x0c = 2", "c\r\rd\xe9", "\udcff"]


def test_ctrl_c_in_generate_exits_130_without_a_traceback(monkeypatch, capsys):
    import deltaserve.server.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_generate", interrupted)
    assert main(["generate", "hi"]) == 130
    assert capsys.readouterr().err.strip() == "deltaserve: interrupted"


def test_generate_says_when_the_context_length_cuts_max_tokens(tiny_model, capsys):
    code = main(["--log-level", "WARNING", "generate", "--model", str(tiny_model), "--device",
                 "cpu", "--max-model-len", "16", "--max-tokens", "100", "--ignore-eos", "hi"])
    assert code == 0
    err = capsys.readouterr().err
    assert "--max-tokens 100 does not fit the context length 16 for 1 prompt(s)" in err


def test_generate_closes_its_engine_on_success_and_on_error(tiny_model, monkeypatch):
    """A tensor-parallel engine's close() stops its worker processes (left to the interpreter's
    exit they leaked a semaphore, and Python warned about it)."""
    import deltaserve.server.cli as cli

    closed, make = [], cli._make_engine

    def recording(args):
        engine = make(args)
        engine.close = lambda: closed.append(True)
        return engine

    monkeypatch.setattr(cli, "_make_engine", recording)
    base = ["--log-level", "WARNING", "generate", "--model", str(tiny_model), "--device", "cpu"]
    assert main([*base, "--max-tokens", "2", "hi"]) == 0
    with pytest.raises(SystemExit, match="context"):  # a prompt over the context length
        main([*base, "--max-model-len", "16", "x " * 40])
    assert closed == [True, True]


def test_generate_prints_a_completion(tiny_model, capsys):
    code = main(["--log-level", "WARNING", "generate", "--model", str(tiny_model), "--device",
                 "cpu", "--max-tokens", "4", "--ignore-eos", "Hello there"])
    assert code == 0
    assert capsys.readouterr().out.strip()


def test_a_context_longer_than_the_model_was_built_for_is_refused(tiny_model):
    # found once config.json is read, not by EngineConfig.validate: named as the flag too
    with pytest.raises(SystemExit, match="deltaserve: error: --max-model-len 10000000 exceeds"):
        main(["generate", "--model", str(tiny_model), "--device", "cpu", "--max-model-len",
              "10000000", "hi"])


def test_generate_with_chat_prints_one_answer_per_prompt(tiny_model, capsys):
    code = main(["--log-level", "WARNING", "generate", "--model", str(tiny_model), "--device",
                 "cpu", "--max-tokens", "3", "--ignore-eos", "--chat", "Hi", "Bye"])
    assert code == 0
    out = capsys.readouterr().out
    assert "=== [0] Hi" in out and "=== [1] Bye" in out


@pytest.mark.slow
def test_generate_without_model_uses_the_embedded_default_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DELTASERVE_CACHE", str(tmp_path))  # the random stand-in is built here
    code = main(["--log-level", "WARNING", "generate", "--device", "cpu", "--max-tokens", "3",
                 "--ignore-eos", "Hello"])
    assert code == 0
    assert capsys.readouterr().out.strip()


@pytest.mark.slow
def test_serve_answers_on_a_free_port_and_stops_on_sigint(tiny_model):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "deltaserve.server.cli", "serve", "--port", "0", "--model",
         str(tiny_model), "--device", "cpu", "--max-model-len", "256", "--num-pages", "64"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        deadline, port = time.monotonic() + 60, None
        while port is None:
            assert time.monotonic() < deadline and proc.poll() is None, "server did not start"
            match = re.search(r"running on http://127\.0\.0\.1:(\d+)", proc.stderr.readline())
            port = match and int(match.group(1))
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(base + "/health").json() == {"status": "ok"}
        r = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 200, r.text
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0


@pytest.mark.slow
def test_a_sigterm_mid_generation_ends_a_tensor_parallel_run_quietly():
    """SIGTERM to rank 0 of a 2-rank `generate` breaks the step's collective on rank 1: the
    run ends by that signal (143 in a shell) without rank 1's traceback (~55 lines before)
    and without Python's leaked-semaphore warning (tqdm's lock in the worker). The embedded
    model prefilling a long prompt in 64-token chunks, so that the signal often lands inside a
    forward (without the fix this failed in 1 of 2-3 runs: the timing decides)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "deltaserve.server.entry", "--log-level", "INFO", "generate",
         "--device", "cpu", "--tensor-parallel-size", "2",
         "--max-tokens", "8", "--chunk-size", "64", "--log-every", "1", "Hi " * 2000],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    lines = []
    try:
        deadline = time.monotonic() + 120
        while sum(" prefill batch" in line for line in lines) < 3:
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            lines.append(proc.stderr.readline())
    finally:
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=60)[1]
    assert proc.returncode == -signal.SIGTERM
    assert "Traceback" not in rest and "leaked semaphore" not in rest, rest


@pytest.mark.parametrize("flag,value", [
    ("--max-num-batched-tokens", "0"), ("--num-pages", "0"), ("--num-pages", "1"),
    ("--num-pages", "-5"), ("--kv-memory-gb", "0"), ("--kv-memory-gb", "-1"),
    ("--max-model-len", "0"), ("--log-every", "-1"), ("--device", "tpu")])
def test_flags_that_would_make_a_useless_engine_are_refused_at_startup(flag, value):
    with pytest.raises(ValueError, match=f"^{flag} must"):
        parse(flag, value)
    with pytest.raises(SystemExit, match=f"deltaserve: error: {flag}"):  # one line, no trace
        main(["generate", flag, value, "hi"])


@pytest.mark.parametrize("flag, healing", [([], True), (["--no-token-healing"], False)])
def test_generate_heals_the_prompts_last_token_unless_told_not_to(tiny_model, capsys, flag,
                                                                   healing):
    from deltaserve import LLM, SamplingParams

    prompt = "def f(x):\n"
    code = main(["--log-level", "WARNING", "generate", "--model", str(tiny_model), "--device",
                 "cpu", "--max-tokens", "6", "--ignore-eos", *flag, prompt])
    assert code == 0
    llm = LLM(str(tiny_model), device="cpu")
    healed, plain = (llm.generate(prompt, SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, token_healing=h))[0].text
        for h in (True, False))
    assert healed != plain  # the trailing "\n" is backed up on this tokenizer
    assert capsys.readouterr().out == (healed if healing else plain) + "\n"


@pytest.mark.parametrize("algo", [None, "ngram"])
def test_disabling_mtp_cuda_graphs_without_the_mtp_proposer_is_an_error(algo):
    args = ("--disable-mtp-cuda-graphs",) + (("--speculative-algorithm", algo) if algo else ())
    with pytest.raises(ValueError, match="--disable-mtp-cuda-graphs needs --speculative-algo"):
        parse(*args)
    assert not parse("--disable-mtp-cuda-graphs", "--speculative-algorithm",
                     "mtp").mtp_cuda_graphs
    assert parse("--speculative-algorithm", "mtp").mtp_cuda_graphs


@pytest.mark.parametrize("algo", [None, "ngram"])
def test_overlap_verify_without_the_mtp_proposer_is_an_error(algo):
    args = ("--overlap-verify",) + (("--speculative-algorithm", algo) if algo else ())
    with pytest.raises(ValueError, match="--overlap-verify needs --speculative-algorithm mtp"):
        parse(*args)
    assert parse("--overlap-verify", "--speculative-algorithm", "mtp").overlap_verify
    assert not parse("--speculative-algorithm", "mtp").overlap_verify


@pytest.mark.parametrize("config", ['{"model_type": "qwen3_5_text"}', "[1, 2]", "{x"])
def test_a_broken_checkpoint_is_a_one_line_error(tmp_path, config):
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(SystemExit, match=r"deltaserve: error: .*config\.json"):  # no traceback
        main(["generate", "--model", str(tmp_path), "hi"])


@pytest.mark.parametrize("flag, value", [("--speculative-algorithm", "eagle"),
                                         ("--speculative-policy", "sometimes")])
def test_closed_choice_flags_list_their_values_and_refuse_others_before_loading(flag, value,
                                                                                 capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", flag, value, "hi"])
    assert e.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    shown = capsys.readouterr().out
    assert "{mtp,ngram}" in shown and "{fixed,adaptive}" in shown


@pytest.mark.parametrize("argv,message", [
    (["generate", "x", "--max-token", "4"], "unrecognized arguments: --max-token"),
    (["serve", "--max-running", "4"], "unrecognized arguments: --max-running"),
    (["--log", "INFO", "serve"], "invalid choice: 'INFO'")])  # "--log" is not --log-level
def test_a_shortened_flag_is_a_usage_error_not_the_flag_it_starts(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_an_unknown_flag_shows_its_commands_usage(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "x", "--bogus-flag"] if command == "generate" else [command, "--bogus"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert f"usage: deltaserve {command}" in err and "unrecognized arguments: --bogus" in err
