"""AsyncEngine: the synchronous LLMEngine behind one background thread, for asyncio callers.

Threading model: the *loop thread* is the only thread that ever touches the engine. Callers on
the asyncio side enqueue commands (add a request, abort one, call a function such as
`cache_status`) under `_cond`; the loop thread drains them between steps, runs `engine.step()`
while there is work, and hands every RequestOutput to its request's asyncio queue with
`loop.call_soon_threadsafe`. With no commands and no unfinished requests it sleeps on `_cond`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from deltaserve.core import SamplingParams
    from deltaserve.engine.grammar import GrammarSpec
    from deltaserve.engine.llm_engine import LLMEngine, RequestOutput

logger = logging.getLogger(__name__)
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine was shut down (or failed) before the request finished."""


@dataclass(eq=False)
class RequestStream:
    """The asyncio side of one request: iterate it for RequestOutputs, `abort()` to drop it.

    Iteration ends after the output with `finished=True`, or early once aborted. An engine
    failure is raised from the iteration. Leaving the iteration early (break, cancellation,
    garbage collection of the iterator) aborts the request in the engine.
    """

    rid: int
    owner: AsyncEngine
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    finished: bool = False
    aborted: bool = False

    def abort(self) -> None:
        """Drop the request: the engine frees its pages and slots; iteration stops. Idempotent."""
        if self.finished or self.aborted:
            return
        self.aborted = True
        self.owner.abort(self.rid)
        self.queue.put_nowait(None)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                item = await self.queue.get()
                if item is None:  # aborted
                    return
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                self.finished = item.finished
                yield item
        finally:
            self.abort()


