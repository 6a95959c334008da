"""The autoscaler's decision: how many replicas a serving runs. Pure: no I/O, the clock is a parameter.

Objective. At a given demand the tokens served per second are fixed by the demand, so the count
that maximises tokens per dollar is the smallest one whose predicted p99s meet the SLO.

Demand is the measured arrival of work, not the requests in flight: requests arrived per second
(all revisions) and tokens generated per request. Requests finished per second measure it
while the replicas keep up; a window with a queue (its requests queued beyond the batch for more
than SATURATED_QUEUE_SHARE of their time, or the window after one) counts what arrived (finished +
the change of the requests in the system, measure.Window.arrived_requests): an overloaded
replica's throughput caps what finishes and would hide the load it cannot keep up with, and a
draining queue finishes faster than requests now arrive, work the backlog below already counts
(counted twice, and read as a rising trend, it would keep the replicas bought for it). (Not
arrived always: its gauge ends add noise where nothing queues.)
Requests in flight depend on the replica count (fewer replicas decode each request more slowly,
so more of them are in flight at once), so they are what the model predicts, not what it takes
as given. For each count n within the bounds, a
replica receives rate = demand x HEADROOM / n requests per second, and by Little's law holds
    c = rate x T(c),    T(c) = tokens per request x (s0 + s1 c) = A + B c seconds
requests in flight, with s the capacity model's mean time in the system per generated token
(capacity.py), fitted to windows that measured it at their own loads, so it already carries
their queueing. With utilisation u = rate x B the solution is c = rate x A / (1 - u). A count
whose replicas would run past UTILISATION_LIMIT does not qualify: near saturation the queue is
too sensitive to trust; nor one whose c would pass UTILISATION_LIMIT of the engine's batch, where
the capacity model knows it (capacity.Prior): beyond it requests wait for a slot in the batch. The capacity model's p99 predictions at that c (with their confidence
margins) must meet the SLO. During a canary the autoscaler sizes the total and the rollout's
weight splits it (replicas.split_replicas): one writer of replicas; both revisions see the same
per-replica rate, so the worse of their two models decides.

Trend. A replica added now serves only after the scale-up stabilisation window and its start-up
(replica_startup_seconds, a setting); on a rising load the count that meets the SLO now is too few
by then. So the demand planned for is the larger of the measured one and the least-squares line
through the last TREND_SECONDS of measured demand, read that far ahead. A falling trend is never
planned for: scale-down waits for the measurement, as before.

Backlog. Requests already queued beyond the batch (a saturated window's vllm:num_requests_waiting at its
end: a cold start under load, a burst) are work too, and sizing for the arrival rate alone would leave
them to the headroom's spare capacity, minutes of p99 TTFT far past the SLO. So the count is sized for
the demand plus the backlog drained within the SLO's time to first token (DEFAULT_DRAIN_SECONDS without
one); the bounds and the budget cap it, and once the backlog is gone the demand alone sizes again: the
recommendations sized for it no longer hold the scale-down window (each says whether it was), as the replicas
that drained a backlog say nothing of the demand.

Bounds: spec.replicas.min / max, the profile's maxReplicas, and as many replicas as the profile's
maxHourlyCostUSD pays for (never exceeded; when the SLO needs more, BudgetLimited with the numbers).
When no count within the bounds is predicted to meet the SLO, the count is the smallest whose
prediction is within FLOOR_TOLERANCE of the best one: past it the model says more replicas do not
help (its floor, latency at no load, is above the SLO), which early on, with few windows and wide
margins, is a matter of evidence rather than of capacity.

Stability, as the HPA does it: recommendations are kept for the stabilisation windows; a scale up
goes to the lowest recommendation of the last scaleUpStabilizationSeconds (a spike must last), a
scale down to the highest of the last scaleDownStabilizationSeconds, and only to a count that
would also hold DOWN_TOLERANCE (10%) more demand; one decision moves at most double (or +4) up and
half down. Only recommendations sized for the same revisions count: when a canary starts or ends, the
windows smooth the new fleet's measurements, not the old fleet's (a canary sized for the worse of two
models would otherwise hold the promoted revision's count for the whole scale-down window), unless the
planned demand is above the measured one by more than DOWN_TOLERANCE. No data holds the current count.
"""

