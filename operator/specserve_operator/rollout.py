"""The canary rollout state machine. Pure: no I/O, and the clock is a parameter.

Its whole state is `status.canary` (step, when it started, consecutive fails and inconclusives,
the last analyses) and `status.lastRollout` (how the last candidate ended), so an operator
restart or a new leader resumes mid-step: nothing is replayed or skipped.

The rules, one call per reconcile (`decide`):
- A new candidate (spec.rollout.candidate renders a revision hash not seen before) starts at
  step 0. A candidate equal to the stable revision is nothing to roll out.
- An analysis is due every `analysis.intervalSeconds` (`analysis_due`); the caller measures,
  runs analysis.analyse and passes the report in.
- Pass resets the consecutive fail count. Fail adds one; `failureLimit` consecutive Fails abort.
  Inconclusive neither passes nor fails: it holds the step (never advances, never promotes) and
  after INCONCLUSIVE_LIMIT consecutive ones sets the condition AnalysisInconclusive.
- A step is complete when its `analysisSeconds` have passed since it started and its last
  `required_passes` analyses (analysisSeconds / intervalSeconds, at least 1) passed; then the
  next step starts at its weight. A Fail starts that count again; an Inconclusive interval (a
  Prometheus outage) neither adds to it nor resets it, so time without evidence (an outage, an
  operator that was down) never completes a step. After the last step: promote when
  `autoPromote`, else wait (state AwaitingPromotion, still analysing) for the annotation
  specserve.io/promote: "true" (which may also be set in advance).
- specserve.io/abort: "true" aborts at once. An aborted candidate keeps its Deployment at zero
  replicas for inspection and is not retried until its spec changes or specserve.io/retry: "true".
- Promotion makes the candidate revision the stable one (same hash, same pods); the old stable
  is removed once the promoted revision is ready with all replicas. The user then moves the
  candidate into spec.speculator (and spec.runtime) and deletes spec.rollout: that renders the
  identical revision hash, so no pod restarts.
The annotations the decision acted on are returned, so the caller removes them.
"""

import datetime
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from . import api
from .analysis import Report, analyse
from .measure import Window

PROMOTE, ABORT, RETRY = "specserve.io/promote", "specserve.io/abort", "specserve.io/retry"
INCONCLUSIVE_LIMIT = 3  # consecutive inconclusive analyses before the AnalysisInconclusive condition
HISTORY_LENGTH = 20

# Stable: no canary. Canary: the candidate takes `weight` percent. Aborted: stable only, the
# candidate's Deployment kept at zero. Promoted: the candidate revision is the stable one.
Stage = Literal["Stable", "Canary", "Aborted", "Promoted"]


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True)
class Decision:
    stage: Stage
    weight: int | None = None  # the candidate's traffic percent while stage == "Canary"
    canary: api.CanaryStatus | None = None  # what status.canary becomes
    last_rollout: api.RolloutRecord | None = None  # what status.lastRollout becomes
    events: list[Event] = field(default_factory=list)
    conditions: dict[str, tuple[bool, str, str]] = field(default_factory=dict)  # type -> (status, reason, message)
    consumed_annotations: list[str] = field(default_factory=list)
    # Aborted only: the candidate keeps its ready pods until the stable's replacements are ready.
    drain_candidate: bool = False


def timestamp(moment: datetime.datetime) -> str:
    return moment.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str) -> datetime.datetime:
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)


def annotation_set(annotations: dict, key: str) -> bool:
    return str((annotations or {}).get(key, "")).lower() == "true"


def analysis_due(rollout: api.Rollout, canary: api.CanaryStatus | None, candidate_revision: str,
                 now: datetime.datetime, last_rollout: api.RolloutRecord | None = None) -> bool:
    """An interval has passed since the last analysis (or since the step started) of this candidate,
    and its rollout has not ended (an aborted candidate's status is kept, but nothing is measured)."""
    if canary is None or canary.revision != candidate_revision:
        return False
    if last_rollout is not None and last_rollout.candidate_revision == candidate_revision:
        return False
    since = canary.last_analysis.at if canary.last_analysis else canary.step_started_at
    return since is None or (now - parse_time(since)).total_seconds() >= rollout.analysis.interval_seconds


