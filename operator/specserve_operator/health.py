"""Continuous analysis of the live revision, pure: does its speculation still pay?

A canary proves a drafter on the traffic of its analysis window. Afterwards the traffic can drift
(a new domain, longer prompts, more concurrency) and speculation can come to cost more than it
saves. Every spec.speculationHealth.intervalSeconds, once no canary runs, the operator measures
the live revision and `assess` compares the window with two references:

- acceptanceRatio: its acceptance length over its baseline, the mean over its first
  BASELINE_ANALYSES windows with data as the live revision (kept in status.speculation, so a
  restarted operator keeps it). Below minAcceptanceRatio the drafter no longer matches the traffic.
- speedup: the mean time per generated token that plain decoding would take at the load measured
  (the capacity prior of method none: capacity.py's service line at the window's requests in
  flight per replica) over the time measured (Window.ms_per_token). Below minSpeedup speculation
  costs more than it saves at this load, whatever its acceptance: acceptance can stay flat while
  more concurrency makes each verify step dearer. Without a prior for none it is not judged.

Fallback. With spec.speculationHealth.fallback set (and autoFallback), a degraded revision whose last
analysis measured it slower than minSpeedup times plain decoding (calls_for_fallback) starts a fallback
(status.fallback): while the spec keeps that generation, `with_fallback` makes the spec the operator
runs one whose stable revision is the degraded one and whose rollout's candidate is the fallback
speculator, so the fallback goes through the same canary, analysis and rollback as any candidate: one
that does worse is rolled back, and the degraded revision keeps serving. While the revision still calls
for one, the lost fallback is retried, each time twice as late (retries_fallback).

A window without data or with fewer than analysis.MIN_GENERATED_TOKENS is Inconclusive: it neither counts
nor clears, so a Prometheus outage never degrades a serving. A saturated window (its requests
mostly queued beyond the engine's batch) is judged at the batch: the requests decoding, their time per token
without the wait. sustainedAnalyses degraded analyses in a row set
SpeculationDegraded; one healthy analysis clears it.

A severe fall does not wait: a degraded analysis whose acceptance ratio is below severeAcceptanceRatio
(0.5 by default), in a window of at least SEVERE_MIN_GENERATED_TOKENS, sets it at once. Acceptance length
is the drafter's own signal, averaged over every verify step of the window (of several requests, so one
odd request cannot halve it), so a fall to half the baseline is the traffic, not noise, where time per
token moves with load and queues; the fast trigger is on acceptance alone (as multi-window burn-rate
alerting pages at once on a fast burn and waits on a slow one). A fall that lasts a minute or two can
start a fallback that is then rolled back at its canary: that is the price of acting in one interval.
"""

from . import api
from .analysis import MIN_GENERATED_TOKENS, too_little_evidence
from .autoscale import saturated
from .capacity import Capacity
from .measure import Window
from .replicas import candidate_hash, candidate_runtime
from .rollout import parse_time
from .schedule import scheduled

BASELINE_ANALYSES = 3  # windows with data whose mean acceptance length is a revision's baseline
SEVERE_MIN_GENERATED_TOKENS = 10 * MIN_GENERATED_TOKENS  # the tokens of several requests: one window acts alone
# The canary of a candidate the operator starts (a fallback, a schedule) without spec.rollout: half the replicas
# for two default analysis intervals (one promotes a minute sooner and misses the SLO after drift-gradual.yaml:
# docs/benchmarks.md).
FALLBACK_STEPS = [api.RolloutStep(weight=50, analysis_seconds=120)]


def assess(previous: api.SpeculationStatus | None, revision: str, window: Window, health: api.SpeculationHealth,
           plain: Capacity | None, at: str) -> api.SpeculationStatus:
    """The live revision's speculation status after one more window: the baseline grown, the analysis, the count."""
    if previous is None or previous.revision != revision:
        previous = api.SpeculationStatus(revision=revision)  # a new live revision: a new baseline
    status = previous.model_copy(update={"last_evaluation_time": at})
    problem = too_little_evidence(window)
    if problem:
        analysis = api.SpeculationAnalysis(at=at, verdict="Inconclusive", reasons=[f"data: {problem}"])
        return status.model_copy(update={"last_analysis": analysis})

    baseline, count = previous.baseline_acceptance_length, previous.baseline_analyses
    acceptance = window.acceptance_length
    if count < BASELINE_ANALYSES and acceptance is not None:
        baseline, count = ((baseline or 0.0) * count + acceptance) / (count + 1), count + 1
    reasons, degraded, fell_severely = [], False, False
    ratio = acceptance / baseline if acceptance is not None and baseline else None
    if ratio is not None and count >= BASELINE_ANALYSES:
        ok = ratio >= health.min_acceptance_ratio
        reasons.append(f"acceptanceRatio: {ratio:.2f} {'>=' if ok else '<'} {health.min_acceptance_ratio:g} "
                       f"(acceptance length {acceptance:.2f}, baseline {baseline:.2f})")
        degraded |= not ok
        # Below severeAcceptanceRatio (itself below minAcceptanceRatio, so degraded too) over enough tokens.
        fell_severely = ratio < health.severe_acceptance_ratio and window.generated_tokens >= SEVERE_MIN_GENERATED_TOKENS
    elif acceptance is not None:
        reasons.append(f"acceptanceRatio: baseline from {count} of {BASELINE_ANALYSES} analyses")
    speedup = None
    measured, load, where = window.ms_per_token, window.in_flight_per_replica, "in flight"
    if saturated(window):
        # Most of its requests' time is the wait beyond the batch, which plain decoding would queue as well:
        # the speed is that of the batch decoding, against plain decoding's with as many requests in it.
        measured, load, where = window.decoding_ms_per_token, window.decoding_per_replica, "decoding (the rest queued)"
    if plain is not None and measured and load is not None:
        predicted = plain.service.at(load)
        speedup = predicted / measured
        ok = speedup >= health.min_speedup
        reasons.append(f"speedup: {speedup:.2f}x {'>=' if ok else '<'} {health.min_speedup:g}x (plain decoding "
                       f"{predicted:.3g} ms per token at {load:.2f} {where} per replica, measured {measured:.3g})")
        degraded |= not ok
    judged = speedup is not None or (ratio is not None and count >= BASELINE_ANALYSES)
    verdict = "Degraded" if degraded else "Healthy" if judged else "Inconclusive"
    per_replica = window.tokens_per_second / window.ready_replicas if window.tokens_per_second and window.ready_replicas else None
    analysis = api.SpeculationAnalysis(
        at=at, verdict=verdict, acceptance_length=acceptance, acceptance_ratio=ratio, speedup=speedup,
        in_flight_per_replica=load, tokens_per_second_per_replica=per_replica, goodput_per_replica=window.goodput_per_replica,
        tokens_per_dollar=window.tokens_per_dollar,
        reasons=reasons)
    # An Inconclusive analysis keeps the count and the severity: a hole in the evidence, as in a canary (rollout.decide).
    degraded_analyses = {"Degraded": previous.degraded_analyses + 1, "Healthy": 0}.get(verdict, previous.degraded_analyses)
    severe = {"Degraded": previous.severe or fell_severely, "Healthy": False}.get(verdict, previous.severe)
    return status.model_copy(update={"baseline_acceptance_length": baseline, "baseline_analyses": count,
                                     "degraded_analyses": degraded_analyses, "severe": severe, "last_analysis": analysis})


