"""Pure rendering: (serving, profile, revisions) -> every child object of a SpeculativeServing.

Nothing here talks to the cluster. The kopf handlers and `specserve render` call `render_all`
and hand the result to apply.py (or print it).
"""

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from specserve_runtime.config import CONFIG_FILE, CONFIG_MOUNT, DEFAULT_PORT, PVC_MOUNT, RuntimeConfig, pvc_claim

from . import api
from .capacity import Point

# Child kinds the operator owns and garbage-collects itself (label specserve.io/serving=<name>).
CHILD_KINDS = [
    ("v1", "ConfigMap"),
    ("apps/v1", "Deployment"),
    ("v1", "Service"),
    ("policy/v1", "PodDisruptionBudget"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
]

PORT_NAME = "http"
RUNTIME_UID = 10001
MANAGED_BY = "specserve-operator"


@dataclass(frozen=True)
class Serving:
    """A parsed SpeculativeServing: identity from metadata, plus the validated spec."""

    name: str
    namespace: str
    uid: str | None
    spec: api.SpeculativeServingSpec


@dataclass(frozen=True)
class Profile:
    name: str
    spec: api.ServingProfileSpec


@dataclass(frozen=True)
class Revision:
    role: str  # "stable" | "canary"
    speculator: api.Speculator
    runtime: api.RuntimeSpec
    hash: str
    replicas: int


@dataclass(frozen=True)
class Traffic:
    """What the rollout state machine decided, as rendering needs it (rollout.py decides it).

    stage: Stable (no canary), Canary (the candidate takes `canary_weight` percent), Aborted (the
    candidate's Deployment kept at zero replicas for inspection), Promoted (the candidate revision
    is the stable one). stable_backend: the revision `<name>-stable` routes to while a new stable
    revision is not ready yet (None: the stable revision itself). canary_ready, stable_ready: each
    revision's ready pods (None: not known), and drain_candidate: an aborted candidate keeps its
    ready pods while the stable's replacements start (rollout.drains); previous_pods: the pods that
    older revisions keep while the one revision of a Stable or Promoted stage replaces them after
    a spec update or a promotion (pods_to_keep; None: none left); see planned_revisions. room: the
    replica ceiling the pods still draining leave (replica_room; None: replica_ceiling).
    """

    stage: Literal["Stable", "Canary", "Aborted", "Promoted"] = "Stable"
    canary_weight: int | None = None
    stable_backend: str | None = None
    canary_ready: int | None = None
    stable_ready: int | None = None
    drain_candidate: bool = False
    previous_pods: int | None = None
    room: int | None = None


@dataclass(frozen=True)
class Settings:
    """Cluster facts the operator is configured with (config.py), not taken from tenants."""

    monitoring_namespace: str = "monitoring"
    operator_namespace: str = "specserve-system"
    autoscale_interval_seconds: float = 30.0  # measure and decide replicas this often (autoscaling.enabled)
    # The autoscaler's capacity prior per speculator method, until measured windows outweigh it
    # (capacity.py): SPECSERVE_CAPACITY_PRIORS in the operator, the scenario's performance in the simulator.
    capacity_priors: Mapping[str, Sequence[Point]] = field(default_factory=dict)
    # How long a new runtime replica takes to serve (image pull, model load): the autoscaler plans a
    # rising demand this far ahead (SPECSERVE_REPLICA_STARTUP_SECONDS; a scenario's startupSeconds).
    replica_startup_seconds: float = 120.0


# Speculator fields newer than the revisions already running: hashed only where set, so that an operator that
# knows them gives a revision that does not use them the hash it had, and upgrading the operator rolls no pods.
HASHED_WHERE_SET = ("prompt_lookup", "num_speculative_tokens_per_batch_size")


def revision_hash(model: api.ModelRef, speculator: api.Speculator, runtime: api.RuntimeSpec) -> str:
    """A short hash of everything that affects the pods: a new value means new pods."""
    speculator_fields = {name: value for name, value in speculator.model_dump().items()
                         if value is not None or name not in HASHED_WHERE_SET}
    pod_spec = {"model": model.model_dump(), "speculator": speculator_fields, "runtime": runtime.model_dump()}
    return hashlib.sha256(json.dumps(pod_spec, sort_keys=True).encode()).hexdigest()[:8]


def candidate_runtime(spec: api.SpeculativeServingSpec) -> api.RuntimeSpec:
    override = spec.rollout.candidate.runtime if spec.rollout else None
    if override is None:
        return spec.runtime
    return spec.runtime.model_copy(update=override.model_dump(exclude_none=True, by_alias=False))


def replica_ceiling(spec: api.SpeculativeServingSpec, profile: api.ServingProfileSpec) -> int:
    """The most replicas all revisions together may run: spec bounds, the profile's limit and its cost budget."""
    ceiling = min(spec.replicas.max, profile.limits.max_replicas)
    cost_per_replica = profile.accelerator.count * profile.accelerator.price_per_hour_usd
    if profile.limits.max_hourly_cost_usd is not None and cost_per_replica > 0:
        ceiling = min(ceiling, math.floor(profile.limits.max_hourly_cost_usd / cost_per_replica))
    return max(ceiling, 0)


def replica_room(ceiling: int, draining: int, running: int) -> int:
    """The replica ceiling for the pods a plan runs while `draining` pods of the serving terminate.
    A pod removed by a scale-down (or with its revision) serves its last requests for up to its
    grace period, on its accelerator and billed: the ceiling is a wall for it too, so a scale-up
    within a drain waits for those pods to go. Never below the `running` pods the Deployments hold
    now (within the ceiling): removing a running pod to make room would only add a draining one."""
    return max(ceiling - draining, min(running, ceiling), 0)


def replica_budget(spec: api.SpeculativeServingSpec, profile: api.ServingProfileSpec, wanted: int | None = None) -> int:
    """Replicas for all revisions together, within spec bounds, the profile's limit and its cost budget."""
    replicas = spec.replicas
    count = replicas.desired if wanted is None and replicas.desired is not None else wanted
    count = replicas.min if count is None else count
    return max(0, min(max(count, replicas.min), replica_ceiling(spec, profile)))


def candidate_hash(spec: api.SpeculativeServingSpec) -> str | None:
    if spec.rollout is None:
        return None
    return revision_hash(spec.model, spec.rollout.candidate.speculator, candidate_runtime(spec))


def split_replicas(total: int, weight: int) -> tuple[int, int]:
    """(stable, canary) replicas whose ratio approximates the weight: at least one each, so that both
    are measured. One Service spreads requests evenly over all ready pods, so per-replica load is
    equal by construction."""
    canary = min(max(1, round(total * weight / 100)), max(total - 1, 1))
    return max(total - canary, 1), canary


def revisions(spec: api.SpeculativeServingSpec, total: int, traffic: Traffic = Traffic()) -> list[Revision]:
    """The stable revision, and the candidate's while a rollout runs or after it was aborted."""
    stable = Revision("stable", spec.speculator, spec.runtime, revision_hash(spec.model, spec.speculator, spec.runtime), total)
    if spec.rollout is None or traffic.stage == "Stable":
        return [stable]
    speculator, runtime, candidate = spec.rollout.candidate.speculator, candidate_runtime(spec), candidate_hash(spec)
    if traffic.stage == "Promoted":
        return [Revision("stable", speculator, runtime, candidate, total)]
    if traffic.stage == "Aborted":
        return [stable, Revision("canary", speculator, runtime, candidate, 0)]
    stable_replicas, canary_replicas = split_replicas(total, traffic.canary_weight or 0)
    return [
        replace(stable, replicas=stable_replicas),
        Revision("canary", speculator, runtime, candidate, canary_replicas),
    ]


def planned_revisions(spec: api.SpeculativeServingSpec, profile: api.ServingProfileSpec, wanted: int | None,
                      traffic: Traffic) -> list[Revision]:
    """The revisions' replica counts as applied: the budgeted total split by the rollout's weight,
    and while one revision's pods start (fewer ready than its replicas), the other keeps the pods
    they will replace. One Service spreads requests over all ready pods, so a pod removed before
    its replacement is ready is capacity lost for a whole start-up. Two cases: the stable while the
    candidate's pods start, and a draining aborted candidate (ReplicaRatio only: a route sends an
    aborted candidate nothing) while the stable's start, never more than its ready pods. The total
    and the surge stay within the ceiling (traffic.room: replica_ceiling less the pods still
    draining): the budget is a wall for them too. So while older revisions keep
    pods (after a spec update or a promotion; pods_to_keep says how many, and they go as the new
    revision's become ready), the new revision gets what the ceiling leaves beside them: at
    promotion at least its canary pods."""
    ceiling = replica_ceiling(spec, profile) if traffic.room is None else traffic.room
    revs = revisions(spec, min(replica_budget(spec, profile, wanted), ceiling), traffic)
    if traffic.stage in ("Stable", "Promoted") and traffic.previous_pods:
        (replacing,) = revs
        return [replace(replacing, replicas=max(min(replacing.replicas, ceiling - traffic.previous_pods), 0))]
    if len(revs) < 2:
        return revs
    stable, canary = revs
    if traffic.stage == "Canary" and traffic.canary_ready is not None:
        return [keep_replaced_pods(stable, canary, traffic.canary_ready, ceiling - canary.replicas), canary]
    if (traffic.stage == "Aborted" and traffic.drain_candidate and spec.traffic.mode == "ReplicaRatio"
            and traffic.canary_ready is not None and traffic.stable_ready is not None):
        most = min(ceiling - stable.replicas, traffic.canary_ready)
        return [stable, keep_replaced_pods(canary, stable, traffic.stable_ready, most)]
    return revs


def pods_to_keep(wanted: int, ready: int, previous: int, ceiling: int) -> int:
    """Of the `previous` pods of older revisions that a revision of `wanted` replicas (`ready` of
    them ready) replaces, after a plain spec update or a promotion: how many stay. Those that cover
    what it has not made ready yet, within `ceiling` beside it; at the ceiling one fewer, so that it
    can start a pod. A rolling replacement, one pod at a time at the budget's wall (Kubernetes'
    maxUnavailable 1), instead of a whole second revision beside the first for a start-up."""
    keep = min(previous, max(wanted - ready, 0))
    if ready < wanted and keep > 0 and ceiling - keep <= ready:
        keep = max(ceiling - ready - 1, 0)
    return keep


def keep_replaced_pods(leaving: Revision, arriving: Revision, arriving_ready: int, most: int) -> Revision:
    """`leaving` with the pods that `arriving`'s starting pods will replace, up to `most` in all."""
    starting = max(arriving.replicas - arriving_ready, 0)
    return replace(leaving, replicas=max(leaving.replicas, min(leaving.replicas + starting, most)))


def selector_labels(serving: Serving) -> dict[str, str]:
    return {"specserve.io/serving": serving.name}


def common_labels(serving: Serving, profile: Profile) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "specserve-runtime",
        "app.kubernetes.io/instance": serving.name,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        **selector_labels(serving),
        "specserve.io/tenant": profile.spec.tenant,
    }


