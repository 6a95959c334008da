"""measure.py: PromQL's histogram_quantile, windows from two scrapes, both sources, and both sources
against real runtimes and a real Prometheus (Debian's 2.42)."""

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from specserve_operator.measure import (
    GENERATION_TOKENS,
    MeasurementError,
    PrometheusSource,
    ScrapeSource,
    Snapshot,
    Target,
    histogram_fraction,
    histogram_quantile,
    parse_metrics,
    promql,
    selector,
    window_between,
    within_slo,
)
from specserve_runtime.metrics import Metrics

INF = math.inf
MODEL = "SmolLM2-135M-Instruct"


# ----- helpers: a local HTTP server, Prometheus, polling ----------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """A tiny HTTP server on loopback in a thread: `answer(path_and_query, headers) -> (status, body)`."""

    def __init__(self, answer):
        outer = self
        self.requests = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                outer.requests.append((self.path, dict(self.headers)))
                status, body = answer(self.path)
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; version=0.0.4" if status == 200 else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def wait_until(condition, timeout: float, what: str):
    """Poll `condition` until it returns something truthy (returned), or fail naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.2)


def start_prometheus(work: Path, scrape_configs: str) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("prometheus")
    assert binary, "Debian's prometheus package is installed by `make test`"
    port = free_port()
    config = work / "prometheus.yml"
    config.write_text("global: {scrape_interval: 1s, evaluation_interval: 1s}\nscrape_configs:\n" + scrape_configs)
    process = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={work / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"

    def ready():
        assert process.poll() is None, f"prometheus exited with {process.returncode}"
        try:
            with urllib.request.urlopen(url + "/-/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    try:
        wait_until(ready, 30, "prometheus to be ready")
    except BaseException:
        stop(process)
        raise
    return process, url


def query(prometheus: str, expression: str) -> list[dict]:
    url = f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expression})
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())["data"]["result"]


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# ----- histogram_quantile on hand-made buckets ------------------------------------------------------

# (0.1, 10) (0.2, 30) (0.5, 40) (+Inf, 40): 10 observations <= 0.1, 20 in (0.1, 0.2], 10 in (0.2, 0.5]
BUCKETS = [(0.1, 10), (0.2, 30), (0.5, 40), (INF, 40)]


def test_quantile_interpolates_linearly_inside_the_bucket():
    assert histogram_quantile(0.05, BUCKETS) == pytest.approx(0.02)  # first bucket: from 0 to 0.1, rank 2 of 10
    assert histogram_quantile(0.5, BUCKETS) == pytest.approx(0.15)  # rank 20: 10 into (0.1, 0.2]'s 20
    assert histogram_quantile(0.99, BUCKETS) == pytest.approx(0.2 + 0.3 * 9.6 / 10)
    assert histogram_quantile(0.99, list(reversed(BUCKETS))) == histogram_quantile(0.99, BUCKETS)  # any order


def test_quantile_in_the_inf_bucket_is_the_highest_finite_bound():
    buckets = [(0.1, 5), (0.2, 8), (INF, 10)]
    assert histogram_quantile(0.9, buckets) == 0.2
    assert histogram_quantile(1.0, buckets) == 0.2


def test_quantile_of_nothing_is_none():
    assert histogram_quantile(0.5, []) is None
    assert histogram_quantile(0.5, [(0.1, 0), (INF, 0)]) is None  # no observations
    assert histogram_quantile(0.5, [(0.1, 3), (0.2, 5)]) is None  # no +Inf bucket
    assert histogram_quantile(0.5, [(INF, 5)]) is None  # one bucket
    assert histogram_quantile(math.nan, BUCKETS) is None
    assert histogram_quantile(0.0, [(0.1, 0), (0.2, 4), (INF, 4)]) is None  # Prometheus: 0/0 = NaN


def test_quantile_outside_zero_to_one_is_infinite_as_in_prometheus():
    assert histogram_quantile(-0.1, BUCKETS) == -INF
    assert histogram_quantile(1.1, BUCKETS) == INF


def test_quantile_forces_monotonic_counts_and_merges_duplicate_bounds():
    # 5 < 10 at 0.2 is raised to 10 (ensureMonotonic): then rank 15 lies 5 into (0.2, 0.3]'s 10
    assert histogram_quantile(0.75, [(0.1, 10), (0.2, 5), (0.3, 20), (INF, 20)]) == pytest.approx(0.25)
    # two buckets with bound 0.1 add up: (0.1, 5) (1, 10); rank 7.5 lies 2.5 into (0.1, 1]'s 5
    assert histogram_quantile(0.75, [(0.1, 2), (0.1, 3), (1.0, 10), (INF, 10)]) == pytest.approx(0.55)


def test_quantile_in_a_first_bucket_at_or_below_zero_is_its_bound():
    assert histogram_quantile(0.25, [(1.0, 4), (-1.0, 2), (INF, 4)]) == -1.0


def test_fraction_interpolates_inside_the_bucket_as_the_quantile_does():
    assert histogram_fraction(0.02, BUCKETS) == pytest.approx(0.05)  # 2 of the first bucket's 10, from 0
    assert histogram_fraction(0.1, BUCKETS) == pytest.approx(0.25)  # at a bound: exactly what it counts
    assert histogram_fraction(0.15, BUCKETS) == pytest.approx(0.5)
    assert histogram_fraction(0.5, list(reversed(BUCKETS))) == 1.0
    assert histogram_fraction(-1.0, BUCKETS) == 0.0
    for q in (0.05, 0.3, 0.5, 0.9, 0.99):
        assert histogram_fraction(histogram_quantile(q, BUCKETS), BUCKETS) == pytest.approx(q)


def test_fraction_beyond_the_highest_finite_bound_counts_the_inf_bucket_as_over():
    buckets = [(0.1, 5), (0.2, 8), (INF, 10)]
    assert histogram_fraction(0.2, buckets) == histogram_fraction(7.0, buckets) == pytest.approx(0.8)


def test_fraction_of_nothing_is_none():
    assert histogram_fraction(0.1, []) is None
    assert histogram_fraction(0.1, [(0.1, 0), (INF, 0)]) is None
    assert histogram_fraction(0.1, [(0.1, 3), (0.2, 5)]) is None  # no +Inf bucket


def test_the_share_within_the_slo_multiplies_the_objectives_judged():
    itl = [(0.025, 50), (0.05, 90), (0.1, 100), (INF, 100)]  # 90% of the gaps within 50 ms
    ttft = [(0.5, 16), (1.0, 20), (INF, 20)]  # 80% of the first tokens within 500 ms
    both = Target("team-a", "qwen", "abc123", 1, itl_objective_ms=50, ttft_objective_ms=500)
    assert within_slo(both, itl, ttft) == pytest.approx(0.9 * 0.8)
    assert within_slo(replace(both, ttft_objective_ms=None), itl, ttft) == pytest.approx(0.9)
    assert within_slo(both, itl, [(0.5, 0), (INF, 0)]) == pytest.approx(0.9)  # no first token in the window
    assert within_slo(replace(both, itl_objective_ms=None, ttft_objective_ms=None), itl, ttft) is None


# ----- histogram_quantile against the real Prometheus ---------------------------------------------

# Served as plain series `hist_bucket{case=..., le=...}`; Prometheus computes
# histogram_quantile(q, sum by (le) (hist_bucket{case="..."})) from the very same numbers.
CASES = {
    "plain": [("0.01", 3), ("0.025", 9), ("0.05", 30), ("0.1", 41), ("0.5", 47), ("+Inf", 50)],
    "inf_heavy": [("0.1", 1), ("0.2", 2), ("+Inf", 40)],
    "non_monotonic": [("0.1", 10), ("0.2", 5), ("0.3", 20), ("1", 18), ("+Inf", 25)],
    "duplicate_bounds": [("0.1", 2), ("1", 3), ("1.0", 4), ("2", 12), ("+Inf", 12)],
    "negative_first": [("-1", 2), ("1", 4), ("+Inf", 6)],
    "empty_first": [("0.5", 0), ("1", 7), ("+Inf", 7)],
    "no_observations": [("0.5", 0), ("1", 0), ("+Inf", 0)],
    "no_inf": [("0.5", 2), ("1", 5)],
}
QUANTILES = [-0.5, 0, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1, 1.5]

# A revision that exists but does nothing: PrometheusSource must say "no traffic", not zeros.
FLAT_RUNTIME = (
    '# TYPE vllm:generation_tokens counter\n'
    'vllm:generation_tokens_total{model_name="m",engine="embedded"} 120\n'
    '# TYPE vllm:request_success counter\n'
    'vllm:request_success_total{model_name="m",engine="embedded",finished_reason="stop"} 3\n'
)


def static_text() -> str:
    lines = [f'hist_bucket{{case="{case}",le="{le}"}} {count}'
             for case, buckets in CASES.items() for le, count in buckets]
    return "\n".join(lines) + "\n" + FLAT_RUNTIME


@pytest.fixture(scope="module")
def static_prometheus(tmp_path_factory):
    """A real Prometheus scraping a local server that serves fixed histograms and a flat runtime."""
    server = LocalServer(lambda path: (200, static_text()))
    process = None
    try:
        target = server.url.removeprefix("http://")
        labels = "{serving: static, revision: flat}"
        process, url = start_prometheus(
            tmp_path_factory.mktemp("prometheus"),
            f"  - job_name: static\n    static_configs: [{{targets: ['{target}'], labels: {labels}}}]\n",
        )
        expected = sum(len(buckets) for buckets in CASES.values())
        wait_until(lambda: (result := query(url, "count(hist_bucket)")) and float(result[0]["value"][1]) == expected,
                   30, "prometheus to have scraped the fixed histograms")
        yield url
    finally:
        if process:
            stop(process)
        server.close()


@pytest.mark.slow
def test_histogram_quantile_equals_prometheus(static_prometheus):
    checked = 0
    for case, served in CASES.items():
        buckets = [(float(le), float(count)) for le, count in served]
        for q in QUANTILES:
            result = query(static_prometheus, f'histogram_quantile({q}, sum by (le) (hist_bucket{{case="{case}"}}))')
            theirs = float(result[0]["value"][1])
            ours = histogram_quantile(q, buckets)
            if math.isnan(theirs):
                assert ours is None, (case, q, ours)
            else:
                assert ours == pytest.approx(theirs, abs=1e-9), (case, q, ours, theirs)
            checked += 1
    assert checked == len(CASES) * len(QUANTILES)


@pytest.mark.slow
def test_histogram_fraction_inverts_prometheus_quantile_and_matches_its_bucket_ratios(static_prometheus):
    checked = 0
    for case in ("plain", "inf_heavy", "duplicate_bounds", "empty_first"):
        buckets = [(float(le), float(count)) for le, count in CASES[case]]
        for q in (0.1, 0.25, 0.5, 0.75, 0.9):
            theirs = float(query(static_prometheus, f'histogram_quantile({q}, sum by (le) (hist_bucket{{case="{case}"}}))')
                           [0]["value"][1])
            if theirs < max(b for b, _ in buckets if b != INF):  # inside a finite bucket: the inverse holds
                assert histogram_fraction(theirs, buckets) == pytest.approx(q), (case, q, theirs)
                checked += 1
        for le, _ in CASES[case][:-1] if case != "duplicate_bounds" else ():  # le="1" would miss le="1.0"
            ratio = query(static_prometheus, f'sum(hist_bucket{{case="{case}",le="{le}"}}) / '
                                             f'sum(hist_bucket{{case="{case}",le="+Inf"}})')
            assert histogram_fraction(float(le), buckets) == pytest.approx(float(ratio[0]["value"][1])), (case, le)
    assert checked >= 12


@pytest.mark.slow
def test_prometheus_source_says_which_series_is_absent_and_when_nothing_happened(static_prometheus):
    source = PrometheusSource(static_prometheus)
    flat = Target(None, "static", "flat", 1)  # no namespace: the selector leaves it out
    # The counter is flat: once Prometheus has two samples in the window, that is "no traffic", not zeros.
    window = wait_until(lambda: (w := source.measure(flat, 5)).missing == "no traffic in the window" and w,
                        30, "two samples of the flat counter")
    assert window.tokens_per_second is None and window.revision == "flat"

    other_namespace = source.measure(Target("team-a", "static", "flat", 1), 5)
    assert other_namespace.missing.startswith(f"no {GENERATION_TOKENS} series")
    assert 'namespace="team-a"' in other_namespace.missing

    assert source.measure(Target(None, "static", "flat", 0), 5).missing == "no ready replicas"


# ----- window_between: two snapshots built from /metrics text ---------------------------------------


def runtime_text(generated=0, drafts=0, accepted_by_position=(), reasons=None, itl=(), ttft=(), e2e=(), queue=(),
                 running=0, waiting=0) -> str:
    """/metrics text exactly as the runtime writes it, after these steps and requests."""
    metrics = Metrics(MODEL, "eagle3", None)
    for position, count in enumerate(accepted_by_position):
        for _ in range(count):  # a step that accepted positions 0..position
            metrics.of(metrics.accepted_per_pos, position=str(position)).inc()
    if generated:
        metrics.of(metrics.generation_tokens).inc(generated)
    if drafts:
        metrics.of(metrics.drafts).inc(drafts)
        metrics.of(metrics.accepted).inc(sum(accepted_by_position))
    for reason, count in (reasons or {}).items():
        metrics.of(metrics.success, finished_reason=reason).inc(count)
    metrics.of(metrics.running).set(running)
    metrics.of(metrics.waiting).set(waiting)
    for histogram, observations in ((metrics.itl, itl), (metrics.ttft, ttft), (metrics.e2e, e2e),
                                    (metrics.queue_time, queue)):
        for seconds in observations:
            metrics.of(histogram).observe(seconds)
    return generate_latest(metrics.registry).decode()


def target(replicas=2, pods=("http://10.0.0.1:8000", "http://10.0.0.2:8000")) -> Target:
    return Target("team-a", "qwen", "abc123", replicas, pods)


def test_parse_metrics_keeps_what_a_window_needs():
    values = parse_metrics(runtime_text(generated=40, drafts=10, accepted_by_position=(6, 2), reasons={"stop": 2}))
    assert values[GENERATION_TOKENS, ""] == 40
    assert values["vllm:spec_decode_num_accepted_tokens_per_pos_total", "1"] == 2
    assert values["vllm:request_success_total", "stop"] == 2
    assert ("vllm:prompt_tokens_total", "") not in values  # not needed


def test_window_between_two_scrapes_of_two_pods():
    pods = target().pod_urls
    before = Snapshot.from_text({
        pods[0]: runtime_text(generated=100, drafts=20, accepted_by_position=(10, 4), reasons={"stop": 2},
                              itl=[0.02] * 10, e2e=[1.0, 1.0]),
        pods[1]: runtime_text(generated=50, running=1),
    })
    after = Snapshot.from_text({
        # pod 0: +200 tokens in 80 drafts, 60 then 20 accepted at positions 0 and 1, 4 requests (1 aborted)
        pods[0]: runtime_text(generated=300, drafts=100, accepted_by_position=(70, 24),
                              reasons={"stop": 5, "abort": 1}, itl=[0.02] * 10 + [0.04] * 99 + [0.3],
                              ttft=[0.05] * 4, e2e=[1.0, 1.0, 2.0, 2.0, 3.0, 3.0], queue=[0.5, 1.5],
                              running=1, waiting=3),
        # pod 1: +100 tokens with no drafts (it shows that per-pod increases add up)
        pods[1]: runtime_text(generated=150, reasons={"length": 1}, e2e=[2.0]),
    })
    window = window_between(before, after, target(), 10.0)
    assert window.missing is None
    assert window.seconds == 10.0 and window.ready_replicas == 2 and window.revision == "abc123"
    assert window.generated_tokens == 300
    assert window.tokens_per_second == 30.0
    assert window.acceptance_length == pytest.approx(1 + 80 / 80)
    assert window.accepted_per_position == pytest.approx((60 / 80, 20 / 80))
    assert window.finished_requests == 5
    # 5 finished, and the requests in the system went from 0 + 1 to 4 + 0 (a gauge that falls is no reset)
    assert window.arrived_requests == 8
    assert window.error_rate == pytest.approx(1 / 5)
    # requests finishing in the window took 10 s + 2 s, over 10 s and 2 replicas: 0.6 in flight per replica
    assert window.in_flight_per_replica == pytest.approx(12.0 / 10 / 2)
    # and of that time 2 s queued beyond the batch (the gauges, sampled twice, play no part)
    assert window.waiting_per_replica == pytest.approx(2.0 / 10 / 2)
    assert window.waiting_requests == 3  # the backlog: queued at the window's end, over the pods
    # the window's 100 new inter-token latencies: 99 in (0.025, 0.05], 1 in (0.2, 0.3]; rank 99 ends the first
    assert window.p99_inter_token_latency_ms == pytest.approx(50.0)
    # 4 first tokens in (0.04, 0.06]: rank 3.96 of 4
    assert window.p99_time_to_first_token_ms == pytest.approx(1000 * (0.04 + 0.02 * 3.96 / 4))
    assert window.hourly_cost_usd is None  # callers price it
    assert window.within_slo is None and window.goodput_per_replica is None  # no objectives to judge against
    # the window's 100 new gaps, 99 at or below 50 ms; its 4 first tokens all within 100 ms
    judged = window_between(before, after, replace(target(), itl_objective_ms=50, ttft_objective_ms=100), 10.0)
    assert judged.within_slo == pytest.approx(99 / 100)
    assert judged.goodput_per_replica == pytest.approx(30.0 * 0.99 / 2)


def test_window_without_drafts_has_no_acceptance_length():
    pod = target().pod_urls[0]
    before = Snapshot.from_text({pod: runtime_text(generated=10)})
    after = Snapshot.from_text({pod: runtime_text(generated=90, reasons={"stop": 2}, e2e=[1.0, 1.0])})
    window = window_between(before, after, target(1, (pod,)), 4.0)
    assert window.missing is None
    assert window.acceptance_length is None and window.accepted_per_position == ()
    assert window.error_rate == 0.0
    assert window.p99_inter_token_latency_ms is None  # no inter-token latency observed


def test_counter_reset_is_no_data_naming_the_pod():
    pods = target().pod_urls
    before = Snapshot.from_text({pods[0]: runtime_text(generated=500), pods[1]: runtime_text(generated=100)})
    # pod 1 restarted (its counter went down) while pod 0 grew more: the sum alone would hide it
    after = Snapshot.from_text({pods[0]: runtime_text(generated=900), pods[1]: runtime_text(generated=20)})
    window = window_between(before, after, target(), 10.0)
    assert window.missing.startswith(f"counter reset on {pods[1]}: {GENERATION_TOKENS} went down")
    assert window.tokens_per_second is None and window.generated_tokens is None


def test_no_traffic_is_no_data_not_zeros():
    pod = target().pod_urls[0]
    text = runtime_text(generated=100, reasons={"stop": 1})
    window = window_between(Snapshot.from_text({pod: text}), Snapshot.from_text({pod: text}), target(1, (pod,)), 10.0)
    assert window.missing == "no traffic in the window"
    assert window.tokens_per_second is None


def test_a_pod_in_one_scrape_only_is_no_data():
    a, b = target().pod_urls
    before = Snapshot.from_text({a: runtime_text(generated=1)})
    after = Snapshot.from_text({a: runtime_text(generated=50), b: runtime_text(generated=50)})
    window = window_between(before, after, target(), 10.0)
    assert window.missing == f"pods changed between the two scrapes (gone: none; new: {b})"


def test_no_ready_replicas_is_no_data():
    pod = target().pod_urls[0]
    snapshot = Snapshot.from_text({pod: runtime_text(generated=1)})
    assert window_between(snapshot, snapshot, target(0, ()), 10.0).missing == "no ready replicas"


# ----- ScrapeSource with an injected fetch and clock --------------------------------------------------


class FakePods:
    """What each pod's /metrics says now, and a clock the test advances."""

    def __init__(self, texts):
        self.texts = texts
        self.now = 100.0

    def fetch(self, url):
        pod = url.removesuffix("/metrics")
        if self.texts.get(pod) is None:
            raise urllib.error.URLError(ConnectionRefusedError(111, "Connection refused"))
        return self.texts[pod]

    def clock(self):
        return self.now


