"""`/metrics` as a Prometheus parser reads it: names, HELP and TYPE, buckets, escaping, folding, gauges."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ecru.serve.entrypoints.metrics import LATENCY_BUCKETS, ServerMetrics


def families(m: ServerMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(m.render().decode())}


def requests(m: ServerMetrics) -> dict[tuple[str, str], float]:
    samples = families(m)["ecru_requests"].samples
    return {(s.labels["endpoint"], s.labels["status"]): s.value for s in samples}


def test_render_has_every_family_once_with_help_and_type():
    m = ServerMetrics(lambda: {"ecru_queue_length": (3, "waiting")}, endpoints=["/v1/completions"])
    m.count_request(endpoint="/v1/completions", status="200")
    m.count_request(endpoint="/v1/completions", status="200")
    m.observe(prompt_tokens=5, generation_tokens=7, ttft_s=0.2, latency_s=1.5)
    text = m.render().decode()
    assert 'ecru_requests_total{endpoint="/v1/completions",status="200"} 2.0' in text
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types)) == 6 and "_created" not in text
    got = {name: (f.type, f.documentation) for name, f in families(m).items()}
    assert got == {
        "ecru_requests": ("counter", "Requests answered, by endpoint and HTTP status"),
        "ecru_prompt_tokens": ("counter", "Prompt tokens of finished requests"),
        "ecru_generation_tokens": ("counter", "Tokens generated for finished requests"),
        "ecru_time_to_first_token_seconds": ("histogram", "Seconds to the first token"),
        "ecru_request_latency_seconds": ("histogram", "Seconds from arrival to the end"),
        "ecru_queue_length": ("gauge", "waiting"),
    }
    values = {s.name: s.value for f in families(m).values() for s in f.samples if not s.labels}
    assert values["ecru_generation_tokens_total"] == 7 and values["ecru_prompt_tokens_total"] == 5
    assert values["ecru_queue_length"] == 3 and values["ecru_request_latency_seconds_count"] == 1


def test_histogram_buckets_are_cumulative():
    m = ServerMetrics(dict, endpoints=[])
    for v in (0.01, 0.05, 0.3, 3.0, 500.0):
        m.observe(prompt_tokens=1, generation_tokens=1, ttft_s=None, latency_s=v)
    samples = families(m)["ecru_request_latency_seconds"].samples
    buckets = [(float(s.labels["le"]), s.value) for s in samples if s.name.endswith("_bucket")]
    assert [b for b, _ in buckets] == [*LATENCY_BUCKETS, float("inf")]
    assert [n for _, n in buckets] == [2, 2, 2, 3, 3, 3, 4, 4, 4, 4, 4, 5]
    rest = {s.name: s.value for s in samples if not s.name.endswith("_bucket")}
    assert len(rest) == 2 and rest["ecru_request_latency_seconds_count"] == 5
    assert rest["ecru_request_latency_seconds_sum"] == pytest.approx(503.36, rel=1e-12)
    ttft = {s.name: s.value for s in families(m)["ecru_time_to_first_token_seconds"].samples}
    assert ttft["ecru_time_to_first_token_seconds_sum"] == 0  # no ttft observed: sum and count are 0
    assert ttft["ecru_time_to_first_token_seconds_count"] == 0


def test_label_values_are_escaped_and_unknown_endpoints_folded():
    m = ServerMetrics(dict, endpoints=["/health"])
    for path in ('/foo"bar', "/x\\y", "/health", *(f"/p{i}" for i in range(100))):
        m.count_request(endpoint=path, status="404")
    m.count_request(endpoint="/y\nz", status="499")
    assert requests(m) == {("/health", "404"): 1, ("other", "404"): 102, ("other", "499"): 1}
    m = ServerMetrics(dict, endpoints=['/a"b\\c\nd'])
    m.count_request(endpoint='/a"b\\c\nd', status="500")
    assert 'ecru_requests_total{endpoint="/a\\"b\\\\c\\nd",status="500"} 1.0' in m.render().decode()
    assert requests(m) == {('/a"b\\c\nd', "500"): 1}


def test_each_server_counts_apart_and_reads_its_gauges_when_scraped():
    engine = {"ecru_running_requests": (1, "running")}
    a = ServerMetrics(lambda: dict(engine), endpoints=["/health"])
    b = ServerMetrics(dict, endpoints=["/health"])  # a second registry: no name collides
    a.count_request(endpoint="/health", status="200")
    assert requests(a) == {("/health", "200"): 1} and "ecru_requests_total{" not in b.render().decode()
    assert families(a)["ecru_running_requests"].samples[0].value == 1
    engine["ecru_running_requests"] = (4, "running")
    assert families(a)["ecru_running_requests"].samples[0].value == 4