def metadata(serving: Serving, profile: Profile, name: str, extra_labels: dict | None = None) -> dict:
    meta = {"name": name, "namespace": serving.namespace, "labels": {**common_labels(serving, profile), **(extra_labels or {})}}
    if serving.uid:
        meta["ownerReferences"] = [
            {
                "apiVersion": api.API_VERSION,
                "kind": "SpeculativeServing",
                "name": serving.name,
                "uid": serving.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    return meta


def runtime_config(serving: Serving, revision: Revision) -> RuntimeConfig:
    """The revision's runtime configuration. References go as written: the runtime resolves hf://, the folder
    where the pod mounts a pvc:// claim, and bundled:// (config.local_reference)."""
    model, speculator = serving.spec.model, revision.speculator
    return RuntimeConfig(
        model=model.name,
        model_uri=model.uri,
        served_name=model.served_name,
        method=speculator.method,
        drafter=speculator.draft_model,
        num_speculative_tokens=speculator.num_speculative_tokens,
        draft_tree=speculator.draft_tree,
        prompt_lookup=speculator.prompt_lookup,
        num_speculative_tokens_per_batch_size=speculator.num_speculative_tokens_per_batch_size,
        engine=revision.runtime.engine,
        engine_args=revision.runtime.args,
        port=DEFAULT_PORT,
    )


def revision_name(serving: Serving, revision: Revision) -> str:
    return f"{serving.name}-{revision.hash}"


def config_map(serving: Serving, profile: Profile, revision: Revision) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(serving, profile, revision_name(serving, revision), {"specserve.io/revision": revision.hash}),
        "data": {CONFIG_FILE: runtime_config(serving, revision).to_yaml()},
    }


def _resources(profile: Profile, runtime: api.RuntimeSpec) -> dict:
    accelerator = profile.spec.accelerator
    requests = {k: str(v) for k, v in runtime.resources.requests.items()}
    limits = {k: str(v) for k, v in runtime.resources.limits.items()}
    if accelerator.count:
        # Extended resources must have requests == limits; the profile, not the tenant, sets them.
        requests[accelerator.resource_name] = limits[accelerator.resource_name] = str(accelerator.count)
    return {key: value for key, value in (("requests", requests), ("limits", limits)) if value}


# Where each engine says it can take requests: the embedded server's /ready answers 200 once its model is loaded;
# vLLM's server listens only once its engine is up, and its /health then answers 200 (it has no /ready).
READINESS_PATHS = {"embedded": "/ready", "vllm": "/health"}
# The pod's root filesystem is read-only: every cache an engine writes (compiled graphs, downloads, HOME's
# dotfiles) goes to the `cache` volume.
CACHE_MOUNT = "/cache"
CACHE_ENV = {
    "HOME": CACHE_MOUNT,
    "XDG_CACHE_HOME": f"{CACHE_MOUNT}/xdg",
    "SPECSERVE_CACHE": CACHE_MOUNT,
    "HF_HOME": f"{CACHE_MOUNT}/huggingface",
    "VLLM_CACHE_ROOT": f"{CACHE_MOUNT}/vllm",
    "VLLM_CONFIG_ROOT": f"{CACHE_MOUNT}/vllm-config",
    "VLLM_NO_USAGE_STATS": "1",
}


def claim_volumes(serving: Serving, revision: Revision) -> tuple[list[dict], list[dict]]:
    """The volumes and mounts of the pvc:// claims the revision's model and drafter name: each claim read-only at
    PVC_MOUNT/CLAIM, where the runtime looks for it (config.local_reference)."""
    uris = [serving.spec.model.uri, revision.speculator.draft_model or ""]
    claims = sorted({pvc_claim(uri)[0] for uri in uris if uri.startswith("pvc://")})
    volumes = [{"name": f"pvc-{i}", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
               for i, claim in enumerate(claims)]
    mounts = [{"name": f"pvc-{i}", "mountPath": f"{PVC_MOUNT}/{claim}", "readOnly": True}
              for i, claim in enumerate(claims)]
    return volumes, mounts


def deployment(serving: Serving, profile: Profile, revision: Revision) -> dict:
    name = revision_name(serving, revision)
    # The role (stable / canary) is a label of the Deployment, not of its pods: promotion turns the
    # canary revision into the stable one without changing its pod template, so no pod restarts.
    pod_labels = {**common_labels(serving, profile), "specserve.io/revision": revision.hash}
    kueue = profile.spec.kueue
    if kueue and kueue.local_queue:
        pod_labels["kueue.x-k8s.io/queue-name"] = kueue.local_queue
    if kueue and kueue.priority_class:
        pod_labels["kueue.x-k8s.io/priority-class"] = kueue.priority_class
    accelerator = profile.spec.accelerator
    claims, claim_mounts = claim_volumes(serving, revision)
    probe = {"httpGet": {"path": "/health", "port": PORT_NAME}, "periodSeconds": 10, "timeoutSeconds": 5}
    container = {
        "name": "runtime",
        "image": revision.runtime.image or api.RUNTIME_IMAGES[revision.runtime.engine],
        "args": ["launch", "--config", f"{CONFIG_MOUNT}/{CONFIG_FILE}"],
        "ports": [{"name": PORT_NAME, "containerPort": DEFAULT_PORT, "protocol": "TCP"}],
        "env": [{"name": name, "value": value} for name, value in CACHE_ENV.items()],
        "resources": _resources(profile, revision.runtime),
        # Model downloads and compilation can take many minutes: the startup probe allows 30.
        "startupProbe": {**probe, "failureThreshold": 180},
        "livenessProbe": {**probe, "failureThreshold": 3},
        "readinessProbe": {"httpGet": {"path": READINESS_PATHS[revision.runtime.engine], "port": PORT_NAME},
                           "periodSeconds": 5, "failureThreshold": 2},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
            {"name": "cache", "mountPath": CACHE_MOUNT},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "shm", "mountPath": "/dev/shm"},
            *claim_mounts,
        ],
    }
    pod_spec = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUNTIME_UID,
            "runAsGroup": RUNTIME_UID,
            "fsGroup": RUNTIME_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationGracePeriodSeconds": 60,
        "containers": [container],
        "volumes": [
            {"name": "config", "configMap": {"name": name}},
            {"name": "cache", "emptyDir": {}},
            {"name": "tmp", "emptyDir": {}},
            {"name": "shm", "emptyDir": {"medium": "Memory"}},
            *claims,
        ],
    }
    if accelerator.node_selector:
        pod_spec["nodeSelector"] = dict(accelerator.node_selector)
    if accelerator.tolerations:
        pod_spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in accelerator.tolerations]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(serving, profile, name, {"specserve.io/revision": revision.hash, "specserve.io/role": revision.role}),
        "spec": {
            "replicas": revision.replicas,
            "selector": {"matchLabels": {**selector_labels(serving), "specserve.io/revision": revision.hash}},
            # Surge first, never go below the ready count: updates do not drop capacity.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {
                    "labels": pod_labels,
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(DEFAULT_PORT),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": pod_spec,
            },
        },
    }


