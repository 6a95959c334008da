"""One reconciliation of a SpeculativeServing: validate, measure, decide, render, apply, clean up, report.

`plan_deletions`, `serving_status` and the decision modules (analysis.py, rollout.py) are pure;
`reconcile` strings them together around the cluster and measurement calls, and is what every
kopf handler (create, update, resume, timers, profile change) runs, so there is one path from
spec to cluster. The clock is a parameter: everything time-dependent is decided from `now`.
"""

import datetime
from dataclasses import dataclass, field, replace
from typing import Protocol

from specserve_runtime.config import DEFAULT_PORT

from . import api, autoscale, health
from .analysis import Report
from .live import apply_schedule, retry_fallback, speculation_health, start_fallback
from .measure import MeasurementError, Pricing, ScrapeSource, Target, Window
from .render import CHILD_KINDS, Profile, Serving, Settings, render_all
from .replicas import (Traffic, candidate_hash, planned_revisions, pods_to_keep, replica_budget, replica_ceiling, replica_room, revision_hash,
                       revisions)
from .rollout import Decision, Event, parse_time, timestamp
from .rollout import tick as rollout_tick
from .schedule import capacity_prior, exceeds_limit
from .validate import check_against_profile, parse_profile, parse_serving

REVISION_SCOPED = {("v1", "ConfigMap"), ("apps/v1", "Deployment")}


class Cluster(Protocol):
    """What a reconcile needs of the cluster: apply.Cluster is the real one (the Kubernetes API), the simulator's
    SimulatedCluster one in memory. Not importing apply keeps the Kubernetes client out of every command that
    does not talk to a cluster (the runtime images' `specserve launch` among them)."""

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict | None: ...

    def list(self, api_version: str, kind: str, namespace: str | None, label_selector: str = "") -> list[dict]: ...

    def apply(self, obj: dict) -> str: ...

    def scale(self, api_version: str, kind: str, namespace: str, name: str, replicas: int) -> None: ...

    def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> bool: ...


@dataclass
class Outcome:
    status: dict
    problems: list[str] = field(default_factory=list)
    applied: dict[str, str] = field(default_factory=dict)  # "Kind/name" -> created | patched | unchanged | scaled to N
    deleted: list[str] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    consumed_annotations: list[str] = field(default_factory=list)
    report: Report | None = None  # this interval's analysis, when one was due
    slo: api.Slo | None = None  # what the serving is held to (valid specs only)


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


def spec_replicas(deployment: dict) -> int:
    return (deployment.get("spec") or {}).get("replicas") or 0


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


def measure_interval(cluster: Cluster, source, serving: Serving, profile: Profile, revisions_: list[str],
                     deployments: dict[str, dict], seconds: float, fallback=None) -> tuple[list[Window], str | None, str]:
    """Each revision's window over the last `seconds`, a measurement problem (Prometheus unreachable) when there
    was one, and what measured them: the source's name, or the `fallback`'s (the pods' /metrics) when the source
    could not be asked, or "None": then every window says 'no data'."""
    windows, problem = _measure(cluster, source, serving, profile, revisions_, deployments, seconds)
    if problem is None:
        return windows, None, source.name
    if fallback is None:
        return windows, problem, "None"
    windows, _ = _measure(cluster, fallback, serving, profile, revisions_, deployments, seconds)
    return windows, problem, fallback.name


def _measure(cluster: Cluster, source, serving: Serving, profile: Profile, revisions_: list[str],
             deployments: dict[str, dict], seconds: float) -> tuple[list[Window], str | None]:
    accelerator = profile.spec.accelerator
    pricing = Pricing(accelerator.count, accelerator.price_per_hour_usd)
    slo = effective_slo(serving.spec, profile)
    windows = []
    for revision in revisions_:
        ready = ready_replicas(deployments.get(f"{serving.name}-{revision}"))
        target = Target(serving.namespace, serving.name, revision, ready, itl_objective_ms=slo.p99_inter_token_latency_ms,
                        ttft_objective_ms=slo.p99_time_to_first_token_ms)
        if not ready:
            windows.append(Window.no_data(target, seconds, "no ready replicas"))
            continue
        if isinstance(source, ScrapeSource):
            target = replace(target, pod_urls=pod_urls(cluster, serving, revision))
        try:
            windows.append(source.measure(target, seconds).priced(pricing))
        except MeasurementError as exc:
            problem = str(exc)
            return [Window.no_data(Target(serving.namespace, serving.name, r, 0), seconds, f"measurement failed: {problem}")
                    for r in revisions_], problem
    return windows, None


