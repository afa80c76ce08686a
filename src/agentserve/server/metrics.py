"""Prometheus metrics, in a registry owned by the app (no process-global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from agentserve.engine.request import RequestOutput
from agentserve.server.async_engine import EngineSnapshot
from agentserve.trajectory.receipts import CacheAdvice, DecisionReceipt
from agentserve.trajectory.residency import MODES, Residency

_LOG_ERROR = (0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0)  # |ln(realized / predicted median)|
_LAG = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30)
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
        # residency (docs/residency.md); class labels are capped by the estimator (max_classes + other)
        q = p + "residency_"
        self.events = Counter(p + "trajectory_events", "Lifecycle events, by event and outcome",
                              ["event", "outcome"], registry=r)
        self.hint_lag = Histogram(q + "hint_lag_seconds", "Event emitted_at to applied", buckets=_LAG, registry=r)
        self.advice = Counter(q + "advice", "Advice at pauses, by action and class", ["action", "class"], registry=r)
        self.receipts = Counter(q + "receipts", "Settled pauses, by outcome and class", ["outcome", "class"],
                                registry=r)
        self.log_error = Histogram(q + "return_log_error", "|ln(realized gap / predicted median)| of returns",
                                   ["class"], buckets=_LOG_ERROR, registry=r)
        self.cdf_at_gap = Histogram(q + "return_cdf_at_gap", "Predicted P(gap <= realized): uniform if calibrated",
                                    ["class"], buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
                                    registry=r)
        self.idle_kv = Counter(q + "idle_kv_token_seconds", "KV held for paused trajectories", ["class"], registry=r)
        self.resident = Counter(q + "resident_tokens", "Tokens a returning trajectory found resident",
                                ["class"], registry=r)
        self.recomputed = Counter(q + "recomputed_tokens", "Tokens a returning trajectory had to recompute",
                                  ["class"], registry=r)
        self.regret = Counter(q + "regret_seconds", "Prefill-seconds a decision cost beyond its alternative",
                              ["class"], registry=r)
        self.mode = Gauge(q + "mode", "1 for the residency mode in use", ["mode"], registry=r)
        self.policy_seconds = Gauge(q + "policy_seconds", "Time spent in the residency policy", registry=r)
        self.trajectories = Gauge(p + "trajectories", "Trajectories tracked", registry=r)
        self.protected = Gauge(q + "protected_trajectories", "Paused trajectories protected", registry=r)

    def watch_residency(self, residency: Residency | None, mode: str) -> None:
        for m in MODES:
            self.mode.labels(m).set(1.0 if m == mode else 0.0)
        if residency is not None:  # plain reads of ints and floats the engine thread updates
            self.policy_seconds.set_function(lambda: residency.policy_s)
            self.trajectories.set_function(lambda: len(residency.registry))
            self.protected.set_function(lambda: len(residency.protected))

    def on_event(self, event: str, outcome: str, lag_s: float | None) -> None:
        self.events.labels(event, outcome).inc()
        if lag_s is not None and lag_s >= 0:
            self.hint_lag.observe(lag_s)

    def on_advice(self, advice: CacheAdvice) -> None:
        self.advice.labels(advice.action, advice.pause_class).inc()

    def on_receipt(self, r: DecisionReceipt) -> None:
        cls = r.advice.pause_class
        self.receipts.labels(r.outcome, cls).inc()
        self.idle_kv.labels(cls).inc(r.held_token_s)
        self.regret.labels(cls).inc(r.regret_s)
        if r.returned:
            self.cdf_at_gap.labels(cls).observe(r.cdf_at_gap)
            self.resident.labels(cls).inc(r.resident_tokens)
            self.recomputed.labels(cls).inc(r.recomputed_tokens)
            if r.log_error is not None:
                self.log_error.labels(cls).observe(abs(r.log_error))

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
