"""Prometheus metrics of one server, in its own CollectorRegistry (never the global one)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily

if TYPE_CHECKING:
    from deltaserve.engine.llm_engine import RequestOutput

# gauge name -> (help, function of engine.cache_status())
_CACHE_GAUGES = {
    "requests_running": ("Requests the scheduler is running",
                         lambda s: s.get("running_requests", 0)),
    "requests_waiting": ("Requests queued for admission", lambda s: s.get("waiting_requests", 0)),
    "pages_total": ("KV pages in the page pool", lambda s: s.get("pages_total", 0)),
    "pages_used": ("KV pages not free (running requests and prefix cache)",
                   lambda s: s.get("pages_total", 0) - s.get("pages_free", 0)),
    "pages_cached": ("KV pages held by the prefix cache", lambda s: s.get("pages_cached", 0)),
    "pages_reserved": ("KV pages promised to running requests and not yet taken",
                       lambda s: s.get("pages_reserved", 0)),
    "slots_total": ("GDN state slots in the state pool", lambda s: s.get("slots_total", 0)),
    "slots_used": ("GDN state slots not free (live, tracking and snapshots)",
                   lambda s: s.get("slots_total", 0) - s.get("slots_free", 0)),
    "slots_snapshot": ("GDN state slots holding prefix-cache snapshots",
                       lambda s: s.get("slots_snapshot", 0)),
    "host_slots_total": ("GDN snapshot slots in the host bank (0: no bank)",
                         lambda s: s.get("host_slots_total", 0)),
    "host_slots_used": ("Host bank slots holding prefix-cache snapshots",
                        lambda s: s.get("host_slots_used", 0)),
    "host_bytes_used": ("Pinned host bytes of the used host bank slots",
                        lambda s: s.get("host_bytes_used", 0)),
}


# counter name -> (help, field of engine/status.py spec_status), vLLM's spec_decode families
_SPEC_COUNTERS = {
    "spec_decode_verify_steps": ("Verify steps (speculative decoding)", "verify_steps"),
    "spec_decode_drafts": ("Requests' verifies: one per request a verify step", "drafts"),
    "spec_decode_draft_tokens": ("Draft tokens verified", "draft_tokens"),
    "spec_decode_accepted_tokens": ("Draft tokens accepted", "accepted_tokens"),
}


class _SpecCollector:
    """The engine's speculative-decoding counters as of the last scrape (none with
    speculation off): counters the engine keeps, so they are read, not incremented here."""

    def __init__(self) -> None:
        self.status: dict | None = None

    def collect(self):
        if self.status is None:
            return
        for name, (help_, key) in _SPEC_COUNTERS.items():
            yield CounterMetricFamily(f"deltaserve_{name}", help_, value=self.status[key])


class ServerMetrics:
    """Request counters updated by the serving code; engine gauges refreshed at each scrape."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("deltaserve_requests", "Finished requests",
                                ["endpoint", "finish_reason"], registry=r)
        self.errors = Counter("deltaserve_request_errors", "Requests answered with an error",
                              ["status"], registry=r)
        self.prompt_tokens = Counter("deltaserve_prompt_tokens",
                                     "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("deltaserve_generation_tokens",
                                         "Completion tokens of finished requests", registry=r)
        self.cached_tokens = Counter("deltaserve_cached_prompt_tokens",
                                     "Prompt tokens served from the prefix cache", registry=r)
        self.inflight = Gauge("deltaserve_server_requests_inflight",
                              "Engine requests the server is waiting on (one per choice: "
                              "a request with n = 4 counts 4)", registry=r)
        self._cache = {name: Gauge(f"deltaserve_{name}", help_, registry=r)
                       for name, (help_, _) in _CACHE_GAUGES.items()}
        self._spec = _SpecCollector()
        r.register(self._spec)

    def observe_finished(self, endpoint: str, out: RequestOutput) -> None:
        self.requests.labels(endpoint=endpoint, finish_reason=out.finish_reason or "none").inc()
        self.prompt_tokens.inc(out.prompt_tokens)
        self.generation_tokens.inc(out.completion_tokens)
        self.cached_tokens.inc(out.cached_tokens)

    def render(self, cache_status: dict, inflight: int, spec: dict | None = None) -> bytes:
        """The Prometheus text exposition, with gauges set from `cache_status` and the
        speculative-decoding counters from `spec` (engine/status.py spec_status; None: off)."""
        for name, (_, value) in _CACHE_GAUGES.items():
            self._cache[name].set(value(cache_status))
        self.inflight.set(inflight)
        self._spec.status = spec
        return generate_latest(self.registry)