@dataclass
class Scaling:
    """What the autoscaling step decided: the total replicas (None: the spec's own count), the
    status.autoscaling and status.metrics to write, Events and conditions."""

    replicas: int | None = None
    status: api.AutoscalingStatus | None = None
    metrics: dict | None = None
    events: list[Event] = field(default_factory=list)
    conditions: dict[str, tuple[bool, str, str]] = field(default_factory=dict)


def fleet_metrics(windows: list[Window]) -> dict | None:
    """status.metrics: the serving as a whole over the last autoscaling window."""
    measured = [w for w in windows if w.missing is None]
    if not measured:
        return None
    tokens = sum(w.tokens_per_second or 0 for w in measured)
    hourly = sum(w.hourly_cost_usd or 0 for w in measured)
    accepted = [w for w in measured if w.acceptance_length is not None]
    judged = [w for w in measured if w.within_slo is not None]
    metrics = {
        "tokensPerSecond": tokens,
        # tokens/s served within the SLO; only when every revision's window could judge it
        "goodputTokensPerSecond": sum(w.tokens_per_second * w.within_slo for w in judged) if len(judged) == len(measured) else None,
        "p99InterTokenLatencyMs": max((w.p99_inter_token_latency_ms for w in measured if w.p99_inter_token_latency_ms is not None), default=None),
        "p99TimeToFirstTokenMs": max((w.p99_time_to_first_token_ms for w in measured if w.p99_time_to_first_token_ms is not None), default=None),
        # acceptance length of the fleet: weighted by each revision's tokens
        "acceptanceLength": (sum(w.acceptance_length * (w.tokens_per_second or 0) for w in accepted) / tokens) if accepted and tokens else None,
        "hourlyCostUSD": hourly,
        "tokensPerDollar": tokens / (hourly / 3600) if hourly > 0 else None,
    }
    return {key: value for key, value in metrics.items() if value is not None}


def autoscale_serving(cluster: Cluster, source, serving: Serving, profile: Profile, settings: Settings, old_status: dict,
                      decision: Decision, deployments: dict[str, dict], now: datetime.datetime, fallback=None) -> Scaling:
    """When autoscaling is on and an evaluation is due: measure every running revision (through `fallback`, the
    pods' /metrics, while the source cannot be asked: load does not wait for Prometheus), decide, record."""
    spec = serving.spec
    previous = api.AutoscalingStatus.model_validate(old_status.get("autoscaling") or {})
    if not spec.autoscaling.enabled:
        ceiling = min(spec.replicas.max, profile.spec.limits.max_replicas)
        limited = replica_budget(spec, profile.spec, ceiling) < ceiling
        return Scaling(conditions={"BudgetLimited": (limited, "MaxHourlyCost" if limited else "WithinBudget", "")})
    current = old_status.get("replicas") or replica_budget(spec, profile.spec)
    held = Scaling(previous.desired_replicas, previous, old_status.get("metrics"))
    last = previous.last_evaluation_time
    if last is not None and (now - parse_time(last)).total_seconds() < settings.autoscale_interval_seconds:
        return held
    # Demand is measured on every revision that serves (an old stable still draining a promotion
    # too); the revisions the decision keeps running are the ones whose capacity decides.
    running = [r for r in revisions(spec, current, Traffic(decision.stage, decision.weight)) if r.replicas > 0]
    serving_now = [name.removeprefix(f"{serving.name}-") for name, d in sorted(deployments.items()) if ready_replicas(d)]
    measured = [r.hash for r in running] + [h for h in serving_now if h not in {r.hash for r in running}]
    windows, problem, measured_by = measure_interval(cluster, source, serving, profile, measured, deployments,
                                                     settings.autoscale_interval_seconds, fallback)
    priors = {r.hash: capacity_prior(r.speculator, settings.capacity_priors, settings.draft_lengths,
                                     settings.inter_token_latency_per_step) for r in running}
    status, scale = autoscale.tick(previous, windows, [r.hash for r in running], priors, spec, profile.spec, effective_slo(spec, profile), current,
                                   decision.stage == "Canary", now, settings.replica_startup_seconds)
    status = status.model_copy(update={"last_evaluation_time": timestamp(now), "measured_by": measured_by})
    result = Scaling(scale.replicas, status, fleet_metrics(windows) or old_status.get("metrics"))
    if scale.replicas != current:
        result.events.append(Event("Normal", "Scaled", f"{current} -> {scale.replicas} replicas: {scale.reason}"))
    result.conditions["BudgetLimited"] = (scale.budget_limited, "MaxHourlyCost" if scale.budget_limited else "WithinBudget",
                                          scale.reason if scale.budget_limited else "")
    no_data = scale.recommended is None
    result.conditions["ScalingActive"] = (not no_data, "NoData" if no_data else "Measured", scale.reason if no_data else "")
    if problem:
        also = "; measured the pods' /metrics directly" if measured_by != "None" else ""
        result.events.append(Event("Warning", "MeasurementFailed", problem + also))
    return result


