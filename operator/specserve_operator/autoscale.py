"""The autoscaler's decision: how many replicas a serving runs. Pure: no I/O, the clock is a parameter.

Objective. At a given demand the tokens served per second are fixed by the demand, so the count
that maximises tokens per dollar is the smallest one whose predicted p99s meet the SLO: for each
count n within the bounds, the per-replica load is the measured demand (requests in flight,
summed over revisions) times HEADROOM, divided by n, and every running revision's capacity model
(capacity.py) must predict a p99 inter-token latency, and time to first token when the SLO sets
one, within the SLO at that load. During a canary the autoscaler sizes the total and the rollout's
weight splits it (render.split_replicas): one writer of replicas; both revisions see the same
per-replica load, so the worse of their two models decides.

Bounds: spec.replicas.min / max, the profile's maxReplicas, and as many replicas as the profile's
maxHourlyCostUSD pays for (never exceeded; when the SLO needs more, BudgetLimited with the numbers).

Stability, as the HPA does it: recommendations are kept for the stabilisation windows; a scale up
goes to the lowest recommendation of the last scaleUpStabilizationSeconds (a spike must last), a
scale down to the highest of the last scaleDownStabilizationSeconds, and only to a count that
would also hold DOWN_TOLERANCE (10%) more demand; one decision moves at most double (or +4) up and
half down. No data holds the current count.
"""

import datetime
import math
from dataclasses import dataclass, field

from . import api
from .capacity import OBSERVATIONS, Capacity, Point, fit
from .measure import Window
from .rollout import parse_time, timestamp

HEADROOM = 1.2  # plan for 20% more load than measured
DOWN_TOLERANCE = 0.1  # like the HPA's tolerance: noise around a boundary must not flap the count


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
    demand: float | None = None  # requests in flight, all revisions
    predicted_p99_inter_token_latency_ms: float | None = None
    predicted_p99_time_to_first_token_ms: float | None = None
    recommendations: list[tuple[str, int]] = field(default_factory=list)  # (at, replicas), the windows' worth


def _predict(capacities: list[Capacity], load: float) -> tuple[float, float | None]:
    itl = max(c.p99_inter_token_latency_ms(load) for c in capacities)
    ttfts = [t for t in (c.p99_time_to_first_token_ms(load) for c in capacities) if t is not None]
    return itl, (max(ttfts) if ttfts else None)


def _meets(slo: api.Slo, itl: float, ttft: float | None) -> bool:
    if slo.p99_inter_token_latency_ms is not None and itl > slo.p99_inter_token_latency_ms:
        return False
    return slo.p99_time_to_first_token_ms is None or ttft is None or ttft <= slo.p99_time_to_first_token_ms


def recommend(demand: float, capacities: list[Capacity], slo: api.Slo, bounds: Limits) -> tuple[int, bool, float, float | None]:
    """(replicas, SLO met, predicted p99 ITL, predicted p99 TTFT) for the smallest count that meets the SLO."""
    for count in range(max(bounds.low, 1), bounds.high + 1):
        itl, ttft = _predict(capacities, demand * HEADROOM / count)
        if _meets(slo, itl, ttft):
            return count, True, itl, ttft
    top = max(bounds.high, 1)
    itl, ttft = _predict(capacities, demand * HEADROOM / top)
    return bounds.high, False, itl, ttft


