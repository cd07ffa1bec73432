"""Prometheus metrics, one registry per app so that tests can build several apps.

Generation counters come from the same ``Stats`` the responses report, so summing the
``usage``/``timings`` of every response gives the counters (cancelled generations count
too: their tokens were computed even if nobody read them).
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

from ..depth import occupancy_label
from ..generate import Stats
from ..scheduler import BatchMetrics

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TPS_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000)


class Metrics:
    """Every counter the server keeps; ``render()`` is the /metrics body."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("pymtp_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.latency = Histogram("pymtp_request_duration_seconds", "Time from request to the end "
                                 "of its response (whole stream included)", ["route"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("pymtp_requests_in_flight", "HTTP requests being answered", registry=r)
        self.errors = Counter("pymtp_errors", "Error responses by OpenAI error type", ["type"], registry=r)
        self.generations = Counter("pymtp_generations", "Generations by how they ended",
                                   ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("pymtp_prompt_tokens", "Prompt tokens of the requests", registry=r)
        self.cached_tokens = Counter("pymtp_prompt_tokens_cached", "Prompt tokens the prompt cache "
                                     "spared decoding", registry=r)
        self.cache_bytes = Gauge("pymtp_prompt_cache_bytes", "Bytes of recurrent-state snapshots "
                                 "the prompt cache holds", registry=r)
        self.cache_budget = Gauge("pymtp_prompt_cache_budget_bytes", "The prompt cache's budget "
                                  "(--cache-ram; 0: off)", registry=r)
        self.generated_tokens = Counter("pymtp_generated_tokens", "Tokens generated", registry=r)
        self.drafted = Counter("pymtp_draft_tokens", "Draft tokens proposed by the MTP head", registry=r)
        self.accepted = Counter("pymtp_draft_tokens_accepted", "Draft tokens the target accepted",
                                registry=r)
        self.drafted_at = Counter("pymtp_draft_position_drafted", "Drafts proposed at each draft "
                                  "position (0 = first draft of a round)", ["position"], registry=r)
        self.accepted_at = Counter("pymtp_draft_position_accepted", "Drafts accepted at each draft "
                                   "position", ["position"], registry=r)
        self.rounds = Counter("pymtp_verify_rounds", "Speculative verify rounds", registry=r)
        self.depths = Counter("pymtp_draft_depth_rounds", "Rounds by the drafts planned for them "
                              "(0: a plain decode; with draft_max=auto the depth policy's choices)",
                              ["depth"], registry=r)
        self.tokens_per_second = Histogram("pymtp_generation_tokens_per_second", "Decode speed of "
                                           "each generation (prompt excluded)", buckets=TPS_BUCKETS,
                                           registry=r)
        self.slots_total = Gauge("pymtp_slots", "Generation slots (--parallel)", registry=r)
        self.slots_busy = Gauge("pymtp_slots_busy", "Slots running a generation", registry=r)
        self.queue_waiting = Gauge("pymtp_queue_waiting", "Requests waiting for a slot", registry=r)

    def watch_pool(self, size: int, busy: Callable[[], int], waiting: Callable[[], int]) -> None:
        self.slots_total.set(size)
        self.slots_busy.set_function(busy)
        self.queue_waiting.set_function(waiting)

    def watch_cache(self, used: Callable[[], int], budget: int) -> None:
        self.cache_bytes.set_function(used)
        self.cache_budget.set(budget)

    def watch_batch(self, metrics: Callable[[], list["BatchMetrics"]]) -> None:
        """Export the batched engines' own metrics (scheduler.BatchMetrics, one per engine),
        read at each scrape: counts summed over the engines, slots numbered across them."""
        self.registry.register(_BatchCollector(metrics))

    def observe_generation(self, stats: Stats | None, finish_reason: str) -> None:
        """Count one generation; called from its worker thread (the client is thread-safe)."""
        self.generations.labels(finish_reason).inc()
        if stats is None:
            return
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.cached_tokens.inc(stats.cached_tokens)
        self.generated_tokens.inc(stats.generated_tokens)
        self.drafted.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        self.rounds.inc(stats.rounds)
        for i, (d, a) in enumerate(zip(stats.drafted_at, stats.accepted_at)):
            self.drafted_at.labels(str(i)).inc(d)
            self.accepted_at.labels(str(i)).inc(a)
        for depth, n in stats.depths.items():
            self.depths.labels(str(depth)).inc(n)
        if stats.generated_tokens and stats.tokens_per_second > 0:
            self.tokens_per_second.observe(stats.tokens_per_second)

    def count_error(self, kind: str) -> None:
        self.errors.labels(kind).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _BatchCollector:
    """Sequences per round, queue time, time to first token and acceptance per slot, of
    every batched engine; auto's measurements by engine (each measures its own rounds)."""

    def __init__(self, metrics: Callable[[], list[BatchMetrics]]) -> None:
        self.metrics = metrics

    def collect(self):
        ms = self.metrics()
        sizes = CounterMetricFamily("pymtp_batch_rounds", "Rounds by the sequences they decoded together",
                                    labels=["size"])
        for size, n in sorted(sum((m.batch_sizes for m in ms), Tally()).items()):
            sizes.add_metric([str(size)], n)
        yield sizes
        yield CounterMetricFamily("pymtp_batch_rows", "Target rows decoded by the rounds, pad rows included",
                                  value=sum(m.rows for m in ms))
        yield SummaryMetricFamily("pymtp_queue_seconds", "Time from a request's arrival to its slot",
                                  count_value=sum(m.queue.count for m in ms),
                                  sum_value=sum(m.queue.total for m in ms))
        yield SummaryMetricFamily("pymtp_time_to_first_token_seconds", "Time from a request's arrival "
                                  "to its first token", count_value=sum(m.ttft.count for m in ms),
                                  sum_value=sum(m.ttft.total for m in ms))
        drafted = CounterMetricFamily("pymtp_slot_draft_tokens", "Drafts proposed, by slot", labels=["slot"])
        accepted = CounterMetricFamily("pymtp_slot_draft_tokens_accepted", "Drafts accepted, by slot",
                                       labels=["slot"])
        for i, slot in enumerate(slot for m in ms for slot in m.slots):
            drafted.add_metric([str(i)], slot.drafted)
            accepted.add_metric([str(i)], slot.accepted)
        yield drafted
        yield accepted
        if any(m.epochs is not None for m in ms):
            labels = ["engine", "occupancy", "gap", "depth"]
            seconds = GaugeMetricFamily("pymtp_auto_sequence_round_seconds", "draft_max=auto: seconds "
                                        "a sequence-round measured, by engine, occupancy, gap in the seq "
                                        "ids and depth", labels=labels)
            rate = GaugeMetricFamily("pymtp_auto_estimated_tokens_per_second", "draft_max=auto: the "
                                     "engine's tokens a second each measured depth is expected to give",
                                     labels=labels)
            for e, m in enumerate(ms):
                if m.epochs is None:
                    continue
                for (bucket, gap), k, s, r in m.epochs.estimates():
                    key = [str(e), occupancy_label(bucket), str(int(gap)), str(k)]
                    seconds.add_metric(key, s)
                    rate.add_metric(key, r)
            yield seconds
            yield rate


class RequestMetrics:
    """ASGI middleware: counts requests by route template and status, and times them."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        t0 = time.perf_counter()

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, watch)
        finally:
            route = scope.get("route")
            label = getattr(route, "path", None) or "other"
            self.metrics.requests.labels(label, str(status)).inc()
            self.metrics.latency.labels(label).observe(time.perf_counter() - t0)
            self.metrics.in_flight.dec()
