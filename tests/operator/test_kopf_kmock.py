"""The real operator (kopf + our handlers) against KMock, the Kubernetes API emulator."""

import asyncio
import copy
import time
import uuid

from .conftest import SERVINGS_RESOURCE, cluster_client, eventually, running_operator


DEPLOYMENTS = "apps/v1/deployments"


def with_uid(obj):
    """KMock assigns no uid; a real API server does, and owner references need it."""
    obj["metadata"]["uid"] = str(uuid.uuid4())
    return obj


async def create(emulator, obj):
    """POST like a user would. KMock keeps no resourceVersion; kopf's optimistic patches test for one."""
    obj["metadata"].setdefault("resourceVersion", "1")
    client = cluster_client(emulator)
    await asyncio.to_thread(client._call, "POST", client._path(obj["apiVersion"], obj["kind"], obj["metadata"].get("namespace")), obj)


async def merge_patch(emulator, obj, patch):
    client = cluster_client(emulator)
    meta = obj["metadata"]
    path = client._path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
    await asyncio.to_thread(client._call, "PATCH", path, patch, None, "application/merge-patch+json")


def live(emulator, resource):
    """Names of the objects of a resource ('apps/v1/deployments') that currently exist."""
    return sorted(key[2] for key, obj in emulator.objects.items() if resource_path(key[0]) == resource and not obj.deleted)


def resource_path(res) -> str:
    return f"{res.group + '/' if res.group else ''}{res.version}/{res.plural}"


def status_of(emulator, name="qwen3-8b"):
    return emulator.objects[SERVINGS_RESOURCE, "team-a", name].get("status") or {}