def test_scrape_source_needs_two_scrapes_and_uses_the_elapsed_time():
    a, b = target().pod_urls
    pods = FakePods({a: runtime_text(generated=10), b: runtime_text(generated=10)})
    source = ScrapeSource(fetch=pods.fetch, clock=pods.clock)
    first = source.measure(target(), 30)
    assert first.missing == "first scrape; a window needs two"

    pods.texts = {a: runtime_text(generated=130, reasons={"stop": 1}, e2e=[2.0], running=1, waiting=2),
                  b: runtime_text(generated=50, reasons={"stop": 1}, e2e=[4.0], running=1)}
    pods.now += 12.0  # asked for 30 s, but 12 s passed: rates are over 12 s
    window = source.measure(target(), 30)
    assert window.missing is None
    assert window.seconds == 12.0
    assert window.generated_tokens == 160 and window.tokens_per_second == pytest.approx(160 / 12)
    assert window.in_flight_per_replica == pytest.approx(6.0 / 12 / 2)  # Little's law: 6 s of requests over 12 s

    other = Target("team-b", "qwen", "abc123", 2, (a, b))  # the same revision hash elsewhere has its own baseline
    assert source.measure(other, 30).missing == "first scrape; a window needs two"


def test_scrape_source_unreachable_pod_is_no_data_naming_it_and_keeps_the_baseline():
    a, b = target().pod_urls
    pods = FakePods({a: runtime_text(generated=10), b: runtime_text(generated=10)})
    source = ScrapeSource(fetch=pods.fetch, clock=pods.clock)
    source.measure(target(), 10)

    pods.texts[b] = None
    pods.now += 10
    window = source.measure(target(), 10)
    assert window.missing.startswith(f"cannot scrape {b}/metrics: ")
    assert "Connection refused" in window.missing

    pods.texts = {a: runtime_text(generated=50, reasons={"stop": 1}),
                  b: runtime_text(generated=30, reasons={"stop": 1})}
    pods.now += 10
    window = source.measure(target(), 10)
    assert window.missing is None and window.seconds == 20.0 and window.generated_tokens == 60


