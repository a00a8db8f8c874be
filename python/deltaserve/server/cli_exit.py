"""How the `deltaserve` command meets the process around it: Ctrl-C (interrupted, and held while
torch imports: interrupt_held, import_torch), and a stdout that fails under `generate`
(OutputError, output_failed). Standard library only: the console script's entry imports it
before the CLI's own modules."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator


def interrupted() -> int:
    """Say that Ctrl-C ended the command, in one line on stderr; its exit status (130)."""
    print("\ndeltaserve: interrupted", file=sys.stderr)
    return 130


@contextlib.contextmanager
def interrupt_held() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) while the body runs: the first one is raised as KeyboardInterrupt
    when the body ends, a second one at once (as without this). Does nothing outside the main
    thread or when SIGINT has a handler other than Python's default (ignored: nohup)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    held = []

    def hold(signum: int, frame) -> None:
        held.append(signum)
        signal.signal(signal.SIGINT, signal.default_int_handler)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if held:
        raise KeyboardInterrupt


def import_torch() -> None:
    """Import torch with Ctrl-C held (interrupt_held): call it before any module that imports
    torch. An interrupt inside torch's import is not safe. Inside the numpy import that torch's
    C extension runs as it loads, torch drops the KeyboardInterrupt: the import succeeds and
    start-up goes on to serve. Later, after torch's modules registered their exit hooks but
    before torch set its loggers' levels, the hooks print INFO lines (FakeTensor cache stats)
    through the root logger as the process exits."""
    with interrupt_held():
        import torch  # noqa: F401


class OutputError(Exception):
    """Writing generate's output to stdout failed (its reader left, a full disk); wraps the
    OSError."""


def output_failed(e: OutputError) -> int:
    """generate's exit status when stdout failed: a reader that left (`| head`) ends it
    quietly with the status of a process killed by SIGPIPE (141), any other write error in one
    line (1). Later writes (the interpreter's final flush) go to /dev/null."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout without a file descriptor (tests' capture)
        pass
    if isinstance(e.__cause__, BrokenPipeError):
        return 141
    print(f"deltaserve: error: cannot write the output: {e.__cause__}", file=sys.stderr)
    return 1