async def test_create_renders_children_with_owner_references_and_status(operator, serving, profile):
    await create(operator, profile)
    await create(operator, with_uid(serving))
    await eventually(lambda: status_of(operator).get("phase") == "Pending")
    deployments = live(operator, DEPLOYMENTS)
    assert len(deployments) == 1 and deployments[0].startswith("qwen3-8b-")
    assert live(operator, "v1/services") == ["qwen3-8b", "qwen3-8b-canary", "qwen3-8b-stable"]
    assert live(operator, "v1/configmaps") == deployments
    assert live(operator, "policy/v1/poddisruptionbudgets") == ["qwen3-8b"]
    assert live(operator, "networking.k8s.io/v1/networkpolicies") == ["qwen3-8b"]
    deployment = operator.objects[DEPLOYMENTS, "team-a", deployments[0]]
    owner = deployment["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "SpeculativeServing" and owner["uid"] == serving["metadata"]["uid"]
    status = status_of(operator)
    assert status["stable"]["revision"] == deployments[0].removeprefix("qwen3-8b-")
    assert status["replicas"] == 2 and status["selector"] == "specserve.io/serving=qwen3-8b"
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions == {"SpecValid": "True", "Ready": "False", "Progressing": "True", "BudgetLimited": "False",
                          "SpeculationDegraded": "False"}
    # The live revision's continuous analysis ran, and had nothing to judge: no pod is ready.
    assert status["speculation"]["lastAnalysis"]["reasons"] == ["data: no ready replicas"]


def requests_to(emulator, method, resource):
    return [r for r in emulator if r.method.value == method and r.resource is not None and resource_path(r.resource) == resource]


async def set_ready(emulator, name, replicas):
    """Stand in for the Deployment controller, which KMock does not run."""
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": "team-a"}}
    await merge_patch(emulator, deployment, {"status": {"readyReplicas": replicas, "replicas": replicas}})


async def test_spec_change_rolls_a_new_revision_and_removes_the_old_once_ready(operator, serving, profile, reconciles):
    await create(operator, profile)
    await create(operator, with_uid(serving))
    first = (await eventually(lambda: live(operator, DEPLOYMENTS)))[0]
    await set_ready(operator, first, 2)
    await eventually(lambda: status_of(operator).get("phase") == "Serving")

    await merge_patch(operator, serving, {"spec": {"speculator": {"method": "ngram", "draftModel": None, "numSpeculativeTokens": 4}}})
    both = await eventually(lambda: len(live(operator, DEPLOYMENTS)) == 2 and live(operator, DEPLOYMENTS))
    second = next(name for name in both if name != first)
    await reconciles.more()  # several passes: the old revision keeps serving while the new is not ready
    assert first in live(operator, DEPLOYMENTS)
    assert status_of(operator)["stable"]["revision"] == second.removeprefix("qwen3-8b-")

    await set_ready(operator, second, 2)
    assert await eventually(lambda: live(operator, DEPLOYMENTS) == [second])
    assert await eventually(lambda: live(operator, "v1/configmaps") == [second])
    assert await eventually(lambda: status_of(operator).get("phase") == "Serving")


async def test_a_spec_change_at_the_replica_ceiling_replaces_pods_one_at_a_time(operator, serving, profile):
    """maxHourlyCostUSD pays for 2 replicas = replicas.min: a second revision of 2 beside the first
    would cost twice the budget for a start-up. The old revision makes way for one new pod at a time
    instead, the two never above 2 together."""
    profile["spec"]["limits"]["maxHourlyCostUSD"] = 5.0  # 2 x $2.50
    await create(operator, profile)
    await create(operator, with_uid(serving))
    first = (await eventually(lambda: live(operator, DEPLOYMENTS)))[0]
    await set_ready(operator, first, 2)
    await eventually(lambda: status_of(operator).get("phase") == "Serving")

    def replicas():
        return {name: operator.objects[DEPLOYMENTS, "team-a", name]["spec"]["replicas"] for name in live(operator, DEPLOYMENTS)}

    await merge_patch(operator, serving, {"spec": {"speculator": {"method": "ngram", "draftModel": None, "numSpeculativeTokens": 4}}})
    both = await eventually(lambda: len(live(operator, DEPLOYMENTS)) == 2 and live(operator, DEPLOYMENTS))
    second = next(name for name in both if name != first)
    assert await eventually(lambda: replicas() == {first: 1, second: 1})
    await set_ready(operator, second, 1)
    assert await eventually(lambda: replicas() == {first: 0, second: 2})
    await set_ready(operator, second, 2)
    assert await eventually(lambda: live(operator, DEPLOYMENTS) == [second])
    scaled = [r.data for r in requests_to(operator, "PATCH", DEPLOYMENTS) if r.name == first and "spec" in r.data]
    assert scaled == [{"spec": {"replicas": 1}}, {"spec": {"replicas": 0}}]  # its replica count alone, twice


async def test_a_scale_up_waits_for_the_serving_s_terminating_pods(operator, serving, profile):
    """Two of the serving's pods still terminate (a scale-down's, draining on their GPUs): with the
    profile's maxReplicas at 4, a `kubectl scale` to 4 gets 2 until they are gone."""
    await create(operator, profile)
    await create(operator, with_uid(serving))
    name = (await eventually(lambda: live(operator, DEPLOYMENTS)))[0]
    await set_ready(operator, name, 2)
    client = cluster_client(operator)
    # A finalizer stands in for the kubelet: a pod stays, terminating, until its containers exit.
    pods = [{"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": f"{owner}-{i}", "namespace": "team-a", "finalizers": ["test/kubelet"],
                          "labels": {"specserve.io/serving": owner}}}
            for owner in ("qwen3-8b", "other") for i in range(2)]  # another serving's are not ours to count
    for pod in pods:
        await create(operator, pod)
        await asyncio.to_thread(client._call, "DELETE", client._path("v1", "Pod", "team-a", pod["metadata"]["name"]))
    await merge_patch(operator, serving, {"spec": {"replicas": {"desired": 4}}})

    def budget_limited():
        return next((c for c in status_of(operator).get("conditions", []) if c["type"] == "BudgetLimited"), {})

    assert await eventually(lambda: budget_limited().get("reason") == "DrainingPods")
    assert budget_limited()["message"] == "2 terminating pods still hold their accelerators: 2 of 4 replicas until they are gone"
    assert operator.objects[DEPLOYMENTS, "team-a", name]["spec"]["replicas"] == 2
    for pod in pods[:2]:  # their containers exit
        await merge_patch(operator, pod, {"metadata": {"finalizers": None}})
    assert await eventually(lambda: operator.objects[DEPLOYMENTS, "team-a", name]["spec"]["replicas"] == 4)
    assert await eventually(lambda: budget_limited()["status"] == "False")  # the status is patched after the apply