def test_scrape_source_with_no_pods_is_no_data():
    source = ScrapeSource(fetch=lambda url: pytest.fail("nothing to scrape"))
    assert source.measure(target(0, ()), 10).missing == "no ready replicas"


# ----- PrometheusSource against canned Prometheus answers ------------------------------------------


def vector(*series) -> str:
    """A Prometheus instant-query answer: series are (labels, value)."""
    result = [{"metric": labels, "value": [1700000000.0, value]} for labels, value in series]
    return json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}})


@pytest.fixture
def canned():
    """A stand-in for Prometheus' HTTP API answering from `answers` (query -> (status, body))."""
    answers = {}

    def answer(path):
        parsed = urllib.parse.urlsplit(path)
        assert parsed.path == "/api/v1/query"
        query_text = urllib.parse.parse_qs(parsed.query)["query"][0]
        server.requested.append(query_text)
        return answers.get(query_text, (200, vector()))

    server = LocalServer(answer)
    server.answers, server.requested = answers, []
    yield server
    server.close()


def test_promql_selects_one_revision():
    queries = promql(Target("team-a", "qwen", "abc123", 3), 60)
    assert selector(Target("team-a", "qwen", "abc123", 3)) == '{namespace="team-a",serving="qwen",revision="abc123"}'
    assert selector(Target(None, "demo", "a", 1)) == '{serving="demo",revision="a"}'
    assert queries["p99_inter_token_latency"] == (
        "histogram_quantile(0.99, sum by (le) (rate(vllm:inter_token_latency_seconds_bucket"
        '{namespace="team-a",serving="qwen",revision="abc123"}[60s])))')
    assert queries["failed_requests"] == ('sum(increase(vllm:request_success_total{namespace="team-a",serving="qwen",'
                                          'revision="abc123",finished_reason=~"abort|error"}[60s]))')
    assert queries["in_flight_per_replica"] == ('sum(increase(vllm:e2e_request_latency_seconds_sum{namespace="team-a",'
                                                'serving="qwen",revision="abc123"}[60s])) / 60 / 3')
    assert queries["in_system_change"] == (
        'sum(delta(vllm:num_requests_running{namespace="team-a",serving="qwen",revision="abc123"}[60s]))'
        ' + sum(delta(vllm:num_requests_waiting{namespace="team-a",serving="qwen",revision="abc123"}[60s]))')
    assert queries["waiting_per_replica"] == ('sum(increase(vllm:request_queue_time_seconds_sum{namespace="team-a",'
                                              'serving="qwen",revision="abc123"}[60s])) / 60 / 3')
    assert queries["waiting_requests"] == 'sum(vllm:num_requests_waiting{namespace="team-a",serving="qwen",revision="abc123"})'



