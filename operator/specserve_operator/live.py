"""The live revision once its rollout is done: its continuous analysis (health.py), the fallback it may start,
and its draft-length schedule (schedule.py), as reconcile calls them. The measuring is the caller's."""

import datetime
from collections.abc import Callable
from dataclasses import dataclass, field

from . import api, health, schedule
from .capacity import Capacity, fit
from .measure import Window
from .render import Settings
from .replicas import Revision
from .rollout import Event, parse_time, timestamp


@dataclass
class Health:
    """What the live revision's continuous analysis leaves: status.speculation, the SpeculationDegraded condition
    (None: leave it as it is), status.draftSchedule, and the Events of a change."""

    speculation: api.SpeculationStatus | None
    degraded: tuple[bool, str, str] | None
    draft_schedule: api.DraftScheduleStatus | None
    events: list[Event] = field(default_factory=list)
    fallback_due: bool = False  # health.calls_for_fallback after this analysis


def plain_decoding(settings: Settings) -> Capacity | None:
    """The capacity model of plain decoding, from the `none` capacity prior: what the speed of speculation is judged
    against (None: not judged)."""
    prior = settings.capacity_priors.get("none")
    return fit([], prior) if prior is not None and prior.points else None


def speculation_health(spec: api.SpeculativeServingSpec, settings: Settings, previous: api.SpeculationStatus | None,
                       draft_schedule: api.DraftScheduleStatus | None, stage: str, live: Revision,
                       measure_live: Callable[[], Window], now: datetime.datetime, max_drafts: int | None) -> Health:
    """The live revision's continuous analysis (health.py) and draft-length schedule (schedule.py) when it
    speculates and runs without a canary. Measured through the source alone, as a canary is: an outage holds the
    analysis and never degrades (`measure_live`: the live revision over the last intervalSeconds)."""
    policy = spec.speculation_health
    if not policy.enabled or live.speculator.method == "none":
        return Health(None, (False, "Disabled" if not policy.enabled else "NotSpeculating", ""), draft_schedule)
    was = health.is_degraded(previous, policy)
    due = previous is None or previous.last_evaluation_time is None or \
        (now - parse_time(previous.last_evaluation_time)).total_seconds() >= policy.interval_seconds
    if stage == "Canary" or not due:  # a canary compares revisions; otherwise one serves (an aborted one drains)
        return Health(previous, None, draft_schedule)
    window = measure_live()
    plain = plain_decoding(settings)
    status = health.assess(previous, live.hash, window, policy, plain, timestamp(now))
    degraded = health.is_degraded(status, policy)
    analysis = status.last_analysis
    figures = "; ".join(analysis.reasons)
    message = f"revision {live.hash} ({live.speculator.method}): {analysis.verdict}: {figures}"
    events = []
    if degraded and not was:
        why = f"acceptance below {policy.severe_acceptance_ratio:g} of its baseline" if status.severe else \
            f"{status.degraded_analyses} degraded analyses in a row"
        events.append(Event("Warning", "SpeculationDegraded", f"{why}, {message}"))
    elif was and not degraded:
        events.append(Event("Normal", "SpeculationRecovered", message))
    reason = "Degraded" if degraded else "NotSustained" if analysis.verdict == "Degraded" else analysis.verdict
    lengths = schedule.within_limit(settings.draft_lengths.get(live.speculator.method), max_drafts)
    if policy.schedule != "Off" and lengths is not None:
        proposal = schedule.propose_for(draft_schedule, live.speculator, live.hash, window, lengths, timestamp(now))
        if proposal is not None and (draft_schedule is None or proposal.proposed != draft_schedule.proposed):
            events.append(Event("Normal", "DraftScheduleProposed", f"revision {live.hash}: {proposal.reason}"))
        draft_schedule = proposal
    return Health(status, (degraded, reason, message), draft_schedule, events,
                  health.calls_for_fallback(status, policy, judges_speed=plain is not None))


def apply_schedule(spec: api.SpeculativeServingSpec, proposal: api.DraftScheduleStatus | None, live: Revision,
                   stage: str, generation: int | None, at: str, events: list[Event]) -> api.DraftScheduleStatus | None:
    """schedule Apply: the proposal rolled out as a canary candidate (health.with_schedule) when it is worth it and
    the live revision serves alone."""
    if spec.speculation_health.schedule != "Apply" or stage not in ("Stable", "Promoted") or \
            not schedule.worth_applying(proposal, live.hash, live.speculator):
        return proposal
    events.append(Event("Normal", "DraftScheduleApplied", f"revision {live.hash}: rolling out {proposal.reason}"))
    applied = api.AppliedSchedule(generation=generation, from_revision=live.hash, at=at, schedule=proposal.proposed)
    return proposal.model_copy(update={"applied": applied})


def start_fallback(spec: api.SpeculativeServingSpec, due: bool, live: Revision, generation: int | None, at: str,
                   events: list[Event]) -> api.FallbackStatus | None:
    """A fallback (health.with_fallback) when the live revision's analysis calls for one (Health.fallback_due) and
    the spec names one to roll out."""
    chosen = spec.speculation_health.fallback
    if not (due and chosen and chosen.auto_fallback and chosen.speculator != live.speculator):
        return None
    events.append(Event("Warning", "FallbackStarted", f"revision {live.hash} ({live.speculator.method}) is degraded: "
                                                      f"rolling {chosen.speculator.method} out as a canary candidate"))
    return api.FallbackStatus(generation=generation, from_revision=live.hash, at=at)


def retry_fallback(spec: api.SpeculativeServingSpec, settings: Settings, started: api.FallbackStatus | None,
                   last: api.RolloutRecord | None, candidate: str | None, speculation: api.SpeculationStatus | None,
                   at: str, events: list[Event]) -> api.FallbackStatus | None:
    """The fallback's next attempt when its canary lost and the revision still calls for it (health.retries_fallback),
    else None."""
    if started is None or not health.retries_fallback(started, last, candidate, speculation, spec.speculation_health,
                                                      judges_speed=plain_decoding(settings) is not None):
        return None
    attempt = started.model_copy(update={"attempts": started.attempts + 1, "at": at})
    events.append(Event("Warning", "FallbackRetried", f"revision {started.from_revision} is still degraded: "
                                                      f"rolling the fallback out again (attempt {attempt.attempts})"))
    return attempt
