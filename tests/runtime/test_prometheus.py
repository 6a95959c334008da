"""A real Prometheus server (Debian's package) scrapes `specserve serve` and answers the documented PromQL."""

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import openai
import pytest

from .test_server import MODEL, free_port, specserve_bin, wait_ready

pytestmark = pytest.mark.slow

ACCEPTANCE_LENGTH = (
    "1 + sum(rate(vllm:spec_decode_num_accepted_tokens_total[1m])) / sum(rate(vllm:spec_decode_num_drafts_total[1m]))"
)
P99_ITL = "histogram_quantile(0.99, sum by (le) (rate(vllm:inter_token_latency_seconds_bucket[1m])))"
TOKENS_PER_SECOND = "sum(rate(vllm:generation_tokens_total[1m]))"


def query(prometheus: str, promql: str) -> float | None:
    url = f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    result = json.loads(urllib.request.urlopen(url, timeout=5).read())["data"]["result"]
    return float(result[0]["value"][1]) if result else None


@pytest.fixture(scope="module")
def runtime_and_prometheus(tmp_path_factory):
    binary = shutil.which("prometheus")
    assert binary, "Debian's prometheus package is installed by `make test`"
    work = tmp_path_factory.mktemp("prometheus")
    runtime_port, prometheus_port = free_port(), free_port()
    runtime = subprocess.Popen(
        # Fixed speculation: every step drafts, so the acceptance series exist whatever adaptive speculation would
        # choose on this machine (where plain decoding can win, it drafts little or nothing: adaptive.py).
        [specserve_bin(), "serve", "--method", "dflash", "--speculation", "fixed", "--port", str(runtime_port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    config = work / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: specserve\n    static_configs: [{{targets: ['127.0.0.1:{runtime_port}']}}]\n"
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
        for process in (runtime, prometheus):
            process.terminate()
            process.wait(timeout=60)


def test_promql_reads_acceptance_latency_and_throughput(runtime_and_prometheus):
    runtime, prometheus = runtime_and_prometheus
    client = openai.OpenAI(base_url=runtime + "/v1", api_key="unused", max_retries=0, timeout=120)
    prompts = ["Natalia sold 48 clips in April and half as many in May. How many in total?",
               "Write a Python function that reverses a string."]
    deadline = time.time() + 90
    values = {}
    while time.time() < deadline:
        for prompt in prompts:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                           temperature=0, max_tokens=48)
        values = {name: query(prometheus, promql) for name, promql in
                  (("acceptance", ACCEPTANCE_LENGTH), ("p99_itl", P99_ITL), ("tokens_per_second", TOKENS_PER_SECOND))}
        if all(v is not None and v == v for v in values.values()):  # present and not NaN
            break
        time.sleep(1)
    assert values["acceptance"] > 1.0, values  # the trained DFlash drafter gets drafts accepted
    assert 0 < values["p99_itl"] < 80, values
    assert values["tokens_per_second"] > 0, values
