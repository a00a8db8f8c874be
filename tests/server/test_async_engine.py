"""AsyncEngine: the loop thread idles without spinning, aborts free requests, errors surface,
shutdown stops the thread and fails what is in flight; streams are the same with overlap
scheduling."""

from __future__ import annotations

import asyncio
import time

import pytest
from live_server import MAX_MODEL_LEN, make_engine

from deltaserve.core import SamplingParams
from deltaserve.engine.cuda_graph import GraphRunner
from deltaserve.server.async_engine import AsyncEngine, EngineDeadError
from drained import assert_drained


class CountingEngine:
    """Counts the loop thread's calls into the engine."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.calls = 0

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def step(self):
        self.calls += 1
        return self._engine.step()

    def has_unfinished(self):
        self.calls += 1
        return self._engine.has_unfinished()


@pytest.fixture(scope="module")
def counting(tiny_model):
    engine = CountingEngine(make_engine(tiny_model))
    async_engine = AsyncEngine(engine)
    yield engine, async_engine
    async_engine.shutdown()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def prompt(engine) -> list[int]:
    return engine.tokenizer.encode("The loop thread")


def test_generate_yields_until_finished_then_the_thread_sleeps(counting):
    engine, async_engine = counting

    async def run():
        return [out async for out in async_engine.generate(prompt(engine), greedy(4))]

    outs = asyncio.run(run())
    assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == 4
    time.sleep(0.05)
    idle_calls = engine.calls
    time.sleep(0.3)
    assert engine.calls == idle_calls, "the loop thread polls the engine while idle"


def test_leaving_the_iteration_early_aborts_the_request(counting):
    engine, async_engine = counting

    async def run():
        async for out in async_engine.generate(prompt(engine), greedy(MAX_MODEL_LEN - 32)):
            assert not out.finished
            break
        for _ in range(200):
            if await async_engine.call(lambda e: not e.has_unfinished()):
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(run()), "the abandoned request is still in the engine"
    assert async_engine.num_inflight == 0


def test_add_request_errors_surface_as_value_error(counting):
    engine, async_engine = counting

    async def run():
        await async_engine.add([1] * MAX_MODEL_LEN, greedy(1))

    with pytest.raises(ValueError, match="context"):
        asyncio.run(run())
    assert async_engine.num_inflight == 0


def test_shutdown_fails_requests_in_flight_and_refuses_new_ones(tiny_model):
    engine = make_engine(tiny_model)
    async_engine = AsyncEngine(engine)

    async def run():
        stream = await async_engine.add(prompt(engine), greedy(MAX_MODEL_LEN - 32))
        got = []
        with pytest.raises(EngineDeadError):
            async for out in stream:
                got.append(out)
                if len(got) == 2:
                    await asyncio.to_thread(async_engine.shutdown)
        with pytest.raises(EngineDeadError):
            await async_engine.add(prompt(engine), greedy(1))

    asyncio.run(run())
    assert not async_engine.alive
    assert not engine.has_unfinished()


class ClosingEngine(CountingEngine):
    """An engine with close() (as a tensor-parallel engine has: it stops the workers)."""

    closed_on: list[str]

    def close(self) -> None:
        import threading

        self.closed_on.append(threading.current_thread().name)


def test_shutdown_closes_an_engine_that_has_close_on_the_loop_thread(tiny_model):
    """A tensor-parallel engine's workers stop with the server, not at the interpreter's exit
    (where their ends were logged as a failed rank)."""
    engine = ClosingEngine(make_engine(tiny_model))
    engine.closed_on = []
    async_engine = AsyncEngine(engine)
    loop_thread = async_engine._thread.name
    async_engine.shutdown()
    assert engine.closed_on == [loop_thread]


class LeakingEngine:
    """The real engine, whose next step leaks one KV page and then raises (a step that fails
    half-way through its bookkeeping), or only raises (leak=False)."""

    def __init__(self, engine, leak: bool) -> None:
        self._engine, self.leak, self.armed = engine, leak, True

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def step(self):
        if self.armed:
            self.armed = False
            if self.leak:
                self._engine.page_pool.allocate(1)
            raise RuntimeError("injected step failure")
        return self._engine.step()


@pytest.mark.parametrize("leak", [False, True])
def test_a_failed_step_stops_the_engine_only_when_it_left_the_cache_inconsistent(
        tiny_model, leak):
    engine = LeakingEngine(make_engine(tiny_model), leak)
    async_engine = AsyncEngine(engine)

    async def run():
        with pytest.raises(RuntimeError, match="injected"):
            async for _ in async_engine.generate(prompt(engine), greedy(4)):
                pass
        if leak:
            with pytest.raises(EngineDeadError):
                await async_engine.add(prompt(engine), greedy(1))
            return None
        return [out async for out in async_engine.generate(prompt(engine), greedy(4))]

    try:
        outs = asyncio.run(run())
        if leak:
            assert not async_engine.alive
            assert "1 KV pages leaked" in async_engine.failure
        else:
            assert async_engine.alive and async_engine.failure is None
            assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == 4
    finally:
        async_engine.shutdown()


def test_stop_token_ids_outside_the_vocabulary_are_refused(tiny_model):
    engine = make_engine(tiny_model)
    vocab = engine.model.config.vocab_size
    for bad in (vocab, -1):
        with pytest.raises(ValueError, match="stop_token_ids"):
            engine.add_request([1, 2], SamplingParams(max_tokens=2, stop_token_ids=[bad]))
    assert not engine.has_unfinished()


def test_streams_with_overlap_scheduling_equal_the_synchronous_engine_and_aborts_free(
        tiny_model):
    # the fixed-shape decode step run eagerly (capture=False): the overlap path on a CPU
    engines = []
    for overlap in (False, True):
        eng = make_engine(tiny_model)
        eng.graphs = GraphRunner(eng.runner, eng.cfg.max_running_reqs, 1, eng.max_model_len,
                                 capture=False)
        if not overlap:
            eng.overlap = None
        engines.append(eng)
    params = [greedy(12), SamplingParams(max_tokens=10, temperature=0.8, seed=4),
              greedy(MAX_MODEL_LEN - 32)]

    async def run(async_engine, eng):
        ids = [eng.tokenizer.encode(t) for t in ("The loop", "A thread", "Overlap")]

        async def collect(i):
            toks = []
            async for out in async_engine.generate(ids[i], params[i]):
                toks += out.new_token_ids
                if i == 2 and len(toks) >= 5:
                    break  # the client leaves: the request is aborted mid-decode
            return toks

        got = await asyncio.gather(*(collect(i) for i in range(3)))
        for _ in range(200):
            if await async_engine.call(lambda e: not e.has_unfinished()):
                return got
            await asyncio.sleep(0.01)
        raise AssertionError("the abandoned request is still in the engine")

    results = []
    for eng in engines:
        async_engine = AsyncEngine(eng)
        try:
            results.append(asyncio.run(run(async_engine, eng)))
        finally:
            async_engine.shutdown()
        assert_drained(eng)
    (sync, over) = results
    assert over[:2] == sync[:2] and len(over[0]) == 12 and len(over[1]) == 10
    assert engines[1].overlap.overlapped_steps > 0
