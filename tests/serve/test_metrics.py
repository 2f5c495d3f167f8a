"""The Prometheus text written by hand: cumulative buckets, sum and count, HELP/TYPE lines."""

from ecru.serve.metrics import Histogram, ServerMetrics, escape


def test_histogram_buckets_are_cumulative():
    h = Histogram(buckets=(0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    assert h.lines("x") == [
        'x_bucket{le="0.1"} 2',
        'x_bucket{le="1"} 3',
        'x_bucket{le="+Inf"} 4',
        "x_sum 3.65",
        "x_count 4",
    ]


def test_render_has_every_family_once_with_help_and_type():
    m = ServerMetrics(lambda: {"ecru_queue_length": (3, "waiting")}, endpoints=["/v1/completions"])
    m.count_request(endpoint="/v1/completions", status="200")
    m.count_request(endpoint="/v1/completions", status="200")
    m.observe(prompt_tokens=5, generation_tokens=7, ttft_s=0.2, latency_s=1.5)
    text = m.render()
    assert 'ecru_requests_total{endpoint="/v1/completions",status="200"} 2' in text
    assert "ecru_generation_tokens_total 7" in text and "ecru_queue_length 3" in text
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types)) == 6
    assert text.endswith("\n") and "ecru_request_latency_seconds_count 1" in text


def test_sum_of_no_observation_is_zero():
    assert Histogram().lines("y")[-2:] == ["y_sum 0", "y_count 0"]


def test_label_values_are_escaped_and_unknown_endpoints_folded():
    assert escape('a"b\\c\nd') == 'a\\"b\\\\c\\nd'
    m = ServerMetrics(dict, endpoints=["/health"])
    for path in ('/foo"bar', "/x\\y", "/health", *(f"/p{i}" for i in range(100))):
        m.count_request(endpoint=path, status="404")
    lines = [line for line in m.render().splitlines() if line.startswith("ecru_requests_total")]
    assert lines == ['ecru_requests_total{endpoint="/health",status="404"} 1',
                     'ecru_requests_total{endpoint="other",status="404"} 102']  # fmt: skip
    m = ServerMetrics(dict, endpoints=['/a"b'])
    m.count_request(endpoint='/a"b', status="500")
    assert 'ecru_requests_total{endpoint="/a\\"b",status="500"} 1' in m.render()