def decide(
    current: int,
    demand: float | None,
    capacities: list[Capacity],
    slo: api.Slo,
    bounds: Limits,
    autoscaling: api.Autoscaling,
    recommendations: list[tuple[str, int]],
    now: datetime.datetime,
    missing: str | None = None,
) -> ScaleDecision:
    """The replica count for all revisions together. `demand` is the measured requests in flight
    (None, with `missing` saying why, when there is no data)."""
    if demand is None or not capacities:
        why = missing or "no capacity model yet"
        held = min(max(current, bounds.low), bounds.high)
        return ScaleDecision(held, None, f"holding {held} replicas: no data ({why})", recommendations=recommendations)
    if slo.p99_inter_token_latency_ms is None and slo.p99_time_to_first_token_ms is None:
        return ScaleDecision(bounds.low, bounds.low, f"no SLO to size against: replicas.min ({bounds.low})", demand=demand)

    raw, met, itl, ttft = recommend(demand, capacities, slo, bounds)
    if raw < current:  # hysteresis: scale down only to a count that would also hold DOWN_TOLERANCE more demand
        raw = min(recommend(demand * (1 + DOWN_TOLERANCE), capacities, slo, bounds)[0], current)
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

    ttft_text = f", p99 TTFT {ttft:.0f}ms" if ttft is not None else ""
    numbers = f"demand {demand:.1f} in flight (x{HEADROOM} headroom): {raw} replicas predict p99 ITL {itl:.1f}ms{ttft_text}"
    budget_limited = not met and bounds.budget_cap is not None and bounds.high == bounds.budget_cap
    if budget_limited:
        reason = (f"{numbers}, above the SLO; maxHourlyCostUSD pays for {bounds.budget_cap} replicas "
                  f"(${bounds.budget_cap * bounds.replica_hourly_usd:.2f}/h)")
    elif not met:
        reason = f"{numbers}, above the SLO even at the maximum of {bounds.high} replicas"
    else:
        reason = f"{numbers} within the SLO"
    if target != raw:
        reason += f"; at {target} (stabilisation and step limits from {current})"
    return ScaleDecision(target, raw, reason, budget_limited, demand, itl, ttft, kept)


def prior_points(performance: list[dict] | None) -> list[Point]:
    """Capacity prior from a performance table: rows of {concurrency, tokensPerSecondPerRequest, ttftMs}
    (the simulator's scenario `performance.<method>.curve`, as `specserve bench --emit-performance` writes it)."""
    return [Point(row["concurrency"], 1000.0 / row["tokensPerSecondPerRequest"], row.get("ttftMs"))
            for row in performance or [] if row["tokensPerSecondPerRequest"] > 0]


def tick(
    status: api.AutoscalingStatus,
    windows: list[Window],
    priors: dict[str, list[Point]],
    spec: api.SpeculativeServingSpec,
    profile: api.ServingProfileSpec,
    slo: api.Slo,
    current: int,
    canary: bool,
    now: datetime.datetime,
) -> tuple[api.AutoscalingStatus, ScaleDecision]:
    """One autoscaling step for a serving: record this tick's windows (one per running revision) as
    capacity observations, fit each revision's model, decide. The operator and `specserve simulate`
    both call this; everything it needs next time is in the returned status."""
    at = timestamp(now)
    running = {w.revision for w in windows}
    observations = [o for o in status.observations if o.revision in running]
    for w in windows:
        if w.missing is None and w.p99_inter_token_latency_ms is not None and w.in_flight_per_replica is not None:
            observations.append(api.CapacityObservation(
                revision=w.revision, at=at, in_flight_per_replica=w.in_flight_per_replica,
                p99_inter_token_latency_ms=w.p99_inter_token_latency_ms,
                p99_time_to_first_token_ms=w.p99_time_to_first_token_ms))
    kept = []
    for revision in running:
        kept += [o for o in observations if o.revision == revision][-OBSERVATIONS:]
    capacities = []
    for revision in sorted(running):
        measured = [Point(o.in_flight_per_replica, o.p99_inter_token_latency_ms, o.p99_time_to_first_token_ms)
                    for o in kept if o.revision == revision]
        model = fit(measured, priors.get(revision, []))
        if model is not None:
            capacities.append(model)

    missing = [f"{w.revision}: {w.missing}" for w in windows if w.missing is not None]
    demand = None if missing or not windows else sum((w.in_flight_per_replica or 0) * w.ready_replicas for w in windows)
    decision = decide(current, demand, capacities, slo, limits(spec, profile, canary), spec.autoscaling,
                      [(r.at, r.replicas) for r in status.recommendations], now, "; ".join(missing) or None)
    changed = decision.replicas != current
    new_status = api.AutoscalingStatus(
        desired_replicas=decision.replicas,
        last_scale_time=at if changed else status.last_scale_time,
        reason=decision.reason,
        demand=decision.demand,
        predicted_p99_inter_token_latency_ms=decision.predicted_p99_inter_token_latency_ms,
        predicted_p99_time_to_first_token_ms=decision.predicted_p99_time_to_first_token_ms,
        recommendations=[api.Recommendation(at=a, replicas=n) for a, n in decision.recommendations],
        observations=sorted(kept, key=lambda o: (o.at, o.revision)),
    )
    return new_status, decision