def slow_api(monkeypatch, seconds):
    """A slow API server: with 0.3 s resyncs, some reconcile is nearly always in flight."""
    from specserve_operator.apply import Cluster

    apply = Cluster.apply

    def slow_apply(self, obj):
        time.sleep(seconds)
        return apply(self, obj)

    monkeypatch.setattr(Cluster, "apply", slow_apply)


async def test_a_resync_in_flight_during_a_spec_change_never_deletes_the_new_revision(operator, serving, profile, monkeypatch,
                                                                                      reconciles):
    """A timer that fetched the serving before a spec change must not act on that stale body (it would
    delete the revision the change just created, as a fresh-machine run once showed)."""
    await create(operator, profile)
    await create(operator, with_uid(serving))
    first = (await eventually(lambda: live(operator, DEPLOYMENTS)))[0]
    await set_ready(operator, first, 2)
    await eventually(lambda: status_of(operator).get("phase") == "Serving")
    slow_api(monkeypatch, 0.05)
    await reconciles.running()
    await merge_patch(operator, serving, {"spec": {"speculator": {"method": "ngram", "draftModel": None, "numSpeculativeTokens": 4}}})
    both = await eventually(lambda: len(live(operator, DEPLOYMENTS)) == 2 and live(operator, DEPLOYMENTS))
    second = next(name for name in both if name != first)
    await reconciles.more()  # several passes, each slow
    deleted = [r.url.path for r in requests_to(operator, "DELETE", DEPLOYMENTS)]
    assert deleted == [] and live(operator, DEPLOYMENTS) == sorted([first, second])


async def test_invalid_resource_is_reported_and_creates_nothing(operator, serving, profile):
    await create(operator, profile)
    serving["spec"]["replicas"] = {"min": 1, "max": 9}  # above the profile's maxReplicas (4)
    serving["spec"]["speculator"] = {"method": "dflash"}  # no draftModel
    await create(operator, with_uid(serving))
    status = await eventually(lambda: status_of(operator).get("phase") == "Invalid" and status_of(operator))
    condition = next(c for c in status["conditions"] if c["type"] == "SpecValid")
    assert condition["status"] == "False" and "spec.speculator.draftModel: required for method dflash" in condition["message"]
    assert live(operator, DEPLOYMENTS) == [] and live(operator, "v1/services") == []
    def warning_events():
        return [obj for key, obj in operator.objects.items()
                if key[0].plural == "events" and "spec.speculator.draftModel" in str(obj.last.raw)]

    assert await eventually(warning_events), "a Warning event names the problem"


async def test_invalid_update_leaves_what_serves_untouched(operator, serving, profile, reconciles):
    await create(operator, profile)
    await create(operator, with_uid(serving))
    deployment = (await eventually(lambda: live(operator, DEPLOYMENTS)))[0]
    versions_before = len(operator.objects[DEPLOYMENTS, "team-a", deployment].history)
    await merge_patch(operator, serving, {"spec": {"replicas": {"min": 5, "max": 2}}})
    status = await eventually(lambda: status_of(operator).get("phase") == "Invalid" and status_of(operator))
    assert "spec.replicas.min: 5 must be <= max (2)" in str(status["conditions"])
    await reconciles.more()
    assert live(operator, DEPLOYMENTS) == [deployment]
    assert len(operator.objects[DEPLOYMENTS, "team-a", deployment].history) == versions_before


