"""Prometheus metrics of one server (``GET /metrics``, text format, ``prometheus_client``).

Each app has its own ``CollectorRegistry`` (no process-global state: two servers in one process,
as the tests run them, do not mix counts). Queue depth, running requests, slots and the token
totals are read from ``Scheduler.stats()`` at scrape time, one snapshot per scrape, so /metrics
always agrees with the scheduler; latencies and request outcomes are observed by the routes.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "graphkiln"
# a CPU decode step of a small model is ~5-50 ms, a long prefill seconds
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.0)


class _SchedulerCollector(Collector):
    def __init__(self, stats: Callable[[], object]) -> None:
        self._stats = stats

    def collect(self) -> Iterator:
        s = self._stats()
        for name, doc, value in (
            ("queue_depth", "Requests waiting for a slot", s.queued),
            ("running_requests", "Requests holding a slot (prefilling or decoding)", s.running),
            ("free_slots", "State-pool slots free for new requests", s.free_slots),
            ("total_slots", "State-pool slots (most requests served at once)", s.total_slots),
        ):
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        yield CounterMetricFamily(f"{PREFIX}_prompt_tokens", "Prompt tokens prefilled since start (not those taken from the prefix cache)", value=s.prompt_tokens)
        yield CounterMetricFamily(f"{PREFIX}_generated_tokens", "Tokens generated since start", value=s.generated_tokens)
        yield CounterMetricFamily(f"{PREFIX}_draft_tokens", "Speculative draft tokens verified since start",
                                  value=s.draft_tokens)
        yield CounterMetricFamily(f"{PREFIX}_accepted_draft_tokens", "Speculative draft tokens accepted since start",
                                  value=s.accepted_draft_tokens)
        kv = getattr(s, "kv_bytes_per_token", None)
        if kv is not None:  # sliding-window layers' KV is window-sized on the CPU pools (runtime.backends.state)
            yield GaugeMetricFamily(f"{PREFIX}_kv_bytes_per_token", "KV cache bytes per token of one request at the "
                                    "maximum sequence length, as the state pools hold it", value=kv)
        p = s.prefix
        if p is not None:  # the prefix cache (runtime.request.prefix); absent when it is off
            yield CounterMetricFamily(f"{PREFIX}_prefix_cache_hit_tokens", "Prompt tokens taken from the prefix cache",
                                      value=p.hit_tokens)
            yield CounterMetricFamily(f"{PREFIX}_prefix_cache_miss_tokens", "Prompt tokens computed by a prefill",
                                      value=p.miss_tokens)
            yield CounterMetricFamily(f"{PREFIX}_prefix_cache_evictions", "Prefix cache blocks evicted",
                                      value=p.evictions)
            yield GaugeMetricFamily(f"{PREFIX}_prefix_cache_bytes", "Bytes of prefix cache blocks held", value=p.bytes)
            yield GaugeMetricFamily(f"{PREFIX}_prefix_cache_capacity_bytes", "The prefix cache's byte budget",
                                    value=p.capacity_bytes)


class ServerMetrics:
    """The server's registry and the instruments the routes observe."""

    def __init__(self, stats: Callable[[], object]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_SchedulerCollector(stats))
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "From the request's arrival to its first generated token", buckets=TTFT_BUCKETS,
                              registry=self.registry)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", "Between consecutive tokens of one request",
                             buckets=ITL_BUCKETS, registry=self.registry)
        self.finished = Counter(f"{PREFIX}_requests_finished", "Generation requests by how they ended "
                                "(stop, length, cancelled: client gone or shutdown deadline, error)",
                                ["reason"], registry=self.registry)
        self.rejected = Counter(f"{PREFIX}_requests_rejected", "Requests refused before generation, by HTTP status",
                                ["status"], registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
