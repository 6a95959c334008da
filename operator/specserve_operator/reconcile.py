"""One reconciliation of a SpeculativeServing: validate, measure, decide, render, apply, clean up, report.

`plan_deletions`, `serving_status` and the decision modules (analysis.py, rollout.py) are pure;
`reconcile` strings them together around the cluster and measurement calls, and is what every
kopf handler (create, update, resume, timers, profile change) runs, so there is one path from
spec to cluster. The clock is a parameter: everything time-dependent is decided from `now`.
"""

import datetime
from dataclasses import dataclass, field, replace

from specserve_runtime.config import DEFAULT_PORT

from . import api
from .analysis import Report, analyse
from .apply import CHILD_KINDS, Cluster
from .measure import MeasurementError, Pricing, ScrapeSource, Target, Window
from .render import Profile, Serving, Settings, Traffic, candidate_hash, render_all, replica_budget, revision_hash, revisions
from .rollout import Decision, Event, analysis_due, decide, timestamp
from .validate import check_against_profile, parse_profile, parse_serving

REVISION_SCOPED = {("v1", "ConfigMap"), ("apps/v1", "Deployment")}


@dataclass
class Outcome:
    status: dict
    problems: list[str] = field(default_factory=list)
    applied: dict[str, str] = field(default_factory=dict)  # "Kind/name" -> created | patched | unchanged
    deleted: list[str] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    consumed_annotations: list[str] = field(default_factory=list)
    report: Report | None = None  # this interval's analysis, when one was due


def set_condition(conditions: list[dict], type_: str, status: bool, reason: str, message: str, at: str) -> list[dict]:
    """Replace one condition, keeping lastTransitionTime when its status did not change."""
    value = "True" if status else "False"
    previous = next((c for c in conditions if c.get("type") == type_), None)
    since = previous["lastTransitionTime"] if previous and previous.get("status") == value else at
    entry = {"type": type_, "status": value, "reason": reason, "message": message, "lastTransitionTime": since}
    return [c for c in conditions if c.get("type") != type_] + [entry]


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


def invalid_status(old_status: dict, generation: int | None, problems: list[str], at: str) -> dict:
    conditions = set_condition(old_status.get("conditions") or [], "SpecValid", False, "InvalidSpec", "; ".join(problems), at)
    return {"observedGeneration": generation, "phase": "Invalid", "conditions": conditions}


def ready_replicas(deployment: dict | None) -> int:
    return ((deployment or {}).get("status") or {}).get("readyReplicas") or 0


def stable_backend(serving: Serving, stable: str, wanted: int, deployments: dict[str, dict], canary: str | None) -> str | None:
    """While the new stable revision is not ready with all its replicas, <name>-stable keeps routing
    to the previous revision that still has ready pods (a plain update, or a promotion in progress)."""
    if ready_replicas(deployments.get(f"{serving.name}-{stable}")) >= wanted:
        return None
    for name, deployment in sorted(deployments.items()):
        revision = name.removeprefix(f"{serving.name}-")
        if revision not in (stable, canary) and ready_replicas(deployment) > 0:
            return revision
    return None


def effective_slo(spec: api.SpeculativeServingSpec, profile: Profile) -> api.Slo:
    return spec.autoscaling.slo or profile.spec.slo


def measure_interval(cluster: Cluster, source, serving: Serving, profile: Profile, revisions_: tuple[str, str],
                     deployments: dict[str, dict]) -> tuple[list[Window], str | None]:
    """The stable's and the candidate's windows over the last analysis interval, and a measurement
    problem (Prometheus unreachable) when there was one: then both windows say 'no data'."""
    seconds = serving.spec.rollout.analysis.interval_seconds
    accelerator = profile.spec.accelerator
    pricing = Pricing(accelerator.count, accelerator.price_per_hour_usd)
    windows = []
    for revision in revisions_:
        ready = ready_replicas(deployments.get(f"{serving.name}-{revision}"))
        target = Target(serving.namespace, serving.name, revision, ready)
        if not ready:
            windows.append(Window.no_data(target, seconds, "no ready replicas"))
            continue
        if isinstance(source, ScrapeSource):
            target = Target(serving.namespace, serving.name, revision, ready, pod_urls(cluster, serving, revision))
        try:
            windows.append(source.measure(target, seconds).priced(pricing))
        except MeasurementError as exc:
            problem = str(exc)
            return [Window.no_data(Target(serving.namespace, serving.name, r, 0), seconds, f"measurement failed: {problem}")
                    for r in revisions_], problem
    return windows, None


def pod_urls(cluster: Cluster, serving: Serving, revision: str) -> tuple[str, ...]:
    """The ready pods of one revision, for scraping their /metrics directly."""
    selector = f"specserve.io/serving={serving.name},specserve.io/revision={revision}"
    urls = []
    for pod in cluster.list("v1", "Pod", serving.namespace, selector):
        labels = (pod.get("metadata") or {}).get("labels") or {}
        status = pod.get("status") or {}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        if labels.get("specserve.io/revision") == revision and ready and status.get("podIP"):
            urls.append(f"http://{status['podIP']}:{DEFAULT_PORT}")
    return tuple(sorted(urls))


