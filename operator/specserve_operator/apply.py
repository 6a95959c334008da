"""The only module that calls the Kubernetes API (kopf's own watching aside).

Objects are applied idempotently: create if absent, else merge-patch, and only when the
rendered object changed (tracked by a hash annotation), so retries and restarts neither
duplicate objects nor patch what is already right. RBAC_RULES lists every verb this module
and kopf use; the chart's ClusterRole is generated from it and a test checks the calls.
"""

import hashlib
import json
from dataclasses import dataclass

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.rest import ApiException

APPLIED_HASH = "specserve.io/applied-hash"
REQUEST_TIMEOUT = (5, 30)  # connect, read: a handler must not hang on a dead API server


@dataclass(frozen=True)
class Kind:
    prefix: str  # /api/v1 or /apis/<group>/<version>
    plural: str
    namespaced: bool = True


KINDS = {
    ("v1", "ConfigMap"): Kind("/api/v1", "configmaps"),
    ("v1", "Service"): Kind("/api/v1", "services"),
    ("v1", "Namespace"): Kind("/api/v1", "namespaces", namespaced=False),
    ("v1", "Pod"): Kind("/api/v1", "pods"),
    ("apps/v1", "Deployment"): Kind("/apis/apps/v1", "deployments"),
    ("policy/v1", "PodDisruptionBudget"): Kind("/apis/policy/v1", "poddisruptionbudgets"),
    ("networking.k8s.io/v1", "NetworkPolicy"): Kind("/apis/networking.k8s.io/v1", "networkpolicies"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): Kind("/apis/gateway.networking.k8s.io/v1", "httproutes"),
    ("specserve.io/v1alpha1", "ServingProfile"): Kind("/apis/specserve.io/v1alpha1", "servingprofiles", namespaced=False),
    ("specserve.io/v1alpha1", "SpeculativeServing"): Kind("/apis/specserve.io/v1alpha1", "speculativeservings"),
}

# Every (API group, resource, verbs) the operator needs: here and in kopf (watching its own
# resources, posting events, patching status and finalizers). cluster_roles splits them by where they are bound.
RBAC_RULES = [
    ("specserve.io", "speculativeservings", ["get", "list", "watch", "patch"]),
    ("specserve.io", "speculativeservings/status", ["patch"]),
    # children's ownerReferences set blockOwnerDeletion, which clusters enforcing owner references (the
    # OwnerReferencesPermissionEnforcement admission plugin) allow only to who may update the owner's finalizers
    ("specserve.io", "speculativeservings/finalizers", ["update"]),
    ("specserve.io", "servingprofiles", ["get", "list", "watch", "patch"]),  # patch: kopf's annotations
    ("", "namespaces", ["get", "list", "watch"]),  # list, watch: kopf, with --namespace
    ("", "configmaps", ["get", "list", "create", "patch", "delete"]),
    ("", "services", ["get", "list", "create", "patch", "delete"]),
    ("", "pods", ["list"]),  # the direct-scrape measurement source lists a revision's ready pods
    ("apps", "deployments", ["get", "list", "create", "patch", "delete"]),
    ("policy", "poddisruptionbudgets", ["get", "list", "create", "patch", "delete"]),
    ("networking.k8s.io", "networkpolicies", ["get", "list", "create", "patch", "delete"]),
    ("gateway.networking.k8s.io", "httproutes", ["get", "list", "create", "patch", "delete"]),
    ("", "events", ["create"]),  # kopf posts core v1 Events: a profile's in the operator's own namespace
    ("apiextensions.k8s.io", "customresourcedefinitions", ["list", "watch"]),  # kopf watches for new CRDs
]


# Bound cluster-wide whatever the operator watches: cluster-scoped resources, and Events (a cluster-scoped object's
# go to the operator's namespace).
CLUSTER_WIDE = {"servingprofiles", "namespaces", "customresourcedefinitions", "events"}


def cluster_roles(name: str = "specserve-operator") -> list[dict]:
    """`name`, the rules on namespaced resources: bound cluster-wide when the operator watches every namespace,
    else in each namespace it watches (a RoleBinding); `name`-cluster, the rest, always bound cluster-wide."""
    def role(role_name: str, rules: list) -> dict:
        return {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": role_name, "labels": {"app.kubernetes.io/name": "specserve-operator"}},
            "rules": [{"apiGroups": [group], "resources": [resource], "verbs": verbs} for group, resource, verbs in rules],
        }

    def cluster_wide(rule) -> bool:
        return rule[1].split("/")[0] in CLUSTER_WIDE

    return [role(name, [r for r in RBAC_RULES if not cluster_wide(r)]),
            role(f"{name}-cluster", [r for r in RBAC_RULES if cluster_wide(r)])]


