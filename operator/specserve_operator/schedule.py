"""The live revision's draft-length schedule, proposed from measurements. Pure.

What a draft length costs comes from the bench: the capacity prior's `draftLengths` (`specserve bench --concurrency
... --propose-schedule K1,K2,... --emit-performance`) give, per fixed length k, the per-request decode rate at each
concurrency, and plain decoding's curve is length 0. What the traffic accepts now comes from the live windows: a
step of k drafts yields 1 + a_1 + ... + a_k tokens where a_i is the share of drafts accepted through position i
(the window's per-position acceptance), so each length's rate is the bench's scaled by the tokens a step yields on
today's traffic over the bench's. Past the longest position the live revision drafts (or without per-position
counts) the bench's accepted drafts are scaled by the live over the bench's at the live length. A live revision
that drafts by a schedule mixes lengths in its counters, so its proposals use the bench's acceptance. A step's
time is the bench's: it depends on the batch and the length, not on what is accepted.

From those curves specserve_runtime.draft_schedule.propose picks, per batch size, the length with the most tokens
per second (and so per dollar, and the least time per token: its docstring says why the SLO cannot disagree).
Its predicted gain is the proposal's rate over the live configuration's at the load measured. Only a gain of
MIN_GAIN or more is applied (spec.speculationHealth.schedule Apply): the new speculator is rolled out as a canary
candidate (health.with_schedule), so a proposal that measures worse is rolled back like any candidate.
"""

from dataclasses import dataclass

from specserve_runtime.config import BatchSizeRange, scheduled_tokens
from specserve_runtime.draft_schedule import describe, propose, rate, scheduled_curve
from specserve_runtime.performance import METHODS, CurvePoint, Performance, draft_length_curves

from . import api
from .autoscale import prior_points
from .capacity import Prior
from .measure import Window

MIN_GAIN = 1.05  # a proposal applied must be predicted this much faster than the live configuration
STICKY = 1.02  # a new proposal replaces the last one when predicted this much faster at the load measured


@dataclass(frozen=True)
class DraftLengths:
    """A method's bench curves by fixed draft length (0: plain decoding) and each length's acceptance length."""

    curves: dict[int, list[CurvePoint]]
    acceptance: dict[int, float]
    batch: int | None = None  # the method's maxConcurrency


def draft_lengths(performance: Performance) -> dict[str, DraftLengths]:
    """Per method with measured draftLengths and plain decoding measured: what `propose_for` reads."""
    found = {}
    for method in METHODS:
        curves = draft_length_curves(performance, method)
        if 0 in curves and len(curves) > 1:
            table = getattr(performance, method)
            found[method] = DraftLengths(curves, {0: 1.0} | {r.num_speculative_tokens: r.acceptance_length for r in table.draft_lengths},
                                         table.max_concurrency)
    return found


def within_limit(measured: DraftLengths | None, limit: int | None) -> DraftLengths | None:
    """The draft lengths the tenant's profile allows (limits.maxNumSpeculativeTokens): what the operator proposes
    for a tenant stays within the limits the tenant's own spec must. None when none were measured or no drafting
    length is left."""
    if measured is None or limit is None:
        return measured
    curves = {k: curve for k, curve in measured.curves.items() if k <= limit}
    if len(curves) < 2:
        return None
    return DraftLengths(curves, {k: a for k, a in measured.acceptance.items() if k in curves}, measured.batch)


def exceeds_limit(status: api.DraftScheduleStatus, limit: int | None) -> bool:
    """A proposal (or the schedule applied from one) drafting more a step than the profile allows now: one made
    before the profile's limit was lowered."""
    schedules = [status.proposed] + ([status.applied.schedule] if status.applied is not None else [])
    return limit is not None and any(r.num_speculative_tokens > limit for ranges in schedules for r in ranges)


def live_length(speculator: api.Speculator, load: float, measured: DraftLengths) -> int:
    """The draft length the live revision runs at this load: its schedule's, its numSpeculativeTokens, else the
    longest the bench measured (the drafter's default)."""
    if speculator.num_speculative_tokens_per_batch_size:
        return scheduled_tokens(speculator.num_speculative_tokens_per_batch_size, max(1, round(load)))
    return speculator.num_speculative_tokens or max(measured.curves)


def on_live_traffic(measured: DraftLengths, window: Window, drafted: int) -> dict[int, list[CurvePoint]]:
    """The bench's curves, each length's rate scaled by the tokens a step of it yields on the live traffic over the
    bench's acceptance length: from the window's per-position acceptance up to the `drafted` positions the live
    revision drafts, beyond them (or without per-position counts) the bench's accepted drafts times the live over
    the bench's at the live length."""
    positions = list(window.accepted_per_position[:drafted])
    drafting = sorted(k for k in measured.acceptance if k > 0)
    reference = max((k for k in drafting if k <= drafted), default=drafting[0])
    live_accepted = sum(positions[:reference]) if positions else window.acceptance_length - 1
    ratio = live_accepted / (measured.acceptance[reference] - 1) if measured.acceptance[reference] > 1 else 1.0
    curves = {}
    for k, curve in measured.curves.items():
        bench_tokens = measured.acceptance[k]
        live_tokens = 1 + sum(positions[:k]) if k <= len(positions) else 1 + (bench_tokens - 1) * ratio
        curves[k] = [point.model_copy(update={"tokens_per_second_per_request":
                                              point.tokens_per_second_per_request * live_tokens / bench_tokens})
                     for point in curve]
    return curves


