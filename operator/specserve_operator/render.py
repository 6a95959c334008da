"""Pure rendering: (serving, profile, revisions) -> every child object of a SpeculativeServing.

replicas.py plans the revisions and their pods; this module writes their objects.

Nothing here talks to the cluster. The kopf handlers and `specserve render` call `render_all`
and hand the result to apply.py (or print it).
"""

from collections.abc import Mapping
from dataclasses import dataclass, field

from specserve_runtime.config import CONFIG_FILE, CONFIG_MOUNT, DEFAULT_PORT, PVC_MOUNT, RuntimeConfig, pvc_claim

from . import api
from .capacity import Prior
from .replicas import Revision, Traffic, planned_revisions
from .schedule import DraftLengths

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
class Settings:
    """Cluster facts the operator is configured with (config.py), not taken from tenants."""

    monitoring_namespace: str = "monitoring"
    operator_namespace: str = "specserve-system"
    autoscale_interval_seconds: float = 30.0  # measure and decide replicas this often (autoscaling.enabled)
    # The autoscaler's capacity prior per speculator method, until measured windows outweigh it
    # (capacity.py): SPECSERVE_CAPACITY_PRIORS in the operator, the scenario's performance in the simulator.
    capacity_priors: Mapping[str, Prior] = field(default_factory=dict)
    # Per speculator method, its fixed draft lengths measured by the bench: what schedules are proposed from
    # (schedule.py); from the same performance block.
    draft_lengths: Mapping[str, DraftLengths] = field(default_factory=dict)
    # How long a new runtime replica takes to serve (image pull, model load): the autoscaler plans a
    # rising demand this far ahead (SPECSERVE_REPLICA_STARTUP_SECONDS; a scenario's startupSeconds).
    replica_startup_seconds: float = 120.0
    # What the measured p99 inter-token latency is: the gap between a request's verify steps, as vLLM and the runtime
    # observe it (so a drafter's capacity prior is converted to it: schedule.capacity_prior); False where it is the
    # time per token, as the simulator measures it (docs/simulator.md).
    inter_token_latency_per_step: bool = True


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
