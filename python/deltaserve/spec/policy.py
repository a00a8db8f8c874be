"""Per-step speculation policies: how many drafts (k) a decode step of the running batch runs.

A step runs either a plain decode (k = 0: one row per request, no proposer call) or a verify of
K + 1 rows per request (K = --speculative-num-steps). Verify steps are captured as CUDA graphs
of exactly K + 1 rows, so a verify with fewer drafts costs the same as one with K: the choice
that changes the cost is between 0 and K. Greedy output never depends on the choice (a verify
commits what plain decoding would).

`AdaptivePolicy` speculates when the tokens a verify step is expected to commit per request
(each request's running acceptance length) beat what the measured cost ratio of a verify step to
a decode step at this batch size demands. A step's cost is its wall period from the previous
decode or verify step's landing to its own (`StepClock`), so the costs of a run add up
to its wall time, whatever the step spent it on (forward, proposer, sampling, host work, a
drained pipeline). Per batch-size bucket the policy keeps two figures per kind:
- the median of the last `window` (32) steps that continued a run of that kind: what the kind
  costs in a steady run. (With 8, a few slow steps set the median: on an H100 the batch-32
  bucket of an MTP run on held-out prompts kept 0.86 ms for a plain step where plain decoding
  ran 0.38 ms a step.)
- the lower median of the last `entry_window` (16) first steps of a run after the other kind:
  what a switch costs. A verify after plain steps runs the MTP catch-up of the rows they left
  eagerly (spec/mtp/proposer.py) and the plain step before it lands without a successor (the
  overlap pipeline drains); a plain step after a verify runs without overlap. `switch_cost`:
  both first-step figures less the steady ones, a round trip's price. On a CPU proxy of the
  GPU's host (benchmarks/bench_switch_host.py, replays spun to the H200's batch-1 steps:
  plain 190 us, verify 1.06 ms; the eager MTP head spun 300 us for its launches) a verify
  after plain steps took 1.66 ms and the plain step after it 0.41 ms, +0.6 and +0.22 ms over
  steps in a run, so one verify every 14 steps ran 0.74x of plain decoding (the H200 at 7%
  verify steps: 0.76x), two thirds of the loss the switches'. (The lower median: of two
  first steps the cheaper, as one may have captured a graph: seconds.)
Until a bucket has both kinds' steady costs (min_samples each) it takes the nearest measured
bucket's figures; only with none measured anywhere does it run each kind to measure it. (The
batch shrinks through every smaller bucket at the end of a run of requests; measuring each
of them forced switches there.)

The policy leaves the kind the last step ran (in any bucket: a bucket change is no switch)
only when the other kind makes a token cheaper by the steady costs and acceptance by enough
to repay the measured cost of the switch to it within the steps before the next probe, and
by at least `switch_margin` (5%; `margin`, at most 50%). Only the way there counts: the way
back is the next probe's, which the probe budget pays. (With the round trip counted, a
synthetic stream of verify steps losing 7% a token against plain decoding stayed on them.)
Motivation: on an H100 in session 37 a batch-32 MTP run on held-out prompts that verified
about 60% of its steps ran 0.73x of plain decoding, where all-verify ran 0.79x and all-plain
0.86x; on an H200 in session 44 MTP at batch 1 verified 7% of the steps and ran 0.76x, where
forced-plain ran 1.09x.

After a run of `explore_every` steps of one kind in a bucket the other kind runs once, to
refresh its acceptance and cost, so the policy notices when a workload turns repetitive (or
stops being so). A probe that only confirms the choice (one step of the other kind, or two
plain steps: the overlap scheduler asks for the step after a plain probe before it lands)
doubles the run before the next one, up to `max_explore_every`; a probed kind that is kept
starts again from `explore_every`. Neither run is shorter than what keeps the probes'
expected cost (the probed step's loss plus the round-trip switch cost) under `probe_budget`
(2%) of the steps between them (`budget_interval`): where a verify costs 3 decode steps and
commits 1 token, and a round trip costs 6 more, the probes come 400 steps apart or more.

A request's acceptance is an exponential moving average of what its verifies committed
(smoothing 0.1, was 0.3: on the CPU proxy three short verifies in a row turned a batch that
verified where it paid to plain decoding for the rest of its requests); the
running mean, a new request's prior, moves once per verify step toward the step's mean (it
moved once per request, so at batch 32 it followed the last step alone).

Designed on the CPU proxy (bench_switch_host.py) and a synthetic stream of step costs with
switch overheads; measured once on a GPU (an H100, session 45, bench_spec.py on held-out
prompts, batches 1 / 8 / 32, benchmarks/RESULTS.md): adaptive ran 0.97 / 0.97 / 1.00x of
speculation on with every step plain for MTP (the policy before: 0.70 / 0.76 / 0.88x on an
H200) and 0.93 / 0.96 / 0.96x for n-gram; the first MTP verify after plain steps cost 9.8 /
20.9 ms at batch 8 / 32 against 1.6 / 2.3 ms in a run, which the switch cost now carries.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from deltaserve.core import Req


class StepClock:
    """Each decode or verify step's cost for the policy: the wall time since the previous
    such step landed, or since its own start (or launch) when a prefill step or an idle call
    came between (`reset`). Landing to landing, the costs of a run add up to its wall time:
    a switch's drained pipeline, catch-up and scheduling fall on the step that pays them. (A
    sync verify step's cost was its run_batch alone, which left out the host work between
    verify steps: on the CPU proxy at batch 8, 492 us a step told where the run took 516.)"""

    def __init__(self, now=time.perf_counter) -> None:
        self.now = now  # seconds; injected for tests
        self.landed_at: float | None = None

    def reset(self) -> None:
        self.landed_at = None

    def landed(self, started_at: float) -> float:
        """Seconds a step started at `started_at` (self.now()'s clock) costs, landing now."""
        now = self.now()
        since = started_at if self.landed_at is None else self.landed_at
        self.landed_at = now
        return now - since


def batch_bucket(n: int) -> int:
    """The power of two at or above n (the batch-size buckets of the CUDA graphs)."""
    return 1 << max(0, n - 1).bit_length()


class SpecPolicy(Protocol):
    """What the engine asks before each decode step and tells after it."""

    def choose(self, reqs: list[Req]) -> int:
        """Drafts per request for a decode step of `reqs`: 0 or the configured K. Changes no
        state: overlap scheduling asks ahead of a step and the scheduler asks again."""

    def on_step(self, k: int, batch_size: int, seconds: float) -> None:
        """A decode step that ran k drafts for `batch_size` requests landed `seconds` (wall)
        after the decode or verify step before it (StepClock)."""

    def on_verify(self, reqs: list[Req], committed: list[int]) -> None:
        """After a verify step: committed[i] tokens (1..K+1; 0 if aborted) for reqs[i]."""

    def release(self, req: Req) -> None:
        """`req` finished or was aborted."""


class FixedPolicy:
    """Always K drafts (`--speculative-policy fixed`)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def choose(self, reqs: list[Req]) -> int:
        return self.k

    def on_step(self, k: int, batch_size: int, seconds: float) -> None:
        pass

    def on_verify(self, reqs: list[Req], committed: list[int]) -> None:
        pass

    def release(self, req: Req) -> None:
        pass


@dataclass(slots=True)
class _Run:
    """One bucket's current run of steps of one kind (k), its length, the run length that
    triggers a probe of the other kind, and whether the run began with such a probe."""

    k: int
    length: int
    interval: int
    probe: bool = False


class AdaptivePolicy:
    """Speculate iff mean acceptance length >= verify cost / decode cost (see module doc).

    k: the configured K (>= 1). window: steps per cost median. explore_every: after a run of
    this many steps of one kind in a bucket, the other kind runs once; max_explore_every: the
    longest run between such probes once they keep confirming the choice (see module doc).
    smoothing: weight of the newest verify in a request's acceptance length (an exponential
    moving average). prior: the acceptance length assumed for a request before its first
    verify (the running mean over verify steps once there is one). probe_budget: the
    share of the step time that probes of the other kind may cost (0: no such bound).
    switch_margin: how much cheaper a token must be through the other kind at least (more
    where the measured cost of the switch demands it) before the policy leaves the kind it
    runs (module doc).
    entry_window: first steps of runs per switch-cost median.

    Counters, for benchmarks: `switches` (steps of the other kind than the step before).
    """

    def __init__(self, k: int, window: int = 32, explore_every: int = 32,
                 smoothing: float = 0.1, prior: float | None = None,
                 min_samples: int = 2, max_explore_every: int = 512,
                 probe_budget: float = 0.02, switch_margin: float = 0.05,
                 entry_window: int = 16) -> None:
        if k < 1:
            raise ValueError("the adaptive policy needs k >= 1 drafts")
        self.k, self.window, self.explore_every = k, window, explore_every
        self.max_explore_every = max(max_explore_every, explore_every)
        self.smoothing, self.min_samples = smoothing, min_samples
        self.probe_budget, self.switch_margin = probe_budget, switch_margin
        self.entry_window = entry_window
        self.prior = prior if prior is not None else 1.0 + k / 2
        self._costs: dict[tuple[int, int], deque[float]] = {}
        self._medians: dict[tuple[int, int], float] = {}  # of _costs, kept by on_step
        # first steps of runs (a switch from the other kind): seconds, and their lower median
        self._entries: dict[tuple[int, int], deque[float]] = {}
        self._entry_medians: dict[tuple[int, int], float] = {}
        self._runs: dict[int, _Run] = {}  # per bucket: the current run of one kind
        self._last_k: int | None = None  # the kind of the last step, in any bucket
        self._accept: dict[int, float] = {}  # rid -> acceptance length (EMA)
        self._global = self.prior
        self.switches = 0
        # the last batch's mean acceptance, kept while no verify or release changes it: a
        # run of plain steps asks twice a step for the same requests (O(batch) each time)
        self._accept_version = 0
        self._mean_memo: tuple[int, list[Req], float] | None = None

    def cost(self, k: int, batch_size: int) -> float | None:
        """Median seconds of the last `window` steps of k drafts in this batch's bucket."""
        return self._medians.get((batch_bucket(batch_size), k))

    def entry_cost(self, b: int, k: int) -> float | None:
        """Seconds a switch to kind k adds in bucket b: the (lower) median of its first steps
        after the other kind less the median of its steps in a run (at least 0); None until
        both are known."""
        entry, steady = self._entry_medians.get((b, k)), self._medians.get((b, k))
        return None if entry is None or steady is None else max(entry - steady, 0.0)

    def switch_cost(self, b: int) -> float | None:
        """Seconds a round trip to the other kind and back adds in bucket b (both kinds'
        `entry_cost`); None until both are known."""
        there, back = self.entry_cost(b, self.k), self.entry_cost(b, 0)
        return None if there is None or back is None else there + back

    def acceptance(self, req: Req) -> float:
        return self._accept.get(req.rid, self._global)

    def mean_acceptance(self, reqs: list[Req]) -> float:
        """The mean of `acceptance` over reqs (memoised while the requests and the
        acceptances stay the same: comparing the lists runs at C speed, by identity)."""
        memo = self._mean_memo
        if memo is not None and memo[0] == self._accept_version and memo[1] == reqs:
            return memo[2]
        mean = sum(self.acceptance(r) for r in reqs) / len(reqs)
        self._mean_memo = (self._accept_version, list(reqs), mean)
        return mean

    def _measured(self, b: int) -> int | None:
        """Bucket b if both kinds have costs there, else the nearest bucket that has (the
        smaller of two as near), else None."""
        def ready(c: int) -> bool:
            return all(len(self._costs.get((c, k), ())) >= self.min_samples
                       for k in (self.k, 0))
        if ready(b):
            return b
        near = sorted((abs(c.bit_length() - b.bit_length()), c) for c, _ in self._costs
                      if ready(c))
        return near[0][1] if near else None

    def choose(self, reqs: list[Req]) -> int:
        b = batch_bucket(len(reqs))
        m = self._measured(b)
        if m is None:  # nothing measured yet: each kind min_samples times, in this bucket
            for k in (self.k, 0):
                if len(self._costs.get((b, k), ())) < self.min_samples:
                    return k
            m = b
        verify, decode = self._medians[(m, self.k)], self._medians[(m, 0)]
        ratio = self.mean_acceptance(reqs) * decode / verify  # > 1: a verify's token is cheaper
        current = self._last_k
        if current is None:
            best = self.k if ratio >= 1 else 0
        else:  # leave the kind the last step ran only past the margin (module doc)
            margin = self.margin(m, current, self.interval(b))
            if current:
                best = self.k if ratio >= 1 - margin else 0
            else:
                best = self.k if ratio * (1 - margin) > 1 else 0
        run = self._runs.get(b)
        if run is not None and run.k == best and run.length >= run.interval:
            return self.k - best  # the other kind, once, to refresh its cost and acceptance
        return best

    def margin(self, b: int, current: int, horizon: int) -> float:
        """How much cheaper a token must be through the other kind before a run of kind
        `current` in bucket b ends: the measured cost of the switch to it (`entry_cost`) over
        `horizon` steps of the current kind (the switch must repay itself before the next
        probe), at least switch_margin (noise) and at most 0.5. Only the way there counts:
        a switch to the cheaper kind is not expected back before a probe, which the probe
        budget pays for."""
        extra, step = self.entry_cost(b, self.k - current), self._medians.get((b, current))
        if not extra or not step:
            return self.switch_margin
        return min(max(self.switch_margin, extra / (horizon * step)), 0.5)

    def interval(self, b: int) -> int:
        """The run of one kind after which bucket b's next step probes the other kind."""
        run = self._runs.get(b)
        return self.explore_every if run is None else run.interval

    def budget_interval(self, b: int) -> int:
        """The shortest run of one kind in bucket b after which a probe of the other kind
        keeps the probes' expected cost within probe_budget of the run's time. A probe of a
        verify where plain decoding wins loses (verify - L * decode) against L plain steps (L
        the mean acceptance length), one of plain decoding where speculation wins loses
        (decode - verify / L); either also pays the round-trip switch cost (`switch_cost`;
        a decode step until it is measured). 0 before both kinds have costs (here or in the
        bucket whose costs b borrows), or with no budget."""
        b = self._measured(b) or b  # a bucket without costs: the one it borrows them from
        decode, verify = self._medians.get((b, 0)), self._medians.get((b, self.k))
        if not self.probe_budget or decode is None or verify is None:
            return 0
        mean_len = self._global
        trip = self.switch_cost(b)
        trip = decode if trip is None else trip
        if mean_len * decode >= verify:  # speculating: the probe is a plain step
            loss, step = max(decode - verify / mean_len, 0.0) + trip, verify
        else:
            loss, step = max(verify - mean_len * decode, 0.0) + trip, decode
        return math.ceil(loss / (self.probe_budget * step))

    def _next_interval(self, b: int, interval: int) -> int:
        return min(max(interval, self.budget_interval(b)), self.max_explore_every)

    def on_step(self, k: int, batch_size: int, seconds: float) -> None:
        b = batch_bucket(batch_size)
        run = self._runs.get(b)
        switched = self._last_k is not None and k != self._last_k
        self._last_k = k
        if switched:  # what the first step of a run costs: the switch's price
            self.switches += 1
            entries = self._entries.setdefault((b, k), deque(maxlen=self.entry_window))
            entries.append(seconds)
            self._entry_medians[(b, k)] = _lower_median(entries)
        elif run is not None and run.k == k:  # the median once here, not at every choose()
            samples = self._costs.setdefault((b, k), deque(maxlen=self.window))
            samples.append(seconds)
            self._medians[(b, k)] = _median(samples)
        if run is None:
            self._runs[b] = _Run(k, 1, self._next_interval(b, self.explore_every))
        elif k == run.k:
            run.length += 1
            # a plain probe in a verify run runs two steps: the overlap scheduler asks for the
            # step after it before the probe lands; a third step means the probed kind was kept
            if run.probe and run.length == 3:
                run.interval, run.probe = self._next_interval(b, self.explore_every), False
        else:
            if run.probe and run.length <= 2:  # a probe, then back: it confirmed the choice
                run.interval = self._next_interval(b, 2 * run.interval)
            run.k, run.probe, run.length = k, run.length >= run.interval, 1

    def on_verify(self, reqs: list[Req], committed: list[int]) -> None:
        """Each request's acceptance moves toward what it committed, the running mean (a new
        request's prior) once per step toward the step's mean: moved once per request, it
        followed the last step's requests alone at batch 32, and the last verify of a batch
        whose requests end together is cut short by max_tokens."""
        self._accept_version += 1
        a = self.smoothing
        counted = []
        for req, n in zip(reqs, committed):
            if n <= 0:
                continue
            old = self._accept.get(req.rid, self._global)
            self._accept[req.rid] = (1 - a) * old + a * n
            counted.append(n)
        if counted:
            self._global = (1 - a) * self._global + a * sum(counted) / len(counted)

    def release(self, req: Req) -> None:
        if self._accept.pop(req.rid, None) is not None:
            self._accept_version += 1


def _median(samples: deque[float]) -> float:
    """statistics.median's value, without its overhead (this runs every decode step)."""
    s = sorted(samples)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def _lower_median(samples: deque[float]) -> float:
    """The lower median: of two samples the smaller (a first step that captured a graph, at
    seconds, must not set a switch's cost)."""
    s = sorted(samples)
    return s[(len(s) - 1) // 2]


def build_policy(name: str, k: int) -> FixedPolicy | AdaptivePolicy:
    """The policy named by `--speculative-policy` (fixed | adaptive) for K = k drafts."""
    if name == "fixed":
        return FixedPolicy(k)
    if name == "adaptive":
        return AdaptivePolicy(k)
    raise ValueError(f"speculative_policy must be fixed or adaptive, not {name!r}")
