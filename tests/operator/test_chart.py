"""The Helm chart, rendered by Helm's own SDK and validated against Kubernetes 1.30 schemas."""

import helm_python
import kubernetes_validate
import pytest
import yaml

CHART = "charts/specserve"


@pytest.fixture(scope="module")
def chart():
    loaded = helm_python.Chart.load(CHART)
    yield loaded
    loaded.close()


def rendered_objects(chart, values):
    files = chart.render(values, name="specserve", namespace="specserve-system", is_install=True)
    return [doc for text in files.values() for doc in yaml.safe_load_all(text) if doc]


def test_chart_lints_clean():
    assert helm_python.lint(CHART)["errors"] == []


@pytest.mark.parametrize("values", [{}, {"allNamespaces": False, "namespaces": ["team-a", "team-b"]}])
def test_rendered_chart_is_valid_and_least_privileged(chart, values):
    objects = rendered_objects(chart, values)
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "Deployment", "ServiceAccount"]
    for obj in objects:
        kubernetes_validate.validate(obj, "1.30", strict=True)
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    expected_scope = ["--all-namespaces"] if not values else ["--namespace=team-a", "--namespace=team-b"]
    assert container["args"] == ["operator"] + expected_scope
    role = next(o for o in objects if o["kind"] == "ClusterRole")
    assert not any("*" in rule["verbs"] or "*" in rule["resources"] for rule in role["rules"])


def test_chart_carries_both_crds(chart):
    names = sorted(yaml.safe_load(crd["data"])["metadata"]["name"] for crd in chart.crds)
    assert names == ["servingprofiles.specserve.io", "speculativeservings.specserve.io"]