def test_prometheus_source_reads_each_number(canned):
    t = Target("team-a", "qwen", "abc123", 2)
    queries = promql(t, 60)
    canned.answers.update({queries[name]: (200, body) for name, body in {
        "samples": vector(({"instance": "10.0.0.1:8000"}, "61"), ({"instance": "10.0.0.2:8000"}, "60")),
        "tokens_per_second": vector(({}, "100")),
        "generated_tokens": vector(({}, "6000")),
        "p99_inter_token_latency": vector(({}, "0.05")),
        "p99_time_to_first_token": vector(({}, "NaN")),  # no first tokens in the window
        "acceptance_length": vector(({}, "2.5")),
        "drafts": vector(({}, "4000")),
        "accepted_per_position": vector(({"position": "2"}, "1000"), ({"position": "0"}, "3000")),
        "finished_requests": vector(({}, "50")),
        "failed_requests": vector(({}, "1")),
        "in_flight_per_replica": vector(({}, "3.5")),
        "waiting_per_replica": vector(({}, "0.25")),
        "in_system_change": vector(({}, "-4")),
        "waiting_requests": vector(({}, "7")),
    }.items()})
    window = PrometheusSource(canned.url).measure(t, 60)
    assert window.missing is None
    assert window.within_slo is None  # no objectives: the buckets are not asked for
    assert queries["inter_token_latency_buckets"] not in canned.requested
    assert (window.tokens_per_second, window.generated_tokens, window.seconds) == (100, 6000, 60)
    assert window.ms_per_token == pytest.approx(1000 * 3.5 * 2 / 100)  # in the system per generated token
    assert window.p99_inter_token_latency_ms == pytest.approx(50)
    assert window.p99_time_to_first_token_ms is None
    assert window.acceptance_length == 2.5
    assert window.accepted_per_position == (0.75, 0.0, 0.25)
    assert (window.finished_requests, window.error_rate, window.in_flight_per_replica) == (50, 0.02, 3.5)
    assert window.waiting_per_replica == 0.25
    assert window.arrived_requests == 46  # a queue of 4 drained: 50 finished
    assert window.waiting_requests == 7

    judged = replace(t, itl_objective_ms=50, ttft_objective_ms=1000)
    canned.answers[queries["inter_token_latency_buckets"]] = (200, vector(
        ({"le": "0.025"}, "800"), ({"le": "0.05"}, "950"), ({"le": "+Inf"}, "1000")))
    # no first token in the window: the TTFT objective is not judged
    assert PrometheusSource(canned.url).measure(judged, 60).within_slo == pytest.approx(0.95)


