"""Prometheus metrics, one registry per app so that tests can build several apps.

Generation counters come from the same ``Stats`` the responses report, so summing the
``usage``/``timings`` of every response gives the counters (cancelled generations count
too: their tokens were computed even if nobody read them; so do the tokens the engine
decoded past a line rule's cut, which /completion's answer leaves out).

Beside pymtp's own names, the body carries llama-server's (``llamacpp:prompt_tokens_total``,
``llamacpp:requests_processing`` ...: ``server_task_result_metrics::to_metrics`` in the
pinned tools/server), so that dashboards and autoscalers written for llama-server read
pymtp as they read it. Three differences: ``n_tokens_max`` is a gauge here (llama-server
types it a counter, which this client library would name ``..._total``; both follow the
running slots); ``n_decode_total`` counts the batched engines' target decodes (none
without them; an engine rebuilt after a lost RPC worker starts its count over); and the
token counters and throughput gauges take a generation when it ends (llama-server's take a
prompt batch by batch), so a long reply's prompt shows in the scrape after it.
"""

from __future__ import annotations

import threading
import time
from collections import Counter as Tally
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

from ..depth_batched import occupancy_label
from ..results import Stats
from ..scheduler import BatchMetrics
from .slot_board import tokens_held

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
        self.cache_bytes = Gauge("pymtp_prompt_cache_bytes", "Bytes of recurrent-state snapshots "
                                 "the prompt cache holds", registry=r)
        self.cache_budget = Gauge("pymtp_prompt_cache_budget_bytes", "The prompt cache's budget "
                                  "(--cache-ram; 0: off)", registry=r)
        self.tokens_per_second = Histogram("pymtp_generation_tokens_per_second", "Decode speed of "
                                           "each generation (prompt excluded)", buckets=TPS_BUCKETS,
                                           registry=r)
        self.slots_total = Gauge("pymtp_slots", "Generation slots (--parallel)", registry=r)
        self.slots_busy = Gauge("pymtp_slots_busy", "Slots running a generation", registry=r)
        self.queue_waiting = Gauge("pymtp_queue_waiting", "Requests waiting for a slot", registry=r)
        # every generation counter from one set of totals, under pymtp's names and llama-server's
        self.totals = _Totals()
        r.register(_GenerationCollector(self.totals))
        self.llama = _LlamaCollector(self.totals)
        r.register(self.llama)

    def watch_pool(self, size: int, busy: Callable[[], int], waiting: Callable[[], int],
                   held: Callable[[], int] = lambda: 0) -> None:
        """The pool's slots, busy and waiting; ``held``: the most tokens a running slot holds
        now (``n_tokens_max`` moves while a request runs, as llama-server's at each decode)."""
        self.slots_total.set(size)
        self.slots_busy.set_function(busy)
        self.queue_waiting.set_function(waiting)
        self.llama.busy, self.llama.waiting, self.llama.held = busy, waiting, held

    def watch_cache(self, used: Callable[[], int], budget: int) -> None:
        self.cache_bytes.set_function(used)
        self.cache_budget.set(budget)

    def watch_batch(self, metrics: Callable[[], list["BatchMetrics"]], slot_of: Callable[[int, int], int]) -> None:
        """Export the batched engines' own metrics (scheduler.BatchMetrics, one per engine),
        read at each scrape: counts summed over the engines, a slot labelled by the pool's
        index of engine e's seq id (``slot_of(e, seq)``: /slots' id, a response's id_slot;
        the pool takes the engines' slots in turn)."""
        self.registry.register(_BatchCollector(metrics, slot_of))
        self.llama.batch = metrics

    def observe_generation(self, stats: Stats | None, finish_reason: str, eog: bool = False) -> None:
        """Count one generation (``eog``: it ended at an end-of-generation token); called
        from its worker thread (the client is thread-safe)."""
        self.generations.labels(finish_reason).inc()
        if stats is None:
            return
        self.totals.add(stats, eog)
        if stats.generated_tokens and stats.tokens_per_second > 0:
            self.tokens_per_second.observe(stats.tokens_per_second)

    def count_error(self, kind: str) -> None:
        self.errors.labels(kind).inc()

    def render(self) -> bytes:
        """The /metrics body; it starts llama-server's throughput bucket over (a read of the
        registry for anything else, the chat page's stats, leaves the bucket be)."""
        with self.llama.scrape():
            return generate_latest(self.registry)


