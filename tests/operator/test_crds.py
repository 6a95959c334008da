"""The CRDs: generated from the models, committed, schema-valid, and enforcing the same rules as the models."""

import copy
from pathlib import Path

import celpy
import kubernetes_validate
import pytest
import yaml
from jsonschema import Draft4Validator

from specserve_operator import api
from specserve_operator.apply import KINDS, RBAC_RULES, cluster_roles
from specserve_operator.crd import all_crds, render_yaml
from specserve_operator.validate import parse_profile, parse_serving

CRD_DIR = Path("crds")


def crd_schema(kind: str) -> dict:
    crd = next(c for c in all_crds().values() if c["spec"]["names"]["kind"] == kind)
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_committed_crds_are_the_generated_ones():
    for name, crd in all_crds().items():
        assert (CRD_DIR / name).read_text() == render_yaml(crd), f"crds/{name} is stale: run `specserve crds --out crds`"


def test_crds_command_writes_both_files_or_names_the_path_it_cannot_write(tmp_path, capsys):
    from specserve.cli import main

    assert main(["crds", "--out", str(tmp_path / "out")]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(all_crds())
    capsys.readouterr()
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert main(["crds", "--out", str(blocked / "out")]) == 2
    assert capsys.readouterr().err.strip() == f"specserve: error: {blocked / 'out'}: Not a directory"


def test_crds_are_valid_kubernetes_objects_with_subresources_and_columns():
    for path in CRD_DIR.glob("*.yaml"):
        crd = yaml.safe_load(path.read_text())
        kubernetes_validate.validate(crd, "1.30", strict=True)
        version = crd["spec"]["versions"][0]
        assert "status" in version["subresources"]
        assert version["additionalPrinterColumns"] and crd["spec"]["names"]["shortNames"]
    servings = yaml.safe_load((CRD_DIR / "specserve.io_speculativeservings.yaml").read_text())
    assert servings["spec"]["versions"][0]["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas.desired"
    assert servings["spec"]["scope"] == "Namespaced"
    profiles = yaml.safe_load((CRD_DIR / "specserve.io_servingprofiles.yaml").read_text())
    assert profiles["spec"]["scope"] == "Cluster"


def printer_columns(kind: str) -> list[dict]:
    crd = next(c for c in all_crds().values() if c["spec"]["names"]["kind"] == kind)
    return crd["spec"]["versions"][0]["additionalPrinterColumns"]


def test_every_printer_column_reads_a_field_of_its_schema_with_the_column_s_type():
    """`kubectl get ssv` shows what a platform team watches: acceptance length and tokens per dollar beside the phase."""
    types = {"string": "string", "integer": "integer", "number": "number", "date": "string"}
    for kind in ("SpeculativeServing", "ServingProfile"):
        for column in printer_columns(kind):
            node = {"properties": {**crd_schema(kind)["properties"],
                                   "metadata": {"properties": {"creationTimestamp": {"type": "string"}}}}}
            for part in column["jsonPath"].strip(".").split("."):
                node = node["properties"][part]
            assert node["type"] == types[column["type"]], column
    columns = {c["name"]: c["jsonPath"] for c in printer_columns("SpeculativeServing")}
    assert columns["Acceptance"] == ".status.metrics.acceptanceLength"
    assert columns["Tokens/$"] == ".status.metrics.tokensPerDollar"


def _walk(schema: dict):
    yield schema
    for child in list((schema.get("properties") or {}).values()) + [schema.get("items"), schema.get("additionalProperties")]:
        if isinstance(child, dict):
            yield from _walk(child)


def test_schemas_are_structural():
    for kind in ("SpeculativeServing", "ServingProfile"):
        for node in _walk(crd_schema(kind)):
            assert "$ref" not in node and "anyOf" not in node and "oneOf" not in node
            assert "type" in node or node.get("x-kubernetes-int-or-string"), node


def test_examples_validate_against_the_crd_schemas(example_documents):
    for doc in example_documents:
        if doc["kind"] in ("SpeculativeServing", "ServingProfile"):
            Draft4Validator(crd_schema(doc["kind"])).validate(doc)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda s: s["rollout"]["steps"].__setitem__(0, {"weight": 0}),
        lambda s: s["replicas"].__setitem__("min", -1),
        lambda s: s["speculator"].__setitem__("method", "medusa"),
        lambda s: s["model"].__setitem__("uri", "ftp://model"),
        lambda s: s["speculator"].__setitem__("numSpeculativeTokens", 0),
    ],
)
def test_invalid_examples_are_rejected_by_the_schema(example_documents, mutate):
    serving = copy.deepcopy(next(d for d in example_documents if d["kind"] == "SpeculativeServing"))
    mutate(serving["spec"])
    assert list(Draft4Validator(crd_schema("SpeculativeServing")).iter_errors(serving))


