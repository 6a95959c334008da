"""The Helm chart, rendered by Helm's own SDK and validated against Kubernetes 1.30 schemas."""

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import helm_python
import kubernetes_validate
import pytest
import yaml
from specserve_runtime.metrics import Metrics

CHART = "charts/specserve"
OPERATOR_MAIN = Path("operator/specserve_operator/main.py")
POD_MONITOR = Path(CHART, "templates", "monitoring.yaml")
# Rendered objects are validated against the oldest Kubernetes the chart admits (Chart.yaml kubeVersion).
MIN_KUBERNETES = re.fullmatch(r">=(\d+\.\d+)\.0-0", yaml.safe_load(Path(CHART, "Chart.yaml").read_text())["kubeVersion"])[1]


@pytest.fixture(scope="module")
def chart():
    loaded = helm_python.Chart.load(CHART)
    yield loaded
    loaded.close()


def rendered_objects(chart, values):
    files = chart.render(values, name="specserve", namespace="specserve-system", is_install=True)
    return [doc for path, text in files.items() if path.endswith(".yaml") for doc in yaml.safe_load_all(text) if doc]


def test_chart_lints_clean():
    assert helm_python.lint(CHART)["errors"] == []


@pytest.mark.parametrize("values", [{}, {"allNamespaces": False, "namespaces": ["team-a", "team-b"]}])
def test_rendered_chart_is_valid_and_least_privileged(chart, values):
    objects = rendered_objects(chart, values)
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == sorted(["ClusterRole", "ClusterRole", "ClusterRoleBinding", "Deployment", "NetworkPolicy", "ServiceAccount",
                            "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
                           + (["ClusterRoleBinding"] if not values else ["RoleBinding", "RoleBinding"]))
    for obj in objects:
        kubernetes_validate.validate(obj, MIN_KUBERNETES, strict=True)
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    expected_scope = ["--all-namespaces"] if not values else ["--namespace=team-a", "--namespace=team-b"]
    assert container["args"] == ["operator"] + expected_scope
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["SPECSERVE_PROMETHEUS_URL"] == ""  # by default the operator scrapes runtime pods directly
    roles = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ClusterRole"}
    assert not any("*" in rule["verbs"] or "*" in rule["resources"] for role in roles.values() for rule in role["rules"])
    assert {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]} in roles["specserve-operator"]["rules"]  # direct scrape
    # The namespaced kinds are granted cluster-wide only when the operator watches every namespace.
    bindings = {(o["kind"], o["metadata"].get("namespace"), o["roleRef"]["name"]) for o in objects if "roleRef" in o}
    assert all(subject == {"kind": "ServiceAccount", "name": "specserve-operator", "namespace": "specserve-system"}
               for o in objects if "roleRef" in o for subject in o["subjects"])
    assert bindings == {("ClusterRoleBinding", None, "specserve-operator-cluster")} | (
        {("ClusterRoleBinding", None, "specserve-operator")} if not values else
        {("RoleBinding", "team-a", "specserve-operator"), ("RoleBinding", "team-b", "specserve-operator")})


def test_a_prometheus_url_with_credentials_comes_from_a_secret_and_the_operator_runs_with_its_own_group(chart):
    objects = rendered_objects(chart, {"prometheus": {"urlSecret": {"name": "prometheus-url", "key": "url"}}})
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    kubernetes_validate.validate(deployment, MIN_KUBERNETES, strict=True)
    pod = deployment["spec"]["template"]["spec"]
    (url,) = [e for e in pod["containers"][0]["env"] if e["name"] == "SPECSERVE_PROMETHEUS_URL"]
    assert url == {"name": "SPECSERVE_PROMETHEUS_URL",
                   "valueFrom": {"secretKeyRef": {"name": "prometheus-url", "key": "url"}}}  # no value in the spec
    assert pod["securityContext"]["runAsGroup"] == 10001

MONITORING_ON = {
    "prometheus": {"url": "http://prometheus.monitoring:9090"},
    "podMonitor": {"enabled": True, "labels": {"release": "kps"}},
    "serviceMonitor": {"enabled": True},
}