def propose_for(previous: api.DraftScheduleStatus | None, speculator: api.Speculator, revision: str,
                window: Window, measured: DraftLengths, at: str) -> api.DraftScheduleStatus | None:
    """The proposal after one more analysis window of the live revision; the previous one when the window has no
    acceptance or load to fit to (None: nothing proposed yet)."""
    load = window.in_flight_per_replica
    if window.acceptance_length is None or load is None:
        return previous if previous is not None and previous.revision == revision else None
    drafted = live_length(speculator, load, measured)
    # A revision drafting by a schedule mixes lengths in its acceptance counters: the bench's acceptance stands.
    by_schedule = bool(speculator.num_speculative_tokens_per_batch_size)
    curves = measured.curves if by_schedule else on_live_traffic(measured, window, drafted)
    batch = max(1.0, load)

    def at_load(proposal: list[BatchSizeRange]) -> float:
        return rate(curves[scheduled_tokens(proposal, max(1, round(load)))], batch)

    schedule = propose(curves)
    if previous is not None and previous.revision == revision and \
            {r.num_speculative_tokens for r in previous.proposed} <= set(curves):
        # The last proposal stands unless the new one is predicted faster at the load measured: a window's
        # acceptance moves every boundary a little, and a proposal that changes nothing here is noise.
        if at_load(schedule) < STICKY * at_load(previous.proposed):
            schedule = previous.proposed
    current = curves.get(drafted) or curves[min(curves, key=lambda k: abs(k - drafted))]
    gain = at_load(schedule) / rate(current, batch)
    applied = previous.applied if previous is not None else None
    return api.DraftScheduleStatus(
        revision=revision, proposed=schedule, predicted_gain=round(gain, 3), in_flight_per_replica=round(load, 2),
        at=at, applied=applied,
        reason=f"{describe(schedule)}: {gain:.2f}x the live configuration ({drafted} drafts) at {load:.2f} in flight "
               f"per replica, from the bench's draft lengths {', '.join(map(str, sorted(measured.curves)))} and "
               + ("their acceptance (the live revision drafts by a schedule)" if by_schedule else
                  f"the window's acceptance (length {window.acceptance_length:.2f})"))


def scheduled(speculator: api.Speculator, schedule: list[BatchSizeRange]) -> api.Speculator:
    """The speculator drafting by `schedule`: numSpeculativeTokens raised to its longest range where it was lower."""
    longest = max(1, max(r.num_speculative_tokens for r in schedule))
    tokens = max(longest, speculator.num_speculative_tokens or longest)
    return speculator.model_copy(update={"num_speculative_tokens": tokens, "num_speculative_tokens_per_batch_size": schedule})


def worth_applying(status: api.DraftScheduleStatus | None, revision: str, speculator: api.Speculator) -> bool:
    """Apply mode: a proposal for the live revision predicted MIN_GAIN faster, which it does not already run, and
    none applied before for this spec (one automatic change per generation: it holds until the spec changes)."""
    return (status is not None and status.revision == revision and status.applied is None
            and status.predicted_gain is not None and status.predicted_gain >= MIN_GAIN
            and speculator.num_speculative_tokens_per_batch_size != status.proposed)


def capacity_prior(speculator: api.Speculator, priors: dict[str, Prior], lengths: dict[str, DraftLengths],
                   step_gaps: bool = True) -> Prior:
    """The autoscaler's prior for a revision of this speculator: its method's, or for one drafting by a schedule,
    the schedule's curve from the draft lengths measured (where they cover it). `step_gaps`: its inter-token
    latencies as the gaps between verify steps, what the runtimes measure (Prior.step_gaps): a step yields the
    table's acceptance length, or under a schedule that of the length it gives the batch."""
    prior = priors.get(speculator.method, Prior())
    measured = lengths.get(speculator.method)
    schedule = speculator.num_speculative_tokens_per_batch_size
    if not schedule or measured is None or not {r.num_speculative_tokens for r in schedule} <= set(measured.curves):
        return prior.step_gaps(lambda point: point.acceptance_length or 1.0) if step_gaps else prior
    rows = [point.model_dump(by_alias=True) for point in scheduled_curve(measured.curves, schedule)]
    prior = prior_points(rows, measured.batch)
    if not step_gaps:
        return prior
    # A prior point's requests in flight are its row's concurrency less the request itself (prior_points).
    return prior.step_gaps(lambda point: measured.acceptance[scheduled_tokens(schedule, round(point.in_flight_per_replica) + 1)])
