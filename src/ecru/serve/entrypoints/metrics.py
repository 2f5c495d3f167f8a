"""Server metrics in the Prometheus text format, kept and written by `prometheus_client`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
"""What `render` writes: always the plain text format, the one every Prometheus version reads."""


class ServerMetrics:
    """What `GET /metrics` reports: requests and tokens (counters), queue and batch (gauges read from the
    engine when scraped), time to first token and request latency (histograms). Each server has its own
    registry, so two servers in one process count apart."""

    def __init__(self, gauges: Callable[[], dict[str, tuple[float, str]]], *, endpoints: Sequence[str]):
        self.gauges = gauges
        self.endpoints = frozenset(endpoints)
        """The paths counted under their own label; any other path is counted as endpoint="other"."""
        self.registry = r = CollectorRegistry()
        # a counter named `x` is exposed as `x_total`
        self.requests = Counter(
            "ecru_requests",
            "Requests answered, by endpoint and HTTP status",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter("ecru_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(
            "ecru_generation_tokens", "Tokens generated for finished requests", registry=r
        )
        self.ttft = Histogram(
            "ecru_time_to_first_token_seconds",
            "Seconds to the first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "ecru_request_latency_seconds",
            "Seconds from arrival to the end",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    def count_request(self, *, endpoint: str, status: str) -> None:
        if endpoint.startswith("/v1/models/"):  # a model's card
            endpoint = "/v1/models"
        self.requests.labels(endpoint if endpoint in self.endpoints else "other", status).inc()

    def observe(self, *, prompt_tokens: int, generation_tokens: int, ttft_s: float | None, latency_s: float):
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        self.latency.observe(latency_s)

    def render(self) -> bytes:
        """The exposition, in `CONTENT_TYPE`."""
        return generate_latest(self)

    def collect(self) -> Iterable[Metric]:
        """The registry's families without the `_created` series prometheus_client adds (its switch for
        them is process-wide), then the engine's gauges as they are now."""
        for family in self.registry.collect():
            family.samples = [s for s in family.samples if s.name != family.name + "_created"]
            yield family
        for name, (value, text) in self.gauges().items():
            yield GaugeMetricFamily(name, text, value=value)
