"""A real Prometheus server (Debian's package) scrapes `specserve serve` and answers the documented PromQL."""

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import openai
import pytest
from prometheus_client import start_http_server

from .test_server import MODEL, free_port, specserve_bin, wait_ready

pytestmark = pytest.mark.slow

ACCEPTANCE_LENGTH = (
    "1 + sum(rate(vllm:spec_decode_num_accepted_tokens_total[1m])) / sum(rate(vllm:spec_decode_num_drafts_total[1m]))"
)
P99_ITL = "histogram_quantile(0.99, sum by (le) (rate(vllm:inter_token_latency_seconds_bucket[1m])))"
TOKENS_PER_SECOND = "sum(rate(vllm:generation_tokens_total[1m]))"
POD_LABELS = {"tenant": "team-a", "namespace": "team-a-apps", "serving": "chat", "revision": "5f3a9c21"}
DASHBOARD = Path(__file__).resolve().parents[2] / "charts" / "specserve" / "dashboards" / "specserve.json"
ALERT_RULES = Path(__file__).resolve().parents[2] / "charts" / "specserve" / "rules" / "specserve.yaml"


def query(prometheus: str, promql: str) -> float | None:
    result = series(prometheus, promql)
    return float(result[0]["value"][1]) if result else None


def series(prometheus: str, promql: str) -> list[dict]:
    url = f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    return json.loads(urllib.request.urlopen(url, timeout=5).read())["data"]["result"]


def chat(runtime: str, max_tokens: int = 48) -> None:
    client = openai.OpenAI(base_url=runtime + "/v1", api_key="unused", max_retries=0, timeout=120)
    for prompt in ("Natalia sold 48 clips in April and half as many in May. How many in total?",
                   "Write a Python function that reverses a string."):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                       temperature=0, max_tokens=max_tokens)


