"""The profile limits at admission (admission.py): the ValidatingAdmissionPolicy refuses what the operator's own check
(validate.check_against_profile) refuses, field for field: the policy evaluated as the API server evaluates it (once
per profile, its variables in order), by a CEL interpreter (celpy), as the CRDs' own rules are in test_crds.py."""

import copy
import re

import celpy
import pytest

from specserve_operator import admission
from specserve_operator.validate import check_against_profile, parse_profile, parse_serving


def evaluate(environment, expression: str, activation: dict):
    result = environment.program(environment.compile(expression)).evaluate(activation)
    # An expression that errors fails the request (failurePolicy: Fail); none may error on a valid object.
    assert not isinstance(result, celpy.CELEvalError), (expression, result)
    return result


def admit(serving: dict, profiles: list[dict], namespace: dict, old: dict | None = None) -> list[str]:
    """The messages the API server would refuse `serving` with: the policy evaluated once per profile the binding
    selects (all of them), its variables in order, every validation."""
    policy = admission.policy()[0]["spec"]
    environment = celpy.Environment()
    request = {"operation": "UPDATE" if old else "CREATE"}
    activation = {"object": celpy.json_to_cel(serving), "oldObject": celpy.json_to_cel(old),
                  "request": celpy.json_to_cel(request), "namespaceObject": celpy.json_to_cel(namespace)}
    if not all(evaluate(environment, c["expression"], activation) for c in policy["matchConditions"]):
        return []
    messages = []
    for profile in profiles:
        variables = {}
        for variable in policy["variables"]:
            bound = {**activation, "params": celpy.json_to_cel(profile), "variables": celpy.celtypes.MapType(variables)}
            variables[celpy.celtypes.StringType(variable["name"])] = evaluate(environment, variable["expression"], bound)
        bound = {**activation, "params": celpy.json_to_cel(profile), "variables": celpy.celtypes.MapType(variables)}
        messages += [str(evaluate(environment, rule["messageExpression"], bound))
                     for rule in policy["validations"] if not evaluate(environment, rule["expression"], bound)]
    return messages


def fields(messages: list[str]) -> list[str]:
    """The field each message names, without list indices: the operator names an entry, the policy its list."""
    return sorted({re.sub(r"\[.*", "", message.split(":", 1)[0]) for message in messages})


def defaulted(kind_parser, document: dict) -> dict:
    """The object as the API server stores it: the schema's defaults filled in (the models carry the same)."""
    parsed, problems = kind_parser(copy.deepcopy(document))
    assert problems == []
    return {**document, "spec": parsed.spec.model_dump(by_alias=True, exclude_none=True, mode="json")}


def both_refuse(documents: dict) -> list[str]:
    """The operator's problems and the policy's messages for the same serving, profile and namespace: the same
    fields, whether or not the API server has filled in the defaults."""
    serving, profile, namespace = documents["SpeculativeServing"], documents["ServingProfile"], documents["Namespace"]
    parsed_serving, problems = parse_serving(copy.deepcopy(serving))
    parsed_profile, profile_problems = parse_profile(copy.deepcopy(profile))
    assert problems == [] and profile_problems == []
    operator = check_against_profile(parsed_serving, parsed_profile, namespace["metadata"].get("labels", {}))
    raw = admit(serving, [profile], namespace)
    stored = admit(defaulted(parse_serving, serving), [defaulted(parse_profile, profile)], namespace)
    assert fields(raw) == fields(stored) == fields(operator), (raw, operator)
    assert all("ServingProfile 'team-a-h100'" in message for message in raw)
    return raw


@pytest.fixture
def documents(example_documents):
    return {d["kind"]: copy.deepcopy(d) for d in example_documents}


def test_the_example_is_admitted(documents):
    assert both_refuse(documents) == []


def limits(d):
    return d["ServingProfile"]["spec"]["limits"]


def spec(d):
    return d["SpeculativeServing"]["spec"]