def _cel_rules(schema: dict, path=()):
    """(path, rule) of every CEL rule under the schema; "[]" in a path stands for each item of a list."""
    for rule in schema.get("x-kubernetes-validations", []):
        yield path, rule
    for name, child in (schema.get("properties") or {}).items():
        yield from _cel_rules(child, path + (name,))
    if "items" in schema:
        yield from _cel_rules(schema["items"], path + ("[]",))


def _nodes(node, path):
    if not path:
        yield node
    elif path[0] == "[]":
        for item in node if isinstance(node, list) else []:
            yield from _nodes(item, path[1:])
    elif isinstance(node, dict) and path[0] in node:
        yield from _nodes(node[path[0]], path[1:])


def _evaluate_cel(spec: dict, kind: str = "SpeculativeServing") -> list[str]:
    """Run every CEL rule of the kind's spec schema on the spec, as the API server would (K8s list helpers added)."""
    environment = celpy.Environment()

    def is_sorted(values):
        values = list(values)
        return celpy.celtypes.BoolType(all(a <= b for a, b in zip(values, values[1:])))

    failures = []
    for path, rule in _cel_rules(crd_schema(kind)["properties"]["spec"]):
        program = environment.program(environment.compile(rule["rule"]), functions={"isSorted": is_sorted})
        for node in _nodes(spec, path):
            if not program.evaluate({"self": celpy.json_to_cel(node)}):
                failures.append(rule["message"])
    return failures


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda s: s.__setitem__("replicas", {"min": 3, "max": 2}), "min must be <= max"),
        (lambda s: s["rollout"].__setitem__("steps", [{"weight": 50}, {"weight": 10}]), "step weights must strictly increase"),
        (lambda s: s["rollout"].__setitem__("steps", [{"weight": 50}, {"weight": 50}]), "step weights must strictly increase"),
        (lambda s: s["speculator"].pop("draftModel"), "dflash and eagle3 need a draftModel"),
        (lambda s: s["traffic"].pop("gateway"), "GatewayAPI mode needs a gateway"),
        (lambda s: s.__setitem__("speculator", {"method": "none", "numSpeculativeTokens": 3}), "method none takes no numSpeculativeTokens"),
        (lambda s: s.__setitem__("speculator", {"method": "ngram", "draftTree": False}), "draftTree is for methods dflash and eagle3"),
        # The example's stable runtime is vLLM, where specserve drafts chains; the candidate inherits it.
        (lambda s: s["speculator"].__setitem__("draftTree", True), api.TREE_NEEDS_EMBEDDED),
        (lambda s: s["rollout"]["candidate"]["speculator"].__setitem__("draftTree", True), api.TREE_NEEDS_EMBEDDED),
        (lambda s: (s["runtime"].__setitem__("engine", "embedded"), s["rollout"]["candidate"].update(
            speculator={"method": "dflash", "draftModel": "bundled://smollm2-135m-instruct-dflash", "draftTree": True},
            runtime={"engine": "vllm"})), api.TREE_NEEDS_EMBEDDED),
        (lambda s: s.__setitem__("speculator", {"method": "ngram", "promptLookup": 0}), "promptLookup is for methods dflash and eagle3"),
        (lambda s: s.__setitem__("speculationHealth", {"fallback": {"speculator": {
            "method": "eagle3", "draftModel": "hf://org/eagle3", "draftTree": True}}}), api.FALLBACK_IS_SIMPLE),
        (lambda s: s.__setitem__("speculationHealth", {"fallback": {"speculator": {"method": "dflash"}}}),
         "dflash and eagle3 need a draftModel"),
        (lambda s: s["speculator"].__setitem__("promptLookup", 4), api.LOOKUP_NEEDS_EMBEDDED),
        (lambda s: s.__setitem__("speculationHealth", {"minAcceptanceRatio": 0.6, "severeAcceptanceRatio": 0.7}),
         api.SEVERE_BELOW_MIN),
        (lambda s: s["rollout"]["candidate"]["speculator"].__setitem__("promptLookup", 4), api.LOOKUP_NEEDS_EMBEDDED),
        (lambda s: s.__setitem__("speculator", {"method": "none", "numSpeculativeTokensPerBatchSize": [
            {"minBatchSize": 1, "numSpeculativeTokens": 0}]}), "numSpeculativeTokensPerBatchSize: method none drafts nothing"),
        *[(lambda s, ranges=ranges: s["speculator"].__setitem__("numSpeculativeTokensPerBatchSize", ranges), api.SCHEDULE_COVERS)
          for ranges in [
              [{"minBatchSize": 2, "numSpeculativeTokens": 3}],  # batch size 1 has no count
              [{"minBatchSize": 1, "maxBatchSize": 4, "numSpeculativeTokens": 3},  # 5 is missing
               {"minBatchSize": 6, "numSpeculativeTokens": 1}],
              [{"minBatchSize": 1, "maxBatchSize": 4, "numSpeculativeTokens": 3},  # 3-4 twice
               {"minBatchSize": 3, "numSpeculativeTokens": 1}],
              [{"minBatchSize": 5, "numSpeculativeTokens": 1},  # out of order
               {"minBatchSize": 1, "maxBatchSize": 4, "numSpeculativeTokens": 3}],
              [{"minBatchSize": 1, "numSpeculativeTokens": 3},  # open before the last
               {"minBatchSize": 2, "maxBatchSize": 8, "numSpeculativeTokens": 1}],
              [{"minBatchSize": 1, "maxBatchSize": 4, "numSpeculativeTokens": 3},
               {"minBatchSize": 5, "maxBatchSize": 3, "numSpeculativeTokens": 1}],  # a range ending before it starts
          ]],
        (lambda s: s["speculator"].__setitem__("numSpeculativeTokensPerBatchSize", [
            {"minBatchSize": 1, "maxBatchSize": 4, "numSpeculativeTokens": 8},  # the stable drafts 7 at the most
            {"minBatchSize": 5, "numSpeculativeTokens": 1}]), "numSpeculativeTokensPerBatchSize: no range drafts more than "
                                                             "numSpeculativeTokens"),
        *[(lambda s, args=args: s["runtime"].__setitem__("args", args), api.RESERVED_FLAG)
          for args in [["--speculative-config", "{}"], ["--speculative_config.method", "ngram"], ["--port=1"],
                       ["--served-model-name", "x"], ["--dtype", "half", "--config", "f.yaml"]]],
        (lambda s: s["rollout"]["candidate"].__setitem__("runtime", {"args": ["--model", "x"]}), api.RESERVED_FLAG),
        (lambda s: s["runtime"].__setitem__("resources", {"limits": {"nvidia.com/gpu": 8}}), api.TENANT_RESOURCES_ONLY),
        (lambda s: s.__setitem__("speculationHealth", {"fallback": {"speculator": dict(s["speculator"])}}),
         api.FALLBACK_DIFFERS),
        (lambda s: s["rollout"]["candidate"].__setitem__("runtime", {"resources": {"requests": {"amd.com/gpu": 1}}}),
         api.TENANT_RESOURCES_ONLY),
    ],
)
def test_cel_rules_and_model_validators_reject_the_same_specs(example_documents, mutate, message):
    serving = copy.deepcopy(next(d for d in example_documents if d["kind"] == "SpeculativeServing"))
    assert _evaluate_cel(serving["spec"]) == [] and parse_serving(serving)[1] == []
    mutate(serving["spec"])
    assert message in _evaluate_cel(serving["spec"])
    assert parse_serving(serving)[1], "the operator's own validation rejects it too"