@pytest.fixture(scope="module")
def runtime_and_prometheus(tmp_path_factory):
    binary = shutil.which("prometheus")
    assert binary, "Debian's prometheus package is installed by `make test`"
    work = tmp_path_factory.mktemp("prometheus")
    runtime_port, prometheus_port, operator_port = free_port(), free_port(), free_port()
    operator_metrics, _ = start_http_server(operator_port, addr="127.0.0.1")  # this process's registry: the operator's gauges
    runtime = subprocess.Popen(
        # Fixed speculation: every step drafts, so the acceptance series exist whatever adaptive speculation would
        # choose on this machine (where plain decoding can win, it drafts little or nothing: adaptive.py).
        [specserve_bin(), "serve", "--method", "dflash", "--speculation", "fixed", "--port", str(runtime_port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    config = work / "prometheus.yml"
    # The labels the chart's PodMonitor and ServiceMonitor give the runtime's and the operator's series.
    pod_labels = ", ".join(f"{key}: {value}" for key, value in POD_LABELS.items())
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: ['{ALERT_RULES}']\n"  # the chart's PrometheusRule's spec
        "scrape_configs:\n"
        f"  - job_name: specserve\n    static_configs: [{{targets: ['127.0.0.1:{runtime_port}'], labels: {{{pod_labels}}}}}]\n"
        # prometheus-operator names a ServiceMonitor's job after the Service: specserve-operator-metrics
        f"  - job_name: specserve-operator-metrics\n    static_configs: [{{targets: ['127.0.0.1:{operator_port}'], "
        "labels: {namespace: specserve-system}}]\n"
    )
    prometheus = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={work / 'data'}",
         f"--web.listen-address=127.0.0.1:{prometheus_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        wait_ready(f"http://127.0.0.1:{runtime_port}", runtime)
        yield f"http://127.0.0.1:{runtime_port}", f"http://127.0.0.1:{prometheus_port}"
    finally:
        operator_metrics.shutdown()
        for process in (runtime, prometheus):
            process.terminate()
            process.wait(timeout=60)


def test_promql_reads_acceptance_latency_and_throughput(runtime_and_prometheus):
    runtime, prometheus = runtime_and_prometheus
    deadline = time.time() + 90
    values = {}
    while time.time() < deadline:
        chat(runtime)
        values = {name: query(prometheus, promql) for name, promql in
                  (("acceptance", ACCEPTANCE_LENGTH), ("p99_itl", P99_ITL), ("tokens_per_second", TOKENS_PER_SECOND))}
        if all(v is not None and v == v for v in values.values()):  # present and not NaN
            break
        time.sleep(1)
    assert values["acceptance"] > 1.0, values  # the trained DFlash drafter gets drafts accepted
    assert 0 < values["p99_itl"] < 80, values
    assert values["tokens_per_second"] > 0, values


def test_every_dashboard_query_answers_for_the_serving_it_selects(runtime_and_prometheus):
    """The chart's Grafana dashboard, its variables set as Grafana would for one serving, against a real Prometheus
    scraping a runtime (labelled as the PodMonitor labels it) and the operator's gauges (as its ServiceMonitor)."""
    from specserve_operator import api
    from specserve_operator.main import publish_status

    runtime, prometheus = runtime_and_prometheus
    publish_status(POD_LABELS["namespace"], POD_LABELS["serving"], {
        "canary": None, "autoscaling": {"desiredReplicas": 2}, "metrics": {"tokensPerDollar": 1.5e6, "goodputTokensPerSecond": 420.0},
        "conditions": [{"type": "SpeculationDegraded", "status": "False"}],
        "speculation": {"lastAnalysis": {"acceptanceRatio": 0.97, "speedup": 1.4}}},
        api.Slo(p99_inter_token_latency_ms=50, p99_time_to_first_token_ms=800))
    variables = {"$tenant": POD_LABELS["tenant"], "$namespace": POD_LABELS["namespace"], "$serving": POD_LABELS["serving"]}
    panels = json.loads(DASHBOARD.read_text())["panels"]
    queries = {}
    for panel in panels:
        for target in panel["targets"]:
            expr = target["expr"]
            for name, value in variables.items():
                expr = expr.replace(name, value)
            queries[f"{panel['title']}: {target['expr'][:60]}"] = expr
    deadline, answers = time.time() + 90, {}
    while time.time() < deadline:
        chat(runtime)
        answers = {title: series(prometheus, expr) for title, expr in queries.items()}
        if all(result and all(float(s["value"][1]) == float(s["value"][1]) for s in result) for result in answers.values()):
            break  # every query has series, none NaN
        time.sleep(1)
    empty = [title for title, result in answers.items() if not result]
    assert not empty, f"no series for {empty}"
    for title, result in answers.items():
        for found in result:
            assert found["metric"].get("serving") == POD_LABELS["serving"], (title, found)
            assert float(found["value"][1]) == float(found["value"][1]), (title, found)  # not NaN
    value = {title: float(result[0]["value"][1]) for title, result in answers.items()}
    assert {title.split(":")[0] for title, v in value.items() if "specserve_operator_slo" in title and v in (0.05, 0.8)} == {
        "p99 inter-token latency against the SLO", "p99 time to first token against the SLO"}  # the SLO lines
    assert [v for title, v in value.items() if "specserve_operator_goodput" in title] == [420.0]
    value = {title.split(":")[0]: v for title, v in value.items()}
    assert value["Acceptance length (tokens per verify step)"] > 1
    assert value["Tokens per dollar (operator, last autoscaling window)"] == 1.5e6
    assert value["Rollout"] == -1 and value["Generated tokens/s per ready replica"] > 0
    positions = answers[next(t for t in answers if t.startswith("Acceptance by draft position"))]
    assert sorted(int(s["metric"]["position"]) for s in positions) == list(range(len(positions)))


def test_the_chart_s_latency_alerts_compare_each_serving_with_its_own_slo(runtime_and_prometheus):
    """The chart's alert rules, loaded by the real Prometheus: with the serving's SLO published by the operator far
    below what it measures, its p99 ITL and TTFT alerts go pending for that serving (their join of the runtime's
    series with the operator's SLO gauges matches), and no other alert does for it. (The operator's gauges are this
    process's registry, which other tests fill for servings of their own: their alerts are not this one's.)"""
    from specserve_operator import api
    from specserve_operator.main import publish_status

    runtime, prometheus = runtime_and_prometheus
    publish_status(POD_LABELS["namespace"], POD_LABELS["serving"], {"canary": None, "conditions": []},
                   api.Slo(p99_inter_token_latency_ms=0.001, p99_time_to_first_token_ms=0.001))
    wanted = {"SpecserveInterTokenLatencyAboveSLO", "SpecserveTimeToFirstTokenAboveSLO"}
    deadline, alerts = time.time() + 90, []
    while time.time() < deadline:
        chat(runtime, max_tokens=8)
        url = f"{prometheus}/api/v1/alerts"
        alerts = [alert for alert in json.loads(urllib.request.urlopen(url, timeout=5).read())["data"]["alerts"]
                  if alert["labels"].get("serving") == POD_LABELS["serving"]
                  and alert["labels"].get("exported_namespace", alert["labels"].get("namespace")) == POD_LABELS["namespace"]]
        if {alert["labels"]["alertname"] for alert in alerts} == wanted:
            break
        time.sleep(1)
    firing = {alert["labels"]["alertname"]: alert for alert in alerts}
    assert set(firing) == wanted, sorted(firing)
    for alert in firing.values():
        assert alert["state"] == "pending"  # for: 10m
        assert {k: alert["labels"][k] for k in ("namespace", "serving")} == {
            "namespace": POD_LABELS["namespace"], "serving": POD_LABELS["serving"]}
        assert POD_LABELS["serving"] in alert["annotations"]["summary"]
