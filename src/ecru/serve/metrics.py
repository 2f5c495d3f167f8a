"""Server metrics in the Prometheus text exposition format (version 0.0.4), written by hand: counters,
gauges and cumulative histograms, each with its `# HELP` and `# TYPE` lines."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Sequence

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def escape(value: str) -> str:
    """A label value as the exposition format quotes it: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{escape(v)}"' for k, v in sorted(labels.items()))
    return "{" + inner + "}"


def _number(value: float) -> str:
    return repr(float(value)) if value != int(value) else str(int(value))


class Histogram:
    """Cumulative buckets (`le`), `_sum` and `_count`."""

    def __init__(self, buckets: Sequence[float] = LATENCY_BUCKETS):
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += count
            le = "+Inf" if bound == float("inf") else _number(bound)
            out.append(f'{name}_bucket{{le="{le}"}} {total}')
        return [*out, f"{name}_sum {_number(self.sum)}", f"{name}_count {total}"]


class ServerMetrics:
    """What `GET /metrics` reports: requests and tokens (counters), queue and batch (gauges read from the
    engine when scraped), time to first token and request latency (histograms)."""

    def __init__(self, gauges: Callable[[], dict[str, tuple[float, str]]], *, endpoints: Sequence[str]):
        self._lock = threading.Lock()
        self.gauges = gauges
        self.endpoints = frozenset(endpoints)
        """The paths counted under their own label; any other path is counted as endpoint="other"."""
        self.requests: dict[tuple[str, str], int] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram()
        self.latency = Histogram()

    def count_request(self, *, endpoint: str, status: str) -> None:
        with self._lock:
            key = (endpoint if endpoint in self.endpoints else "other", status)
            self.requests[key] = self.requests.get(key, 0) + 1

    def observe(self, *, prompt_tokens: int, generation_tokens: int, ttft_s: float | None, latency_s: float):
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += generation_tokens
            if ttft_s is not None:
                self.ttft.observe(ttft_s)
            self.latency.observe(latency_s)

    def render(self) -> str:
        with self._lock:
            lines = self._counters()
            lines += self._histogram(
                "ecru_time_to_first_token_seconds", "Seconds to the first token", self.ttft
            )
            lines += self._histogram(
                "ecru_request_latency_seconds", "Seconds from arrival to the end", self.latency
            )
        for name, (value, text) in self.gauges().items():
            lines += [f"# HELP {name} {text}", f"# TYPE {name} gauge", f"{name} {_number(value)}"]
        return "\n".join(lines) + "\n"

    def _counters(self) -> list[str]:
        lines = ["# HELP ecru_requests_total Requests answered, by endpoint and HTTP status",
                 "# TYPE ecru_requests_total counter"]  # fmt: skip
        for (endpoint, status), n in sorted(self.requests.items()):
            lines.append(f"ecru_requests_total{_labels({'endpoint': endpoint, 'status': status})} {n}")
        for name, value, text in (
            ("ecru_prompt_tokens_total", self.prompt_tokens, "Prompt tokens of finished requests"),
            (
                "ecru_generation_tokens_total",
                self.generation_tokens,
                "Tokens generated for finished requests",
            ),
        ):
            lines += [f"# HELP {name} {text}", f"# TYPE {name} counter", f"{name} {value}"]
        return lines

    @staticmethod
    def _histogram(name: str, text: str, hist: Histogram) -> list[str]:
        return [f"# HELP {name} {text}", f"# TYPE {name} histogram", *hist.lines(name)]