async def test_a_profile_that_names_no_namespaces_invalidates_its_servings_and_touches_nothing(operator, serving, profile,
                                                                                           reconciles):
    """As a profile stored under an older CRD, without namespaceSelector: its servings say why, and serve on."""
    await create(operator, profile)
    await create(operator, with_uid(serving))
    deployment = (await eventually(lambda: live(operator, DEPLOYMENTS)))[0]
    versions_before = len(operator.objects[DEPLOYMENTS, "team-a", deployment].history)
    await merge_patch(operator, profile, {"spec": {"namespaceSelector": None}})
    status = await eventually(lambda: status_of(operator).get("phase") == "Invalid" and status_of(operator))
    assert ("spec.profile: ServingProfile 'team-a-h100' is invalid (spec.namespaceSelector: Field required)"
            in str(status["conditions"]))
    await reconciles.more()
    assert live(operator, DEPLOYMENTS) == [deployment]
    assert len(operator.objects[DEPLOYMENTS, "team-a", deployment].history) == versions_before


async def test_profile_change_re_renders_its_servings(operator, serving, profile):
    await create(operator, profile)
    await create(operator, with_uid(serving))
    name = (await eventually(lambda: live(operator, DEPLOYMENTS)))[0]
    await merge_patch(operator, profile, {"spec": {"accelerator": {"nodeSelector": {"gpu": "h200"}, "count": 2}}})

    def pod_spec():
        return operator.objects[DEPLOYMENTS, "team-a", name]["spec"]["template"]["spec"]

    assert await eventually(lambda: pod_spec().get("nodeSelector") == {"gpu": "h200"})
    assert pod_spec()["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"


async def test_a_cluster_without_the_gateway_api_is_served_and_cleaned_up(emulator, serving, profile):
    """Without the Gateway API's CRDs the API answers 404 for HTTPRoutes: a ReplicaRatio serving needs none."""
    del emulator.resources["gateway.networking.k8s.io/v1/httproutes"]
    async with running_operator(emulator):
        await create(emulator, profile)
        await create(emulator, with_uid(serving))
        assert await eventually(lambda: status_of(emulator).get("phase") == "Pending")
        assert live(emulator, "v1/services") == ["qwen3-8b", "qwen3-8b-canary", "qwen3-8b-stable"]
        client = cluster_client(emulator)
        await asyncio.to_thread(client.delete, "specserve.io/v1alpha1", "SpeculativeServing", "team-a", "qwen3-8b")
        assert await eventually(lambda: live(emulator, SERVINGS_RESOURCE) == [])  # the cleanup finished
        assert live(emulator, DEPLOYMENTS) == []

async def test_operator_restart_creates_no_duplicates(emulator, serving, profile, reconciles):
    async with running_operator(emulator):
        await create(emulator, profile)
        await create(emulator, with_uid(serving))
        await eventually(lambda: status_of(emulator).get("phase") == "Pending")
    children_before = {k: live(emulator, k) for k in (DEPLOYMENTS, "v1/services", "v1/configmaps")}
    posts_before = len(requests_to(emulator, "POST", DEPLOYMENTS))
    async with running_operator(emulator):  # resumes the existing serving
        await reconciles.more()
    assert {k: live(emulator, k) for k in children_before} == children_before
    assert len(requests_to(emulator, "POST", DEPLOYMENTS)) == posts_before == 1
    assert requests_to(emulator, "PATCH", DEPLOYMENTS) == []  # nothing changed, so nothing was patched


async def test_delete_cleans_up_every_child(operator, serving, profile):
    await create(operator, profile)
    await create(operator, with_uid(serving))
    await eventually(lambda: live(operator, DEPLOYMENTS))
    client = cluster_client(operator)
    await asyncio.to_thread(client.delete, "specserve.io/v1alpha1", "SpeculativeServing", "team-a", "qwen3-8b")
    for resource in (DEPLOYMENTS, "v1/services", "v1/configmaps", "policy/v1/poddisruptionbudgets", "networking.k8s.io/v1/networkpolicies"):
        assert await eventually(lambda: live(operator, resource) == []), resource


async def test_a_deleted_serving_s_gauges_are_removed(operator, serving, profile):
    """Its series end with it: an alert on a deleted serving (SpeculationDegraded) resolves, not fires forever."""
    from prometheus_client import REGISTRY

    def gauge(metric):
        return REGISTRY.get_sample_value(metric, {"namespace": "team-a", "serving": "qwen3-8b"})

    await create(operator, profile)
    await create(operator, with_uid(serving))
    assert await eventually(lambda: gauge("specserve_operator_speculation_degraded") == 0)
    assert gauge("specserve_operator_rollout_step") == -1
    client = cluster_client(operator)
    await asyncio.to_thread(client.delete, "specserve.io/v1alpha1", "SpeculativeServing", "team-a", "qwen3-8b")
    assert await eventually(lambda: live(operator, SERVINGS_RESOURCE) == [])
    assert await eventually(lambda: gauge("specserve_operator_speculation_degraded") is None)
    assert gauge("specserve_operator_rollout_step") is None

async def test_delete_during_a_slow_resync_leaves_no_child_behind(operator, serving, profile, monkeypatch, reconciles):
    """A resync in flight when the serving is deleted must not re-apply children behind the cleanup."""
    await create(operator, profile)
    await create(operator, with_uid(serving))
    await eventually(lambda: live(operator, "networking.k8s.io/v1/networkpolicies"))
    slow_api(monkeypatch, 0.1)
    await reconciles.running()
    client = cluster_client(operator)
    await asyncio.to_thread(client.delete, "specserve.io/v1alpha1", "SpeculativeServing", "team-a", "qwen3-8b")
    assert await eventually(lambda: live(operator, SERVINGS_RESOURCE) == [])  # the finalizer was released
    await reconciles.idle()  # any pass in flight at the delete has ended
    for resource in (DEPLOYMENTS, "v1/services", "v1/configmaps", "policy/v1/poddisruptionbudgets", "networking.k8s.io/v1/networkpolicies"):
        assert live(operator, resource) == [], resource


VERBS = {"LIST": "list", "WATCH": "watch", "FETCH": "get", "CREATE": "create", "UPDATE": "patch", "DELETE": "delete"}


def api_calls(emulator, first: int) -> set[tuple[str, str, str, str | None]]:
    """(API group, resource, verb, namespace or None) of every call the emulator took after its first `first`."""
    calls = set()
    for request in list(emulator)[first:]:
        if request.resource is None or request.action is None:
            continue  # discovery (/api, /apis): allowed to every authenticated client
        if request.resource.plural is None:
            if request.url.path == "/api/v1/namespaces/team-a":  # KMock parses this GET as a bare namespace
                calls.add(("", "namespaces", "get", None))
            continue  # otherwise discovery of a group version
        resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
        calls.add((request.resource.group, resource, VERBS[request.action.name], request.namespace))
    return calls


async def test_every_api_call_is_allowed_by_the_cluster_role(operator, serving, profile):
    """Least privilege, checked against what the operator (our code and kopf) really calls."""
    from specserve_operator.apply import RBAC_RULES

    test_calls = len(list(operator))
    await create(operator, profile)
    await create(operator, with_uid(serving))
    name = (await eventually(lambda: live(operator, DEPLOYMENTS)))[0]
    allowed = {(group, resource, verb) for group, resource, verbs in RBAC_RULES for verb in verbs}
    # What a cluster enforcing owner references checks besides: blockOwnerDeletion on a child needs update on
    # its owner's finalizers.
    (owner,) = operator.objects[DEPLOYMENTS, "team-a", name]["metadata"]["ownerReferences"]
    assert owner["blockOwnerDeletion"] and ("specserve.io", "speculativeservings/finalizers", "update") in allowed
    await merge_patch(operator, profile, {"spec": {"accelerator": {"count": 2}}})
    await eventually(lambda: operator.objects[DEPLOYMENTS, "team-a", name]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2")
    client = cluster_client(operator)
    await asyncio.to_thread(client.delete, "specserve.io/v1alpha1", "SpeculativeServing", "team-a", "qwen3-8b")
    await eventually(lambda: live(operator, DEPLOYMENTS) == [])
    ours = {("specserve.io", "servingprofiles", "create"), ("specserve.io", "speculativeservings", "create"),
            ("specserve.io", "servingprofiles", "patch"), ("specserve.io", "speculativeservings", "delete")}
    used = {call[:3] for call in api_calls(operator, test_calls)}
    # The test itself created and deleted the custom resources; everything else is the operator's.
    calls = used - {c for c in ours if c not in allowed}
    assert calls - allowed == set(), calls - allowed
    assert ("apps", "deployments", "create") in calls and ("", "events", "create") in calls


async def test_an_operator_watching_named_namespaces_calls_only_what_their_role_bindings_grant(emulator, serving, profile):
    """The chart's allNamespaces: false: the namespaced kinds are granted by a RoleBinding in each watched namespace,
    the rest cluster-wide (apply.cluster_roles); every call stays within that, and a serving in a namespace the
    operator does not watch is never touched."""
    from specserve_operator.apply import cluster_roles

    def grants(role):
        return {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
                for resource in rule["resources"] for verb in rule["verbs"]}

    in_watched_namespaces, cluster_wide = (grants(role) for role in cluster_roles())
    async with running_operator(emulator, namespaces=["team-a"]):
        first = len(list(emulator))
        await create(emulator, profile)
        elsewhere = copy.deepcopy(serving)
        elsewhere["metadata"]["namespace"] = "team-b"
        await create(emulator, with_uid(elsewhere))
        await create(emulator, with_uid(serving))
        await eventually(lambda: status_of(emulator).get("phase") == "Pending")
        assert len(live(emulator, DEPLOYMENTS)) == 1
        client = cluster_client(emulator)
        await asyncio.to_thread(client.delete, "specserve.io/v1alpha1", "SpeculativeServing", "team-a", "qwen3-8b")
        await eventually(lambda: live(emulator, DEPLOYMENTS) == [] and live(emulator, SERVINGS_RESOURCE) == ["qwen3-8b"])
    ours = {("specserve.io", "servingprofiles", "create", None), ("specserve.io", "speculativeservings", "create", "team-a"),
            ("specserve.io", "speculativeservings", "create", "team-b"), ("specserve.io", "speculativeservings", "delete", "team-a")}
    calls = api_calls(emulator, first) - ours
    assert ("apps", "deployments", "create", "team-a") in calls
    outside = {call for call in calls if call[:3] not in cluster_wide and not (call[:3] in in_watched_namespaces and call[3] == "team-a")}
    assert outside == set()
    assert {call for call in calls if call[3] == "team-b"} == set()
    unwatched = emulator.objects[SERVINGS_RESOURCE, "team-b", "qwen3-8b"]
    assert not unwatched.get("status") and not unwatched["metadata"].get("finalizers")


async def test_servings_in_one_namespace_never_touch_each_others_children(operator, serving, profile, reconciles):
    """KMock ignores label selectors, like a misbehaving API server would: children are still kept apart."""
    await create(operator, profile)
    other = copy.deepcopy(serving)
    other["metadata"]["name"] = "llama"
    await create(operator, with_uid(serving))
    await create(operator, with_uid(other))
    expected = ["llama", "llama-canary", "llama-stable", "qwen3-8b", "qwen3-8b-canary", "qwen3-8b-stable"]
    assert await eventually(lambda: live(operator, "v1/services") == expected)
    await reconciles.more(name="qwen3-8b")  # several passes over both
    await reconciles.more(name="llama")
    assert live(operator, "v1/services") == expected
    assert requests_to(operator, "DELETE", "v1/services") == []