def test_prometheus_source_too_few_samples_is_no_data(canned):
    t = Target("team-a", "qwen", "abc123", 2)
    canned.answers[promql(t, 60)["samples"]] = (
        200, vector(({"instance": "10.0.0.1:8000"}, "30"), ({"instance": "10.0.0.2:8000"}, "1")))
    window = PrometheusSource(canned.url).measure(t, 60)
    assert window.missing.startswith("too few samples: ")
    assert "10.0.0.2:8000" in window.missing


def test_prometheus_source_nan_throughput_is_no_data_naming_it(canned):
    t = Target("team-a", "qwen", "abc123", 2)
    queries = promql(t, 60)
    canned.answers[queries["samples"]] = (200, vector(({}, "60")))
    canned.answers[queries["tokens_per_second"]] = (200, vector(({}, "NaN")))
    window = PrometheusSource(canned.url).measure(t, 60)
    assert window.missing.startswith("no value for tokens_per_second")


def test_prometheus_errors_raise_naming_the_url_and_the_cause(canned):
    t = Target("team-a", "qwen", "abc123", 2)
    samples = promql(t, 60)["samples"]
    source = PrometheusSource(canned.url)

    canned.answers[samples] = (503, "Service Unavailable")
    with pytest.raises(MeasurementError, match=rf"Prometheus at {canned.url}/api/v1/query answered HTTP 503"):
        source.measure(t, 60)

    canned.answers[samples] = (400, json.dumps({"status": "error", "errorType": "bad_data", "error": "parse error"}))
    with pytest.raises(MeasurementError, match=r"HTTP 400 .*\(parse error\)"):
        source.measure(t, 60)

    canned.answers[samples] = (200, "<html>not prometheus</html>")
    with pytest.raises(MeasurementError, match="invalid JSON"):
        source.measure(t, 60)

    canned.answers[samples] = (200, json.dumps({"status": "success", "data": {}}))
    with pytest.raises(MeasurementError, match="unexpected shape"):
        source.measure(t, 60)


