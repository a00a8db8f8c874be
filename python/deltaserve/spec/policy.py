"""Per-step speculation policies: how many drafts (k) a decode step of the running batch runs.

A step runs either a plain decode (k = 0: one row per request, no proposer call) or a verify of
K + 1 rows per request (K = --speculative-num-steps). Verify steps are captured as CUDA graphs
of exactly K + 1 rows, so a verify with fewer drafts costs the same as one with K: the choice
that changes the cost is between 0 and K. Greedy output never depends on the choice (a verify
commits what plain decoding would).

`AdaptivePolicy` speculates when the tokens a verify step is expected to commit per request
(each request's running acceptance length) beat what the measured cost ratio of a verify step to
a decode step at this batch size demands. The costs are the engine's wall time per step
(forward, proposer, sampling and host work alike), kept per batch-size bucket as the median of
the last `window` (32) steps of each kind that continued a run of that kind: what each kind
costs in a steady run, the way the policy's choice runs it. (With 8, a few slow steps set the
median: on an H100 the batch-32 bucket of an MTP run on held-out prompts kept 0.86 ms for a
plain step where plain decoding ran 0.38 ms a step, and so kept verifying where it lost.) The
first step of a run is not counted: the first of a kind in a bucket captures a CUDA graph
(seconds, not milliseconds, which on the H200 made a median of the first two samples pick plain
decode for a whole MTP run), a plain step after a verify is not overlapped with the one before
(engine/overlap.py), and a verify after plain steps catches their rows up: while the two kinds
alternate, counting those first steps would make each kind look dearer than it runs. Each kind
is measured `min_samples` times before the policy decides. After a run of `explore_every` steps
of one kind in a bucket the other kind runs once, to refresh its cost and the acceptance, so the
policy notices when a workload turns repetitive (or stops being so). Each such probe costs: a
verify that does not pay, or, under overlap scheduling, a drained pipeline and the MTP catch-up
of the rows the plain steps left. So when a probe only confirms the choice (one step of the
other kind, then back), the run before the next one doubles, up to `max_explore_every`; when the
policy keeps the probed kind, it starts again from `explore_every`. Neither run is shorter than
what keeps the probes' expected cost under `probe_budget` of the steps between them
(`budget_interval`): where speculation loses clearly (a verify costing 2.9 decode steps that
commits 1.6 tokens) a probe costs about 2.3 decode steps, so at a 2% budget the probes come 115
steps apart or more, and speculation left on costs under 2% of plain decoding; near the break-
even the probes cost little and come as often as `explore_every` allows.

Near the break-even the two kinds in turn cost more than either alone (each switch drains the
overlap pipeline or catches deferred rows up): on an H100 in session 37 a batch-32 MTP run on
held-out prompts that verified about 60% of its steps ran 0.73x of plain decoding, where
all-verify ran 0.79x and all-plain 0.86x. So the policy leaves a run of one kind only when the
other makes a token `switch_margin` (5%) cheaper by the measured costs and acceptance; inside
that band it keeps what it runs, which costs at most the margin. (Set after that run; not yet
measured on a GPU.)
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from deltaserve.core import Req


def batch_bucket(n: int) -> int:
    """The power of two at or above n (the batch-size buckets of the CUDA graphs)."""
    return 1 << max(0, n - 1).bit_length()


class SpecPolicy(Protocol):
    """What the engine asks before each decode step and tells after it."""

    def choose(self, reqs: list[Req]) -> int:
        """Drafts per request for a decode step of `reqs`: 0 or the configured K. Changes no
        state: overlap scheduling asks ahead of a step and the scheduler asks again."""

    def on_step(self, k: int, batch_size: int, seconds: float) -> None:
        """A decode step that ran k drafts for `batch_size` requests took `seconds` (wall)."""

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
    verify (the running mean over finished verifies once there is one). probe_budget: the
    share of the step time that probes of the other kind may cost (0: no such bound).
    switch_margin: how much cheaper a token must be through the other kind before the policy
    leaves a run of one kind (module doc).
    """

    def __init__(self, k: int, window: int = 32, explore_every: int = 32,
                 smoothing: float = 0.3, prior: float | None = None,
                 min_samples: int = 2, max_explore_every: int = 512,
                 probe_budget: float = 0.02, switch_margin: float = 0.05) -> None:
        if k < 1:
            raise ValueError("the adaptive policy needs k >= 1 drafts")
        self.k, self.window, self.explore_every = k, window, explore_every
        self.max_explore_every = max(max_explore_every, explore_every)
        self.smoothing, self.min_samples = smoothing, min_samples
        self.probe_budget, self.switch_margin = probe_budget, switch_margin
        self.prior = prior if prior is not None else 1.0 + k / 2
        self._costs: dict[tuple[int, int], deque[float]] = {}
        self._medians: dict[tuple[int, int], float] = {}  # of _costs, kept by on_step
        self._runs: dict[int, _Run] = {}  # per bucket: the current run of one kind
        self._accept: dict[int, float] = {}  # rid -> acceptance length (EMA)
        self._global = self.prior
        # the last batch's mean acceptance, kept while no verify or release changes it: a
        # run of plain steps asks twice a step for the same requests (O(batch) each time)
        self._accept_version = 0
        self._mean_memo: tuple[int, list[Req], float] | None = None

    def cost(self, k: int, batch_size: int) -> float | None:
        """Median seconds of the last `window` steps of k drafts in this batch's bucket."""
        return self._medians.get((batch_bucket(batch_size), k))

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

    def choose(self, reqs: list[Req]) -> int:
        b = batch_bucket(len(reqs))
        for k in (self.k, 0):  # measure each kind min_samples times first
            if len(self._costs.get((b, k), ())) < self.min_samples:
                return k
        verify, decode = self.cost(self.k, len(reqs)), self.cost(0, len(reqs))
        mean_len = self.mean_acceptance(reqs)
        ratio = mean_len * decode / verify  # > 1: a token costs less through a verify
        run = self._runs.get(b)
        if run is None:
            best = self.k if ratio >= 1 else 0
        elif run.k:  # verifying: plain decoding must be `switch_margin` cheaper a token
            best = self.k if ratio >= 1 - self.switch_margin else 0
        else:  # and the other way round
            best = self.k if ratio * (1 - self.switch_margin) > 1 else 0
        if run is not None and run.k == best and run.length >= run.interval:
            return self.k - best  # the other kind, once, to refresh its cost and acceptance
        return best

    def interval(self, b: int) -> int:
        """The run of one kind after which bucket b's next step probes the other kind."""
        run = self._runs.get(b)
        return self.explore_every if run is None else run.interval

    def budget_interval(self, b: int) -> int:
        """The shortest run of one kind in bucket b after which a probe of the other kind
        keeps the probes' expected cost within probe_budget of the run's time. A probe of a
        verify where plain decoding wins loses (verify - L * decode) against L plain steps (L
        the mean acceptance length), one of plain decoding where speculation wins loses
        (decode - verify / L); either also drains the pipeline around it (about a decode
        step). 0 before both kinds have costs, or with no budget."""
        decode, verify = self._medians.get((b, 0)), self._medians.get((b, self.k))
        if not self.probe_budget or decode is None or verify is None:
            return 0
        mean_len = self._global
        if mean_len * decode >= verify:  # speculating: the probe is a plain step
            loss, step = max(decode - verify / mean_len, 0.0) + decode, verify
        else:
            loss, step = max(verify - mean_len * decode, 0.0) + decode, decode
        return math.ceil(loss / (self.probe_budget * step))

    def _next_interval(self, b: int, interval: int) -> int:
        return min(max(interval, self.budget_interval(b)), self.max_explore_every)

    def on_step(self, k: int, batch_size: int, seconds: float) -> None:
        b = batch_bucket(batch_size)
        run = self._runs.get(b)
        if run is not None and run.k == k:  # the median once here, not at every choose()
            samples = self._costs.setdefault((b, k), deque(maxlen=self.window))
            samples.append(seconds)
            self._medians[(b, k)] = _median(samples)
        if run is None:
            self._runs[b] = _Run(k, 1, self._next_interval(b, self.explore_every))
        elif k == run.k:
            run.length += 1
            if run.probe and run.length == 2:  # the probed kind was kept
                run.interval, run.probe = self._next_interval(b, self.explore_every), False
        else:
            if run.probe and run.length == 1:  # a probe, then back: it confirmed the choice
                run.interval = self._next_interval(b, 2 * run.interval)
            run.k, run.probe, run.length = k, run.length >= run.interval, 1

    def on_verify(self, reqs: list[Req], committed: list[int]) -> None:
        self._accept_version += 1
        a = self.smoothing
        for req, n in zip(reqs, committed):
            if n <= 0:
                continue
            old = self._accept.get(req.rid, self._global)
            self._accept[req.rid] = (1 - a) * old + a * n
            self._global = (1 - a / 8) * self._global + (a / 8) * n

    def release(self, req: Req) -> None:
        if self._accept.pop(req.rid, None) is not None:
            self._accept_version += 1


def _median(samples: deque[float]) -> float:
    """statistics.median's value, without its overhead (this runs every decode step)."""
    s = sorted(samples)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def build_policy(name: str, k: int) -> FixedPolicy | AdaptivePolicy:
    """The policy named by `--speculative-policy` (fixed | adaptive) for K = k drafts."""
    if name == "fixed":
        return FixedPolicy(k)
    if name == "adaptive":
        return AdaptivePolicy(k)
    raise ValueError(f"speculative_policy must be fixed or adaptive, not {name!r}")