class _BatchCollector:
    """Sequences per round, queue time, time to first token and acceptance per slot, of
    every batched engine; auto's measurements by engine (each measures its own rounds)."""

    def __init__(self, metrics: Callable[[], list[BatchMetrics]], slot_of: Callable[[int, int], int]) -> None:
        self.metrics = metrics
        self.slot_of = slot_of

    def collect(self):
        ms = self.metrics()
        sizes = CounterMetricFamily("pymtp_batch_rounds", "Rounds by the sequences they decoded together",
                                    labels=["size"])
        for size, n in sorted(_batch_sizes(ms).items()):
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
        by_slot = sorted(((self.slot_of(e, seq), slot) for e, m in enumerate(ms) for seq, slot in enumerate(m.slots)),
                         key=lambda pair: pair[0])
        for i, slot in by_slot:
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


def _batch_sizes(ms: list[BatchMetrics]) -> Tally:
    """Rounds by sequences, summed over the engines: each engine's counter copied first
    (one C-level copy under the GIL), as its thread may add a size while this reads."""
    return sum((Tally(dict(m.batch_sizes)) for m in ms), Tally())


def _per_position(into: list[int], counts: list[int]) -> None:
    for i, n in enumerate(counts):
        if i == len(into):
            into.append(0)
        into[i] += n


@dataclass
class _Totals:
    """The generation counters, summed from the generations' ``Stats``: one set of books
    that pymtp's names and llama-server's both read (``_GenerationCollector``,
    ``_LlamaCollector``). The throughput gauges read the generations since the last /metrics
    body (llama-server's bucket, which each one empties). ``add`` runs in worker threads,
    hence the lock."""

    prompt: int = 0                  # prompt tokens decoded (the cached ones apart)
    cached: int = 0
    prompt_seconds: float = 0.0
    predicted: int = 0
    predicted_seconds: float = 0.0
    n_tokens_max: int = 0            # the most tokens a slot's context held (slot_board.tokens_held)
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0                  # verify rounds that had drafts (RunStats.count_round)
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    depths: Tally = field(default_factory=Tally)
    bucket: list[float] = field(default_factory=lambda: [0, 0.0, 0, 0.0])   # prompt n, s, predicted n, s
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, s: Stats, eog: bool = False) -> None:
        with self.lock:
            self.prompt += s.prompt_processed
            self.cached += s.cached_tokens
            self.prompt_seconds += s.prompt_seconds
            self.predicted += s.generated_tokens
            self.predicted_seconds += s.decode_seconds
            held = s.cached_tokens + s.prompt_processed     # the prompt, or what a cut one got to
            self.n_tokens_max = max(self.n_tokens_max, tokens_held(held, s.generated_tokens, eog))
            self.drafted += s.drafted
            self.accepted += s.accepted
            self.rounds += s.rounds
            # a position's count only where both lists have it, as RunStats keeps them
            n = min(len(s.drafted_at), len(s.accepted_at))
            _per_position(self.drafted_at, s.drafted_at[:n])
            _per_position(self.accepted_at, s.accepted_at[:n])
            self.depths.update(s.depths)
            b = self.bucket
            # llama-server's steps: the first token came with the prompt, not the decode
            b[0], b[1], b[2], b[3] = b[0] + s.prompt_processed, b[1] + s.prompt_seconds, \
                b[2] + max(s.generated_tokens - 1, 0), b[3] + s.decode_seconds

    def read(self, empty: bool = False) -> tuple[_Totals, list[float]]:
        """A copy of the totals, and the bucket (``empty``: which then starts over)."""
        with self.lock:
            bucket = list(self.bucket)
            copy = replace(self, drafted_at=list(self.drafted_at), accepted_at=list(self.accepted_at),
                           depths=Tally(self.depths), bucket=bucket)
            if empty:
                self.bucket = [0, 0.0, 0, 0.0]
            return copy, bucket