def test_prometheus_credentials_are_sent_but_never_shown(canned):
    canned.answers[promql(target(), 60)["samples"]] = (500, "")
    host = canned.url.removeprefix("http://")
    with pytest.raises(MeasurementError) as caught:
        PrometheusSource(f"http://reader:s3cr%40t@{host}/").measure(target(), 60)
    assert "s3cr" not in str(caught.value) and "reader" not in str(caught.value)
    assert f"{canned.url}/api/v1/query" in str(caught.value)
    assert canned.requests[-1][1]["Authorization"] == "Basic cmVhZGVyOnMzY3JAdA=="  # reader:s3cr@t


def test_unreachable_prometheus_raises_naming_the_url():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(MeasurementError, match=rf"cannot reach Prometheus at {url}/api/v1/query: .*refused"):
        PrometheusSource(url, timeout=2).measure(target(), 60)


# ----- end to end: two real runtimes, a real Prometheus, both sources ---------------------------------


def specserve_bin() -> str:
    return shutil.which("specserve") or str(Path(sys.executable).parent / "specserve")


def start_runtime(method: str, port: int, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [specserve_bin(), "serve", "--method", method, "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=log.open("w"),
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # two runtimes share two cores
    )


def runtime_ready(base: str, process: subprocess.Popen, log: Path) -> bool:
    assert process.poll() is None, f"runtime exited with {process.returncode}: {log.read_text()[-2000:]}"
    try:
        with urllib.request.urlopen(base + "/ready", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def generated_on(base: str) -> float:
    with urllib.request.urlopen(base + "/metrics", timeout=5) as response:
        return parse_metrics(response.read().decode()).get((GENERATION_TOKENS, ""), 0.0)


def generated_series(revision: str) -> str:
    """The selector of the revision's generated-tokens counter in these tests' Prometheus."""
    return f'vllm:generation_tokens_total{{serving="demo",revision="{revision}"}}'


def prometheus_latest(prometheus: str, revision: str) -> float | None:
    """Prometheus' latest sample of the revision's generated tokens."""
    result = query(prometheus, generated_series(revision))
    return float(result[0]["value"][1]) if result else None


def prometheus_settled(prometheus: str, revision: str, value: float, seconds: int) -> bool:
    """Prometheus' sample of the revision's generated tokens is `value` now and was `value` `seconds` ago.

    A counter only grows, so equal ends mean it was flat in between. Asking for the sample of
    `seconds` ago also asks that Prometheus has one: a series it first scraped after the warm-up
    is young, and increase() over a range that starts before a series assumes the series started
    at zero just before its first sample (1.37-1.44x the real count, seen with 3 s of samples).
    """
    then = query(prometheus, f"{generated_series(revision)} offset {seconds}s")
    return prometheus_latest(prometheus, revision) == value and bool(then) and float(then[0]["value"][1]) == value


@pytest.mark.slow
def test_prometheus_and_scrape_sources_agree_on_real_runtimes(tmp_path):
    import openai

    ports = {"a": free_port(), "b": free_port()}
    methods = {"a": "ar", "b": "eagle3"}
    bases = {revision: f"http://127.0.0.1:{port}" for revision, port in ports.items()}
    logs = {revision: tmp_path / f"runtime-{revision}.log" for revision in ports}
    processes = []
    try:
        runtimes = {revision: start_runtime(methods[revision], ports[revision], logs[revision]) for revision in ports}
        processes += runtimes.values()
        static_configs = "".join(
            f"      - {{targets: ['127.0.0.1:{port}'], labels: {{serving: demo, revision: {revision}}}}}\n"
            for revision, port in ports.items())
        prometheus, prometheus_url = start_prometheus(
            tmp_path, f"  - job_name: specserve\n    static_configs:\n{static_configs}")
        processes.append(prometheus)
        for revision in ports:
            wait_until(lambda: runtime_ready(bases[revision], runtimes[revision], logs[revision]), 120,
                       f"runtime {revision} to be ready")
        clients = {revision: openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
                   for revision, base in bases.items()}
        prompts = ["Write a Python function that reverses a string.",
                   "Natalia sold 48 clips in April and half as many in May. How many in total?",
                   "List three colours of the rainbow."]

        def ask(revision, prompt_list):
            for prompt in prompt_list:
                clients[revision].chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=32)

        def both(prompt_list):
            with ThreadPoolExecutor(2) as pool:
                list(pool.map(lambda revision: ask(revision, prompt_list), ports))

        # Warm up, so that every series exists before the window; then wait until Prometheus has
        # seen the settled counters, flat for `flat_seconds`, before taking the baseline. The
        # Prometheus range below reaches that far back: increase() extrapolates the change it sees
        # to the range's ends (up to 1.1 scrape intervals each side), so a range of a few seconds
        # can read half as much again as happened (1.56x, seen); one of 21 s or more whose samples
        # span it, at most 1.12x. The same factor scales every bucket of a histogram, except one that
        # starts near zero (measure.py's docstring: where the two sources differ); warming up with the
        # window's own prompts starts each bucket at about the count it gains.
        flat_seconds = 20
        both(prompts)
        for revision in ports:
            settled = generated_on(bases[revision])
            wait_until(lambda: prometheus_settled(prometheus_url, revision, settled, flat_seconds), 60,
                       f"prometheus to see {revision} settle")
        targets = {revision: Target(None, "demo", revision, 1, (bases[revision],), itl_objective_ms=25, ttft_objective_ms=200)
                   for revision in ports}
        scrape = ScrapeSource()
        for revision in ports:
            assert scrape.measure(targets[revision], 10).missing == "first scrape; a window needs two"
        started = time.monotonic()

        both(prompts)
        for revision in ports:
            final = generated_on(bases[revision])
            wait_until(lambda: prometheus_latest(prometheus_url, revision) == final, 30,
                       f"prometheus to scrape {revision}'s last tokens")

        # The Prometheus range covers the traffic and the flat samples before the baseline, not the warm-up.
        seconds = math.ceil(time.monotonic() - started) + flat_seconds - 2
        prometheus_source = PrometheusSource(prometheus_url)
        windows = {}
        for revision in ports:
            windows[revision] = (scrape.measure(targets[revision], 10),
                                 prometheus_source.measure(targets[revision], seconds))
        for revision, (direct, via_prometheus) in windows.items():
            # The raw samples behind the Prometheus window, so that a disagreement shows its cause.
            samples = query(prometheus_url, f"{generated_series(revision)}[{seconds}s]")
            context = (revision, seconds, [tuple(v) for v in samples[0]["values"]] if samples else None,
                       direct.generated_tokens, via_prometheus.generated_tokens)
            assert direct.missing is None and via_prometheus.missing is None, context
            # Prometheus extrapolates increase() to the range's ends, so counts agree loosely; ratios
            # of counters scraped together (acceptance, quantiles) agree closely. The two windows
            # differ in length (the Prometheus range also covers idle seconds around the traffic),
            # so per-second averages are compared as totals over each window.
            def over_window(window, per_second):
                return per_second * window.seconds

            assert via_prometheus.generated_tokens == pytest.approx(direct.generated_tokens, rel=0.3), context
            assert (over_window(via_prometheus, via_prometheus.tokens_per_second)
                    == pytest.approx(over_window(direct, direct.tokens_per_second), rel=0.3)), context
            assert via_prometheus.finished_requests == pytest.approx(direct.finished_requests, rel=0.3), context
            assert via_prometheus.arrived_requests == pytest.approx(direct.arrived_requests, rel=0.3), context
            # Request-seconds: the time the prompts spent in the system.
            assert (over_window(via_prometheus, via_prometheus.in_flight_per_replica)
                    == pytest.approx(over_window(direct, direct.in_flight_per_replica), rel=0.3)), context
            assert via_prometheus.p99_inter_token_latency_ms == pytest.approx(direct.p99_inter_token_latency_ms,
                                                                              rel=0.1), context
            assert direct.within_slo is not None, context  # goodput: the same buckets, read the same way
            assert via_prometheus.within_slo == pytest.approx(direct.within_slo, abs=0.05), context
            assert direct.error_rate == via_prometheus.error_rate == 0, context
            assert direct.finished_requests == direct.arrived_requests == len(prompts), context
        (ar_direct, ar_prometheus), (eagle3_direct, eagle3_prometheus) = windows["a"], windows["b"]
        assert ar_direct.acceptance_length is None and ar_prometheus.acceptance_length is None
        assert eagle3_direct.acceptance_length > 1
        assert eagle3_prometheus.acceptance_length == pytest.approx(eagle3_direct.acceptance_length, rel=0.05)
    finally:
        for process in processes:
            stop(process)


def test_scrape_source_gives_each_decider_its_own_window_over_the_same_pods():
    """The autoscaler (every 30 s) and the speculation health or a canary's analysis (every 60 s) scrape the same
    revision, often in the same reconcile: each window spans its own interval, not the time since the other's scrape."""
    a, b = target().pod_urls
    pods = FakePods({a: runtime_text(generated=0), b: runtime_text(generated=0)})
    source = ScrapeSource(fetch=pods.fetch, clock=pods.clock)
    assert source.measure(target(), 30).missing == "first scrape; a window needs two"
    health = []
    for elapsed in (30, 60, 90, 120, 150, 180):
        pods.now, generated = 100.0 + elapsed, 10 * elapsed  # 10 tokens/s per pod, all along
        pods.texts = {a: runtime_text(generated=generated), b: runtime_text(generated=generated)}
        autoscaler = source.measure(target(), 30)
        assert autoscaler.seconds == 30 and autoscaler.tokens_per_second == pytest.approx(20.0)
        if elapsed % 60 == 0:
            health.append(source.measure(target(), 60))  # right after the autoscaler's scrape
    # The first 60 s window is asked for before the source keeps scrapes that old: it spans what there is.
    assert [w.seconds for w in health] == [30, 60, 60]
    assert [w.generated_tokens for w in health] == pytest.approx([600, 1200, 1200])
    assert len(source.scrapes[("team-a", "qwen", "abc123")]) <= 4  # only what a 60 s window can still use