def is_degraded(status: api.SpeculationStatus | None, health: api.SpeculationHealth) -> bool:
    return status is not None and (status.severe or status.degraded_analyses >= health.sustained_analyses)


def calls_for_fallback(status: api.SpeculationStatus | None, health: api.SpeculationHealth, judges_speed: bool) -> bool:
    """Degraded, and measured slower than minSpeedup times plain decoding at its load: only then would a fallback
    win its canary. A drafter degraded by its acceptance alone can still save more than it costs; a fallback
    started then loses, and each retry comes later (retries_fallback), when a drift that goes on makes the drafter
    slower than plain decoding. A window that could not judge the speed (saturated) waits for one that can.
    Without a capacity prior for plain decoding (`judges_speed` False) acceptance alone decides."""
    if not is_degraded(status, health):
        return False
    speedup = status.last_analysis.speedup if status.last_analysis is not None else None
    return not judges_speed or (speedup is not None and speedup < health.min_speedup)


def retries_fallback(fallback: api.FallbackStatus, last: api.RolloutRecord | None, candidate: str | None,
                     status: api.SpeculationStatus | None, health: api.SpeculationHealth, judges_speed: bool) -> bool:
    """Roll a fallback whose canary lost (`last`: its analysis failed, not an abort by hand) out again? Once an
    analysis sustainedAnalyses x intervalSeconds x 2^attempts after the loss still calls for it: a drift that goes
    on can make the drafter slower than the fallback it beat, and each loss doubles the wait."""
    if last is None or last.candidate_revision != candidate or last.outcome != "Aborted" or last.reason != "AnalysisFailed":
        return False
    analysis = status.last_analysis if status is not None else None
    wait = health.sustained_analyses * health.interval_seconds * 2 ** fallback.attempts
    if analysis is None or (parse_time(analysis.at) - parse_time(last.at)).total_seconds() < wait:
        return False
    return calls_for_fallback(status, health, judges_speed)


def with_fallback(spec: api.SpeculativeServingSpec, fallback: api.FallbackStatus | None,
                  generation: int | None) -> api.SpeculativeServingSpec:
    """The spec the operator runs: the tenant's, or, while a fallback it started holds (the spec still at its
    generation), the degraded revision as the stable one and the fallback speculator as the rollout's candidate,
    with spec.rollout's steps, analysis and autoPromote when it has them."""
    chosen = spec.speculation_health.fallback
    if fallback is None or chosen is None or fallback.generation != generation:
        return spec
    return with_candidate(spec, fallback.from_revision, lambda live: chosen.speculator)


def with_schedule(spec: api.SpeculativeServingSpec, draft_schedule: api.DraftScheduleStatus | None,
                  generation: int | None) -> api.SpeculativeServingSpec:
    """The spec the operator runs while a draft-length schedule it applied holds (schedule.py): the revision it was
    proposed for as the stable one, the same speculator drafting by the schedule as the rollout's candidate."""
    applied = draft_schedule.applied if draft_schedule is not None else None
    if applied is None or applied.generation != generation:
        return spec
    return with_candidate(spec, applied.from_revision, lambda live: scheduled(live, applied.schedule))


def with_candidate(spec: api.SpeculativeServingSpec, from_revision: str, candidate_of) -> api.SpeculativeServingSpec:
    """`from_revision` (the spec's revision, or its promoted candidate's) as the stable revision and
    candidate_of(its speculator) as the rollout's candidate."""
    if spec.rollout is not None and from_revision == candidate_hash(spec):  # a promoted candidate
        speculator, runtime = spec.rollout.candidate.speculator, candidate_runtime(spec)
    else:
        speculator, runtime = spec.speculator, spec.runtime
    candidate = api.Candidate(speculator=candidate_of(speculator))
    rollout = (spec.rollout.model_copy(update={"candidate": candidate}) if spec.rollout is not None
               else api.Rollout(candidate=candidate, steps=FALLBACK_STEPS))
    return spec.model_copy(update={"speculator": speculator, "runtime": runtime, "rollout": rollout})