def analysis_result(report: Report, canary: api.CanaryStatus, now: datetime.datetime) -> api.AnalysisResult:
    candidate, stable = report.candidate, report.stable
    return api.AnalysisResult(
        at=timestamp(now), step=canary.step, weight=canary.weight,
        acceptance_length=candidate.acceptance_length,
        p99_inter_token_latency_ms=candidate.p99_inter_token_latency_ms,
        stable_p99_inter_token_latency_ms=stable.p99_inter_token_latency_ms,
        tokens_per_dollar_gain=report.tokens_per_dollar_gain,
        error_rate=candidate.error_rate,
        in_flight_per_replica=candidate.in_flight_per_replica,
        stable_in_flight_per_replica=stable.in_flight_per_replica,
        verdict=report.verdict, reasons=report.reasons,
    )


def _numbers(canary: api.CanaryStatus) -> str:
    last = canary.last_analysis
    if last is None:
        return f"step {canary.step} at weight {canary.weight}%, no analysis yet"
    return f"step {canary.step} at weight {canary.weight}%: " + "; ".join(last.reasons)


def _abort(events: list[Event], consumed: list[str], rollout: api.Rollout, canary: api.CanaryStatus, now,
           reason: str, why: str) -> Decision:
    record = api.RolloutRecord(candidate_revision=canary.revision, outcome="Aborted", reason=reason, at=timestamp(now),
                               message=why)
    return Decision(
        "Aborted", None, canary, record,
        events=events + [Event("Warning", "RolloutAborted", why)],
        conditions={"RolloutAborted": (True, reason, why),
                    "AnalysisInconclusive": (False, "RolloutEnded", "")},
        consumed_annotations=consumed,
        drain_candidate=drains(rollout, canary, record),
    )


def drains(rollout: api.Rollout, canary: api.CanaryStatus | None, record: api.RolloutRecord) -> bool:
    """Whether an aborted candidate keeps its ready pods until the stable's replacements are ready.

    Speculative decoding is lossless: a candidate that lost on latency, acceptance or cost still
    answers exactly as the stable would, while removing its pods before their replacements are
    ready is capacity lost for a whole start-up (every request then misses the SLO). A candidate
    whose errors failed the analysis, or one a user aborted by hand, leaves at once.
    """
    last = canary.last_analysis if canary is not None else None
    return (record.reason == "AnalysisFailed" and last is not None and last.error_rate is not None
            and last.error_rate <= rollout.analysis.max_error_rate)


def _promote(events: list[Event], consumed: list[str], canary: api.CanaryStatus, now, why: str) -> Decision:
    record = api.RolloutRecord(candidate_revision=canary.revision, outcome="Promoted", at=timestamp(now), message=why)
    return Decision(
        "Promoted", None, None, record,
        events=events + [Event("Normal", "Promoted", why)],
        conditions={"RolloutAborted": (False, "Promoted", ""), "AnalysisInconclusive": (False, "RolloutEnded", "")},
        consumed_annotations=consumed,
    )