import datetime
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from . import api
from .capacity import OBSERVATIONS, Capacity, Point, Prior, fit
from .measure import Window
from .rollout import parse_time, timestamp

HEADROOM = 1.2  # plan for 20% more load than measured
UTILISATION_LIMIT = 0.85  # of a replica's saturating arrival rate (1 / B in Little's law above)
DOWN_TOLERANCE = 0.1  # like the HPA's tolerance: noise around a boundary must not flap the count
TREND_SECONDS = 180  # the demand trend is fitted over this much history (at least TREND_POINTS points)
TREND_POINTS = 4
FLOOR_TOLERANCE = 0.05  # when no count meets the SLO: replicas that improve the prediction by less buy nothing
SATURATED_QUEUE_SHARE = 0.1  # a window whose requests spent more of their time queued measured the backlog
DEFAULT_DRAIN_SECONDS = 60.0  # the backlog's drain time when the SLO sets no time to first token


@dataclass(frozen=True)
class Limits:
    low: int
    high: int
    budget_cap: int | None  # replicas maxHourlyCostUSD pays for (None: no budget)
    replica_hourly_usd: float


def limits(spec: api.SpeculativeServingSpec, profile: api.ServingProfileSpec, canary: bool) -> Limits:
    hourly = profile.accelerator.count * profile.accelerator.price_per_hour_usd
    high = min(spec.replicas.max, profile.limits.max_replicas)
    cap = None
    if profile.limits.max_hourly_cost_usd is not None and hourly > 0:
        cap = math.floor(profile.limits.max_hourly_cost_usd / hourly)
        high = min(high, cap)
    low = min(max(spec.replicas.min, 2 if canary else 1), high)  # a canary needs one replica of each revision
    return Limits(low, max(high, 0), cap, hourly)


def max_step_up(current: int) -> int:
    return current + max(4, current)


