"""Pure rendering and validation: every child object, checked field by field and against real schemas."""

import copy

import kubernetes_validate
import pytest
import yaml
from jsonschema import validate as jsonschema_validate
from specserve_operator.commands import RenderError, render_file
from specserve_operator.render import Settings, render_all
from specserve_operator.replicas import (Traffic, candidate_hash, candidate_runtime, pods_to_keep, replica_budget, replica_room, revision_hash,
                                         split_replicas)
from specserve_operator.validate import check_against_profile, parse_profile, parse_serving

from .conftest import EXAMPLE

# The HTTPRoute fields we render, as the Gateway API (v1) defines them; HTTPRoute is a CRD, so the
# Kubernetes schemas that kubernetes-validate ships do not cover it.
HTTPROUTE_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "gateway.networking.k8s.io/v1"},
        "kind": {"const": "HTTPRoute"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "parentRefs": {"type": "array", "maxItems": 32, "items": {
                    "type": "object", "required": ["name"], "additionalProperties": False,
                    "properties": {"name": {"type": "string"}, "namespace": {"type": "string"}, "sectionName": {"type": "string"}},
                }},
                "rules": {"type": "array", "maxItems": 16, "items": {
                    "type": "object", "additionalProperties": False,
                    "properties": {
                        "matches": {"type": "array", "items": {"type": "object", "properties": {"path": {
                            "type": "object", "properties": {"type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                                                             "value": {"type": "string"}}}}}},
                        "backendRefs": {"type": "array", "maxItems": 16, "items": {
                            "type": "object", "required": ["name"], "additionalProperties": False,
                            "properties": {"name": {"type": "string"}, "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                                           "weight": {"type": "integer", "minimum": 0, "maximum": 1000000}},
                        }},
                    },
                }},
            },
        },
    },
}


def parsed(documents):
    by_kind = {d["kind"]: d for d in documents}
    serving, problems = parse_serving(copy.deepcopy(by_kind["SpeculativeServing"]))
    profile, profile_problems = parse_profile(by_kind["ServingProfile"])
    assert problems == [] and profile_problems == []
    return serving, profile, by_kind["Namespace"]["metadata"]["labels"]


def of_kind(objects, kind):
    return [o for o in objects if o["kind"] == kind]


@pytest.fixture
def rendered(example_documents):
    serving, profile, _ = parsed(example_documents)
    serving = serving.__class__(serving.name, serving.namespace, "uid-1234", serving.spec)
    return render_all(serving, profile, Settings(), Traffic("Canary", 10))


def test_every_object_is_valid_for_kubernetes_1_30(rendered):
    for obj in rendered:
        if obj["kind"] == "HTTPRoute":
            jsonschema_validate(obj, HTTPROUTE_SCHEMA)
        else:
            kubernetes_validate.validate(obj, "1.30", strict=True)


def test_rollout_renders_stable_and_canary_with_a_weighted_route(rendered):
    deployments = of_kind(rendered, "Deployment")
    assert [d["metadata"]["labels"]["specserve.io/role"] for d in deployments] == ["stable", "canary"]
    assert [d["spec"]["replicas"] for d in deployments] == [1, 1]  # min 1 replica: at least one each
    backends = of_kind(rendered, "HTTPRoute")[0]["spec"]["rules"][0]["backendRefs"]
    assert [(b["name"], b["weight"]) for b in backends] == [("qwen3-8b-stable", 90), ("qwen3-8b-canary", 10)]
    configs = {c["metadata"]["name"]: yaml.safe_load(c["data"]["runtime.yaml"]) for c in of_kind(rendered, "ConfigMap")}
    canary_config = configs[deployments[1]["metadata"]["name"]]
    assert canary_config["method"] == "dflash" and canary_config["numSpeculativeTokens"] == 15
    assert canary_config["drafter"] == "hf://z-lab/Qwen3-8B-DFlash-b16" and canary_config["engine"] == "vllm"


def test_deployment_schedules_on_the_profiles_gpus_securely(rendered):
    deployment = of_kind(rendered, "Deployment")[0]
    pod = deployment["spec"]["template"]
    spec, container = pod["spec"], pod["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == container["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert container["resources"]["requests"]["cpu"] == "4"
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    labels = pod["metadata"]["labels"]
    assert labels["kueue.x-k8s.io/queue-name"] == "team-a-gpus"
    assert labels["kueue.x-k8s.io/priority-class"] == "serving-high"
    assert labels["specserve.io/tenant"] == "team-a" and labels["specserve.io/serving"] == "qwen3-8b"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"  # vLLM's: it serves no /ready
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["automountServiceAccountToken"] is False
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert {"name": "config", "configMap": {"name": deployment["metadata"]["name"]}} in spec["volumes"]
    assert container["args"] == ["launch", "--config", "/etc/specserve/runtime.yaml"]
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_every_cache_an_engine_writes_is_on_a_writable_volume_under_the_read_only_root(rendered):
    pod = of_kind(rendered, "Deployment")[0]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
    emptied = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
    assert {m["name"] for m in container["volumeMounts"] if m["mountPath"] in writable} <= emptied
    # vLLM writes under HOME (~/.cache, ~/.config), XDG_CACHE_HOME, VLLM_CACHE_ROOT and VLLM_CONFIG_ROOT unguarded
    for name in ("HOME", "XDG_CACHE_HOME", "HF_HOME", "VLLM_CACHE_ROOT", "VLLM_CONFIG_ROOT", "SPECSERVE_CACHE"):
        assert any(env[name] == path or env[name].startswith(path + "/") for path in writable), name
    assert env["VLLM_NO_USAGE_STATS"] == "1"


def test_the_readiness_probe_asks_each_engine_where_it_says_it_is_ready(example_documents):
    documents = copy.deepcopy(example_documents)
    serving_doc = next(d for d in documents if d["kind"] == "SpeculativeServing")
    serving_doc["spec"]["runtime"]["engine"] = "embedded"
    serving_doc["spec"]["runtime"]["args"] = []
    serving_doc["spec"].pop("rollout")
    serving, profile, _ = parsed(documents)
    (deployment,) = of_kind(render_all(serving, profile), "Deployment")
    assert deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/ready"


def test_pvc_models_and_drafters_are_mounted_read_only_where_the_runtime_reads_them(example_documents):
    from specserve_runtime.config import RuntimeConfig

    documents = copy.deepcopy(example_documents)
    serving_doc = next(d for d in documents if d["kind"] == "SpeculativeServing")
    serving_doc["spec"]["model"]["uri"] = "pvc://models/qwen3/8b"
    serving_doc["spec"]["speculator"]["draftModel"] = "pvc://drafters/qwen3-8b-eagle3"
    serving_doc["spec"]["rollout"]["candidate"]["speculator"]["draftModel"] = "pvc://models/qwen3/dflash-b16"
    serving, profile, _ = parsed(documents)
    objects = render_all(serving, profile, Settings(), Traffic("Canary", 10))
    for deployment in of_kind(objects, "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        claims = {v["name"]: v["persistentVolumeClaim"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
        mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"] if m["name"] in claims}
        assert all(claim["readOnly"] and mounts[name]["readOnly"] for name, claim in claims.items())
        folders = {claims[name]["claimName"]: mounts[name]["mountPath"] for name in claims}
        config_map = next(o for o in of_kind(objects, "ConfigMap") if o["metadata"]["name"] == deployment["metadata"]["name"])
        config = RuntimeConfig.model_validate(yaml.safe_load(config_map["data"]["runtime.yaml"]))
        assert config.model_source == folders["models"] + "/qwen3/8b"
        drafter_claim = config.drafter.removeprefix("pvc://").split("/")[0]
        assert sorted(folders) == sorted({"models", drafter_claim})
        assert config.drafter_source.startswith(folders[drafter_claim] + "/")
    # A bucket is not fetched: refused at admission, naming the field.
    serving_doc["spec"]["model"]["uri"] = "s3://bucket/qwen3-8b"
    _, problems = parse_serving(serving_doc)
    assert any(problem.startswith("spec.model.uri: String should match pattern") for problem in problems), problems


def test_every_child_is_owned_by_the_serving(rendered):
    for obj in rendered:
        owner = obj["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == ("SpeculativeServing", "qwen3-8b", "uid-1234", True)


def test_network_policy_admits_only_the_tenant_gateway_monitoring_and_operator(rendered):
    policy = of_kind(rendered, "NetworkPolicy")[0]
    namespaces = [p["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] for p in policy["spec"]["ingress"][0]["from"]]
    assert namespaces == ["gateways", "monitoring", "specserve-system", "team-a"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]


def test_services_and_pdb(rendered):
    stable, canary = [d["metadata"]["labels"]["specserve.io/revision"] for d in of_kind(rendered, "Deployment")]
    services = {s["metadata"]["name"]: s["spec"]["selector"] for s in of_kind(rendered, "Service")}
    assert services == {
        "qwen3-8b": {"specserve.io/serving": "qwen3-8b"},
        "qwen3-8b-stable": {"specserve.io/serving": "qwen3-8b", "specserve.io/revision": stable},
        "qwen3-8b-canary": {"specserve.io/serving": "qwen3-8b", "specserve.io/revision": canary},
    }
    assert of_kind(rendered, "PodDisruptionBudget")[0]["spec"]["maxUnavailable"] == 1


def test_promotion_keeps_the_candidates_pod_template(example_documents):
    """Promotion changes the candidate's Deployment role and replicas, never its pods; moving the
    candidate into spec.speculator afterwards renders the very same revision."""
    serving, profile, _ = parsed(example_documents)
    canary = of_kind(render_all(serving, profile, Settings(), Traffic("Canary", 10)), "Deployment")[1]
    promoted = of_kind(render_all(serving, profile, Settings(), Traffic("Promoted")), "Deployment")
    assert len(promoted) == 1 and promoted[0]["metadata"]["name"] == canary["metadata"]["name"]
    assert promoted[0]["spec"]["template"] == canary["spec"]["template"]
    assert promoted[0]["metadata"]["labels"]["specserve.io/role"] == "stable"
    assert promoted[0]["spec"]["replicas"] == replica_budget(serving.spec, profile.spec)
    rollout = serving.spec.rollout
    moved = serving.spec.model_copy(update={"speculator": rollout.candidate.speculator, "runtime": candidate_runtime(serving.spec),
                                            "rollout": None})
    after = of_kind(render_all(serving.__class__(serving.name, serving.namespace, None, moved), profile), "Deployment")
    assert after[0]["metadata"]["name"] == canary["metadata"]["name"]
    assert after[0]["spec"]["template"] == canary["spec"]["template"]


def test_an_aborted_candidate_is_kept_at_zero_replicas(example_documents):
    serving, profile, _ = parsed(example_documents)
    deployments = of_kind(render_all(serving, profile, Settings(), Traffic("Aborted")), "Deployment")
    assert [(d["metadata"]["labels"]["specserve.io/role"], d["spec"]["replicas"]) for d in deployments] == [
        ("stable", replica_budget(serving.spec, profile.spec)), ("canary", 0)]
    route = of_kind(render_all(serving, profile, Settings(), Traffic("Aborted")), "HTTPRoute")[0]
    assert [b["name"] for b in route["spec"]["rules"][0]["backendRefs"]] == ["qwen3-8b-stable"]


def test_the_stable_service_keeps_routing_to_the_serving_revision_until_the_new_one_is_ready(example_documents):
    serving, profile, _ = parsed(example_documents)
    objects = render_all(serving, profile, Settings(), Traffic(stable_backend="0ld0ld00"))
    selector = next(s for s in of_kind(objects, "Service") if s["metadata"]["name"] == "qwen3-8b-stable")["spec"]["selector"]
    assert selector["specserve.io/revision"] == "0ld0ld00"


@pytest.mark.parametrize("total, weight, expected", [(1, 10, (1, 1)), (4, 50, (2, 2)), (10, 10, (9, 1)), (10, 25, (8, 2)),
                                                      (10, 100, (1, 9)), (3, 50, (1, 2))])
def test_replica_split_approximates_the_weight_with_one_replica_each_at_least(total, weight, expected):
    assert split_replicas(total, weight) == expected


def test_revision_hash_follows_the_pod_affecting_spec_only(example_documents):
    serving, _, _ = parsed(example_documents)
    spec = serving.spec
    base = revision_hash(spec.model, spec.speculator, spec.runtime)
    assert base == revision_hash(spec.model, spec.speculator, spec.runtime)
    changed = spec.speculator.model_copy(update={"num_speculative_tokens": 5})
    assert revision_hash(spec.model, changed, spec.runtime) != base
    image = spec.runtime.model_copy(update={"image": "registry.example.com/specserve/runtime:0.2.0"})
    assert revision_hash(spec.model, spec.speculator, image) != base
    copies = spec.speculator.model_copy(update={"prompt_lookup": 0})
    assert revision_hash(spec.model, copies, spec.runtime) != base


def test_an_operator_that_knows_newer_speculator_fields_gives_a_revision_without_them_its_old_hash(example_documents):
    """promptLookup came after these revisions were running: unset, the example's revisions keep the hashes the
    operator before it gave them (so upgrading the operator rolls no pods)."""
    serving, _, _ = parsed(example_documents)
    spec = serving.spec
    assert (revision_hash(spec.model, spec.speculator, spec.runtime), candidate_hash(spec)) == ("e198b13a", "d844a203")


def test_a_bundled_drafter_renders_as_written_and_the_image_follows_the_engine(example_documents):
    from specserve_operator import api

    documents = copy.deepcopy(example_documents)
    serving_doc = next(d for d in documents if d["kind"] == "SpeculativeServing")
    serving_doc["spec"]["speculator"] = {"method": "dflash", "draftModel": "bundled://smollm2-135m-instruct-dflash"}
    serving_doc["spec"]["runtime"] = {"engine": "embedded"}
    serving_doc["spec"].pop("rollout", None)
    serving, profile, _ = parsed(documents)
    objects = render_all(serving, profile)
    (config_map,) = of_kind(objects, "ConfigMap")
    config = yaml.safe_load(config_map["data"]["runtime.yaml"])
    assert config["drafter"] == "bundled://smollm2-135m-instruct-dflash"  # the runtime resolves it (test_images)
    assert "numSpeculativeTokens" not in config and "draftTree" not in config  # the drafter's own operating point
    (deployment,) = of_kind(objects, "Deployment")
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == api.RUNTIME_IMAGES["embedded"]
    # Only the drafters the images embed: an unknown name is refused by the API's own pattern.
    serving_doc["spec"]["speculator"]["draftModel"] = "bundled://my-drafter"
    _, problems = parse_serving(serving_doc)
    assert any("draftModel" in problem for problem in problems)


@pytest.mark.parametrize("field, values", [("draftTree", (True, False)), ("promptLookup", (4, 0))])
def test_an_embedded_engine_option_renders_into_the_runtime_configuration_as_its_own_revision(example_documents, field,
                                                                                             values):
    documents = copy.deepcopy(example_documents)
    serving_doc = next(d for d in documents if d["kind"] == "SpeculativeServing")
    speculator = {"method": "dflash", "draftModel": "bundled://smollm2-135m-instruct-dflash", "numSpeculativeTokens": 6}
    serving_doc["spec"].update(speculator=speculator, runtime={"engine": "embedded"})
    serving_doc["spec"].pop("rollout", None)
    configs = {}
    for value in (None, *values):
        speculator.pop(field, None)
        if value is not None:
            speculator[field] = value
        serving, profile, _ = parsed(documents)
        (config_map,) = of_kind(render_all(serving, profile), "ConfigMap")
        configs[value] = (config_map["metadata"]["name"], yaml.safe_load(config_map["data"]["runtime.yaml"]))
    assert field not in configs[None][1]  # the drafter's own operating point
    assert all(configs[value][1][field] == value for value in values)
    assert len({name for name, _ in configs.values()}) == 3  # each a revision of its own


def test_replica_ratio_mode_has_no_route_and_splits_replicas(example_documents):
    serving, profile, _ = parsed(example_documents)
    spec = serving.spec.model_copy(update={"traffic": serving.spec.traffic.model_copy(update={"mode": "ReplicaRatio", "gateway": None}),
                                           "replicas": serving.spec.replicas.model_copy(update={"min": 4})})
    objects = render_all(serving.__class__(serving.name, serving.namespace, None, spec), profile, traffic=Traffic("Canary", 50))
    assert of_kind(objects, "HTTPRoute") == []
    assert [d["spec"]["replicas"] for d in of_kind(objects, "Deployment")] == [2, 2]
    assert "ownerReferences" not in objects[0]["metadata"]  # no uid yet (render from a file)


def test_the_stable_keeps_the_pods_a_starting_canary_will_replace_within_the_budget(example_documents):
    serving, profile, _ = parsed(example_documents)
    spec = serving.spec.model_copy(update={"traffic": serving.spec.traffic.model_copy(update={"mode": "ReplicaRatio", "gateway": None}),
                                           "replicas": serving.spec.replicas.model_copy(update={"min": 4, "max": 8})})
    serving = serving.__class__(serving.name, serving.namespace, None, spec)

    def replicas(ready, profile=profile):
        objects = render_all(serving, profile, traffic=Traffic("Canary", 50, canary_ready=ready))
        return [d["spec"]["replicas"] for d in of_kind(objects, "Deployment")]

    assert replicas(None) == [2, 2]  # readiness unknown: the plain split
    assert replicas(0) == [4, 2]  # no canary pod ready: the stable keeps all four
    assert replicas(1) == [3, 2]
    assert replicas(2) == [2, 2]  # both ready: the split
    limits = profile.spec.limits.model_copy(update={"max_hourly_cost_usd": 12.5})  # 5 x $2.49 fits, 6 does not
    capped = profile.__class__(profile.name, profile.spec.model_copy(update={"limits": limits}))
    assert replicas(0, capped) == [3, 2]  # the surge never passes the budget


def test_a_draining_aborted_candidate_keeps_its_ready_pods_until_the_stables_replacements_are_ready(example_documents):
    serving, profile, _ = parsed(example_documents)
    spec = serving.spec.model_copy(update={"traffic": serving.spec.traffic.model_copy(update={"mode": "ReplicaRatio", "gateway": None}),
                                           "replicas": serving.spec.replicas.model_copy(update={"min": 4, "max": 8})})

    def replicas(stable_ready, canary_ready=2, drain=True, spec=spec):
        traffic = Traffic("Aborted", canary_ready=canary_ready, stable_ready=stable_ready, drain_candidate=drain)
        objects = render_all(serving.__class__(serving.name, serving.namespace, None, spec), profile, traffic=traffic)
        return [d["spec"]["replicas"] for d in of_kind(objects, "Deployment")]

    assert replicas(2) == [4, 2]  # two stable pods starting: the two ready candidate pods stay
    assert replicas(3) == [4, 1]
    assert replicas(4) == [4, 0]  # the stable is whole: the candidate goes
    assert replicas(0, canary_ready=1) == [4, 1]  # never more than its ready pods: a loser never grows
    assert replicas(2, drain=False) == [4, 0]  # errors, or aborted by hand: at once
    routed = serving.spec.model_copy(update={"replicas": spec.replicas})  # GatewayAPI: the route sends it nothing
    assert replicas(2, spec=routed) == [4, 0]


def test_hourly_budget_caps_replicas(example_documents):
    serving, profile, _ = parsed(example_documents)
    spec = serving.spec.model_copy(update={"replicas": serving.spec.replicas.model_copy(update={"min": 6, "max": 6})})
    limits = profile.spec.limits.model_copy(update={"max_hourly_cost_usd": 10.0})  # 4 x $2.49 fits, 5 does not
    profile_spec = profile.spec.model_copy(update={"limits": limits})
    objects = render_all(serving.__class__(serving.name, serving.namespace, None, spec),
                         profile.__class__(profile.name, profile_spec))
    assert [d["spec"]["replicas"] for d in of_kind(objects, "Deployment")] == [4]


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda s: s["rollout"]["steps"].__setitem__(0, {"weight": 0}), "spec.rollout.steps[0].weight: Input should be greater than or equal to 1"),
        (lambda s: s["rollout"]["steps"].__setitem__(1, {"weight": 5}), "spec.rollout.steps[1].weight: 5 must be greater than the previous step's weight (10)"),
        (lambda s: s.__setitem__("replicas", {"min": 3, "max": 2}), "spec.replicas.min: 3 must be <= max (2)"),
        (lambda s: s["speculator"].pop("draftModel"), "spec.speculator.draftModel: required for method eagle3"),
        (lambda s: s["traffic"].pop("gateway"), "spec.traffic.gateway: required for mode GatewayAPI"),
        (lambda s: s["model"].__setitem__("uri", "ftp://x"), "spec.model.uri: String should match pattern"),
        (lambda s: s["speculator"].__setitem__("method", "medusa"), "spec.speculator.method: Input should be"),
        (lambda s: s.__setitem__("replicaz", 3), "spec.replicaz: Extra inputs are not permitted"),
        (lambda s: s["replicas"].__setitem__("max_replicas", 3), "spec.replicas.max_replicas: Extra inputs are not permitted"),
        # A tenant's limits: extra engine arguments cannot change what the profile checked, resources cannot add
        # accelerators; a flag abbreviated (vLLM's argparse takes a unique prefix) or written vLLM's other ways.
        *[(lambda s, args=args: s["runtime"].__setitem__("args", ["--dtype", "half", *args]),
           f"spec.runtime.args: [2] {args[0]!r}: {flag} is set from the serving's own fields")
          for args, flag in [(["--speculative-config", '{"method":"ngram"}'], "--speculative-config"),
                             (["--speculative_config.num_speculative_tokens", "60"], "--speculative-config"),
                             (["--specul", "{}"], "--speculative-config"), (["--port=9999"], "--port"),
                             (["--model", "other"], "--model"), (["--config", "serve.yaml"], "--config")]],
        (lambda s: s["rollout"]["candidate"].__setitem__("runtime", {"args": ["--host", "::"]}),
         "spec.rollout.candidate.runtime.args: [0] '--host': --host is set from the serving's own fields"),
        (lambda s: s["runtime"].__setitem__("resources", {"limits": {"cpu": 4, "nvidia.com/gpu": 8}}),
         "spec.runtime.resources.limits: nvidia.com/gpu: resources are cpu, memory, ephemeral-storage; accelerators "
         "come from the ServingProfile"),
        (lambda s: s["runtime"].__setitem__("resources", {"requests": {"cpu": [1]}}),
         "spec.runtime.resources.requests.cpu: Input should be a valid integer"),  # no ".int": pydantic's shape name
        # Types as the API server reads them: a quoted number or boolean is a string.
        (lambda s: s["replicas"].__setitem__("max", "4"), "spec.replicas.max: Input should be a valid integer"),
        (lambda s: s["autoscaling"].__setitem__("enabled", "true"), "spec.autoscaling.enabled: Input should be a valid boolean"),
    ],
)
def test_invalid_specs_name_the_field_path(example_documents, mutate, expected):
    serving = copy.deepcopy(next(d for d in example_documents if d["kind"] == "SpeculativeServing"))
    mutate(serving["spec"])
    result, problems = parse_serving(serving)
    assert result is None and any(p.startswith(expected) for p in problems), problems


@pytest.mark.parametrize("name", ["qwen3.8b", "Qwen3-8b", "3b", "a" * 55, "a-"])
def test_a_serving_name_that_its_services_and_revisions_cannot_carry_is_refused(example_documents, name):
    serving = copy.deepcopy(next(d for d in example_documents if d["kind"] == "SpeculativeServing"))
    serving["metadata"]["name"] = "a" * 54  # the longest: <name>-<8-digit revision hash> is 63 characters
    assert parse_serving(serving)[1] == []
    serving["metadata"]["name"] = name
    assert parse_serving(serving) == (None, [
        f"metadata.name: {name!r} must be lower-case letters, digits and '-', start with a letter, and be at most 54 "
        f"characters: its Services and revisions are named after it"])


def test_metadata_that_is_not_an_object_is_a_problem_not_a_crash(example_documents):
    serving = copy.deepcopy(next(d for d in example_documents if d["kind"] == "SpeculativeServing"))
    profile = copy.deepcopy(next(d for d in example_documents if d["kind"] == "ServingProfile"))
    serving["metadata"] = profile["metadata"] = "qwen3-8b"
    assert parse_serving(serving) == parse_profile(profile) == (None, ["metadata: must be an object"])


def test_profile_rules(example_documents):
    serving, profile, labels = parsed(example_documents)
    assert check_against_profile(serving, profile, labels) == []
    assert check_against_profile(serving, None, labels) == ["spec.profile: ServingProfile 'team-a-h100' not found"]
    assert check_against_profile(serving, profile, {"specserve.io/tenant": "team-b"}) == [
        "spec.profile: ServingProfile 'team-a-h100' does not select namespace 'team-a'"
    ]
    limits = profile.spec.limits.model_copy(update={"allowed_methods": ["none", "eagle3"], "max_replicas": 4})
    strict = profile.__class__(profile.name, profile.spec.model_copy(update={"limits": limits}))
    assert check_against_profile(serving, strict, labels) == [
        "spec.rollout.candidate.speculator.method: method dflash is not allowed by ServingProfile 'team-a-h100' (allowed: none, eagle3)",
        "spec.replicas.max: 6 exceeds ServingProfile 'team-a-h100' limits.maxReplicas (4)",
    ]


def test_a_tenant_names_only_the_images_its_profile_allows(example_documents):
    from specserve_operator import api

    serving, profile, labels = parsed(example_documents)  # the example allows registry.example.com/specserve/
    assert serving.spec.runtime.image == "registry.example.com/specserve/runtime:0.1.0"

    def allowing(*images):
        limits = profile.spec.limits.model_copy(update={"allowed_images": list(images)})
        return profile.__class__(profile.name, profile.spec.model_copy(update={"limits": limits}))

    def with_images(stable, candidate=None):
        rollout = serving.spec.rollout.model_copy(update={"candidate": serving.spec.rollout.candidate.model_copy(
            update={"runtime": api.RuntimeOverride(image=candidate) if candidate else None})})
        spec = serving.spec.model_copy(update={"runtime": serving.spec.runtime.model_copy(update={"image": stable}),
                                               "rollout": rollout})
        return serving.__class__(serving.name, serving.namespace, None, spec)

    assert check_against_profile(serving, allowing("registry.example.com/specserve/runtime:0.1.0"), labels) == []
    assert check_against_profile(serving, allowing(), labels) == [
        "spec.runtime.image: image 'registry.example.com/specserve/runtime:0.1.0' is not allowed by ServingProfile "
        "'team-a-h100' (limits.allowedImages: none besides the engines' defaults)"]
    # A prefix without '/' allows no look-alike path; the engines' default images need no entry.
    evil = with_images(api.RUNTIME_IMAGES["vllm"], "registry.example.com/specserve-evil/runtime:1")
    assert check_against_profile(evil, allowing("registry.example.com/specserve/"), labels) == [
        "spec.rollout.candidate.runtime.image: image 'registry.example.com/specserve-evil/runtime:1' is not allowed by "
        "ServingProfile 'team-a-h100' (limits.allowedImages: registry.example.com/specserve/)"]
    assert check_against_profile(with_images(None), allowing(), labels) == []


def test_a_tenant_runs_a_model_repositorys_code_only_where_its_profile_allows_it(example_documents):
    from specserve_operator import api

    serving, profile, labels = parsed(example_documents)

    def with_args(stable, candidate=None):
        rollout = serving.spec.rollout.model_copy(update={"candidate": serving.spec.rollout.candidate.model_copy(
            update={"runtime": api.RuntimeOverride(args=candidate) if candidate is not None else None})})
        spec = serving.spec.model_copy(update={"runtime": serving.spec.runtime.model_copy(update={"args": stable}),
                                               "rollout": rollout})
        return serving.__class__(serving.name, serving.namespace, None, spec)

    def allowing(allowed):
        limits = profile.spec.limits.model_copy(update={"allow_trust_remote_code": allowed})
        return profile.__class__(profile.name, profile.spec.model_copy(update={"limits": limits}))

    assert profile.spec.limits.allow_trust_remote_code is False  # off unless the platform team turns it on
    # Every spelling vLLM's parser reads as the flag: underscores, a unique prefix; its negation runs nothing.
    remote = with_args(["--max-num-batched-tokens", "32768", "--trust-remote-code"], ["--trust_remote_code"])
    assert check_against_profile(remote, profile, labels) == [
        "spec.runtime.args[2]: '--trust-remote-code' runs the Python that the model's repository ships, which "
        "ServingProfile 'team-a-h100' does not allow (limits.allowTrustRemoteCode)",
        "spec.rollout.candidate.runtime.args[0]: '--trust_remote_code' runs the Python that the model's repository "
        "ships, which ServingProfile 'team-a-h100' does not allow (limits.allowTrustRemoteCode)"]
    assert len(check_against_profile(with_args(["--trust-rem"]), profile, labels)) == 1
    assert check_against_profile(with_args(["--no-trust-remote-code"]), profile, labels) == []
    assert check_against_profile(remote, allowing(True), labels) == []


def test_a_profile_limits_the_drafts_a_step_and_a_tenant_cannot_raise_it(example_documents):
    from specserve_operator import api

    serving, profile, labels = parsed(example_documents)
    limits = profile.spec.limits.model_copy(update={"max_num_speculative_tokens": 7})
    capped = profile.__class__(profile.name, profile.spec.model_copy(update={"limits": limits}))
    # The stable drafts 7, the candidate 15: the candidate is over the limit.
    assert check_against_profile(serving, capped, labels) == [
        "spec.rollout.candidate.speculator.numSpeculativeTokens: 15 exceeds ServingProfile 'team-a-h100' "
        "limits.maxNumSpeculativeTokens (7)"]
    schedule = [api.BatchSizeRange(min_batch_size=1, max_batch_size=2, num_speculative_tokens=9),
                api.BatchSizeRange(min_batch_size=3, num_speculative_tokens=2)]
    speculator = api.Speculator(method="ngram", num_speculative_tokens_per_batch_size=schedule)
    spec = serving.spec.model_copy(update={"speculator": speculator, "rollout": None})
    assert check_against_profile(serving.__class__(serving.name, serving.namespace, None, spec), capped, labels) == [
        "spec.speculator.numSpeculativeTokens: required, ServingProfile 'team-a-h100' limits drafts a step to 7 "
        "(limits.maxNumSpeculativeTokens)",
        "spec.speculator.numSpeculativeTokensPerBatchSize[0].numSpeculativeTokens: 9 exceeds ServingProfile "
        "'team-a-h100' limits.maxNumSpeculativeTokens (7)"]


def test_a_bundled_drafter_of_another_method_is_refused_before_any_pod_starts(example_documents):
    serving = copy.deepcopy(next(d for d in example_documents if d["kind"] == "SpeculativeServing"))
    serving["spec"]["speculator"] = {"method": "eagle3", "draftModel": "bundled://smollm2-135m-instruct-dflash"}
    _, problems = parse_serving(serving)
    assert len(problems) == 1 and problems[0].startswith("spec.speculator.draftModel: ") and \
        problems[0].endswith("config.json: speculators_model_type is 'dflash', the method 'eagle3'"), problems


def test_render_file_reports_every_problem_with_its_path(tmp_path, example_documents):
    documents = copy.deepcopy(example_documents)
    serving = next(d for d in documents if d["kind"] == "SpeculativeServing")
    serving["spec"]["rollout"]["steps"][0]["weight"] = 150
    serving["spec"]["replicas"]["max"] = 20
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump_all(documents))
    with pytest.raises(RenderError) as caught:
        render_file(path, cluster=None)
    assert caught.value.problems == [
        f"{path}: SpeculativeServing team-a/qwen3-8b: spec.rollout.steps[0].weight: Input should be less than or equal to 100"
    ]


def test_a_serving_of_an_invalid_profile_in_the_file_says_so_rather_than_not_found(tmp_path, example_documents):
    documents = copy.deepcopy(example_documents)
    next(d for d in documents if d["kind"] == "ServingProfile")["spec"]["limits"]["maxReplicas"] = "8"
    path = tmp_path / "bad-profile.yaml"
    path.write_text(yaml.safe_dump_all(documents))
    with pytest.raises(RenderError) as caught:
        render_file(path, cluster=None)
    assert caught.value.problems == [
        f"{path}: ServingProfile team-a-h100: spec.limits.maxReplicas: Input should be a valid integer",
        f"{path}: SpeculativeServing team-a/qwen3-8b: spec.profile: ServingProfile 'team-a-h100' is invalid (above)",
    ]


def test_render_file_without_namespace_or_cluster_says_what_to_add(tmp_path, example_documents):
    path = tmp_path / "no-namespace.yaml"
    path.write_text(yaml.safe_dump_all([d for d in example_documents if d["kind"] != "Namespace"]))
    with pytest.raises(RenderError, match="Namespace 'team-a' is not in the file and no cluster is configured"):
        render_file(path, cluster=None)


def test_render_command_exit_status_and_stream(tmp_path, capsys):
    from specserve.cli import main

    assert main(["render", "-f", EXAMPLE]) == 0
    kinds = [d["kind"] for d in yaml.safe_load_all(capsys.readouterr().out)]
    assert kinds == ["ConfigMap", "Deployment", "ConfigMap", "Deployment", "Service", "Service", "Service", "HTTPRoute",
                     "PodDisruptionBudget", "NetworkPolicy"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: SpeculativeServing\nmetadata: {name: x, namespace: team-a}\nspec: {}\n")
    assert main(["render", "-f", str(bad)]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert any(line.endswith("spec.profile: Field required") for line in errors)
    assert any(line.endswith("spec.model: Field required") for line in errors)


def test_older_revisions_keep_the_pods_not_yet_replaced_within_the_ceiling():
    # wanted, ready, previous, ceiling -> older pods kept
    assert pods_to_keep(3, 0, 3, 8) == 3  # room for all 3 new pods beside the 3 old ones
    assert pods_to_keep(3, 2, 3, 8) == 1  # 2 replaced
    assert pods_to_keep(3, 3, 1, 8) == 0  # all replaced
    assert pods_to_keep(4, 0, 4, 6) == 4  # the new revision starts 2 beside them (render: 6 - 4)
    # at the ceiling, one old pod makes way so that a new one can start; then one at a time
    assert pods_to_keep(2, 0, 2, 2) == 1
    assert pods_to_keep(2, 1, 1, 2) == 0
    assert pods_to_keep(6, 3, 3, 6) == 2  # 3 ready, and only 3 + 3 = 6: one goes for the fourth
    assert pods_to_keep(2, 0, 0, 2) == 0  # nothing older


def test_pods_still_draining_hold_their_place_under_the_ceiling_but_never_remove_running_ones():
    assert replica_room(6, 0, 2) == 6  # nothing draining: the ceiling
    assert replica_room(6, 4, 2) == 2  # a scale-down from 6 to 2 drains 4: no room to grow
    assert replica_room(6, 2, 2) == 4
    assert replica_room(6, 4, 5) == 5  # 5 running already (over the wall while 4 drain): none is removed for room
    assert replica_room(6, 1, 9) == 6  # the ceiling was lowered below what runs: down to it
    assert replica_room(6, 9, 0) == 0


def test_a_scale_up_waits_for_the_draining_pods_within_the_ceiling(example_documents):
    serving, profile, _ = parsed(example_documents)
    spec = serving.spec.model_copy(update={"replicas": serving.spec.replicas.model_copy(update={"min": 1, "max": 8})})
    serving = serving.__class__(serving.name, serving.namespace, None, spec)
    stable = revision_hash(spec.model, spec.speculator, spec.runtime)
    canary = candidate_hash(spec)

    def replicas(wanted, traffic):
        return [d["spec"]["replicas"] for d in of_kind(render_all(serving, profile, Settings(), traffic, wanted), "Deployment")]

    assert replicas(6, Traffic()) == [6]
    assert replicas(6, Traffic(held={stable: 2}, draining=4)) == [4]  # 2 run, 4 drain: 2 more fit under 8
    assert replicas(1, Traffic(held={stable: 2}, draining=4)) == [1]  # a scale-down is never held
    assert replicas(8, Traffic(held={stable: 8}, draining=3)) == [8]  # nor a running pod removed for room
    # a starting canary's surge stays within what the draining pods leave
    assert replicas(4, Traffic("Canary", 50, canary_ready=0, held={stable: 4}, draining=3)) == [4, 1]
    # a weight step at the wall: the stable's removed pods still drain, so the canary grows once they are gone
    assert replicas(8, Traffic("Canary", 25, canary_ready=2, held={stable: 6, canary: 2})) == [6, 2]
    assert replicas(8, Traffic("Canary", 50, canary_ready=2, held={stable: 6, canary: 2})) == [4, 2]
    assert replicas(8, Traffic("Canary", 50, canary_ready=2, held={stable: 4, canary: 2}, draining=2)) == [4, 2]
    assert replicas(8, Traffic("Canary", 50, canary_ready=2, held={stable: 4, canary: 2})) == [4, 4]


def test_a_promotion_replaces_the_old_pods_one_at_a_time_at_the_wall(example_documents):
    serving, profile, _ = parsed(example_documents)
    spec = serving.spec.model_copy(update={"replicas": serving.spec.replicas.model_copy(update={"min": 4, "max": 4})})
    serving = serving.__class__(serving.name, serving.namespace, None, spec)
    new = candidate_hash(spec)

    def replicas(previous_pods, held, draining=0):
        traffic = Traffic("Promoted", previous_pods=previous_pods, held={new: held}, draining=draining)
        return [d["spec"]["replicas"] for d in of_kind(render_all(serving, profile, traffic=traffic), "Deployment")]

    # 4 replicas at most; the promoted revision holds 2 ready pods beside 2 old ones
    assert pods_to_keep(4, 2, 2, 4) == 1  # one old pod makes way...
    assert replicas(2, 2) == [2]  # ...but drains on its accelerator: nothing starts in this pass
    assert pods_to_keep(4, 2, 1, 4) == 1  # while it drains, no second one goes
    assert replicas(1, 2, draining=1) == [2]
    assert replicas(1, 2) == [3]  # gone: its slot is the new revision's


def test_a_promotion_starts_only_the_pods_the_budget_leaves_beside_the_previous_stables(example_documents):
    serving, profile, _ = parsed(example_documents)
    spec = serving.spec.model_copy(update={"replicas": serving.spec.replicas.model_copy(update={"min": 4, "max": 8})})
    serving = serving.__class__(serving.name, serving.namespace, None, spec)
    limits = profile.spec.limits.model_copy(update={"max_hourly_cost_usd": 12.5})  # 5 x $2.49 fits, 6 does not
    capped = profile.__class__(profile.name, profile.spec.model_copy(update={"limits": limits}))

    def replicas(previous_pods, profile=capped):
        objects = render_all(serving, profile, traffic=Traffic("Promoted", previous_pods=previous_pods))
        return [d["spec"]["replicas"] for d in of_kind(objects, "Deployment")]

    assert replicas(2) == [3]  # 2 previous pods + 3 = the 5 the budget pays for
    assert replicas(None) == [4]  # the previous stable is gone: the whole count
    assert replicas(2, profile) == [4]  # without a binding budget, the surge fits