def required_passes(step: api.RolloutStep, analysis: api.Analysis) -> int:
    """Passing analyses that complete a step, with no failure between them (Inconclusive ones
    neither count nor interrupt): one per interval of its analysisSeconds."""
    return max(1, int(step.analysis_seconds // analysis.interval_seconds))


def decide(
    rollout: api.Rollout | None,
    stable_revision: str,
    candidate_revision: str | None,
    canary: api.CanaryStatus | None,
    last_rollout: api.RolloutRecord | None,
    annotations: dict,
    report: Report | None,
    now: datetime.datetime,
) -> Decision:
    """The next rollout state. `report` is this interval's analysis, or None when none was due."""
    if rollout is None or candidate_revision is None or candidate_revision == stable_revision:
        return Decision("Stable", last_rollout=last_rollout)
    events: list[Event] = []
    consumed: list[str] = []

    if last_rollout is not None and last_rollout.candidate_revision == candidate_revision:
        if last_rollout.outcome == "Promoted":
            return Decision("Promoted", last_rollout=last_rollout)
        if not annotation_set(annotations, RETRY):
            return Decision("Aborted", None, canary, last_rollout,
                            conditions={"RolloutAborted": (True, last_rollout.reason or "Aborted", last_rollout.message)},
                            drain_candidate=drains(rollout, canary, last_rollout))
        consumed.append(RETRY)
        events.append(Event("Normal", "RolloutRetried", f"retrying candidate {candidate_revision} (annotation {RETRY})"))
        last_rollout, canary = None, None

    if canary is None or canary.revision != candidate_revision:
        first = rollout.steps[0]
        previous = f" (replaces candidate {canary.revision})" if canary is not None else ""
        events.append(Event("Normal", "RolloutStarted",
                                     f"canary {candidate_revision}{previous} at step 0, weight {first.weight}%"))
        canary = api.CanaryStatus(revision=candidate_revision, step=0, weight=first.weight, step_started_at=timestamp(now))
        report = None  # a measurement taken before this candidate existed says nothing about it

    if annotation_set(annotations, ABORT):
        consumed.append(ABORT)
        return _abort(events, consumed, rollout, canary, now, "Aborted", f"aborted by annotation {ABORT} at {_numbers(canary)}")

    if report is not None:
        result = analysis_result(report, canary, now)
        # An Inconclusive interval is a hole in the evidence, not evidence: it keeps both counts,
        # so an outage or a load mismatch costs the intervals it lasts, never the passes before it.
        passes = {"Pass": canary.passed_checks + 1, "Fail": 0}.get(report.verdict, canary.passed_checks)
        fails = 0 if report.verdict == "Pass" else canary.failed_checks + (report.verdict == "Fail")
        inconclusive = canary.inconclusive_checks + 1 if report.verdict == "Inconclusive" else 0
        canary = canary.model_copy(update={
            "last_analysis": result, "history": (canary.history + [result])[-HISTORY_LENGTH:],
            "passed_checks": passes, "failed_checks": fails, "inconclusive_checks": inconclusive,
        })
        if report.verdict == "Fail":
            events.append(Event("Warning", "AnalysisFailed",
                                         f"{fails}/{rollout.analysis.failure_limit} failed: {_numbers(canary)}"))
            if fails >= rollout.analysis.failure_limit:
                return _abort(events, consumed, rollout, canary, now, "AnalysisFailed",
                              f"analysis failed {fails} times in a row at {_numbers(canary)}")

    step = rollout.steps[min(canary.step, len(rollout.steps) - 1)]
    held = (now - parse_time(canary.step_started_at)).total_seconds() >= step.analysis_seconds
    passed = canary.passed_checks >= required_passes(step, rollout.analysis)
    if canary.state == "Progressing" and report is not None and report.verdict == "Pass" and held and passed:
        if canary.step + 1 < len(rollout.steps):
            following = rollout.steps[canary.step + 1]
            events.append(Event("Normal", "StepAdvanced",
                                         f"step {canary.step} passed ({_numbers(canary)}); step {canary.step + 1} at weight {following.weight}%"))
            canary = canary.model_copy(update={"step": canary.step + 1, "weight": following.weight,
                                               "step_started_at": timestamp(now), "passed_checks": 0})
        elif rollout.auto_promote:
            return _promote(events, consumed, canary, now, f"all {len(rollout.steps)} steps passed; {_numbers(canary)}")
        else:
            canary = canary.model_copy(update={"state": "AwaitingPromotion"})
            events.append(Event("Normal", "AwaitingPromotion",
                                         f"all steps passed; set annotation {PROMOTE}: \"true\" to promote"))
    if canary.state == "AwaitingPromotion" and annotation_set(annotations, PROMOTE):
        consumed.append(PROMOTE)
        return _promote(events, consumed, canary, now, f"promoted by annotation {PROMOTE} after all steps passed")

    stuck = canary.inconclusive_checks >= INCONCLUSIVE_LIMIT
    if stuck and report is not None and canary.inconclusive_checks == INCONCLUSIVE_LIMIT:
        events.append(Event("Warning", "AnalysisInconclusive",
                                     f"{canary.inconclusive_checks} inconclusive analyses in a row: {_numbers(canary)}"))
    conditions = {
        "RolloutAborted": (False, "Progressing", ""),
        "AnalysisInconclusive": (stuck, "NoDecision" if stuck else "Deciding", _numbers(canary) if stuck else ""),
    }
    return Decision("Canary", canary.weight, canary, last_rollout, events, conditions, consumed)


def tick(
    rollout: api.Rollout | None,
    stable_revision: str,
    candidate_revision: str | None,
    canary: api.CanaryStatus | None,
    last_rollout: api.RolloutRecord | None,
    annotations: dict,
    slo: api.Slo,
    now: datetime.datetime,
    measure: Callable[[list[str]], list[Window]],
) -> tuple[Decision, Report | None]:
    """One decision tick, as the operator (reconcile.py), `specserve canary` / `demo` and `specserve simulate` all
    run it, with only `measure` (the two revisions' windows over the last interval) different: when an analysis is
    due, measure and analyse the revisions; then decide the next state."""
    report = None
    if rollout is not None and candidate_revision is not None \
            and analysis_due(rollout, canary, candidate_revision, now, last_rollout):
        stable, candidate = measure([stable_revision, candidate_revision])
        report = analyse(stable, candidate, rollout.analysis, slo, rollout.candidate.speculator.method)
    return decide(rollout, stable_revision, candidate_revision, canary, last_rollout, annotations, report, now), report