class _GenerationCollector:
    """pymtp's generation counters, read from the totals at each scrape."""

    def __init__(self, totals: _Totals) -> None:
        self.totals = totals

    def collect(self):
        t, _ = self.totals.read()
        counters = (
            ("pymtp_prompt_tokens", "Prompt tokens of the requests", t.prompt + t.cached),
            ("pymtp_prompt_tokens_cached", "Prompt tokens the prompt cache spared decoding", t.cached),
            ("pymtp_generated_tokens", "Tokens generated", t.predicted),
            ("pymtp_draft_tokens", "Draft tokens proposed by the MTP head", t.drafted),
            ("pymtp_draft_tokens_accepted", "Draft tokens the target accepted", t.accepted),
            ("pymtp_verify_rounds", "Speculative verify rounds", t.rounds),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
        labelled = (
            ("pymtp_draft_position_drafted", "Drafts proposed at each draft position (0 = first draft "
             "of a round)", "position", enumerate(t.drafted_at)),
            ("pymtp_draft_position_accepted", "Drafts accepted at each draft position", "position",
             enumerate(t.accepted_at)),
            ("pymtp_draft_depth_rounds", "Rounds by the drafts planned for them (0: a plain decode; "
             "with draft_max=auto the depth policy's choices)", "depth", sorted(t.depths.items())),
        )
        for name, doc, label, values in labelled:
            family = CounterMetricFamily(name, doc, labels=[label])
            for key, value in values:
                family.add_metric([str(key)], value)
            yield family


class _LlamaCollector:
    """llama-server's /metrics names and meanings (module docstring), read at each scrape."""

    def __init__(self, totals: _Totals) -> None:
        self.totals = totals
        self.busy: Callable[[], int] = lambda: 0
        self.waiting: Callable[[], int] = lambda: 0
        self.held: Callable[[], int] = lambda: 0
        self.batch: Callable[[], list[BatchMetrics]] = lambda: []
        self.scraping = False       # a /metrics body is being rendered: the bucket starts over

    @contextmanager
    def scrape(self):
        self.scraping = True
        try:
            yield
        finally:
            self.scraping = False

    def collect(self):
        t, (p_n, p_s, g_n, g_s) = self.totals.read(empty=self.scraping)
        sizes = _batch_sizes(self.batch())
        decodes = sum(sizes.values())
        counters = (
            ("prompt_tokens", "Number of prompt tokens processed, excluding cached tokens", t.prompt),
            ("prompt_tokens_cached", "Number of prompt tokens reused from the cache", t.cached),
            ("prompt_seconds", "Total time spent processing prompts", t.prompt_seconds),
            ("tokens_predicted", "Number of generation tokens processed", t.predicted),
            ("tokens_predicted_seconds", "Total time spent generating tokens", t.predicted_seconds),
            ("n_decode", "Total number of target decodes of the batched engines", decodes),
            ("spec_decode_num_draft_tokens", "Speculative: Total draft tokens generated", t.drafted),
            ("spec_decode_num_accepted_tokens", "Speculative: Total draft tokens accepted by the target model",
             t.accepted),
            ("spec_decode_num_drafts", "Speculative: Total speculative decoding verification steps",
             t.rounds),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(f"llamacpp:{name}", doc, value=value)
        gauges = (
            ("n_tokens_max", "Largest observed sequence length (prompt + generation)",
             max(t.n_tokens_max, self.held())),
            ("prompt_tokens_seconds", "Average prompt throughput in tokens/s", p_n / p_s if p_s > 0 else 0.0),
            ("predicted_tokens_seconds", "Average generation throughput in tokens/s", g_n / g_s if g_s > 0 else 0.0),
            ("requests_processing", "Number of requests processing", self.busy()),
            ("requests_deferred", "Number of requests deferred", self.waiting()),
            ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call",
             sum(k * n for k, n in sizes.items()) / max(decodes, 1)),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(f"llamacpp:{name}", doc, value=value)
        if t.accepted_at:
            per_pos = CounterMetricFamily("llamacpp:spec_decode_num_accepted_tokens_per_pos",
                                          "Accepted tokens per draft position", labels=["position"])
            for i, a in enumerate(t.accepted_at):
                per_pos.add_metric([str(i)], a)
            yield per_pos


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
            label = _route_label(scope)
            self.metrics.requests.labels(label, str(status)).inc()
            self.metrics.latency.labels(label).observe(time.perf_counter() - t0)
            self.metrics.in_flight.dec()


def _route_label(scope: Scope) -> str:
    """The route template a request went to, also when a middleware answered it before
    routing (a 413 for its body, a CORS preflight): those were counted as "other". A path
    no route serves stays "other", which keeps the label's values few."""
    route = scope.get("route")
    for candidate in () if route is not None else getattr(scope.get("app"), "routes", ()):
        if candidate.matches(scope)[0] is not Match.NONE:     # PARTIAL: the path, another method
            route = candidate
            break
    return getattr(route, "path", None) or "other"