def test_monitoring_values_render_prometheus_url_pod_and_service_monitors(chart):
    objects = rendered_objects(chart, MONITORING_ON)
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == ["ClusterRole", "ClusterRole", "ClusterRoleBinding", "ClusterRoleBinding", "Deployment",
                     "NetworkPolicy", "PodMonitor", "Service", "ServiceAccount", "ServiceMonitor",
                     "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    for obj in objects:  # kubernetes-validate has no schemas for monitoring.coreos.com: checked by hand below
        if obj["apiVersion"] != "monitoring.coreos.com/v1":
            kubernetes_validate.validate(obj, MIN_KUBERNETES, strict=True)
    by_kind = {o["kind"]: o for o in objects}
    deployment = by_kind["Deployment"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["SPECSERVE_PROMETHEUS_URL"] == "http://prometheus.monitoring:9090"

    pod_monitor = by_kind["PodMonitor"]
    assert pod_monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert pod_monitor["metadata"]["namespace"] == "specserve-system"
    assert pod_monitor["metadata"]["labels"]["release"] == "kps"
    spec = pod_monitor["spec"]
    assert spec["namespaceSelector"] == {"any": True}
    assert spec["selector"] == {"matchLabels": {"app.kubernetes.io/name": "specserve-runtime"}}
    (endpoint,) = spec["podMetricsEndpoints"]
    assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
    assert endpoint["relabelings"] == [
        {"action": "replace", "sourceLabels": [f"__meta_kubernetes_pod_label_specserve_io_{label}"], "targetLabel": label}
        for label in ("serving", "revision", "tenant")
    ] + [{"action": "replace", "sourceLabels": ["__meta_kubernetes_namespace"], "targetLabel": "namespace"}]

    service, service_monitor = by_kind["Service"], by_kind["ServiceMonitor"]
    assert service["metadata"]["namespace"] == service_monitor["metadata"]["namespace"] == "specserve-system"
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert {"name": "metrics", "containerPort": 9090} in container["ports"]
    assert service_monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert service_monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert service_monitor["spec"]["namespaceSelector"] == {"matchNames": ["specserve-system"]}
    assert service_monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics"}]


def test_pod_monitor_selects_the_runtime_pods_the_operator_renders(chart, example_documents):
    """The PodMonitor's selector, port and relabelings fit the pods of every revision render.py makes."""
    from specserve_operator.render import Settings, render_all
    from specserve_operator.replicas import Traffic
    from specserve_operator.validate import parse_profile, parse_serving

    by_kind = {d["kind"]: d for d in example_documents}
    serving, serving_problems = parse_serving(by_kind["SpeculativeServing"])
    profile, profile_problems = parse_profile(by_kind["ServingProfile"])
    assert serving_problems == [] and profile_problems == []
    deployments = [o for o in render_all(serving, profile, Settings(), Traffic("Canary", 10)) if o["kind"] == "Deployment"]
    assert len(deployments) == 2  # stable and canary

    spec = next(o for o in rendered_objects(chart, MONITORING_ON) if o["kind"] == "PodMonitor")["spec"]
    (endpoint,) = spec["podMetricsEndpoints"]
    prefix = "__meta_kubernetes_pod_label_"
    for deployment in deployments:
        pod = deployment["spec"]["template"]
        assert spec["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        assert endpoint["port"] in [p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])]
        # Prometheus names a pod label's meta label by replacing every character outside [a-zA-Z0-9_] with _.
        meta = {prefix + re.sub(r"[^a-zA-Z0-9_]", "_", key): value for key, value in pod["metadata"]["labels"].items()}
        series = {r["targetLabel"]: meta.get(r["sourceLabels"][0]) for r in endpoint["relabelings"]
                  if r["sourceLabels"][0].startswith(prefix)}
        assert series == {"serving": serving.name, "revision": pod["metadata"]["labels"]["specserve.io/revision"],
                          "tenant": profile.spec.tenant}


def test_chart_carries_both_crds(chart):
    names = sorted(yaml.safe_load(crd["data"])["metadata"]["name"] for crd in chart.crds)
    assert names == ["servingprofiles.specserve.io", "speculativeservings.specserve.io"]


PRIORS = {"dflash": {"acceptanceLength": 4.6, "curve": [
    {"concurrency": 1, "tokensPerSecondPerRequest": 230, "ttftMs": 50},
    {"concurrency": 16, "tokensPerSecondPerRequest": 100, "ttftMs": 180}]}}
EVERYTHING_ON = {
    **MONITORING_ON,
    "allNamespaces": False, "namespaces": ["team-a"],
    "autoscaleIntervalSeconds": 15,
    "replicaStartupSeconds": 300,
    "capacityPriors": PRIORS,
    "profiles": {"team-a-h100": {"tenant": "team-a", "namespaceSelector": {"matchLabels": {"specserve.io/tenant": "team-a"}},
                                 "accelerator": {"pricePerHourUSD": 2.49},
                                 "limits": {"maxReplicas": 8, "maxHourlyCostUSD": 40}}},
}


def test_every_option_on_renders_valid_objects_the_operator_can_read(chart, tmp_path):
    from specserve_operator import api
    from specserve_operator.priors import capacity_priors, load_performance

    objects = rendered_objects(chart, EVERYTHING_ON)
    for obj in objects:  # no schemas for monitoring.coreos.com or our own group in kubernetes-validate
        if obj["apiVersion"] not in ("monitoring.coreos.com/v1", api.API_VERSION):
            kubernetes_validate.validate(obj, MIN_KUBERNETES, strict=True)
    by_kind = {o["kind"]: o for o in objects}
    profile = by_kind["ServingProfile"]
    assert profile["metadata"]["name"] == "team-a-h100"
    api.ServingProfileSpec.model_validate(profile["spec"])  # the CRD's own model
    # The priors ConfigMap is what the operator loads at start-up (SPECSERVE_CAPACITY_PRIORS).
    config_map = by_kind["ConfigMap"]
    (path := tmp_path / "capacity-priors.yaml").write_text(config_map["data"]["capacity-priors.yaml"])
    assert [p.in_flight_per_replica for p in capacity_priors(load_performance(path))["dflash"].points] == [0, 15]  # rows at concurrency 1 and 16
    pod = by_kind["Deployment"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    mount = container["volumeMounts"][0]
    assert env["SPECSERVE_CAPACITY_PRIORS"] == f"{mount['mountPath']}/capacity-priors.yaml"
    assert pod["volumes"][0]["configMap"]["name"] == config_map["metadata"]["name"]
    assert env["SPECSERVE_AUTOSCALE_INTERVAL_SECONDS"] == "15"
    assert env["SPECSERVE_REPLICA_STARTUP_SECONDS"] == "300"
    assert container["args"] == ["operator", "--namespace=team-a"]


def test_a_measured_performance_block_is_a_capacity_prior_the_operator_loads(chart, tmp_path):
    """What `specserve bench --emit-performance` wrote goes into the chart as it is."""
    from specserve_operator.priors import capacity_priors, load_performance

    measured = yaml.safe_load(Path("docs/examples/performance-embedded-cpu.yaml").read_text())
    config_map = next(o for o in rendered_objects(chart, {"capacityPriors": measured}) if o["kind"] == "ConfigMap")
    (path := tmp_path / "priors.yaml").write_text(config_map["data"]["capacity-priors.yaml"])
    assert set(capacity_priors(load_performance(path))) == {"none", "ngram", "eagle3", "dflash"}


def test_the_operator_pod_is_hardened(chart):
    from specserve_operator.commands import add_commands

    deployment = next(o for o in rendered_objects(chart, {}) if o["kind"] == "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}  # kopf standalone: never two at once
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                            "capabilities": {"drop": ["ALL"]}}
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(container["resources"][kind])
    # Probes on kopf's liveness endpoint, at the port `specserve operator` serves it on by default.
    import argparse
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers())
    defaults = parser.parse_args(container["args"])
    health = next(p for p in container["ports"] if p["name"] == "health")
    assert health["containerPort"] == defaults.health_port
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}


@pytest.mark.parametrize("values, named", [
    ({"allNamespaces": "yes"}, "/allNamespaces"),
    ({"podMonitor": {"enabled": True, "lables": {}}}, "lables"),
    ({"prometheusRule": {"enabled": "true"}}, "/prometheusRule/enabled"),
    ({"prometheus": {"url": "prometheus:9090"}}, "/prometheus/url"),
    ({"prometheus": {"urlSecret": {"name": "prometheus-url"}}}, "key"),
    ({"autoscaleIntervalSeconds": 0}, "/autoscaleIntervalSeconds"),
    ({"replicaStartupSeconds": -1}, "/replicaStartupSeconds"),
    ({"capacityPriors": {"dflash": {"curve": [{"concurrency": 1, "tokensPerSecond": 5, "ttftMs": 1}]}}}, "tokensPerSecond"),
    ({"resources": {"limits": {"gpu": 1}}}, "gpu"),
    ({"imagePullPolicy": "Always"}, "imagePullPolicy"),
    ({"profiles": {"team-a": {"tenant": "team-a", "accelerator": {"pricePerHourUSD": 2.49}}}}, "namespaceSelector"),
])
def test_helm_refuses_wrong_values_by_name(chart, values, named):
    with pytest.raises(helm_python.HelmValuesError) as caught:
        chart.render(values, name="specserve", namespace="specserve-system", is_install=True)
    assert named in str(caught.value)


def test_every_value_is_in_the_schema(chart):
    schema = json.loads(Path(CHART, "values.schema.json").read_text())
    defaults = yaml.safe_load(Path(CHART, "values.yaml").read_text())
    assert set(defaults) == set(schema["properties"]) == set(schema["required"])


def test_the_chart_ships_the_generated_admission_policy_unless_it_is_turned_off(chart):
    from specserve_operator.admission import policy

    template = Path(CHART, "templates/admissionpolicy.yaml").read_text().splitlines(keepends=True)
    assert list(yaml.safe_load_all("".join(template[2:-1]))) == policy(), "stale: see the template's first line"
    for values, expected in [({}, policy()), ({"admissionPolicy": {"enabled": False}}, [])]:
        files = chart.render(values, name="specserve", namespace="specserve-system", is_install=True)
        assert [d for d in yaml.safe_load_all(files["specserve/templates/admissionpolicy.yaml"]) if d] == expected
    for document in policy():
        kubernetes_validate.validate(document, MIN_KUBERNETES, strict=True)


def test_notes_say_what_to_run_next(chart):
    notes = chart.render({}, name="specserve", namespace="specserve-system", is_install=True)["specserve/templates/NOTES.txt"]
    assert "kubectl -n specserve-system rollout status deployment/specserve-operator" in notes
    assert "ServingProfile" in notes and "prometheus.url" in notes
    with_profiles = chart.render(EVERYTHING_ON, name="specserve", namespace="specserve-system", is_install=True)
    assert "ServingProfiles installed: team-a-h100" in with_profiles["specserve/templates/NOTES.txt"]


def test_the_operator_admits_only_prometheus_on_its_metrics_port(chart):
    deployment, policy = (next(o for o in rendered_objects(chart, {}) if o["kind"] == kind)
                          for kind in ("Deployment", "NetworkPolicy"))
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    assert rule["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]


CHECKOV = Path(sys.prefix, "checkov", "bin", "checkov")  # a venv of its own (Makefile: its pins clash with pytest's)
CHECKOV_SKIPS = Path("tests/operator/checkov-skips.yaml")


def test_checkov_fails_nothing_but_the_justified_skips(chart, tmp_path):
    """checkov on the chart rendered with default values and with every option on, on what the
    operator renders for the example tenant, and on the Dockerfile. Every failed check must be in checkov-skips.yaml with a one-line reason, and every
    skip there must still be needed: the scan runs without skips and the two sets must be equal."""
    assert CHECKOV.is_file(), f"{CHECKOV} missing: `make setup` installs checkov in its own virtual environment"
    for name, values in (("default", {}), ("everything-on", EVERYTHING_ON)):
        text = "\n---\n".join(yaml.safe_dump(obj) for obj in rendered_objects(chart, values))
        (tmp_path / f"{name}.yaml").write_text(text)
    from specserve_operator.commands import render_file

    runtime_objects = render_file(Path("docs/examples/team-a.yaml"))  # what the operator creates for a tenant
    (tmp_path / "operator-rendered.yaml").write_text("\n---\n".join(yaml.safe_dump(obj) for obj in runtime_objects))
    (tmp_path / "Dockerfile").write_text(Path("Dockerfile").read_text())
    result = subprocess.run(
        [str(CHECKOV), "--directory", str(tmp_path), "--framework", "kubernetes", "dockerfile",
         "--output", "json", "--quiet", "--compact", "--skip-download"],
        check=False, capture_output=True, text=True,  # exit 1 on any failed check: the sets below decide
    )
    reports = json.loads(result.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    assert {r["check_type"] for r in reports} == {"kubernetes", "dockerfile"}, result.stderr[-2000:]
    assert all(r["summary"]["passed"] > 0 for r in reports)  # it really scanned something
    failed = {(c["check_id"], c["resource"]) for r in reports for c in r["results"]["failed_checks"]}
    skips = yaml.safe_load(CHECKOV_SKIPS.read_text())
    assert all(isinstance(reason, str) and len(reason) > 20 for reason in skips.values()), "each skip needs its reason"
    assert {check for check, _ in failed} == set(skips), f"failed: {sorted(failed)}; skips: {sorted(skips)}"


def test_the_grafana_dashboard_ships_for_grafana_s_sidecar_and_every_query_passes_promtool(chart, tmp_path):
    """Per tenant and serving: acceptance (and by position), tokens/s, tokens per dollar, p99s, replicas, the
    rollout and the speculation health, from series the runtimes and the operator export, in valid PromQL."""
    assert not [o for o in rendered_objects(chart, {}) if o["kind"] == "ConfigMap"]  # off by default
    (config_map,) = [o for o in rendered_objects(chart, {"grafanaDashboard": {"enabled": True}}) if o["kind"] == "ConfigMap"]
    kubernetes_validate.validate(config_map, MIN_KUBERNETES, strict=True)
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(config_map["data"]["specserve.json"])
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource", "tenant", "namespace", "serving"]
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    used = assert_exported({expr: (expr, set()) for expr in expressions})
    assert {"vllm:spec_decode_num_accepted_tokens_per_pos_total", "vllm:inter_token_latency_seconds_bucket",
            "vllm:time_to_first_token_seconds_bucket", "specserve_operator_tokens_per_dollar",
            "specserve_operator_desired_replicas", "specserve_operator_rollout_step",
            "specserve_operator_speculation_degraded", "specserve_operator_goodput_tokens_per_second"} <= used
    # Grafana substitutes its variables before Prometheus sees a query: as "All" does, with .*
    rules = [{"record": f"dashboard:query_{index}", "expr": re.sub(r"\$(tenant|namespace|serving)\b", ".*", expr)}
             for index, expr in enumerate(expressions)]
    assert_promtool_accepts({"groups": [{"name": "dashboard", "rules": rules}]}, tmp_path)


def test_the_alert_rules_ship_as_a_prometheus_rule_querying_only_exported_series_and_pass_promtool(chart, tmp_path):
    """rules/specserve.yaml as the PrometheusRule's spec, its {{ $labels }} left to Prometheus, every series and
    label one the runtimes and the operator export (as the chart's monitors label them), in rules promtool accepts."""
    assert not [o for o in rendered_objects(chart, {}) if o["kind"] == "PrometheusRule"]  # off by default
    values = {"prometheusRule": {"enabled": True, "labels": {"release": "kps"}}}
    with pytest.raises(Exception, match="prometheusRule.enabled needs podMonitor.enabled and serviceMonitor.enabled"):
        rendered_objects(chart, values)  # alerts on series that nothing labels would never fire, or always
    values |= {"podMonitor": {"enabled": True}, "serviceMonitor": {"enabled": True}}
    (rule,) = [o for o in rendered_objects(chart, values) if o["kind"] == "PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["metadata"]["namespace"] == "specserve-system"
    assert rule["metadata"]["labels"]["release"] == "kps"
    assert rule["spec"] == yaml.safe_load(Path(CHART, "rules", "specserve.yaml").read_text())
    rules = {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"]}
    assert {"SpecserveSpeculationDegraded", "SpecserveInterTokenLatencyAboveSLO", "SpecserveTimeToFirstTokenAboveSLO",
            "SpecserveRolloutStalled", "SpecserveOperatorDown"} <= set(rules)
    assert "{{ $labels.serving }}" in rules["SpecserveSpeculationDegraded"]["annotations"]["summary"]
    used = assert_exported({alert: (r["expr"], {label for text in r["annotations"].values()
                                                 for label in re.findall(r"\$labels\.(\w+)", text)})
                            for alert, r in rules.items()})
    assert {"vllm:inter_token_latency_seconds_bucket", "specserve_operator_slo_p99_inter_token_latency_seconds",
            "specserve_operator_speculation_degraded", "specserve_operator_rollout_step"} <= used
    assert_promtool_accepts(rule["spec"], tmp_path)


def exported_series() -> tuple[set[str], set[str]]:
    """The sample names and label names Prometheus stores for the runtime and the operator."""
    runtime = Metrics("model", "dflash", "drafter")
    runtime.record_step(num_emitted=3, num_draft_tokens=2, num_accepted=1)  # creates the per-position series
    runtime.of(runtime.rejected, reason="queue_full").inc()
    samples = [sample for family in runtime.registry.collect() for sample in family.samples]
    names = {sample.name for sample in samples} | {"up"}
    labels = {label for sample in samples for label in sample.labels}
    for node in ast.walk(ast.parse(OPERATOR_MAIN.read_text())):  # Counter("name", "doc", [labels])
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("Counter", "Gauge"):
            name = node.args[0].value
            names.add(f"{name}_total" if node.func.id == "Counter" else name)
            labels |= {label.value for label in node.args[2].elts}
    # The PodMonitor copies pod labels onto the series; Prometheus adds its target labels and, through
    # the ServiceMonitor, renames the operator gauges' `namespace` to exported_namespace.
    labels |= set(re.findall(r"targetLabel: (\w+)", POD_MONITOR.read_text()))
    labels |= {"job", "instance", "pod", "container", "endpoint", "exported_namespace"}
    return names, labels


PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset"}


def used_by(expr: str) -> tuple[set[str], set[str]]:
    """The metric names and label names a PromQL expression uses (enough PromQL for the chart's alert rules and dashboard)."""
    labels = set(re.findall(r'(\w+)\s*(?:=~|!~|!=|=)\s*"', expr))
    for grouping in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr):
        labels |= {label.strip() for label in grouping.split(",") if label.strip()}
    bare = re.sub(r'\{[^}]*\}|\[[^\]]*\]|"[^"]*"|\b(?:by|without|on|ignoring)\s*\([^)]*\)', " ", expr)
    names = set(re.findall(r"[A-Za-z_:][\w:]*(?![\w:]|\s*\()", bare)) - PROMQL_WORDS  # not followed by "(": no function
    return names, labels


def assert_exported(queries: dict[str, tuple[str, set[str]]]) -> set[str]:
    """Each query (what it is -> its PromQL and the labels it reads besides) uses only series and labels that the
    runtimes and the operator export, as the chart's monitors label them; the series they use."""
    names, labels = exported_series()
    used = set()
    for what, (expr, read) in queries.items():
        expr_names, expr_labels = used_by(expr)
        expr_labels |= read
        assert expr_names <= names, f"{what}: no such series {sorted(expr_names - names)}"
        assert expr_labels <= labels, f"{what}: no such label {sorted(expr_labels - labels)}"
        used |= expr_names
    return used


def assert_promtool_accepts(rules: dict, tmp_path: Path) -> None:
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    promtool = shutil.which("promtool")
    assert promtool, "promtool comes with Debian's prometheus package, which `make test` installs"
    checked = subprocess.run([promtool, "check", "rules", str(tmp_path / "rules.yml")], capture_output=True, text=True,
                             check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
