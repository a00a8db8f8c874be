"""Worker processes of a tensor-parallel engine and the control channel to them.

Control plane: one duplex pipe per worker (pickled messages, in order); data plane: the
process group's collectives inside the model forward (distributed/group.py). Rank 0 sends
every engine call that changes state (request added, aborted, cache flushed, step) as it
happens, and inside a step what only rank 0 decides (drafts, sampled tokens, accepted tokens,
the speculation policy's step time), so every rank's scheduler, caches and pools execute the
same commands in the same order (SGLang's TP scheduler runs the same way on every rank).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from deltaserve.config import EngineConfig

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from deltaserve.core import SamplingParams
    from deltaserve.distributed.engine import TPEngine

logger = logging.getLogger("deltaserve.distributed")
T = TypeVar("T")
# How long a failed pipe or collective waits for a worker's exit to show: a killed process
# closes its sockets one by one, so the peer's error can come before the exit is visible,
# and the exit is what names the rank to blame.
DEATH_GRACE_S = 2.0


class RankFailure(RuntimeError):
    """A tensor-parallel rank died, timed out or failed a step: the engine cannot go on."""


# ---- messages rank 0 -> workers -----------------------------------------------------------
@dataclass
class AddRequest:
    prompt_ids: list[int]
    params: SamplingParams
    rid: int

    def apply(self, engine: TPEngine) -> None:
        engine.add_request(self.prompt_ids, self.params, self.rid)


@dataclass
class AddForks:
    prompt_ids: list[int]
    params: list[SamplingParams]
    rids: list[int]

    def apply(self, engine: TPEngine) -> None:
        engine.add_forks(self.prompt_ids, self.params, self.rids)


@dataclass
class Abort:
    rid: int

    def apply(self, engine: TPEngine) -> None:
        engine.abort(self.rid)


@dataclass
class Flush:
    def apply(self, engine: TPEngine) -> None:
        engine.flush_cache()


@dataclass
class Step:
    def apply(self, engine: TPEngine) -> None:
        engine.step()


@dataclass
class Check:
    """Run check_integrity on the worker; it answers with a PoolReport."""

    def apply(self, engine: TPEngine) -> None:
        engine.link.reply(engine.pool_report())


@dataclass
class Stop:
    def apply(self, engine: TPEngine) -> None:
        raise AssertionError("Stop is handled by the worker loop")


@dataclass
class Decision:
    """Inside a step: what rank 0 decided (drafts, tokens, accepted tokens, step seconds)."""

    kind: str
    value: Any


# ---- messages workers -> rank 0 -----------------------------------------------------------
@dataclass
class Ready:
    rank: int


@dataclass
class Failed:
    rank: int
    error: str


@dataclass
class PoolReport:
    """One rank's pool counters and check_integrity result (error: None when it passed)."""

    rank: int
    pages_allocated: int
    slots_allocated: int
    host_slots_allocated: int
    error: str | None


class WorkerLink:
    """A worker's end of its pipe to rank 0. Waiting for the next command has no time limit
    (an idle server sends none), but rank 0 going away ends it (EOFError: the worker exits);
    waiting for a decision inside a step is bounded by timeout_s."""

    def __init__(self, conn: Connection, timeout_s: float) -> None:
        self.conn, self.timeout_s = conn, timeout_s

    def next_command(self):
        return self.conn.recv()

    def expect(self, kind: str) -> Any:
        if not self.conn.poll(self.timeout_s):
            raise RankFailure(f"rank 0 sent no {kind} within {self.timeout_s:.0f} s")
        msg = self.conn.recv()
        if not isinstance(msg, Decision) or msg.kind != kind:
            raise RankFailure(f"expected rank 0's {kind}, got {msg!r}: the ranks are out of step")
        return msg.value

    def reply(self, msg) -> None:
        self.conn.send(msg)


