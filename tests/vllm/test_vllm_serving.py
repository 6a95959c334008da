"""What the operator renders for `engine: vllm`, served by a real vLLM for each speculator method: ready where the
Deployment probes, answering the openai client, the same greedy text whatever the method, and measured through
a real Prometheus with the chart's PodMonitor relabelling by the operator's own PrometheusSource."""

import json
import os
import re
import shutil
import subprocess
import time

import helm_python
import openai
import pytest
import yaml
from specserve_operator.measure import PrometheusSource, Target
from specserve_runtime.launch import VLLM_ENV
from specserve_runtime.metric_names import DRAFTS, GENERATION_TOKENS, INTER_TOKEN_LATENCY, parse_metrics

from ..operator.test_chart import CHART, MONITORING_ON, rendered_objects
from ..runtime.test_server import free_port
from .conftest import NAMESPACE, SERVED, vllm_program


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def greedy_chat(server, prompt: str, max_tokens: int = 64) -> str:
    response = client(server).chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=max_tokens)
    return response.choices[0].message.content


def test_each_method_is_ready_where_the_deployment_probes_and_says_the_same_greedy_text(vllm_servers, prompts):
    texts = {}
    for method, server in vllm_servers.items():
        assert server.readiness_path == "/health"  # the vLLM revision's probe: vLLM serves no /ready
        models = client(server).models.list()
        assert [m.id for m in models.data] == [SERVED]
        texts[method] = [greedy_chat(server, prompt) for prompt in prompts]
        streamed = client(server).chat.completions.create(
            model=SERVED, messages=[{"role": "user", "content": prompts[0]}], temperature=0, max_tokens=64, stream=True)
        assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices) == texts[method][0]
        completion = client(server).completions.create(model=SERVED, prompt="The capital of France is", max_tokens=8,
                                                       temperature=0)
        assert completion.choices[0].text and completion.usage.completion_tokens == 8
    assert all(text for text in texts["none"])
    for method in ("ngram", "eagle3", "dflash"):
        assert texts[method] == texts["none"], method  # speculation never changes what the target says


def test_the_schedule_and_the_bundled_drafters_reach_vllm_as_rendered(vllm_servers):
    ngram = vllm_servers["ngram"].log.read_text()
    assert re.search(r"num_speculative_tokens_per_batch_size.{0,40}\[\[1, 4, 4\], \[5, 1048576, 2\]\]", ngram), \
        "vLLM started with the batch-size schedule"
    for method in ("eagle3", "dflash"):
        config = vllm_servers[method].config
        assert config["drafter"] == f"bundled://smollm2-135m-instruct-{method}"
        assert "smollm2-135m-instruct-" + method in vllm_servers[method].log.read_text()


def test_vllm_observes_one_inter_token_latency_per_verify_step_and_request(vllm_servers, prompts):
    """What a drafter's capacity prior predicts (capacity.Prior.step_gaps): vLLM's inter-token latency is the gap
    between a request's emissions, one per verify step whatever number of tokens the step yields. Read with the
    parser of the operator's pod scrapes."""
    keys = ((f"{INTER_TOKEN_LATENCY}_bucket", "+Inf"), (GENERATION_TOKENS, ""), (DRAFTS, ""))

    def totals(server) -> list[float]:
        values = parse_metrics(server.metrics())
        return [values.get(key, 0.0) for key in keys]

    counted = {}
    for method in ("none", "dflash"):
        server = vllm_servers[method]
        before = totals(server)
        for prompt in prompts:
            greedy_chat(server, prompt, 48)
        counted[method] = [after - b for after, b in zip(totals(server), before)]
    gaps, tokens, drafts = counted["none"]
    assert gaps == tokens - len(prompts) and drafts == 0  # plain decoding: one gap per token after the first
    gaps, tokens, drafts = counted["dflash"]
    assert gaps == drafts, counted  # one gap per drafting step of a request
    assert gaps * 1.5 < tokens - len(prompts), counted  # each step yields the tokens accepted (>= 1.5 a step here)


def relabel_configs(pod_monitor: dict) -> list[dict]:
    """A PodMonitor endpoint's relabelings as Prometheus' relabel_configs, as the Prometheus operator writes them."""
    (endpoint,) = pod_monitor["spec"]["podMetricsEndpoints"]
    names = {"sourceLabels": "source_labels", "targetLabel": "target_label", "action": "action", "regex": "regex",
             "replacement": "replacement", "separator": "separator"}
    return [{names[key]: value for key, value in rule.items()} for rule in endpoint["relabelings"]]