def service(serving: Serving, profile: Profile, name: str, selector: dict) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(serving, profile, name),
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [{"name": PORT_NAME, "port": DEFAULT_PORT, "targetPort": PORT_NAME, "protocol": "TCP"}],
        },
    }


def services(serving: Serving, profile: Profile, revs: list[Revision], traffic: Traffic) -> list[dict]:
    """<name> reaches every ready pod of every revision. <name>-stable routes to the stable revision
    (or, while a new stable revision is not ready yet, to the one that still serves) and
    <name>-canary to the candidate's; both select by revision hash, which never changes on a pod."""
    by_role = {revision.role: revision.hash for revision in revs}
    backends = {"stable": traffic.stable_backend or by_role["stable"], "canary": by_role.get("canary", "none")}
    out = [service(serving, profile, serving.name, selector_labels(serving))]
    for role, revision in backends.items():
        selector = {**selector_labels(serving), "specserve.io/revision": revision}
        out.append(service(serving, profile, f"{serving.name}-{role}", selector))
    return out


def http_route(serving: Serving, profile: Profile, canary_weight: int | None) -> dict:
    gateway = serving.spec.traffic.gateway
    weight = canary_weight or 0
    backends = [{"name": f"{serving.name}-stable", "port": DEFAULT_PORT, "weight": 100 - weight}]
    if weight:
        backends.append({"name": f"{serving.name}-canary", "port": DEFAULT_PORT, "weight": weight})
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": metadata(serving, profile, serving.name),
        "spec": {
            "parentRefs": [p.model_dump(by_alias=True, exclude_none=True) for p in gateway.parent_refs],
            "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": "/v1"}}], "backendRefs": backends}],
        },
    }