@pytest.mark.parametrize(
    "expression, message",
    [
        ({"key": "specserve.io/tier", "operator": "In"}, api.SELECTOR_SET_NEEDS_VALUES),
        ({"key": "specserve.io/tier", "operator": "NotIn", "values": []}, api.SELECTOR_SET_NEEDS_VALUES),
        ({"key": "specserve.io/tier", "operator": "Exists", "values": ["gold"]}, api.SELECTOR_PRESENCE_TAKES_NO_VALUES),
    ],
)
def test_a_namespace_selector_requirement_is_checked_as_kubernetes_checks_it(example_documents, expression, message):
    profile = copy.deepcopy(next(d for d in example_documents if d["kind"] == "ServingProfile"))
    profile["spec"]["namespaceSelector"]["matchExpressions"] = [{"key": "specserve.io/tier", "operator": "In",
                                                                 "values": ["gold"]}]
    assert _evaluate_cel(profile["spec"], "ServingProfile") == [] and parse_profile(profile)[1] == []
    profile["spec"]["namespaceSelector"]["matchExpressions"] = [expression]
    assert _evaluate_cel(profile["spec"], "ServingProfile") == [message]
    assert parse_profile(profile)[1] == [f"spec.namespaceSelector.matchExpressions[0].{message}"]