class Workers:
    """Rank 0's handles on ranks 1..size-1: processes it spawned and their pipes."""

    def __init__(self, cfg: EngineConfig, size: int, port: int, timeout_s: float) -> None:
        ctx = multiprocessing.get_context("spawn")  # fork would copy rank 0's threads/CUDA
        self.timeout_s, self.stopped = timeout_s, False
        # dead() runs on the watchdog thread and the engine's: two concurrent reaps of one
        # exit (waitpid) leave the loser with ECHILD and no exit code, so one at a time
        self.reap_lock = threading.Lock()
        self.procs, self.conns = [], []
        for rank in range(1, size):
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=worker_main, args=(cfg, rank, size, port, child,
                                                         timeout_s),
                               name=f"deltaserve-tp{rank}", daemon=True)
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)

    def watch(self, on_exit: Callable[[str], None]) -> None:
        """Call on_exit(why) from a daemon thread when a worker exits before stop()."""
        def run() -> None:
            multiprocessing.connection.wait([p.sentinel for p in self.procs])
            if not self.stopped:
                on_exit(self.dead() or "a tensor-parallel rank exited")

        threading.Thread(target=run, name="deltaserve-tp-watchdog", daemon=True).start()

    def dead(self, grace_s: float = 0.0) -> str | None:
        """Why a worker is gone (`rank 2 (pid 123) exited with code -9`), or None after
        waiting up to `grace_s` seconds for one to go."""
        with self.reap_lock:
            gone = multiprocessing.connection.wait([p.sentinel for p in self.procs],
                                                   timeout=grace_s)
            for rank, proc in enumerate(self.procs, start=1):
                if proc.sentinel in gone:
                    proc.join(1.0)  # reap it: exitcode is None until then
                if proc.exitcode is not None:
                    return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code " \
                           f"{proc.exitcode}"
            return None

    def rendezvous(self, make: Callable[[], T]) -> T:
        """make() (the process group's construction, which waits for every rank) run while
        watching the workers: RankFailure as soon as one exits (it failed to start, and says
        why on its stderr) instead of at the timeout."""
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = make()
            except BaseException as e:
                box["error"] = e

        thread = threading.Thread(target=run, name="deltaserve-tp-rendezvous", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            dead = self.dead()
            if dead is not None and thread.is_alive():
                raise RankFailure(f"{dead} before joining the process group")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def send(self, msg) -> None:
        """To every worker, in order. Raises RankFailure when a pipe is broken."""
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send(msg)
            except OSError as e:  # BrokenPipeError, ConnectionResetError
                raise RankFailure(self.dead(DEATH_GRACE_S)
                                  or f"tensor-parallel rank {rank}: {e}") from e

    def collect(self, kind: type) -> list:
        """One reply of type `kind` from each worker, within timeout_s each. Raises
        RankFailure naming the rank that failed, died or said nothing."""
        out = []
        for rank, conn in enumerate(self.conns, start=1):
            try:
                ready = conn.poll(self.timeout_s)
                msg = conn.recv() if ready else None
            except (EOFError, OSError):
                msg = None
            if isinstance(msg, Failed):
                raise RankFailure(f"tensor-parallel rank {msg.rank} failed: {msg.error}")
            if not isinstance(msg, kind):
                raise RankFailure(self.dead(DEATH_GRACE_S) or f"tensor-parallel rank {rank} "
                                  f"gave no {kind.__name__} within {self.timeout_s:.0f} s")
            out.append(msg)
        return out

    def stop(self, graceful: bool) -> None:
        """Stop the workers (Stop message first when graceful), then terminate what is left."""
        self.stopped = True
        if graceful:
            for conn in self.conns:
                try:
                    conn.send(Stop())
                except OSError:
                    pass
        with self.reap_lock:
            for proc in self.procs:
                proc.join(2.0 if graceful else 0.0)
                if proc.is_alive():
                    proc.terminate()
                    proc.join(2.0)
                if proc.is_alive():
                    proc.kill()
                    proc.join(1.0)
        for conn in self.conns:
            conn.close()


def worker_main(cfg: EngineConfig, rank: int, size: int, port: int, conn: Connection,
                timeout_s: float) -> None:
    """A worker process: build this rank's engine, then run rank 0's commands until Stop or
    until rank 0 is gone. Any failure ends the process (its peers' collectives then fail fast
    instead of waiting for the timeout)."""
    from deltaserve.distributed.engine import TPEngine

    logging.basicConfig(level=logging.WARNING)
    # tqdm's default lock is a multiprocessing semaphore, which a worker that is stopped hard
    # (os._exit, a signal) leaves behind: Python's resource_tracker then warns at exit
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    # the ranks share the host's cores
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    link = WorkerLink(conn, timeout_s)
    try:
        engine = TPEngine(cfg, rank=rank, port=port, link=link)
    except BaseException:
        conn.send(Failed(rank, traceback.format_exc(limit=8)))
        return
    conn.send(Ready(rank))
    while True:
        try:
            msg = link.next_command()
        except (EOFError, OSError):
            return  # rank 0 is gone
        if isinstance(msg, Stop):
            return
        try:
            msg.apply(engine)
        except BaseException:
            if not _rank0_gone():  # else its exit broke the collective: nothing to report
                logger.error("tensor-parallel rank %d: %s failed, exiting:\n%s", rank,
                             type(msg).__name__, traceback.format_exc())
            os._exit(1)


def _rank0_gone(wait_s: float = 1.0) -> bool:
    """Whether rank 0 (this worker's parent) has exited, waiting up to `wait_s` for it: a
    signal that ends rank 0 mid-step breaks the step's collective here a moment before the
    parent's exit is visible."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return False
    parent.join(wait_s)
    return not parent.is_alive()