def runtime_override(d, **fields):
    spec(d)["rollout"]["candidate"]["runtime"] = fields


@pytest.mark.parametrize("change, refused", [
    (lambda d: limits(d).__setitem__("allowedMethods", ["none", "eagle3"]),
     ["spec.rollout.candidate.speculator.method"]),
    (lambda d: (limits(d).__setitem__("allowedMethods", ["eagle3", "dflash"]),
                spec(d).__setitem__("speculationHealth", {"fallback": {"speculator": {"method": "ngram"}}})),
     ["spec.speculationHealth.fallback.speculator.method"]),
    (lambda d: limits(d).pop("allowedMethods"), []),  # the default allows every method
    (lambda d: limits(d).__setitem__("maxReplicas", 4), ["spec.replicas.max"]),
    (lambda d: limits(d).pop("maxReplicas"), []),  # the default, 8, holds the example's 6
    (lambda d: spec(d).__setitem__("replicas", {"min": 3, "max": 9}), ["spec.replicas.max"]),
    (lambda d: limits(d).__setitem__("maxHourlyCostUSD", 5), []),  # one replica costs 2.49 $/h
    (lambda d: (limits(d).__setitem__("maxHourlyCostUSD", 5), spec(d)["replicas"].__setitem__("min", 3)),
     ["spec.replicas.min"]),
    (lambda d: d["Namespace"]["metadata"].__setitem__("labels", {"specserve.io/tenant": "team-b"}), ["spec.profile"]),
    (lambda d: d["Namespace"]["metadata"].pop("labels"), ["spec.profile"]),
    (lambda d: d["ServingProfile"]["spec"].__setitem__("namespaceSelector", {}), []),
    (lambda d: d["ServingProfile"]["spec"].__setitem__("namespaceSelector", {"matchExpressions": [
        {"key": "specserve.io/tenant", "operator": "In", "values": ["team-a", "team-c"]}]}), []),
    (lambda d: d["ServingProfile"]["spec"].__setitem__("namespaceSelector", {"matchExpressions": [
        {"key": "specserve.io/tenant", "operator": "NotIn", "values": ["team-a"]}]}), ["spec.profile"]),
    (lambda d: d["ServingProfile"]["spec"].__setitem__("namespaceSelector", {"matchExpressions": [
        {"key": "quarantined", "operator": "NotIn", "values": ["true"]}]}), []),
    (lambda d: d["ServingProfile"]["spec"].__setitem__("namespaceSelector", {"matchExpressions": [
        {"key": "specserve.io/tenant", "operator": "DoesNotExist"}]}), ["spec.profile"]),
    (lambda d: d["ServingProfile"]["spec"].__setitem__("namespaceSelector", {"matchExpressions": [
        {"key": "specserve.io/tenant", "operator": "Exists"}]}), []),
    (lambda d: limits(d).__setitem__("maxNumSpeculativeTokens", 7),
     ["spec.rollout.candidate.speculator.numSpeculativeTokens"]),
    (lambda d: (limits(d).__setitem__("maxNumSpeculativeTokens", 15), spec(d)["speculator"].pop("numSpeculativeTokens")),
     ["spec.speculator.numSpeculativeTokens"]),
    (lambda d: (limits(d).__setitem__("maxNumSpeculativeTokens", 15),
                spec(d)["speculator"].__setitem__("numSpeculativeTokensPerBatchSize", [
                    {"minBatchSize": 1, "maxBatchSize": 4, "numSpeculativeTokens": 7},
                    {"minBatchSize": 5, "numSpeculativeTokens": 3}]),
                spec(d)["rollout"]["candidate"]["speculator"].__setitem__("numSpeculativeTokens", 16)),
     ["spec.rollout.candidate.speculator.numSpeculativeTokens"]),
    (lambda d: (limits(d).__setitem__("maxNumSpeculativeTokens", 6),
                spec(d)["speculator"].__setitem__("numSpeculativeTokens", 7),
                spec(d)["speculator"].__setitem__("numSpeculativeTokensPerBatchSize", [
                    {"minBatchSize": 1, "maxBatchSize": 4, "numSpeculativeTokens": 7},
                    {"minBatchSize": 5, "numSpeculativeTokens": 3}]),
                spec(d)["rollout"]["candidate"]["speculator"].__setitem__("numSpeculativeTokens", 6)),
     ["spec.speculator.numSpeculativeTokens", "spec.speculator.numSpeculativeTokensPerBatchSize"]),
    (lambda d: (limits(d).__setitem__("maxNumSpeculativeTokens", 7), spec(d).__setitem__("speculator", {"method": "none"}),
                spec(d)["rollout"]["candidate"]["speculator"].__setitem__("numSpeculativeTokens", 7)), []),
    (lambda d: limits(d).__setitem__("allowedImages", []), ["spec.runtime.image"]),
    (lambda d: limits(d).__setitem__("allowedImages", ["registry.example.com/specserve/runtime:0.1.0"]), []),
    (lambda d: (limits(d).pop("allowedImages"), spec(d)["runtime"].pop("image")), []),  # the engine's default image
    (lambda d: runtime_override(d, image="registry.example.com/specserve-evil/runtime:1"),
     ["spec.rollout.candidate.runtime.image"]),
    (lambda d: spec(d)["runtime"]["args"].append("--trust-remote-code"), ["spec.runtime.args"]),
    (lambda d: runtime_override(d, args=["--trust_remote_code"]), ["spec.rollout.candidate.runtime.args"]),
    (lambda d: runtime_override(d, args=["--trust-rem=1"]), ["spec.rollout.candidate.runtime.args"]),
    (lambda d: runtime_override(d, args=["--no-trust-remote-code", "--tokenizer", "x"]), []),
    (lambda d: (spec(d)["runtime"]["args"].append("--trust-remote-code"), limits(d).__setitem__("allowTrustRemoteCode", True)),
     []),
])
def test_the_policy_and_the_operator_refuse_the_same_fields(documents, change, refused):
    change(documents)
    assert fields(both_refuse(documents)) == refused