def test_a_profile_must_say_which_namespaces_it_serves(example_documents):
    """A forgotten selector would let every namespace spend this tenant's accelerators and budget."""
    profile = copy.deepcopy(next(d for d in example_documents if d["kind"] == "ServingProfile"))
    del profile["spec"]["namespaceSelector"]
    assert [e.message for e in Draft4Validator(crd_schema("ServingProfile")).iter_errors(profile)] == [
        "'namespaceSelector' is a required property"]
    assert parse_profile(profile)[1] == ["spec.namespaceSelector: Field required"]
    profile["spec"]["namespaceSelector"] = {}  # every namespace, said out loud
    assert parse_profile(profile)[1] == []


@pytest.mark.parametrize("field, entries", [("allowedMethods", ["ngram", "dflash", "ngram"]),
                                             ("allowedImages", ["registry.example/team-a/", "registry.example/team-a/"])])
def test_a_profile_allow_list_names_each_entry_once(example_documents, field, entries):
    """The API server refuses a duplicate in a list of type set ('Duplicate value'); the model names it."""
    assert crd_schema("ServingProfile")["properties"]["spec"]["properties"]["limits"]["properties"][field][
        "x-kubernetes-list-type"] == "set"
    profile = copy.deepcopy(next(d for d in example_documents if d["kind"] == "ServingProfile"))
    profile["spec"]["limits"][field] = entries
    assert parse_profile(profile)[1] == [f"spec.limits.{field}: listed more than once: {entries[0]}"]
    profile["spec"]["limits"][field] = sorted(set(entries))
    assert parse_profile(profile)[1] == []