def draining_pods(cluster: Cluster, serving: Serving) -> int:
    """The serving's pods that terminate (deletionTimestamp set): still on their accelerators. The
    label is checked here too, as in `children`."""
    pods = cluster.list("v1", "Pod", serving.namespace, f"specserve.io/serving={serving.name}")
    return sum(1 for pod in pods if (pod.get("metadata") or {}).get("deletionTimestamp")
               and (pod["metadata"].get("labels") or {}).get("specserve.io/serving") == serving.name)


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
                   decision: Decision, revs: list, total: int, scaling: "Scaling", at: str) -> dict:
    deployments = {d["metadata"]["name"]: d for d in existing.get(("apps/v1", "Deployment"), [])}

    def revision_status(revision) -> dict:
        return {
            "revision": revision.hash,
            "speculator": revision.speculator.model_dump(by_alias=True, exclude_none=True),
            "replicas": revision.replicas,
            "readyReplicas": ready_replicas(deployments.get(f"{serving.name}-{revision.hash}")),
        }

    stable = revision_status(revs[0])
    # Ready once the stable has every pod it is meant to have, not only those this pass could plan:
    # fit_growth holds its growth back while older revisions' pods still hold the budget.
    meant = max(revs[0].replicas, revisions(serving.spec, total, Traffic(decision.stage, decision.weight))[0].replicas)
    ready = stable["readyReplicas"] >= meant
    others = [name for name in deployments if name != f"{serving.name}-{stable['revision']}"]
    conditions = old_status.get("conditions") or []
    conditions = set_condition(conditions, "SpecValid", True, "Valid", "", at)
    conditions = set_condition(
        conditions, "Ready", ready, "AllReplicasReady" if ready else "ReplicasNotReady",
        f"{stable['readyReplicas']}/{meant} replicas of revision {stable['revision']} ready", at,
    )
    progressing = decision.stage == "Canary" or not ready
    conditions = set_condition(conditions, "Progressing", progressing, "Rollout" if decision.stage == "Canary" else "Steady", "", at)
    for type_, (value, reason, message) in {**scaling.conditions, **decision.conditions}.items():
        conditions = set_condition(conditions, type_, value, reason, message, at)

    # The stage stays Promoted or Aborted after the rollout is over: a scale-up later is Pending, not the rollout.
    was_in_rollout = old_status.get("phase") in ("Progressing", "RollingBack")
    if decision.stage == "Canary":
        phase = "Progressing"
    elif decision.stage == "Promoted" and others:
        phase = "Promoting"  # the promoted revision scales up; the old stable goes once it is ready
    elif decision.stage == "Aborted" and ((not ready and was_in_rollout) or (len(revs) > 1 and is_serving(revision_status(revs[1])))):
        phase = "RollingBack"  # until the stable is ready again and the candidate serves nothing
    else:
        phase = "Serving" if ready else "Pending"
    status = {
        "observedGeneration": generation,
        "phase": phase,
        "conditions": conditions,
        "stable": stable,
        "canary": None,
        "lastRollout": decision.last_rollout.model_dump(by_alias=True, exclude_none=True) if decision.last_rollout else None,
        "replicas": total,
        "selector": f"specserve.io/serving={serving.name}",
        "autoscaling": scaling.status.model_dump(by_alias=True, exclude_none=True) if scaling.status else None,
        "metrics": scaling.metrics or old_status.get("metrics"),
    }
    if decision.canary is not None and len(revs) > 1:
        state = decision.canary.model_dump(by_alias=True, exclude_none=True)
        status["canary"] = {**state, **revision_status(revs[1])}
    return status


