"""Replica planning, pure: which revisions a SpeculativeServing runs and how many pods each gets.

The rollout's stage and weight (rollout.py) and the autoscaler's total (autoscale.py) come in;
the revisions with their replica counts come out, within the spec's bounds, the profile's limits
and its cost budget, counting the pods that older revisions still hold and those that drain.
render.py turns them into objects; reconcile.py scales older revisions down to pods_to_keep.
"""

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

from . import api


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
    older revisions hold while the one revision of a Stable or Promoted stage replaces them after
    a spec update or a promotion (None: none left), counted before this pass scales them down to
    pods_to_keep: a pod removed now drains on its accelerator; see planned_revisions. held: each
    rendered revision's replicas as its Deployment has them now (None: none exist), and draining:
    the serving's pods that terminate now; a revision grows only into what they leave (fit_growth).
    """

    stage: Literal["Stable", "Canary", "Aborted", "Promoted"] = "Stable"
    canary_weight: int | None = None
    stable_backend: str | None = None
    canary_ready: int | None = None
    stable_ready: int | None = None
    drain_candidate: bool = False
    previous_pods: int | None = None
    held: Mapping[str, int] | None = None
    draining: int = 0


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
    """The replicas a serving can run while `draining` of its pods terminate: a pod removed by a
    scale-down (or with its revision) serves its last requests for up to its grace period, on its
    accelerator and billed, so the ceiling is a wall for it too (fit_growth holds a scale-up back
    until it is gone). Never below the `running` pods the Deployments hold now (within the ceiling):
    removing a running pod to make room would only add a draining one."""
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
    and the surge stay within the ceiling: the budget is a wall for them too. So while older
    revisions keep pods (after a spec update or a promotion; pods_to_keep says how many, and they
    go as the new revision's become ready), the new revision gets what the ceiling leaves beside
    them: at promotion at least its canary pods. Last, fit_growth holds back any growth that the
    pods still draining, or those this plan removes, have not left room for yet."""
    ceiling = replica_ceiling(spec, profile)
    revs = revisions(spec, replica_budget(spec, profile, wanted), traffic)
    previous = traffic.previous_pods or 0
    if traffic.stage in ("Stable", "Promoted") and previous:
        (replacing,) = revs
        revs = [replace(replacing, replicas=max(min(replacing.replicas, ceiling - previous), 0))]
    elif len(revs) == 2:
        stable, canary = revs
        if traffic.stage == "Canary" and traffic.canary_ready is not None:
            revs = [keep_replaced_pods(stable, canary, traffic.canary_ready, ceiling - canary.replicas), canary]
        elif (traffic.stage == "Aborted" and traffic.drain_candidate and spec.traffic.mode == "ReplicaRatio"
                and traffic.canary_ready is not None and traffic.stable_ready is not None):
            most = min(ceiling - stable.replicas, traffic.canary_ready)
            revs = [stable, keep_replaced_pods(canary, stable, traffic.stable_ready, most)]
    return fit_growth(revs, traffic.held or {}, ceiling - traffic.draining - previous)


def fit_growth(revs: list[Revision], held: Mapping[str, int], room: int) -> list[Revision]:
    """`revs` with the growth beyond the replicas each revision's Deployment `held` cut, the
    candidate's first, so that what the serving holds after this plan fits `room`. A pod the plan
    removes is not free at once: it serves its last requests for up to its grace period, on its
    accelerator and billed, so a revision that shrinks still holds its `held` pods here, and a
    revision grows only into slots free now (a shrink's slots, once its pods are gone). Shrinks
    are never held back, nor a revision cut below what it holds: removing a running pod to make
    room would only add a draining one."""
    excess = sum(max(r.replicas, held.get(r.hash, 0)) for r in revs) - room
    fitted = []
    for revision in reversed(revs):
        cut = min(max(revision.replicas - held.get(revision.hash, 0), 0), max(excess, 0))
        excess -= cut
        fitted.append(replace(revision, replicas=revision.replicas - cut))
    return fitted[::-1]


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