def pod_target(server) -> dict:
    """A static target carrying the meta labels Kubernetes service discovery gives the pod's endpoint."""
    labels = {"__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", key): value
              for key, value in server.pod_labels.items()}
    return {"targets": [server.url.removeprefix("http://")],
            "labels": {**labels, "__meta_kubernetes_namespace": server.serving.namespace}}


@pytest.fixture(scope="module")
def prometheus(vllm_servers, tmp_path_factory):
    binary = shutil.which("prometheus")
    assert binary, "Debian's prometheus package is installed by `make test`"
    chart = helm_python.Chart.load(CHART)
    try:
        pod_monitor = next(o for o in rendered_objects(chart, MONITORING_ON) if o["kind"] == "PodMonitor")
    finally:
        chart.close()
    work = tmp_path_factory.mktemp("prometheus")
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "scrape_configs": [{"job_name": "specserve-runtime", "metrics_path": "/metrics",
                                  "static_configs": [pod_target(server) for server in vllm_servers.values()],
                                  "relabel_configs": relabel_configs(pod_monitor)}]}
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    process = subprocess.Popen([binary, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
                                f"--web.listen-address=127.0.0.1:{port}"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_prometheus_measures_every_revision_through_the_charts_relabelling(vllm_servers, prompts, prometheus):
    """The operator's own PrometheusSource, on the series of each revision's pod as the PodMonitor labels them:
    both bundled drafters have their drafts accepted by vLLM, 1.5 tokens a step or more."""
    source = PrometheusSource(prometheus)
    targets = {method: Target(NAMESPACE, server.serving.name, server.pod_labels["specserve.io/revision"], 1)
               for method, server in vllm_servers.items()}
    windows, deadline = {}, time.monotonic() + 300
    while time.monotonic() < deadline:
        for server in vllm_servers.values():
            for prompt in prompts:
                greedy_chat(server, prompt, 48)
        windows = {method: source.measure(target, 120) for method, target in targets.items()}
        drafting = [windows[m] for m in ("ngram", "eagle3", "dflash")]
        if all(w.missing is None for w in windows.values()) and all(w.acceptance_length for w in drafting):
            break
    assert all(w.missing is None and w.tokens_per_second > 0 and w.error_rate == 0 for w in windows.values()), windows
    assert windows["none"].acceptance_length is None  # no drafts: no acceptance, not 1.0
    assert windows["ngram"].acceptance_length > 1.0, windows["ngram"]
    for method in ("eagle3", "dflash"):
        assert windows[method].acceptance_length >= 1.5, windows[method]
        assert len(windows[method].accepted_per_position) >= 3, windows[method]
    print(json.dumps({method: {"acceptance_length": round(w.acceptance_length or 1, 3),
                               "tokens_per_second": round(w.tokens_per_second, 1),
                               "p99_itl_ms": w.p99_inter_token_latency_ms} for method, w in windows.items()}))


def test_the_local_canary_runs_both_revisions_on_vllm_through_the_same_launcher():
    """`specserve canary` with engine=vllm in both SPECs: two vLLMs started by `specserve launch`, measured and
    decided by the operator's code."""
    from ..runtime.test_server import specserve_bin

    run = subprocess.run([specserve_bin(), "canary", "--stable", "engine=vllm,method=eagle3",
                          "--candidate", "engine=vllm,method=dflash", "--steps", "50,100", "--interval-seconds", "10",
                          "--json"],
                         capture_output=True, text=True, timeout=900, env={**os.environ, VLLM_ENV: vllm_program()})
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert result["stable"]["speculator"] == {"method": "eagle3", "engine": "vllm"}
    assert result["decision"] in ("Promoted", "Aborted") and result["analyses"], result["reason"]
    for analysis in result["analyses"]:
        for role in ("stable", "candidate"):
            assert analysis[role]["missing"] is None and analysis[role]["acceptance_length"] >= 1.5, analysis


def test_bench_measures_vllm_beside_the_embedded_engine_on_the_same_prompts():
    """`specserve bench --baselines vllm`: a row for vLLM, started through the same launcher, on the same prompt
    token ids and threads as the engine's methods."""
    from ..runtime.test_server import specserve_bin

    run = subprocess.run([specserve_bin(), "bench", "--methods", "ar", "--baselines", "vllm", "--per-category", "1",
                          "--max-new-tokens", "16", "--json"],
                         capture_output=True, text=True, timeout=900, env={**os.environ, VLLM_ENV: vllm_program()})
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in run.stdout.splitlines() if line.startswith("| ")}
    assert "ar" in rows and "vllm" in rows, run.stdout
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["methods"]["vllm"]["tokens"] > 0 and summary["methods"]["vllm"]["tokens_per_second"] > 0, summary