def object_hash(obj: dict) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


class Cluster:
    """A thin synchronous client for the handful of REST calls the operator makes."""

    def __init__(self, api_client: k8s.ApiClient | None = None):
        if api_client is None:
            try:
                k8s_config.load_incluster_config()
            except k8s_config.ConfigException:
                k8s_config.load_kube_config()
            api_client = k8s.ApiClient()
        self.api = api_client

    def _path(self, api_version: str, kind: str, namespace: str | None, name: str | None = None) -> str:
        info = KINDS[(api_version, kind)]
        path = info.prefix
        if info.namespaced and namespace is not None:  # None lists across all namespaces
            path += f"/namespaces/{namespace}"
        path += f"/{info.plural}"
        return f"{path}/{name}" if name else path

    def _call(self, method: str, path: str, body=None, query=None, content_type="application/json"):
        method, url, headers, body, _ = self.api.param_serialize(
            method=method, resource_path=path, query_params=query or [], body=body,
            header_params={"Content-Type": content_type, "Accept": "application/json"}, auth_settings=["BearerToken"],
        )
        response = self.api.call_api(method, url, header_params=headers, body=body, _request_timeout=REQUEST_TIMEOUT)
        response.read()
        if not 200 <= response.status < 300:
            raise ApiException(http_resp=response)
        return json.loads(response.data) if response.data else None

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict | None:
        try:
            return self._call("GET", self._path(api_version, kind, namespace, name))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, api_version: str, kind: str, namespace: str | None, label_selector: str = "") -> list[dict]:
        """The objects of a kind; none where the cluster does not serve the kind (HTTPRoute without the Gateway
        API's CRDs)."""
        query = [("labelSelector", label_selector)] if label_selector else []
        try:
            result = self._call("GET", self._path(api_version, kind, namespace), query=query)
        except ApiException as exc:
            if exc.status == 404:
                return []
            raise
        return list((result or {}).get("items") or [])

    def apply(self, obj: dict) -> str:
        """Create or merge-patch `obj`; returns 'created', 'patched' or 'unchanged'."""
        meta = obj["metadata"]
        desired_hash = object_hash(obj)
        body = {**obj, "metadata": {**meta, "annotations": {**meta.get("annotations", {}), APPLIED_HASH: desired_hash}}}
        current = self.get(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        if current is None:
            try:
                self._call("POST", self._path(obj["apiVersion"], obj["kind"], meta.get("namespace")), body)
                return "created"
            except ApiException as exc:
                if exc.status != 409:  # created concurrently (a retry, a second replica): patch below
                    raise
        elif (current.get("metadata", {}).get("annotations") or {}).get(APPLIED_HASH) == desired_hash:
            return "unchanged"
        path = self._path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        self._call("PATCH", path, body, content_type="application/merge-patch+json")
        return "patched"

    def scale(self, api_version: str, kind: str, namespace: str, name: str, replicas: int) -> None:
        """Set spec.replicas alone (a merge patch): for an object no longer rendered, whose spec is gone."""
        path = self._path(api_version, kind, namespace, name)
        self._call("PATCH", path, {"spec": {"replicas": replicas}}, content_type="application/merge-patch+json")

    def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> bool:
        try:
            self._call("DELETE", self._path(api_version, kind, namespace, name), {"propagationPolicy": "Background"})
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise

    def patch_status(self, api_version: str, kind: str, namespace: str | None, name: str, status: dict,
                     resource_version: str | None = None) -> None:
        """Merge-patch the status; with `resource_version`, only if the object is still at that version (409 if not)."""
        body = {"status": status}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        path = self._path(api_version, kind, namespace, name) + "/status"
        self._call("PATCH", path, body, content_type="application/merge-patch+json")

    def remove_annotations(self, api_version: str, kind: str, namespace: str | None, name: str, keys: "list[str]") -> None:
        """Merge-patch the annotations away (the operator consumes specserve.io/promote, abort and retry)."""
        body = {"metadata": {"annotations": {key: None for key in keys}}}
        self._call("PATCH", self._path(api_version, kind, namespace, name), body, content_type="application/merge-patch+json")