def serving_status(serving: Serving, profile: Profile, old_status: dict, generation: int | None, existing: dict,
                   decision: Decision, traffic: Traffic, at: str) -> dict:
    spec = serving.spec
    revs = revisions(spec, replica_budget(spec, profile.spec), traffic)
    deployments = {d["metadata"]["name"]: d for d in existing.get(("apps/v1", "Deployment"), [])}

    def revision_status(revision) -> dict:
        return {
            "revision": revision.hash,
            "speculator": revision.speculator.model_dump(by_alias=True, exclude_none=True),
            "replicas": revision.replicas,
            "readyReplicas": ready_replicas(deployments.get(f"{serving.name}-{revision.hash}")),
        }

    stable = revision_status(revs[0])
    ready = is_ready(stable)
    others = [name for name in deployments if name != f"{serving.name}-{stable['revision']}"]
    conditions = old_status.get("conditions") or []
    conditions = set_condition(conditions, "SpecValid", True, "Valid", "", at)
    conditions = set_condition(
        conditions, "Ready", ready, "AllReplicasReady" if ready else "ReplicasNotReady",
        f"{stable['readyReplicas']}/{stable['replicas']} replicas of revision {stable['revision']} ready", at,
    )
    progressing = decision.stage == "Canary" or not ready
    conditions = set_condition(conditions, "Progressing", progressing, "Rollout" if decision.stage == "Canary" else "Steady", "", at)
    ceiling = min(spec.replicas.max, profile.spec.limits.max_replicas)
    budget_limited = replica_budget(spec, profile.spec, ceiling) < ceiling
    conditions = set_condition(conditions, "BudgetLimited", budget_limited, "MaxHourlyCost" if budget_limited else "WithinBudget", "", at)
    for type_, (value, reason, message) in decision.conditions.items():
        conditions = set_condition(conditions, type_, value, reason, message, at)

    if decision.stage == "Canary":
        phase = "Progressing"
    elif decision.stage == "Promoted" and (not ready or others):
        phase = "Promoting"  # the promoted revision scales up; the old stable goes once it is ready
    elif decision.stage == "Aborted" and (not ready or (len(revs) > 1 and is_serving(revision_status(revs[1])))):
        phase = "RollingBack"
    else:
        phase = "Serving" if ready else "Pending"
    status = {
        "observedGeneration": generation,
        "phase": phase,
        "conditions": conditions,
        "stable": stable,
        "canary": None,
        "lastRollout": decision.last_rollout.model_dump(by_alias=True, exclude_none=True) if decision.last_rollout else None,
        "replicas": sum(r.replicas for r in revs),
        "selector": f"specserve.io/serving={serving.name}",
    }
    if decision.canary is not None and len(revs) > 1:
        state = decision.canary.model_dump(by_alias=True, exclude_none=True)
        status["canary"] = {**state, **revision_status(revs[1])}
    return status


def reconcile(cluster: Cluster, body: dict, settings: Settings, source, now: datetime.datetime) -> Outcome:
    """`body` must be the object as it is now (the caller re-reads it): a decision made on an older
    body could undo what a newer one applied."""
    meta, old_status = body.get("metadata") or {}, body.get("status") or {}
    generation, at = meta.get("generation"), timestamp(now)
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
        return Outcome(invalid_status(old_status, generation, problems, at), problems)

    spec = serving.spec
    existing = {kind: children(cluster, kind, serving.name, serving.namespace) for kind in CHILD_KINDS}
    deployments = {d["metadata"]["name"]: d for d in existing[("apps/v1", "Deployment")]}
    stable_hash, candidate = revision_hash(spec.model, spec.speculator, spec.runtime), candidate_hash(spec)
    canary = api.CanaryStatus.model_validate(old_status["canary"]) if old_status.get("canary") else None
    last = api.RolloutRecord.model_validate(old_status["lastRollout"]) if old_status.get("lastRollout") else None

    outcome, problem = Outcome({}), None
    if spec.rollout is not None and analysis_due(spec.rollout, canary, candidate, now, last):
        windows, problem = measure_interval(cluster, source, serving, profile, (stable_hash, candidate), deployments)
        outcome.report = analyse(windows[0], windows[1], spec.rollout.analysis, effective_slo(spec, profile))
    decision = decide(spec.rollout, stable_hash, candidate, canary, last, meta.get("annotations") or {}, outcome.report, now)
    if outcome.report is not None:  # an unreachable Prometheus is a condition and an Event, never a crash loop
        metrics = (problem is None, "MeasurementFailed" if problem else "Measured", problem or "")
        decision = replace(decision, conditions={**decision.conditions, "MetricsAvailable": metrics})
        if problem:
            outcome.events.append(Event("Warning", "MeasurementFailed", problem))

    revs = revisions(spec, replica_budget(spec, profile.spec), Traffic(decision.stage, decision.weight))
    canary_revision = revs[1].hash if len(revs) > 1 else None
    backend = stable_backend(serving, revs[0].hash, revs[0].replicas, deployments, canary_revision)
    traffic = Traffic(decision.stage, decision.weight, backend)
    desired = render_all(serving, profile, settings, traffic)
    for obj in desired:
        outcome.applied[f"{obj['kind']}/{obj['metadata']['name']}"] = cluster.apply(obj)
    outcome.status = serving_status(serving, profile, old_status, generation, existing, decision, traffic, at)
    outcome.events += decision.events
    outcome.consumed_annotations = decision.consumed_annotations
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


def is_serving(revision_status: dict) -> bool:
    return revision_status["readyReplicas"] > 0


def cleanup(cluster: Cluster, name: str, namespace: str) -> list[str]:
    """Delete every child (owner references would cascade too; this does not depend on them)."""
    deleted = []
    for api_version, kind in CHILD_KINDS:
        for obj in children(cluster, (api_version, kind), name, namespace):
            if cluster.delete(api_version, kind, namespace, obj["metadata"]["name"]):
                deleted.append(f"{kind}/{obj['metadata']['name']}")
    return deleted
