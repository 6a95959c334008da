"""One reconciliation of a SpeculativeServing: validate, render, apply, clean up, report status.

`plan_deletions` and `serving_status` are pure; `reconcile` strings them together around the
cluster calls, and is what every kopf handler (create, update, resume, timer, profile change)
runs, so there is one path from spec to cluster.
"""

import datetime
from dataclasses import dataclass, field

from . import api
from .apply import CHILD_KINDS, Cluster
from .render import Profile, Serving, Settings, render_all, replica_budget, revisions
from .validate import check_against_profile, parse_profile, parse_serving

REVISION_SCOPED = {("v1", "ConfigMap"), ("apps/v1", "Deployment")}


@dataclass
class Outcome:
    status: dict
    problems: list[str] = field(default_factory=list)
    applied: dict[str, str] = field(default_factory=dict)  # "Kind/name" -> created | patched | unchanged
    deleted: list[str] = field(default_factory=list)


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(conditions: list[dict], type_: str, status: bool, reason: str, message: str = "") -> list[dict]:
    """Replace one condition, keeping lastTransitionTime when its status did not change."""
    value = "True" if status else "False"
    previous = next((c for c in conditions if c.get("type") == type_), None)
    since = previous["lastTransitionTime"] if previous and previous.get("status") == value else now()
    entry = {"type": type_, "status": value, "reason": reason, "message": message, "lastTransitionTime": since}
    return [c for c in conditions if c.get("type") != type_] + [entry]


def canary_weight(spec: api.SpeculativeServingSpec, status: dict) -> int | None:
    """The rollout's current traffic weight: the recorded step, or the first step of a new rollout."""
    if spec.rollout is None:
        return None
    step = min((status.get("canary") or {}).get("step", 0), len(spec.rollout.steps) - 1)
    return spec.rollout.steps[step].weight


def plan_deletions(desired: list[dict], existing: dict[tuple, list[dict]], stable_ready: bool) -> list[tuple]:
    """Children to delete: those no longer rendered. Old revisions go only once the new stable is ready."""
    wanted = {(o["apiVersion"], o["kind"], o["metadata"]["name"]) for o in desired}
    deletions = []
    for kind_key, objects in existing.items():
        if kind_key in REVISION_SCOPED and not stable_ready:
            continue
        for obj in objects:
            if (*kind_key, obj["metadata"]["name"]) not in wanted:
                deletions.append((*kind_key, obj["metadata"]["name"]))
    return deletions


def invalid_status(old_status: dict, generation: int | None, problems: list[str]) -> dict:
    conditions = set_condition(old_status.get("conditions") or [], "SpecValid", False, "InvalidSpec", "; ".join(problems))
    return {"observedGeneration": generation, "phase": "Invalid", "conditions": conditions}


def serving_status(serving: Serving, profile: Profile, old_status: dict, generation: int | None, existing: dict) -> dict:
    spec = serving.spec
    weight = canary_weight(spec, old_status)
    revs = revisions(spec, replica_budget(spec, profile.spec), weight)
    deployments = {d["metadata"]["name"]: d for d in existing.get(("apps/v1", "Deployment"), [])}

    def revision_status(revision) -> dict:
        current = deployments.get(f"{serving.name}-{revision.hash}", {}).get("status") or {}
        return {
            "revision": revision.hash,
            "speculator": revision.speculator.model_dump(by_alias=True, exclude_none=True),
            "replicas": revision.replicas,
            "readyReplicas": current.get("readyReplicas", 0),
        }

    stable = revision_status(revs[0])
    ready = is_ready(stable)
    conditions = old_status.get("conditions") or []
    conditions = set_condition(conditions, "SpecValid", True, "Valid")
    conditions = set_condition(
        conditions, "Ready", ready, "AllReplicasReady" if ready else "ReplicasNotReady",
        f"{stable['readyReplicas']}/{stable['replicas']} replicas of revision {stable['revision']} ready",
    )
    conditions = set_condition(conditions, "Progressing", len(revs) > 1 or not ready, "Rollout" if len(revs) > 1 else "Steady")
    ceiling = min(spec.replicas.max, profile.spec.limits.max_replicas)
    budget_limited = replica_budget(spec, profile.spec, ceiling) < ceiling
    conditions = set_condition(conditions, "BudgetLimited", budget_limited, "MaxHourlyCost" if budget_limited else "WithinBudget")
    status = {
        "observedGeneration": generation,
        "phase": "Progressing" if len(revs) > 1 else ("Serving" if ready else "Pending"),
        "conditions": conditions,
        "stable": stable,
        "replicas": sum(r.replicas for r in revs),
        "selector": f"specserve.io/serving={serving.name}",
    }
    if len(revs) > 1:
        canary = old_status.get("canary") or {}
        status["canary"] = {
            **revision_status(revs[1]),
            "step": canary.get("step", 0),
            "weight": weight,
            "stepStartedAt": canary.get("stepStartedAt") or now(),
            "failedChecks": canary.get("failedChecks", 0),
        }
    else:
        status["canary"] = None
    return status


def reconcile(cluster: Cluster, body: dict, settings: Settings) -> Outcome:
    meta, old_status = body.get("metadata") or {}, body.get("status") or {}
    generation = meta.get("generation")
    serving, problems = parse_serving(body)
    profile = None
    if serving is not None:
        profile_obj = cluster.get(api.API_VERSION, "ServingProfile", None, serving.spec.profile)
        if profile_obj is not None:
            profile, profile_problems = parse_profile(profile_obj)
            problems += [f"spec.profile: ServingProfile {serving.spec.profile!r} is invalid ({p})" for p in profile_problems]
        namespace = cluster.get("v1", "Namespace", None, serving.namespace)
        labels = None if namespace is None else (namespace.get("metadata", {}).get("labels") or {})
        if not problems:
            problems = check_against_profile(serving, profile, labels)
    if problems:  # touch nothing that is already serving
        return Outcome(invalid_status(old_status, generation, problems), problems)

    desired = render_all(serving, profile, settings, canary_weight(serving.spec, old_status))
    outcome = Outcome({})
    for obj in desired:
        outcome.applied[f"{obj['kind']}/{obj['metadata']['name']}"] = cluster.apply(obj)
    existing = {kind: children(cluster, kind, serving.name, serving.namespace) for kind in CHILD_KINDS}
    outcome.status = serving_status(serving, profile, old_status, generation, existing)
    for api_version, kind, name in plan_deletions(desired, existing, is_ready(outcome.status["stable"])):
        if cluster.delete(api_version, kind, serving.namespace, name):
            outcome.deleted.append(f"{kind}/{name}")
    return outcome


def children(cluster: Cluster, kind: tuple, name: str, namespace: str) -> list[dict]:
    """Children of one serving. The label is checked here too: never delete what another serving owns,
    even from an API server that ignores the selector."""
    listed = cluster.list(*kind, namespace, f"specserve.io/serving={name}")
    return [o for o in listed if (o.get("metadata", {}).get("labels") or {}).get("specserve.io/serving") == name]


def is_ready(revision_status: dict) -> bool:
    return revision_status["readyReplicas"] >= revision_status["replicas"]


def cleanup(cluster: Cluster, name: str, namespace: str) -> list[str]:
    """Delete every child (owner references would cascade too; this does not depend on them)."""
    deleted = []
    for api_version, kind in CHILD_KINDS:
        for obj in children(cluster, (api_version, kind), name, namespace):
            if cluster.delete(api_version, kind, namespace, obj["metadata"]["name"]):
                deleted.append(f"{kind}/{obj['metadata']['name']}")
    return deleted
