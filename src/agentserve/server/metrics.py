"""Prometheus metrics, in a registry owned by the app (no process-global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from agentserve.engine.request import RequestOutput
from agentserve.server.async_engine import EngineSnapshot

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "agentserve_"
        self.requests = Counter(p + "requests", "Requests finished, by route and finish reason",
                                ["route", "finish_reason"], registry=r)
        self.errors = Counter(p + "request_errors", "Requests rejected, by status", ["status"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens", registry=r)
        self.reused_tokens = Counter(p + "reused_tokens", "Prompt tokens served from the prefix cache", registry=r)
        self.prefilled_tokens = Counter(p + "prefilled_tokens", "Prompt tokens computed", registry=r)
        self.generated_tokens = Counter(p + "generated_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between streamed tokens", buckets=_LATENCY, registry=r)
        self.queue = Histogram(p + "queue_time_seconds", "Arrival to first scheduled", buckets=_LATENCY, registry=r)
        self.e2e = Histogram(p + "request_latency_seconds", "Arrival to finish", buckets=_LATENCY, registry=r)
        self.running = Gauge(p + "requests_running", "Requests running", registry=r)
        self.waiting = Gauge(p + "requests_waiting", "Requests waiting", registry=r)
        self.blocks = Gauge(p + "kv_blocks", "KV blocks by state", ["state"], registry=r)
        self.evictions = Gauge(p + "kv_evictions", "Cached blocks evicted so far", registry=r)

    def on_step(self, snap: EngineSnapshot) -> None:
        """Called from the engine thread after every step (prometheus-client is thread-safe)."""
        self.running.set(snap.num_running)
        self.waiting.set(snap.num_waiting)
        self.blocks.labels("used").set(snap.pool.num_used)
        self.blocks.labels("cached").set(snap.pool.num_cached)
        self.blocks.labels("free").set(snap.pool.num_free)
        self.evictions.set(snap.pool.num_evictions)

    def on_finish(self, route: str, out: RequestOutput, finished_at: float) -> None:
        self.requests.labels(route, out.finish_reason.value if out.finish_reason else "none").inc()
        self.prompt_tokens.inc(out.num_prompt_tokens)
        self.reused_tokens.inc(out.num_reused_tokens)
        self.prefilled_tokens.inc(out.num_prefilled_tokens)
        self.generated_tokens.inc(out.num_generated_tokens)
        if out.first_token_time is not None:
            self.ttft.observe(out.first_token_time - out.arrival_time)
        if out.first_scheduled_time is not None:
            self.queue.observe(out.first_scheduled_time - out.arrival_time)
        self.e2e.observe(finished_at - out.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