def test_only_the_profile_a_serving_names_judges_it(documents):
    strict = copy.deepcopy(documents["ServingProfile"])
    strict["metadata"]["name"] = "team-b-h100"
    strict["spec"]["limits"]["allowedMethods"] = ["none"]
    assert admit(documents["SpeculativeServing"], [strict, documents["ServingProfile"]], documents["Namespace"]) == []
    documents["SpeculativeServing"]["spec"]["profile"] = "team-b-h100"
    assert fields(admit(documents["SpeculativeServing"], [strict, documents["ServingProfile"]], documents["Namespace"])) == [
        "spec.rollout.candidate.speculator.method", "spec.speculator.method"]
    # A profile that does not exist: admitted, and the operator reports it (SpecValid False, "not found").
    documents["SpeculativeServing"]["spec"]["profile"] = "absent"
    assert admit(documents["SpeculativeServing"], [strict, documents["ServingProfile"]], documents["Namespace"]) == []


def test_a_profile_made_stricter_blocks_spec_changes_but_not_the_operators_metadata_writes(documents):
    serving = documents["SpeculativeServing"]
    limits(documents)["maxReplicas"] = 4  # the serving, at 6, is now over it
    profile, namespace = documents["ServingProfile"], documents["Namespace"]
    finalized = copy.deepcopy(serving)
    finalized["metadata"]["finalizers"] = ["kopf.zalando.org/KopfFinalizerMarker"]
    assert admit(finalized, [profile], namespace, old=serving) == []  # kopf adds (and removes) its finalizer
    scaled = copy.deepcopy(serving)
    scaled["spec"]["replicas"]["min"] = 2
    assert fields(admit(scaled, [profile], namespace, old=serving)) == ["spec.replicas.max"]