def reconcile(cluster: Cluster, body: dict, settings: Settings, source, now: datetime.datetime,
              fallback=None) -> Outcome:
    """`body` must be the object as it is now (the caller re-reads it): a decision made on an older
    body could undo what a newer one applied. `fallback` (the pods' /metrics, when `source` is Prometheus)
    measures for the autoscaler while the source cannot be asked; a canary's analyses use the source alone:
    a step's evidence comes from one place, and an outage holds the rollout (Inconclusive) until it ends."""
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

    # Candidates the operator started (a fallback, a draft-length schedule) hold while the spec keeps its generation:
    # a changed spec runs as the tenant asks. `started` is the fallback; not `fallback`, the pods' /metrics source.
    started = api.FallbackStatus.model_validate(old_status["fallback"]) if old_status.get("fallback") else None
    if started is not None and started.generation != generation:
        started = None
    speculation = api.SpeculationStatus.model_validate(old_status["speculation"]) if old_status.get("speculation") else None
    draft_schedule = (api.DraftScheduleStatus.model_validate(old_status["draftSchedule"])
                      if old_status.get("draftSchedule") else None)
    if draft_schedule is not None and draft_schedule.applied is not None and draft_schedule.applied.generation != generation:
        draft_schedule = draft_schedule.model_copy(update={"applied": None})
    max_drafts = profile.spec.limits.max_num_speculative_tokens
    if draft_schedule is not None and exceeds_limit(draft_schedule, max_drafts):
        draft_schedule = None  # never rolled out beyond the tenant's limits; proposed again within them
    serving = replace(serving, spec=health.with_fallback(health.with_schedule(serving.spec, draft_schedule, generation),
                                                         started, generation))
    spec = serving.spec
    existing = {kind: children(cluster, kind, serving.name, serving.namespace) for kind in CHILD_KINDS}
    deployments = {d["metadata"]["name"]: d for d in existing[("apps/v1", "Deployment")]}
    stable_hash, candidate = revision_hash(spec.model, spec.speculator, spec.runtime), candidate_hash(spec)
    canary = api.CanaryStatus.model_validate(old_status["canary"]) if old_status.get("canary") else None
    last = api.RolloutRecord.model_validate(old_status["lastRollout"]) if old_status.get("lastRollout") else None
    # The order of the decisions: the rollout decides the stage and weight; the autoscaler sizes the
    # total for the revisions that stage runs; rendering splits the total by the weight.
    outcome, problems_seen = Outcome({}, slo=effective_slo(spec, profile)), []
    retried = retry_fallback(spec, settings, started, last, candidate, speculation, at, outcome.events)
    if retried is not None:  # the lost fallback's canary again, from its first step
        started, last, canary = retried, None, None

    def measure(revisions_: list[str]) -> list[Window]:
        windows, problem, _ = measure_interval(cluster, source, serving, profile, revisions_, deployments,
                                               spec.rollout.analysis.interval_seconds)
        problems_seen.append(problem)
        return windows

    decision, outcome.report = rollout_tick(spec.rollout, stable_hash, candidate, canary, last,
                                            meta.get("annotations") or {}, effective_slo(spec, profile), now, measure)
    problem = problems_seen[0] if problems_seen else None
    if outcome.report is not None:  # an unreachable Prometheus is a condition and an Event, never a crash loop
        metrics = (problem is None, "MeasurementFailed" if problem else "Measured", problem or "")
        decision = replace(decision, conditions={**decision.conditions, "MetricsAvailable": metrics})
        if problem:
            outcome.events.append(Event("Warning", "MeasurementFailed", problem))

    scaling = autoscale_serving(cluster, source, serving, profile, settings, old_status, decision, deployments, now,
                                fallback)
    outcome.events += scaling.events
    canary_ready = ready_replicas(deployments.get(f"{serving.name}-{candidate}")) if candidate else None
    stable_ready = ready_replicas(deployments.get(f"{serving.name}-{stable_hash}"))
    draining = draining_pods(cluster, serving)
    ceiling = replica_ceiling(spec, profile.spec)
    room = replica_room(ceiling, draining, sum(spec_replicas(d) for d in deployments.values()))
    wanted = replica_budget(spec, profile.spec, scaling.replicas)  # the autoscaler's count: without a start-up surge
    total = min(wanted, room)
    if total < wanted:
        scaling.conditions["BudgetLimited"] = (True, "DrainingPods", f"{draining} terminating pods still hold their accelerators: "
                                               f"{total} of {wanted} replicas until they are gone")
    previous_pods = None
    if decision.stage in ("Stable", "Promoted"):  # one revision: older ones' pods go as its pods become ready
        replacing = f"{serving.name}-{candidate if decision.stage == 'Promoted' else stable_hash}"
        older = {name: d for name, d in deployments.items() if name != replacing}
        if older:
            previous_pods = sum(spec_replicas(d) for d in older.values())
            keep = pods_to_keep(total, ready_replicas(deployments.get(replacing)), previous_pods, ceiling)
            scale_older(cluster, serving.namespace, older, keep, outcome)
    prefix = f"{serving.name}-"
    held = {name.removeprefix(prefix): spec_replicas(d) for name, d in deployments.items()}
    traffic = Traffic(decision.stage, decision.weight, canary_ready=canary_ready, stable_ready=stable_ready,
                      drain_candidate=decision.drain_candidate, previous_pods=previous_pods, held=held, draining=draining)
    revs = planned_revisions(spec, profile.spec, scaling.replicas, traffic)
    canary_revision = revs[1].hash if len(revs) > 1 else None
    traffic = replace(traffic, stable_backend=stable_backend(serving, revs[0].hash, revs[0].replicas, deployments,
                                                             canary_revision))
    live = revs[0]

    def measure_live() -> Window:
        interval = serving.spec.speculation_health.interval_seconds
        (window,), _, _ = measure_interval(cluster, source, serving, profile, [live.hash], deployments, interval)
        return window

    watched = speculation_health(serving.spec, settings, speculation, draft_schedule, decision.stage, live, measure_live, now,
                                 max_drafts)
    speculation, degraded, health_events = watched.speculation, watched.degraded, watched.events
    started = started or start_fallback(serving.spec, watched.fallback_due, live, generation, at, health_events)
    draft_schedule = watched.draft_schedule
    if not started:  # a fallback goes first
        draft_schedule = apply_schedule(serving.spec, draft_schedule, live, decision.stage, generation, at, health_events)
    desired = render_all(serving, profile, settings, traffic, scaling.replicas)
    for obj in desired:
        outcome.applied[f"{obj['kind']}/{obj['metadata']['name']}"] = cluster.apply(obj)
    outcome.status = serving_status(serving, profile, old_status, generation, existing, decision, revs, total, scaling, at)
    outcome.status["speculation"] = speculation.model_dump(by_alias=True, exclude_none=True) if speculation else None
    outcome.status["fallback"] = started.model_dump(by_alias=True, exclude_none=True) if started else None
    outcome.status["draftSchedule"] = draft_schedule.model_dump(by_alias=True, exclude_none=True) if draft_schedule else None
    if degraded is not None:
        outcome.status["conditions"] = set_condition(outcome.status["conditions"], "SpeculationDegraded", *degraded, at)
    if outcome.status["phase"] == "Serving" and condition_true(outcome.status, "SpeculationDegraded"):
        outcome.status["phase"] = "Degraded"  # serving, but its speculation no longer pays
    outcome.events += decision.events + health_events
    outcome.consumed_annotations = decision.consumed_annotations
    for api_version, kind, name in plan_deletions(desired, existing, condition_true(outcome.status, "Ready")):
        if cluster.delete(api_version, kind, serving.namespace, name):
            outcome.deleted.append(f"{kind}/{name}")
    return outcome


def scale_older(cluster: Cluster, namespace: str, older: dict[str, dict], keep: int, outcome: Outcome) -> None:
    """Scale older revisions' Deployments down to `keep` pods in all, those with the most ready pods
    kept first; never up. They are not rendered any more (their spec is gone), so only their
    replica count is patched."""
    for name, deployment in sorted(older.items(), key=lambda item: -ready_replicas(item[1])):
        replicas = min(spec_replicas(deployment), keep)
        keep -= replicas
        if replicas < spec_replicas(deployment):
            cluster.scale("apps/v1", "Deployment", namespace, name, replicas)
            outcome.applied[f"Deployment/{name}"] = f"scaled to {replicas}"


def children(cluster: Cluster, kind: tuple, name: str, namespace: str) -> list[dict]:
    """Children of one serving. The label is checked here too: never delete what another serving owns,
    even from an API server that ignores the selector."""
    listed = cluster.list(*kind, namespace, f"specserve.io/serving={name}")
    return [o for o in listed if (o.get("metadata", {}).get("labels") or {}).get("specserve.io/serving") == name]


def condition_true(status: dict, type_: str) -> bool:
    return any(c["type"] == type_ and c["status"] == "True" for c in status["conditions"])


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