def max_step_down(current: int) -> int:
    return max(current - max(1, current // 2), 0)


@dataclass(frozen=True)
class ScaleDecision:
    replicas: int
    recommended: int | None  # before stabilisation and step limits; None without data
    reason: str
    budget_limited: bool = False
    demand: "Demand | None" = None
    predicted_p99_inter_token_latency_ms: float | None = None
    predicted_p99_time_to_first_token_ms: float | None = None
    recommendations: list[tuple[str, int]] = field(default_factory=list)  # (at, replicas), the windows' worth


@dataclass(frozen=True)
class Demand:
    requests_per_second: float  # finished, all revisions (or the trend's forecast of it)
    tokens_per_request: float  # generated tokens per finished request
    measured_requests_per_second: float | None = None  # set when requests_per_second is a forecast
    backlog: float = 0.0  # requests queued at the window's end, in saturated windows
    drain_seconds: float = DEFAULT_DRAIN_SECONDS  # ... to be served within this, on top of the demand

    @property
    def sized_requests_per_second(self) -> float:
        """What the replicas must take: the demand, and the backlog drained in time."""
        return self.requests_per_second + self.backlog / self.drain_seconds

    def __str__(self) -> str:
        text = f"{self.requests_per_second:.2f} req/s x {self.tokens_per_request:.0f} tokens"
        if self.measured_requests_per_second is not None:
            text += f" (rising trend; measured {self.measured_requests_per_second:.2f} req/s)"
        if self.backlog:
            text += f" + a backlog of {self.backlog:.0f} requests drained within {self.drain_seconds:g} s"
        return text


def saturated(w: Window) -> bool:
    """The window's requests spent more than SATURATED_QUEUE_SHARE of their time in the system
    queued beyond the batch: its latencies are the full batch's and its in-flight count is mostly
    the queue, so it says nothing about the replica's capacity curve (capacity.py)."""
    if w.waiting_per_replica is None or w.in_flight_per_replica is None:
        return False
    return w.waiting_per_replica > SATURATED_QUEUE_SHARE * w.in_flight_per_replica


def drain_seconds(slo: api.Slo) -> float:
    """How soon a backlog must be served: within the SLO's time to first token, the queue being where it waits."""
    ttft = slo.p99_time_to_first_token_ms
    return ttft / 1000 if ttft is not None else DEFAULT_DRAIN_SECONDS


def demand_of(windows: list[Window], slo: api.Slo, after_backlog: bool = False) -> tuple[Demand | None, str | None]:
    """The serving's demand over its revisions' windows, or None and why; `after_backlog`: the last
    evaluation measured a backlog, so what finishes now still drains it. A revision without ready
    replicas (a canary's first pod starting) serves nothing, so the others' windows are the whole
    demand: holding the count until it is ready would leave an overloaded stable unscaled."""
    serving = [w for w in windows if w.ready_replicas > 0]
    missing = [f"{w.revision}: {w.missing}" for w in (serving or windows) if w.missing is not None]
    if missing or not serving:
        return None, "; ".join(missing) or "no running revision"
    windows = serving
    finished = sum(w.finished_requests or 0 for w in windows)
    tokens = sum(w.generated_tokens or 0 for w in windows)
    if finished <= 0:
        return None, "no request finished in the window"

    def arrived(w: Window) -> float:
        if (saturated(w) or after_backlog) and w.arrived_requests is not None:
            return max(w.arrived_requests, 0.0)  # a gauge's end lost with a pod can take the change below -finished
        return w.finished_requests or 0

    backlog = sum(w.waiting_requests or 0.0 for w in windows if saturated(w))
    return Demand(sum(arrived(w) / w.seconds for w in windows), max(tokens / finished, 1.0), backlog=backlog,
                  drain_seconds=drain_seconds(slo)), None


def trend(history: Sequence[tuple[float, float]], ahead: float) -> float | None:
    """The least-squares line through (seconds, requests/s) points, read `ahead` seconds after the
    last point; None with fewer than TREND_POINTS points."""
    if len(history) < TREND_POINTS:
        return None
    n = len(history)
    mean_t = sum(t for t, _ in history) / n
    mean_r = sum(r for _, r in history) / n
    spread = sum((t - mean_t) ** 2 for t, _ in history)
    if spread <= 0:
        return None
    slope = sum((t - mean_t) * (r - mean_r) for t, r in history) / spread
    return mean_r + slope * (history[-1][0] + ahead - mean_t)


def planned(demand: Demand, history: Sequence[tuple[float, float]], ahead: float) -> Demand:
    """The demand to size for: the measured one, or where a rising trend takes it `ahead` seconds on."""
    forecast = trend(history, ahead)
    if forecast is None or forecast <= demand.requests_per_second:
        return demand
    return replace(demand, requests_per_second=forecast, measured_requests_per_second=demand.requests_per_second)


def in_flight(capacity: Capacity, rate: float, tokens_per_request: float) -> float | None:
    """Requests in flight per replica at `rate` requests/s (Little's law on the fitted mean time
    per token), or None past UTILISATION_LIMIT, of the replica's saturating rate or of its batch."""
    fixed = tokens_per_request * capacity.service.intercept / 1000  # A: seconds per request
    per_request = tokens_per_request * capacity.service.slope / 1000  # B: ... per request in flight
    utilisation = rate * per_request
    if utilisation >= UTILISATION_LIMIT:
        return None
    load = rate * fixed / (1 - utilisation)
    if capacity.batch is not None and load >= UTILISATION_LIMIT * capacity.batch:
        return None  # so near the engine's batch, requests would queue beyond it: the same limit
    return load


def _predict(capacities: list[Capacity], demand: Demand, count: int) -> tuple[float, float | None] | None:
    """The worst revision's predicted p99s with `count` replicas, or None when one would saturate."""
    rate = demand.sized_requests_per_second * HEADROOM / count
    loads = [in_flight(c, rate, demand.tokens_per_request) for c in capacities]
    if any(load is None for load in loads):
        return None
    itl = max(c.p99_inter_token_latency_ms(load) for c, load in zip(capacities, loads))
    ttfts = [t for t in (c.p99_time_to_first_token_ms(load) for c, load in zip(capacities, loads)) if t is not None]
    return itl, (max(ttfts) if ttfts else None)


def _meets(slo: api.Slo, itl: float, ttft: float | None) -> bool:
    if slo.p99_inter_token_latency_ms is not None and itl > slo.p99_inter_token_latency_ms:
        return False
    return slo.p99_time_to_first_token_ms is None or ttft is None or ttft <= slo.p99_time_to_first_token_ms


def _over_slo(slo: api.Slo, itl: float, ttft: float | None) -> float:
    """How far predictions are from the SLO: the larger of predicted / objective (<= 1 meets it)."""
    ratios = [itl / slo.p99_inter_token_latency_ms] if slo.p99_inter_token_latency_ms else []
    if slo.p99_time_to_first_token_ms and ttft is not None:
        ratios.append(ttft / slo.p99_time_to_first_token_ms)
    return max(ratios, default=0.0)


def recommend(demand: Demand, capacities: list[Capacity], slo: api.Slo, bounds: Limits
              ) -> tuple[int, bool, float | None, float | None]:
    """(replicas, SLO met, predicted p99 ITL, predicted p99 TTFT) for the smallest count that meets
    the SLO. When none does, the smallest count within FLOOR_TOLERANCE of the best prediction:
    past the count where the prediction stops improving (latency at no load is the model's
    floor, and with few windows its margin is wide), more replicas cost without helping. The
    predictions are None where even the maximum would saturate."""
    predictions = {}
    for count in range(max(bounds.low, 1), bounds.high + 1):
        predicted = _predict(capacities, demand, count)
        if predicted is not None and _meets(slo, *predicted):
            return count, True, *predicted
        predictions[count] = predicted
    feasible = {count: p for count, p in predictions.items() if p is not None}
    if not feasible:
        return bounds.high, False, None, None
    best = min(_over_slo(slo, *p) for p in feasible.values())
    count = min(n for n, p in feasible.items() if _over_slo(slo, *p) <= best * (1 + FLOOR_TOLERANCE))
    return count, False, *feasible[count]


def decide(
    current: int,
    demand: Demand | None,
    capacities: list[Capacity],
    slo: api.Slo,
    bounds: Limits,
    autoscaling: api.Autoscaling,
    recommendations: list[tuple[str, int]],
    now: datetime.datetime,
    missing: str | None = None,
) -> ScaleDecision:
    """The replica count for all revisions together (`demand` None, with `missing` saying why, when
    there is no data)."""
    if demand is None or not capacities:
        why = missing or "no capacity model yet"
        held = min(max(current, bounds.low), bounds.high)
        return ScaleDecision(held, None, f"holding {held} replicas: no data ({why})", recommendations=recommendations)
    if slo.p99_inter_token_latency_ms is None and slo.p99_time_to_first_token_ms is None:
        return ScaleDecision(bounds.low, bounds.low, f"no SLO to size against: replicas.min ({bounds.low})", demand=demand)

    raw, met, itl, ttft = recommend(demand, capacities, slo, bounds)
    if raw < current:  # hysteresis: scale down only to a count that would also hold DOWN_TOLERANCE more demand
        more = replace(demand, requests_per_second=demand.requests_per_second * (1 + DOWN_TOLERANCE))
        raw = min(recommend(more, capacities, slo, bounds)[0], current)
    now = parse_time(timestamp(now))  # whole seconds, as the recommendations are stored: this one is at age 0
    window = max(autoscaling.scale_up_stabilization_seconds, autoscaling.scale_down_stabilization_seconds)
    kept = [(at, n) for at, n in recommendations if (now - parse_time(at)).total_seconds() < window]
    kept.append((timestamp(now), raw))

    def within(seconds: int) -> list[int]:
        return [n for at, n in kept if (now - parse_time(at)).total_seconds() <= seconds]

    target = current
    if raw > current:
        target = min(max(min(within(autoscaling.scale_up_stabilization_seconds)), current), max_step_up(current))
    elif raw < current:
        target = max(min(max(within(autoscaling.scale_down_stabilization_seconds)), current), max_step_down(current))
    target = min(max(target, bounds.low), bounds.high)

    if itl is None:
        predicted = "saturate"
    else:
        predicted = f"predict p99 ITL {itl:.1f}ms" + (f", p99 TTFT {ttft:.0f}ms" if ttft is not None else "")
    numbers = f"demand {demand} (x{HEADROOM} headroom): {raw} replicas {predicted}"
    budget_limited = not met and bounds.budget_cap is not None and raw == bounds.high == bounds.budget_cap
    if budget_limited:
        reason = (f"{numbers}, above the SLO; maxHourlyCostUSD pays for {bounds.budget_cap} replicas "
                  f"(${bounds.budget_cap * bounds.replica_hourly_usd:.2f}/h)")
    elif not met and raw == bounds.high:
        reason = f"{numbers}, above the SLO even at the maximum of {bounds.high} replicas"
    elif not met:
        reason = (f"{numbers}, above the SLO at any count; more replicas improve the prediction by less "
                  f"than {FLOOR_TOLERANCE:.0%}")
    else:
        reason = f"{numbers} within the SLO"
    if target != raw:
        reason += f"; at {target} (stabilisation and step limits from {current})"
    return ScaleDecision(target, raw, reason, budget_limited, demand, itl, ttft, kept)


def prior_points(performance: list[dict] | None, max_concurrency: int | None = None) -> Prior:
    """Capacity prior from a performance table: rows of {concurrency, tokensPerSecondPerRequest, ttftMs}
    (a scenario's `performance.<method>.curve`; the operator's SPECSERVE_CAPACITY_PRIORS file), and
    its batch: `max_concurrency`, else the highest concurrency it measured (as the simulator runs it).
    A row's concurrency counts the request itself; a request arriving at a replica finds the
    time-averaged number in the system there (Poisson arrivals see time averages), so row k is the
    point at k - 1 requests in flight. The row's mean time per token stands in for the p99 and for
    the time in the system (the TTFT spread over the response is not known without its length)."""
    points = []
    for row in performance or []:
        if row["tokensPerSecondPerRequest"] > 0:
            ms_per_token = 1000.0 / row["tokensPerSecondPerRequest"]
            points.append(Point(row["concurrency"] - 1, ms_per_token, row.get("ttftMs"), ms_per_token))
    batch = max_concurrency or max((row["concurrency"] for row in performance or []), default=None)
    return Prior(tuple(points), batch)


def tick(
    status: api.AutoscalingStatus,
    windows: list[Window],
    deciding: list[str],
    priors: Mapping[str, Prior],
    spec: api.SpeculativeServingSpec,
    profile: api.ServingProfileSpec,
    slo: api.Slo,
    current: int,
    canary: bool,
    now: datetime.datetime,
    startup_seconds: float,
) -> tuple[api.AutoscalingStatus, ScaleDecision]:
    """One autoscaling step for a serving: record this tick's windows (one per serving revision) as
    capacity observations, fit the models of the revisions that will run (`deciding`), decide at
    the demand all the windows measured, or where its rising trend goes before a replica added now
    serves (`startup_seconds` after the scale-up stabilisation window). The operator and
    `specserve simulate` both call this; everything it needs next time is in the returned status."""
    at = timestamp(now)
    serving = {w.revision for w in windows}
    observations = [o for o in status.observations if o.revision in serving]
    # The window after a backlog still serves requests that waited in it: their times to first token measured
    # the queue, not the replica at the load the window saw (its inter-token latencies did).
    after_backlog = bool(status.backlog_requests)
    for w in windows:
        if w.missing is None and w.p99_inter_token_latency_ms is not None and w.in_flight_per_replica is not None \
                and not saturated(w):
            observations.append(api.CapacityObservation(
                revision=w.revision, at=at, in_flight_per_replica=w.in_flight_per_replica,
                p99_inter_token_latency_ms=w.p99_inter_token_latency_ms,
                p99_time_to_first_token_ms=None if after_backlog else w.p99_time_to_first_token_ms,
                ms_per_token=w.ms_per_token, acceptance_length=w.acceptance_length))
    kept = []
    for revision in serving:
        kept += [o for o in observations if o.revision == revision][-OBSERVATIONS:]
    # A revision's acceptance now: its window's (a saturated one measures it too), else its last observation's.
    acceptance = {o.revision: o.acceptance_length for o in kept if o.acceptance_length is not None}
    acceptance |= {w.revision: w.acceptance_length for w in windows if w.missing is None and w.acceptance_length is not None}
    capacities = []
    for revision in sorted(set(deciding)):
        measured = [Point(o.in_flight_per_replica, o.p99_inter_token_latency_ms, o.p99_time_to_first_token_ms,
                          o.ms_per_token, o.acceptance_length) for o in kept if o.revision == revision]
        model = fit(measured, priors.get(revision, Prior()), acceptance.get(revision))
        if model is not None:
            capacities.append(model)

    measured, missing = demand_of(windows, slo, after_backlog)
    now_s, demand = parse_time(at), None
    history = [p for p in status.demand_history if (now_s - parse_time(p.at)).total_seconds() < TREND_SECONDS]
    if measured is not None:
        history.append(api.DemandPoint(at=at, requests_per_second=measured.requests_per_second))
        points = [((parse_time(p.at) - now_s).total_seconds(), p.requests_per_second) for p in history]
        demand = planned(measured, points, spec.autoscaling.scale_up_stabilization_seconds + startup_seconds)
    # A recommendation sized for other revisions (before a canary started, or ended) is not one for this fleet:
    # the stabilisation windows smooth measurements of the same revisions, not a change of them. While the
    # demand rises beyond the scale-down's tolerance they all hold: a new revision's model, fitted at its
    # canary's share, is read at more load than it measured, and a scale-down can wait.
    revisions = sorted(set(deciding))
    rising = demand is not None and demand.measured_requests_per_second is not None and \
        demand.requests_per_second > demand.measured_requests_per_second * (1 + DOWN_TOLERANCE)
    # Nor is one sized for a backlog that is since served: the replicas that drained it are not the demand's.
    backlog = bool(measured and measured.backlog)
    served = measured is not None and not backlog
    same = [(r.at, r.replicas) for r in status.recommendations
            if (rising or r.revisions in ([], revisions)) and not (r.backlog and served)]
    sized_for = {r.at: r for r in status.recommendations}  # kept as they were sized, this one for these
    decision = decide(current, demand, capacities, slo, limits(spec, profile, canary), spec.autoscaling, same, now, missing)
    queueing = [f"{w.revision} queues {w.waiting_per_replica:.1f} of {w.in_flight_per_replica:.1f} requests per replica"
                for w in windows if w.missing is None and saturated(w)]
    if queueing:  # say why the window's latencies did not move the capacity model
        decision = replace(decision, reason=f"{decision.reason}; {', '.join(queueing)}: demand, not a capacity observation")
    changed = decision.replicas != current
    new_status = api.AutoscalingStatus(
        desired_replicas=decision.replicas,
        last_scale_time=at if changed else status.last_scale_time,
        reason=decision.reason,
        demand_requests_per_second=decision.demand.requests_per_second if decision.demand else None,
        demand_measured_requests_per_second=measured.requests_per_second if measured else None,
        demand_tokens_per_request=decision.demand.tokens_per_request if decision.demand else None,
        backlog_requests=measured.backlog if measured else None,
        predicted_p99_inter_token_latency_ms=decision.predicted_p99_inter_token_latency_ms,
        predicted_p99_time_to_first_token_ms=decision.predicted_p99_time_to_first_token_ms,
        recommendations=[sized_for.get(a) or api.Recommendation(at=a, replicas=n, revisions=revisions, backlog=backlog)
                         for a, n in decision.recommendations],
        observations=sorted(kept, key=lambda o: (o.at, o.revision)),
        demand_history=history,
    )
    return new_status, decision