def test_a_draft_tree_and_a_lookup_branch_are_accepted_where_the_engine_is_embedded(example_documents):
    serving = copy.deepcopy(next(d for d in example_documents if d["kind"] == "SpeculativeServing"))
    serving["spec"]["speculator"]["promptLookup"] = 0  # none: vLLM runs that
    candidate = serving["spec"]["rollout"]["candidate"]
    candidate["speculator"]["draftTree"], candidate["runtime"] = True, {"engine": "embedded"}  # stable stays on vLLM
    candidate["speculator"]["promptLookup"] = 4
    assert _evaluate_cel(serving["spec"]) == [] and parse_serving(serving)[1] == []
    serving["spec"]["speculator"] = candidate["speculator"]
    serving["spec"]["runtime"]["engine"] = "embedded"
    assert _evaluate_cel(serving["spec"]) == [] and parse_serving(serving)[1] == []


def test_a_batch_size_schedule_that_covers_every_batch_size_once_is_accepted(example_documents):
    serving = copy.deepcopy(next(d for d in example_documents if d["kind"] == "SpeculativeServing"))
    serving["spec"]["speculator"]["numSpeculativeTokensPerBatchSize"] = [
        {"minBatchSize": 1, "maxBatchSize": 4, "numSpeculativeTokens": 7},
        {"minBatchSize": 5, "maxBatchSize": 5, "numSpeculativeTokens": 3},
        {"minBatchSize": 6, "numSpeculativeTokens": 0}]
    serving["spec"]["rollout"]["candidate"]["speculator"]["numSpeculativeTokensPerBatchSize"] = [
        {"minBatchSize": 1, "maxBatchSize": 64, "numSpeculativeTokens": 15}]
    assert _evaluate_cel(serving["spec"]) == [] and parse_serving(serving)[1] == []


def test_every_problem_of_a_batch_size_schedule_is_named_at_once(example_documents):
    serving = copy.deepcopy(next(d for d in example_documents if d["kind"] == "SpeculativeServing"))
    serving["spec"]["speculator"]["numSpeculativeTokensPerBatchSize"] = [
        {"minBatchSize": 1, "numSpeculativeTokens": 9},  # open before the last, and more than numSpeculativeTokens
        {"minBatchSize": 3, "maxBatchSize": 8, "numSpeculativeTokens": 1}]  # a gap
    at = "spec.speculator.numSpeculativeTokensPerBatchSize"
    assert parse_serving(serving)[1] == [
        f"{at}[0].maxBatchSize: only the last range may be open-ended",
        f"{at}[0].numSpeculativeTokens: 9 exceeds the 7 drafts a step this speculator takes",
        f"{at}[1].minBatchSize: 3, expected 2 (the ranges are ordered and cover every batch size from 1 once, with no "
        "gap or overlap)"]


def test_chart_ships_the_generated_crds():
    for name in all_crds():
        assert (Path("charts/specserve/crds") / name).read_text() == (CRD_DIR / name).read_text()


def test_cluster_roles_in_the_chart_are_the_generated_ones():
    chart_roles = list(yaml.safe_load_all(Path("charts/specserve/templates/clusterrole.yaml").read_text().split("\n", 1)[1]))
    assert chart_roles == cluster_roles()
    for role in cluster_roles():
        kubernetes_validate.validate(role, "1.30", strict=True)
    assert all("*" not in verbs and "*" != resource for _, resource, verbs in RBAC_RULES)


def test_only_cluster_scoped_resources_and_events_are_granted_cluster_wide_whatever_the_operator_watches():
    """specserve-operator (namespaced kinds) is bound per watched namespace unless the operator watches them all."""
    namespaced, cluster = cluster_roles()
    scoped = {kind.plural: kind.namespaced for kind in KINDS.values()}
    assert all(scoped[rule["resources"][0].split("/")[0]] for rule in namespaced["rules"])
    assert {rule["resources"][0] for rule in cluster["rules"]} == {
        "servingprofiles", "namespaces", "customresourcedefinitions", "events"}
    assert len(namespaced["rules"]) + len(cluster["rules"]) == len(RBAC_RULES)


def test_api_group_and_version():
    assert api.API_VERSION == "specserve.io/v1alpha1"