class AsyncEngine:
    """Runs `engine` on a background thread; see the module docstring for the threading model.

    `engine` must offer the LLMEngine interface (add_request, step, abort, has_unfinished, ...).
    `model_name` overrides the name the API serves the model under (default: the engine's).
    The thread starts in the constructor; call `shutdown()` to stop it.
    """

    def __init__(self, engine: LLMEngine, model_name: str | None = None) -> None:
        self.engine = engine
        # The tokenizer is shared: the asyncio side only encodes, the loop thread only decodes;
        # neither reconfigures it (truncation/padding), so the Rust tokenizer is never borrowed
        # mutably.
        self.tokenizer = engine.tokenizer
        self.model_name: str = model_name or engine.model_name
        self.max_model_len: int = engine.max_model_len
        self.max_request_len: int = engine.max_request_len  # pool-bounded (fixed after start)
        self._cond = threading.Condition()
        # (command, future for its result or None): guarded by _cond
        self._commands: list[tuple[Callable[[], Any], concurrent.futures.Future | None]] = []
        self._streams: dict[int, RequestStream] = {}  # guarded by _cond
        self._stopping = False  # guarded by _cond
        self.failure: str | None = None  # why the loop stopped on its own (set once)
        self._rids = itertools.count(1)
        self._grammar_lock = threading.Lock()
        self._compile_slot: asyncio.Semaphore | None = None  # made on the loop: one compile
        self._thread = threading.Thread(target=self._run, name="deltaserve-engine", daemon=True)
        self._thread.start()

    # -- asyncio side ----------------------------------------------------------------------

    async def add(self, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
        """Add a request; returns its stream once the engine accepted it.

        Raises ValueError (the engine's message) for a prompt over the context limit or bad
        parameters, EngineDeadError after shutdown.
        """
        loop = asyncio.get_running_loop()
        stream = RequestStream(next(self._rids), self, loop)

        def add() -> None:
            self.engine.add_request(list(prompt_ids), params, rid=stream.rid)
            with self._cond:
                self._streams[stream.rid] = stream

        await self._submit(add)
        return stream

    async def add_forks(self, prompt_ids: list[int],
                        params: list[SamplingParams]) -> list[RequestStream]:
        """Add len(params) choices of one prompt, prefilled once (LLMEngine.add_forks); returns
        their streams in order once the engine accepted all of them. Raises as `add`; on an
        error none of them was queued."""
        loop = asyncio.get_running_loop()
        streams = [RequestStream(next(self._rids), self, loop) for _ in params]

        def add() -> None:
            self.engine.add_forks(list(prompt_ids), list(params), [s.rid for s in streams])
            with self._cond:
                self._streams.update({s.rid: s for s in streams})

        await self._submit(add)
        return streams

    async def prepare_grammar(self, spec: GrammarSpec) -> GrammarSpec:
        """`spec` with its grammar compiled (GrammarSpec.compiled), compiled off the loop
        thread and the engine thread, one grammar at a time (a compile cannot be interrupted:
        hostile schemas queue behind each other on one core instead of taking them all; a
        request cancelled while it waits compiles nothing). The first call also builds the
        backend, which reads the whole vocabulary. Raises ValueError for a grammar that is
        refused or cannot be compiled (GrammarBackend.compile)."""
        if self._compile_slot is None:
            self._compile_slot = asyncio.Semaphore(1)

        def compile_once():
            with self._grammar_lock:  # one thread builds the backend
                backend = self.engine.grammar
            return backend.compile(spec)

        async with self._compile_slot:
            compiled = await asyncio.to_thread(compile_once)
        return replace(spec, compiled=compiled)

    async def generate(self, prompt_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes; aborts it if the caller stops early."""
        stream = await self.add(prompt_ids, params)
        async for out in stream:
            yield out

    def abort(self, rid: int) -> None:
        """Abort request `rid` if it is still running (non-blocking; safe from any thread)."""

        def abort() -> None:
            with self._cond:
                live = self._streams.pop(rid, None) is not None
            if live:
                self.engine.abort(rid)
                logger.info("request %d aborted", rid)

        self._enqueue(abort, None)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the loop thread between steps and return its result."""
        return await self._submit(lambda: fn(self.engine))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop thread; requests still in flight fail with EngineDeadError."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("engine thread did not stop within %.0f s", timeout)

    @property
    def alive(self) -> bool:
        """True while the loop thread runs and accepts requests, and the engine can serve
        (a tensor-parallel engine whose rank died cannot, even while idle)."""
        with self._cond:
            running = self._thread.is_alive() and not self._stopping
            if running and self.engine.failure is not None and self.failure is None:
                self.failure = f"the engine cannot serve: {self.engine.failure}"
            return running and self.engine.failure is None

    @property
    def num_inflight(self) -> int:
        with self._cond:
            return len(self._streams)

    async def _submit(self, fn: Callable[[], T]) -> T:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._enqueue(fn, future)
        return await asyncio.wrap_future(future)

    def _enqueue(self, fn: Callable[[], Any], future: concurrent.futures.Future | None) -> None:
        with self._cond:
            if self._stopping:
                if future is not None:
                    future.set_exception(EngineDeadError("the engine is shut down"))
                return
            self._commands.append((fn, future))
            self._cond.notify()

    @staticmethod
    def _execute(fn: Callable[[], Any], future: concurrent.futures.Future | None) -> None:
        """Run one command on the loop thread; its error goes to the caller, never up."""
        if future is not None and not future.set_running_or_notify_cancel():
            return  # the caller gave up (cancelled) before the command ran
        try:
            result = fn()
        except BaseException as e:
            if future is None:
                logger.exception("engine command failed")
            else:
                future.set_exception(e)
        else:
            if future is not None:
                future.set_result(result)

    # -- loop thread -----------------------------------------------------------------------

    def _run(self) -> None:
        busy = False
        while True:
            with self._cond:
                while not (self._commands or self._stopping or busy):
                    self._cond.wait()
                if self._stopping:
                    break
                commands, self._commands = self._commands, []
            for fn, future in commands:
                self._execute(fn, future)
            try:
                busy = self.engine.has_unfinished()
                if busy:
                    self._dispatch(self.engine.step())
                    busy = self.engine.has_unfinished()
            except Exception as e:
                logger.exception("engine step failed; failing the requests in flight")
                self._fail_all(e)
                busy = False
                if not self._still_sound(e):
                    break
        self._close()

    def _still_sound(self, error: BaseException) -> bool:
        """After a failed step and the abort of everything in flight: whether the engine's
        caches and pools are still consistent (then it keeps serving). If not, it must not
        serve another token: the loop stops, `alive` turns False and /health says why."""
        try:
            self.engine.check_integrity()
            return True
        except Exception as bad:
            self.failure = f"engine step failed ({error}) and left the cache inconsistent: {bad}"
            logger.error("%s; the engine stops", self.failure)
            with self._cond:
                self._stopping = True
            return False

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        with self._cond:
            for out in outputs:
                stream = self._streams.get(out.rid)
                if stream is None:  # aborted meanwhile
                    continue
                if out.finished:
                    del self._streams[out.rid]
                self._deliver(stream, out)

    def _deliver(self, stream: RequestStream, item: Any) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening
            pass

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            streams, self._streams = self._streams, {}
        for stream in streams.values():
            self._deliver(stream, error)
            try:
                self.engine.abort(stream.rid)
            except Exception:
                logger.exception("abort of request %d failed", stream.rid)

    def _close(self) -> None:
        """After the loop: refuse pending commands, fail and abort the requests in flight."""
        with self._cond:
            commands, self._commands = self._commands, []
        for _, future in commands:
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(EngineDeadError("the engine was shut down"))
        self._fail_all(EngineDeadError("the engine was shut down"))
        # tensor parallel: stop the worker processes here, on the engine's thread; left to the
        # interpreter's exit, their ends read as a failure ("a tensor-parallel rank exited")
        close = getattr(self.engine, "close", None)
        if close is not None:
            try:
                close()
            except Exception:
                logger.exception("stopping the tensor-parallel workers failed")
        logger.info("engine thread stopped")
