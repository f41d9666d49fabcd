"""``/metrics``: the backend's figures and the server's latency histograms as Prometheus text.

Each scrape asks the backend for one ``metrics()`` snapshot (``hybridkv.server.backend`` lists the
keys) and exports what it holds: gauges for what is true now (requests running and waiting,
cells per pool and state, pages and slots live / cached / held by requests), counters for the
cumulative figures (prefix-cache hit tokens per component, evictions, retractions, transfer
bytes and failures for PD, CPU of the engine thread); for PD also open requests per phase,
worker deaths, engine restarts and per worker the pages and slots it holds (``hybridkv_pd_*``);
with tiers below the device, bytes written and loaded per tier, hit tokens per component and tier,
misses by reason, host usage and whether the store is up (``hybridkv_tier_*``);
the request fields the server ignored, by endpoint and name (``hybridkv_ignored_request_fields_total``);
plus the process's own figures (``process_cpu_seconds_total``, memory, file descriptors). The
server observes TTFT, TPOT and end-to-end latency per request into histograms as each request ends.

Invariant: one ``CollectorRegistry`` per app (no process-global state), so several servers in one
process (tests) never share or double-register series.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "hybridkv_"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

GAUGES = {
    "running": ("num_requests_running", "Requests in the engine's running batch."),
    "waiting": ("num_requests_waiting", "Requests queued in the engine, not yet admitted."),
    "live_pages": ("live_pages", "Virtual KV pages in use (requests and prefix cache)."),
    "live_slots": ("live_slots", "Recurrent-state slots in use (requests and prefix cache)."),
    "cached_pages": ("cached_pages", "KV pages the prefix cache keeps."),
    "cached_states": ("cached_states", "State checkpoints the prefix cache keeps."),
    "held_pages": ("request_pages", "KV pages held by open requests (live minus cached)."),
    "held_slots": ("request_slots", "State slots held by open requests (live minus cached)."),
    "probe_ok": ("pd_probe_ok", "1 when every live PD worker answered this scrape's probe (its figures are current)."),
}
COUNTERS = {
    "requests": ("engine_requests", "Requests the engine accepted."),
    "aborted": (
        "engine_aborted_requests",
        "Requests aborted (client gone, abort_request, a stop string matched, shutdown).",
    ),
    "errors": ("engine_failed_requests", "Requests that failed in the engine."),
    "steps": ("engine_steps", "Engine steps (forward passes)."),
    "retractions": ("retractions", "Requests retracted under memory pressure."),
    "prefix_waits": (
        "prefix_waits",
        "Steps a waiting request let others pass to wait for a running prefill of its prefix (then a cache hit).",
    ),
    "prompt_tokens": ("prompt_tokens", "Prompt tokens accepted."),
    "cached_tokens": ("prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache."),
    "evicted_pages": ("evicted_pages", "KV pages evicted from the prefix cache."),
    "evicted_states": ("evicted_states", "State checkpoints evicted from the prefix cache."),
    "transfer_bytes": ("transfer_bytes", "KV and state bytes moved prefill -> decode (PD)."),
    "transfer_failures": ("transfer_failures", "Failed prefill -> decode transfers (PD)."),
    "deaths": ("pd_worker_deaths", "PD worker processes that died while serving."),
    "quarantined": (
        "pd_quarantined_requests",
        "PD requests failed alone for being present at two deaths of an engine.",
    ),
    "mooncake_log_lines": ("pd_mooncake_log_lines", "Mooncake's own log lines from PD workers, routed to logging."),
    "engine_thread_cpu_s": (
        "engine_thread_cpu_seconds",
        "CPU seconds of the engine thread (the rest of process_cpu_seconds is the HTTP side).",
    ),
    "http_loop_cpu_s": (
        "http_loop_cpu_seconds",
        "CPU seconds of the thread serving HTTP (its event loop), exact (process_cpu_seconds counts 10 ms ticks).",
    ),
    "stream_write_cpu_s": (
        "stream_write_cpu_seconds",
        "CPU seconds the backend's thread spent encoding and writing streamed chunks (in engine_thread_cpu_seconds).",
    ),
}
HIT_COMPONENTS = {"hit_full_tokens": "full", "hit_window_tokens": "window", "hit_checkpoint_tokens": "checkpoint"}


class _BackendCollector(Collector):
    def __init__(self, snapshot: Callable[[], dict[str, Any]]):
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        m = self.snapshot()
        for key, (name, doc) in GAUGES.items():
            if key in m:
                yield GaugeMetricFamily(PREFIX + name, doc, value=m[key])
        if "pools" in m:
            yield _labelled(
                GaugeMetricFamily,
                "pool_cells",
                "Cells per memory pool and state (cached: window cells kept).",
                ["pool", "state"],
                m["pools"],
            )
        for key, (name, doc) in COUNTERS.items():
            if key in m:
                yield CounterMetricFamily(PREFIX + name, doc, value=m[key])
        hits = CounterMetricFamily(
            PREFIX + "prefix_cache_component_hit_tokens",
            "Prompt tokens matched per cache component at first admission.",
            labels=["component"],
        )
        for key, component in HIT_COMPONENTS.items():
            if key in m:
                hits.add_metric([component], m[key])
        yield hits
        if "connections_refused" in m:
            yield _labelled(
                CounterMetricFamily,
                "http_connections_refused",
                "Connections answered and closed before a request reached the app, by reason.",
                ["reason"],
                m["connections_refused"],
            )
        yield from _pd_families(m)
        if "tiers" in m:
            yield from _tier_families(m["tiers"])


def _pd_families(m: dict[str, Any]) -> Iterator[Metric]:
    """The PD server's labelled figures: open requests per phase, restarts per engine, and per worker
    (``name``, ``epoch``) the pages and slots it holds now and held before its first request."""
    if "phases" in m:
        phases = GaugeMetricFamily(PREFIX + "pd_requests", "Open PD requests per phase.", labels=["phase"])
        for phase, n in m["phases"].items():
            phases.add_metric([phase], n)
        yield phases
    if "restarts" in m:
        restarts = CounterMetricFamily(
            PREFIX + "pd_engine_restarts", "Restarts of a PD engine after a worker died.", labels=["engine"]
        )
        for engine, n in m["restarts"].items():
            restarts.add_metric([engine], n)
        yield restarts
    if "workers" in m:
        labels = ["worker", "epoch", "state"]
        pages = GaugeMetricFamily(
            PREFIX + "pd_worker_pages",
            "KV pages of a PD worker outside the prefill prefix cache: live now, and before its first request.",
            labels=labels,
        )
        slots = GaugeMetricFamily(
            PREFIX + "pd_worker_slots", "State slots of a PD worker, like pd_worker_pages.", labels=labels
        )
        held = GaugeMetricFamily(
            PREFIX + "pd_worker_requests", "Requests holding memory on a PD worker.", labels=["worker", "epoch"]
        )
        threads = GaugeMetricFamily(
            PREFIX + "pd_worker_threads", "Intra-op CPU threads a PD worker runs.", labels=["worker", "epoch"]
        )
        for w in m["workers"]:
            who = [w["worker"], str(w["epoch"])]
            for state in ("live", "before"):
                pages.add_metric([*who, state], w[f"{state}_pages"])
                slots.add_metric([*who, state], w[f"{state}_slots"])
            held.add_metric(who, w["requests"])
            threads.add_metric(who, w["threads"])
        yield from (pages, slots, held, threads)


def _labelled(
    family: type[CounterMetricFamily] | type[GaugeMetricFamily],
    name: str,
    doc: str,
    labels: list[str],
    values: dict[str, Any],
) -> Metric:
    """One sample per leaf of ``values``, a dict nested one level per label."""
    metric = family(PREFIX + name, doc, labels=labels)
    rows: list[tuple[list[str], Any]] = [([], values)]
    for _ in labels:
        rows = [([*keys, key], value) for keys, level in rows for key, value in level.items()]
    for keys, value in rows:
        metric.add_metric(keys, value)
    return metric


def _tier_families(t: dict[str, Any]) -> Iterator[Metric]:
    """The tiers below the device: a single engine's (``TieredCache.metrics``) or the PD prefill
    ranks' summed counters (``pd_backend.pd_tiers``: no hit or restored figures, no host usage)."""
    yield _labelled(CounterMetricFamily, "tier_written_bytes", "Bytes written to a tier.", ["tier"], t["written_bytes"])
    yield _labelled(
        CounterMetricFamily,
        "tier_write_refused",
        "Objects a tier refused (full, down, error).",
        ["tier"],
        t["write_refused"],
    )
    yield _labelled(
        CounterMetricFamily,
        "tier_write_around",
        "Objects larger than host memory's budget written straight to the store, per component.",
        ["component"],
        t.get("write_around", {}),
    )
    yield _labelled(
        CounterMetricFamily,
        "tier_loaded_bytes",
        "Bytes restored to the device, by the tier they came from.",
        ["tier"],
        t["loaded_bytes"],
    )
    yield _labelled(
        CounterMetricFamily, "tier_misses", "Planned loads a tier did not serve, by reason.", ["reason"], t["misses"]
    )
    if "hit_tokens" in t:  # a single engine's (the PD router sums the ranks' counters only)
        yield _labelled(
            CounterMetricFamily,
            "tier_hit_tokens",
            "Hit tokens per cache component and the tier they came from.",
            ["component", "tier"],
            t["hit_tokens"],
        )
        yield CounterMetricFamily(
            PREFIX + "tier_restored_tokens",
            "Prompt tokens restored from the tiers beyond the device's hit.",
            value=t["restored_tokens"],
        )
        yield CounterMetricFamily(
            PREFIX + "tier_restored_requests",
            "Requests that restored a prefix from the tiers.",
            value=t["restored_requests"],
        )
    yield CounterMetricFamily(
        PREFIX + "tier_fallbacks",
        "Restores that fell back to the device hit (an object was missing).",
        value=t["fallbacks"],
    )
    if "host" in t:
        host = t["host"]
        yield GaugeMetricFamily(PREFIX + "tier_host_used_bytes", "Bytes the host tier holds.", value=host["used_bytes"])
        yield GaugeMetricFamily(
            PREFIX + "tier_host_budget_bytes", "The host tier's budget.", value=host["budget_bytes"]
        )
        yield CounterMetricFamily(
            PREFIX + "tier_host_evictions", "Objects the host tier evicted.", value=host["evictions"]
        )
    if "store" in t:
        yield GaugeMetricFamily(
            PREFIX + "tier_store_up",
            "1 while the Mooncake Store answers, 0 while it is down.",
            value=int(t["store"]["up"]),
        )


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], dict[str, Any]]):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_BackendCollector(snapshot))
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, memory, open fds
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Arrival -> first token.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Mean seconds per token after the first, per request.",
            buckets=TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Arrival -> end.", buckets=LATENCY_BUCKETS, registry=self.registry
        )
        self.finished = Counter(
            PREFIX + "requests_finished", "Requests ended, by finish reason.", ["finish_reason"], registry=self.registry
        )
        self.ignored_fields = Counter(
            PREFIX + "ignored_request_fields",
            "Request fields no model of the server knows, accepted and ignored, by endpoint and field.",
            ["endpoint", "field"],
            registry=self.registry,
        )

    def observe(
        self, arrived: float, first_at: float | None, last_at: float | None, tokens: int, ended_at: float, reason: str
    ) -> None:
        if first_at is not None:
            self.ttft.observe(first_at - arrived)
            if tokens > 1 and last_at is not None:
                self.tpot.observe((last_at - first_at) / (tokens - 1))
        self.e2e.observe(ended_at - arrived)
        self.finished.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
