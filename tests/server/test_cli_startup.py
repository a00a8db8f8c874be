"""The `deltaserve` command's exit statuses (0 done, 1 an error in one line, 2 a usage error
with the usage line, 130 interrupted), and the pool flags it refuses before the engine and
the weights load."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import textwrap

import pytest

from deltaserve.server.cli import build_parser, main
from deltaserve.server.cli_exit import interrupt_held


@pytest.fixture
def no_engine(monkeypatch):
    """Fail the test if the engine is built (its modules and the weights loaded)."""
    import deltaserve.distributed as distributed

    def create_engine(cfg):
        raise AssertionError("the engine was built before the flags were checked")

    monkeypatch.setattr(distributed, "create_engine", create_engine)


def test_no_prompt_is_a_usage_error_with_the_usage_line_and_status_2(monkeypatch, capsys,
                                                                     no_engine):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"\n  \r\n")))
    with pytest.raises(SystemExit) as e:
        main(["generate", "--device", "cpu"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: deltaserve generate")
    assert err.rstrip().endswith("deltaserve generate: error: no prompts given: pass PROMPT "
                                 "arguments or one prompt per line on standard input")


def test_a_model_without_a_tokenizer_is_an_error_with_status_1(tmp_path):
    from deltaserve.model.testing import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "m", "qwen3_5_text", seed=0)
    with pytest.raises(SystemExit) as e:
        main(["--log-level", "WARNING", "generate", "--model", str(path), "--device", "cpu",
              "hi"])
    assert e.value.code == ("deltaserve: error: the model has no tokenizer (tokenizer.json or "
                            "tokenizer_config.json in the checkpoint folder)")  # status 1


def test_every_help_names_the_exit_statuses(capsys):
    for argv in ([], ["generate"], ["serve"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*argv, "--help"])
        help_text = " ".join(capsys.readouterr().out.split())
        assert "exit status: 0 done; 1 an error" in help_text
        assert "2 a usage error, with the usage line" in help_text


@pytest.mark.parametrize("argv, says", [
    (["--num-pages", "100000000000"], "the caches do not fit in memory: they alone need"),
    (["--max-running-reqs", "1000000000"], "1 + 2 x --max-running-reqs 1000000000"),
    (["--host-snapshot-slots", "10000000000"], "10000000000 host snapshot slots"),
    (["--page-size", "100000000000"], "2 KV pages of 100000000000 tokens"),
    (["--num-pages", "2", "--page-size", "1"],
     "--num-pages: the KV page pool cannot hold even a 2-token request (1 tokens fit)"),
    (["--max-model-len", "10000000"], "--max-model-len 10000000 exceeds the model's"),
])
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_absurd_pool_flags_are_one_line_errors_before_the_engine_loads(tiny_model, command,
                                                                      argv, says, no_engine):
    prompt = ["hi"] if command == "generate" else ["--port", "0"]
    with pytest.raises(SystemExit) as e:
        main([command, "--model", str(tiny_model), "--device", "cpu", *argv, *prompt])
    message = str(e.value.code)
    assert message.startswith("deltaserve: error: ") and "\n" not in message
    assert says in message


def test_the_command_exits_1_with_the_one_line_error_and_loads_no_weight(tiny_model):
    """As a user runs it: the loader's INFO line ("merged projections") never comes."""
    done = subprocess.run([sys.executable, "-m", "deltaserve.server.cli", "generate", "--model",
                           str(tiny_model), "--device", "cpu", "--num-pages", "100000000000",
                           "hi"], capture_output=True, text=True)
    assert done.returncode == 1
    lines = [line for line in done.stderr.splitlines() if "deltaserve" in line]
    assert lines[-1].startswith("deltaserve: error: the caches do not fit in memory")
    assert "merged projections" not in done.stderr


def test_version_prints_the_installed_package_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"deltaserve {version('deltaserve')}\n"


def test_a_held_ctrl_c_is_raised_when_the_block_ends_and_a_second_one_at_once():
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT has another handler here")
    ran = []
    with pytest.raises(KeyboardInterrupt):
        with interrupt_held():
            signal.raise_signal(signal.SIGINT)
            ran.append("after the first")
    assert ran == ["after the first"]
    with pytest.raises(KeyboardInterrupt):
        with interrupt_held():
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
            ran.append("after the second")
    assert ran == ["after the first"]
    with interrupt_held():
        ran.append("no Ctrl-C")
    assert ran[-1] == "no Ctrl-C"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


# Sends Ctrl-C to itself when `module` is first imported, then runs the command. SIGINT starts
# at Python's default handler, as in a terminal: a pytest started in the background by a shell
# without job control passes SIGINT on ignored, and the command then rightly ignores Ctrl-C.
_INTERRUPTED_AT = textwrap.dedent("""
    import signal, sys

    signal.signal(signal.SIGINT, signal.default_int_handler)

    class CtrlCAt:
        def find_spec(self, name, path=None, target=None):
            if name == sys.argv[1]:
                sys.meta_path.remove(self)
                signal.raise_signal(signal.SIGINT)

    sys.meta_path.insert(0, CtrlCAt())
    from deltaserve.server.entry import main  # the console script's entry
    sys.exit(main(sys.argv[2:]))
""")


@pytest.mark.parametrize("module", [
    "fastapi",  # imported with the CLI's own modules: a traceback
    "numpy",  # imported by torch's C extension as it loads, which dropped the interrupt
    "torch._meta_registrations",  # torch's exit hooks printed FakeTensor INFO lines
])
@pytest.mark.parametrize("command", [["serve", "--port", "0"], ["generate", "hi"]])
def test_ctrl_c_inside_an_import_at_start_up_exits_130_with_only_the_short_message(
        tmp_path, module, command):
    script = tmp_path / "interrupted.py"
    script.write_text(_INTERRUPTED_AT)
    done = subprocess.run([sys.executable, str(script), module, *command, "--device", "cpu"],
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (130, "", "\ndeltaserve: interrupted\n")


def test_generate_stops_quietly_when_its_reader_leaves_and_names_a_failed_write():
    """`generate ... | head`: exit 141 (a process killed by SIGPIPE), no traceback; stdout on a
    full disk: one error line, exit 1."""
    cmd = [sys.executable, "-m", "deltaserve.server.entry", "generate", "def f():",
           "--max-tokens", "64", "--ignore-eos", "--device", "cpu"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.read(1)  # the first streamed text, then the reader leaves
    proc.stdout.close()
    assert proc.wait(timeout=120) == 141
    err = proc.stderr.read().decode()  # the loading log lines, then nothing
    assert "Traceback" not in err and "Error" not in err
    with open("/dev/full", "w") as full:
        done = subprocess.run(cmd, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.endswith(
        "\ndeltaserve: error: cannot write the output: [Errno 28] No space left on device\n")