def pod_disruption_budget(serving: Serving, profile: Profile) -> dict:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(serving, profile, serving.name),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(serving)}},
    }


def network_policy(serving: Serving, profile: Profile, settings: Settings) -> dict:
    """Ingress only from the tenant's own namespace, the gateways', monitoring and the operator."""
    namespaces = {serving.namespace, settings.monitoring_namespace, settings.operator_namespace}
    if serving.spec.traffic.gateway:
        namespaces |= {p.namespace or serving.namespace for p in serving.spec.traffic.gateway.parent_refs}
    peers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}} for ns in sorted(namespaces)]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(serving, profile, serving.name),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(serving)},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": peers, "ports": [{"protocol": "TCP", "port": DEFAULT_PORT}]}],
        },
    }


def render_all(
    serving: Serving,
    profile: Profile,
    settings: Settings = Settings(),
    traffic: Traffic = Traffic(),
    wanted_replicas: int | None = None,
) -> list[dict]:
    """Every child object, for the rollout's current `traffic` decision."""
    spec = serving.spec
    revs = planned_revisions(spec, profile.spec, wanted_replicas, traffic)
    objects = []
    for revision in revs:
        objects += [config_map(serving, profile, revision), deployment(serving, profile, revision)]
    objects += services(serving, profile, revs, traffic)
    if spec.traffic.mode == "GatewayAPI":
        objects.append(http_route(serving, profile, traffic.canary_weight if traffic.stage == "Canary" else None))
    objects += [pod_disruption_budget(serving, profile), network_policy(serving, profile, settings)]
    return objects
