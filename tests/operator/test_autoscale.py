"""The capacity model and the autoscaler's decision, pure: SLO at least cost, budget wall, no data,
stabilisation, step limits, no flapping on noisy measurements, and state carried in status alone."""

import datetime
import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve_operator import api, autoscale
from specserve_operator.autoscale import (
    DEFAULT_DRAIN_SECONDS,
    HEADROOM, UTILISATION_LIMIT, Demand, Limits, decide, demand_of, in_flight, limits, max_step_down, max_step_up,
    prior_points, tick, trend,
)
from specserve_operator.capacity import OBSERVATIONS, Point, Prior, fit
from specserve_operator.measure import Target, Window

T0 = datetime.datetime(2026, 11, 23, 10, 0, 0, tzinfo=datetime.timezone.utc)
SLO = api.Slo(p99InterTokenLatencyMs=40)
NO_WAIT = api.Autoscaling(enabled=True, scaleUpStabilizationSeconds=0, scaleDownStabilizationSeconds=0)
# A batching engine: 10 ms per token plus 1 ms per request in flight at the p99, 8 + 0.8 ms in the
# mean; 40 ms holds up to ~16 in flight with the margins
LINEAR = [Point(c, 10.0 + 1.0 * c, 100.0 + 10.0 * c, 8.0 + 0.8 * c) for c in (1, 2, 4, 8, 16)]
TOKENS = 100  # generated tokens per request


def rps(value: float) -> Demand:
    return Demand(value, TOKENS)


def capacity(points=LINEAR, measured=()):
    return fit(list(measured), Prior(points))


def test_capacity_fits_a_line_and_widens_with_little_evidence():
    model = capacity()
    assert model.itl.slope == pytest.approx(1.0) and model.itl.intercept == pytest.approx(10.0)
    assert model.margin == pytest.approx(0.5)  # prior only
    many = fit([Point(2, 12.0)] * 15, Prior(LINEAR))
    assert many.margin == pytest.approx(0.2)
    assert many.p99_inter_token_latency_ms(2) < model.p99_inter_token_latency_ms(2)


def test_requests_in_flight_follow_littles_law_on_the_mean_and_saturate():
    """c = rate x T(c), T(c) = tokens x mean time per token at c = A + B c seconds: checked against
    the fixed point directly. The mean, not the p99: the p99 line would predict more in flight."""
    model = capacity()
    assert (model.service.intercept, model.service.slope) == (pytest.approx(8.0), pytest.approx(0.8))
    a, b = TOKENS * 8.0 / 1000, TOKENS * 0.8 / 1000
    for rate in (0.5, 2.0, 5.0):
        c = in_flight(model, rate, TOKENS)
        assert c == pytest.approx(rate * (a + b * c))
    on_the_p99 = capacity([Point(p.in_flight_per_replica, p.p99_inter_token_latency_ms, None, p.p99_inter_token_latency_ms)
                           for p in LINEAR])
    assert in_flight(model, 5.0, TOKENS) == pytest.approx(4.0 / 0.6)  # rate x A / (1 - rate x B)
    assert in_flight(on_the_p99, 5.0, TOKENS) == pytest.approx(5.0 / 0.5)  # half as many more on the p99
    assert in_flight(model, UTILISATION_LIMIT / b * 1.01, TOKENS) is None  # past the utilisation limit
    fewer_replicas = [in_flight(model, rate, TOKENS) for rate in (1.0, 2.0, 4.0)]
    assert fewer_replicas == sorted(fewer_replicas)  # more load per replica: more in flight, superlinearly
    assert fewer_replicas[2] > 4 * fewer_replicas[0]


def test_a_replica_is_never_planned_near_the_engines_batch():
    """Past the batch requests wait for a slot, a queue the lines through the points do not model:
    the prior's batch bounds the load as UTILISATION_LIMIT bounds the utilisation."""
    rows = [{"concurrency": c, "tokensPerSecondPerRequest": 1000 / (8.0 + 0.8 * (c - 1)), "ttftMs": 100} for c in (1, 9)]
    unbounded = fit([], prior_points(rows, max_concurrency=256))
    assert unbounded.batch == 256 and fit([], prior_points(rows)).batch == 9  # else the curve's highest concurrency
    bounded = fit([], prior_points(rows, max_concurrency=8))
    rate = 5.0  # 4 / 0.6 = 6.7 in flight: within 85% of a batch of 8 (6.8)
    assert in_flight(bounded, rate, TOKENS) == pytest.approx(in_flight(unbounded, rate, TOKENS)) == pytest.approx(4.0 / 0.6)
    assert in_flight(bounded, 5.2, TOKENS) is None and in_flight(unbounded, 5.2, TOKENS) is not None  # 7.2 in flight
    slo = api.Slo(p99TimeToFirstTokenMs=10_000)
    bounds = Limits(1, 20, None, 1.0)
    assert decide(1, rps(20.0), [bounded], slo, bounds, NO_WAIT, [], T0).recommended > \
        decide(1, rps(20.0), [unbounded], slo, bounds, NO_WAIT, [], T0).recommended


def test_demand_is_the_arrived_requests_and_their_tokens_over_every_revision():
    windows = [Window("a", 30, 2, generated_tokens=6000, finished_requests=60),
               Window("b", 30, 1, generated_tokens=3000, finished_requests=30)]
    demand, missing = demand_of(windows, api.Slo())
    assert missing is None and demand == Demand(3.0, 100.0)
    assert demand_of([windows[0], Window.no_data(Target(None, "s", "b", 1), 30, "prometheus outage")], api.Slo()) == (
        None, "b: prometheus outage")
    assert demand_of([Window("a", 30, 2, generated_tokens=500, finished_requests=0)], api.Slo())[0] is None  # nothing finished
    # a revision whose pods are all starting serves nothing: the others' windows are the demand
    starting = Window.no_data(Target(None, "s", "b", 0), 30, "no ready replicas")
    assert demand_of([windows[0], starting], api.Slo()) == (Demand(2.0, 100.0), None)
    assert demand_of([starting], api.Slo()) == (None, "b: no ready replicas")
    # saturated (most of the time in the system queued): a queue that grows, more arrived than
    # finished, and the arrivals are the demand
    growing = Window("a", 30, 2, generated_tokens=6000, finished_requests=60, arrived_requests=150,
                     in_flight_per_replica=40, waiting_per_replica=30)
    assert demand_of([growing], api.Slo()) == (Demand(5.0, 100.0), None)
    # a backlog that drains: fewer arrive than finish; the arrivals are the demand, the queue is the
    # backlog's term (what finishes would count it twice)
    draining = Window("a", 30, 2, generated_tokens=6000, finished_requests=60, arrived_requests=15,
                      in_flight_per_replica=40, waiting_per_replica=30, waiting_requests=60)
    assert demand_of([draining], api.Slo()) == (Demand(0.5, 100.0, backlog=60.0), None)
    # keeping up (no queue): what finished is the demand; the gauges' ends are noise
    keeping_up = Window("a", 30, 2, generated_tokens=6000, finished_requests=60, arrived_requests=66,
                        in_flight_per_replica=4, waiting_per_replica=0)
    assert demand_of([keeping_up], api.Slo()) == (Demand(2.0, 100.0), None)
    # ... unless the window before measured a backlog: the last of it finishes in this one
    drained = Window("a", 30, 2, generated_tokens=6000, finished_requests=60, arrived_requests=36,
                     in_flight_per_replica=4, waiting_per_replica=0)
    assert demand_of([drained], api.Slo(), after_backlog=True) == (Demand(1.2, 100.0), None)
    assert demand_of([drained], api.Slo()) == (Demand(2.0, 100.0), None)
    # requests never arrive negatively, whatever the gauges' ends say (a pod gone with its requests in the system)
    gone = replace(drained, arrived_requests=-20)
    assert demand_of([gone], api.Slo(), after_backlog=True) == (Demand(0.0, 100.0), None)


def autoscaled_serving() -> tuple[api.SpeculativeServingSpec, api.ServingProfileSpec]:
    spec = api.SpeculativeServingSpec.model_validate({
        "profile": "p", "model": {"name": "m", "uri": "hf://m", "servedName": "m"},
        "replicas": {"min": 1, "max": 10}, "autoscaling": {"enabled": True}})
    profile = api.ServingProfileSpec.model_validate({
        "tenant": "t", "namespaceSelector": {}, "accelerator": {"pricePerHourUSD": 2.0}, "slo": {"p99InterTokenLatencyMs": 40}})
    return spec, profile


def test_a_saturated_window_is_not_a_capacity_observation():
    spec, profile = autoscaled_serving()

    def window(in_flight, waiting):
        return Window("abc", 30, 2, in_flight_per_replica=in_flight, waiting_per_replica=waiting,
                      p99_inter_token_latency_ms=25.0, generated_tokens=9000, tokens_per_second=300,
                      finished_requests=60, arrived_requests=90)  # saturated or not, a queue grew

    status = api.AutoscalingStatus()
    # a short wait for the batch (a twentieth of the time in the system) is the replica's own curve
    status, decision = tick(status, [window(20.0, 1.0)], ["abc"], {}, spec, profile, profile.slo, 2, False, T0,
                            startup_seconds=120)
    assert [o.in_flight_per_replica for o in status.observations] == [20.0] and "queues" not in decision.reason
    # 300 in flight of which 280 queue: the backlog, not the replica; still demand, not capacity
    status, decision = tick(status, [window(300.0, 280.0)], ["abc"], {}, spec, profile, profile.slo, 2, False,
                            T0 + datetime.timedelta(seconds=30), startup_seconds=120)
    assert [o.in_flight_per_replica for o in status.observations] == [20.0]
    assert status.demand_measured_requests_per_second == 3.0  # saturated: 90 arrived in 30 s
    assert decision.reason.endswith("; abc queues 280.0 of 300.0 requests per replica: demand, not a capacity observation")
    assert status.reason == decision.reason


def test_without_spread_the_model_assumes_fixed_throughput():
    model = fit([Point(3, 30.0, None, 20.0), Point(3, 30.0, None, 20.0)])
    assert model.itl.intercept == 0 and model.itl.slope == pytest.approx(10.0)  # latency proportional to load
    # time in the system: the service of the request and the 3 it finds, so 5 ms per token each
    assert (model.service.intercept, model.service.slope) == (pytest.approx(5.0), pytest.approx(5.0))
    u = 0.5 * TOKENS * 5.0 / 1000  # 0.5 requests/s
    assert in_flight(model, 0.5, TOKENS) == pytest.approx(u / (1 - u))  # the processor-sharing queue


def test_times_per_token_are_rescaled_to_the_acceptance_now():
    """A step costs the same whatever its draft's acceptance; it yields acceptance-length tokens, so a window
    measured at acceptance 4 and one at 2 with the same ms/token disagree by 2x once both are read at 2."""
    then, now = Point(4, 20.0, None, 10.0, acceptance_length=4.0), Point(4, 20.0, None, 10.0, acceptance_length=2.0)
    as_measured = fit([then, now])
    rescaled = fit([then, now], acceptance_length=2.0)
    assert as_measured.service.at(4) == pytest.approx(10.0)
    assert rescaled.service.at(4) == pytest.approx((20.0 + 10.0) / 2)  # the old window at half the tokens per step
    assert rescaled.itl.at(4) == pytest.approx(20.0)  # a step's latency (vLLM's ITL) is not rescaled
    plain = Point(4, 20.0, None, 10.0)  # no drafts (method none): nothing to rescale
    assert fit([plain], acceptance_length=2.0).service.at(4) == pytest.approx(10.0)
    # a prior states the acceptance of its table
    prior = Prior(LINEAR).measured_at(4.0)
    assert fit([], prior, acceptance_length=2.0).service.at(8) == pytest.approx(2 * (8.0 + 0.8 * 8))


def test_a_falling_acceptance_plans_replicas_for_the_acceptance_now():
    """Old windows at a high acceptance overstate a replica's capacity once the drafter accepts less: tick reads
    every kept window at the acceptance of the latest one, so the count follows the drift at once."""
    spec, profile = autoscaled_serving()

    def window(acceptance, ms_per_token_at_4):  # the same demand; the time per token is 4 / acceptance of that at 4
        tokens_per_second = 2 * 4.0 * 1000 / (ms_per_token_at_4 * 4.0 / acceptance)
        return Window("abc", 30, 2, in_flight_per_replica=4.0, p99_inter_token_latency_ms=20.0,
                      generated_tokens=27000, tokens_per_second=tokens_per_second, finished_requests=180,
                      acceptance_length=acceptance)

    def replicas_after(acceptances):
        status = api.AutoscalingStatus()
        for index, acceptance in enumerate(acceptances):
            status, decision = tick(status, [window(acceptance, 10.0)], ["abc"], {}, spec, profile, profile.slo, 2,
                                    False, T0 + datetime.timedelta(seconds=30 * index), startup_seconds=0)
        return decision.recommended

    steady = replicas_after([4.0] * 20)
    dropped = replicas_after([4.0] * 19 + [2.0])
    assert steady >= 3 and dropped >= 2 * steady - 1  # half the tokens per step: about twice the replicas, from one window
    status = api.AutoscalingStatus()
    status, _ = tick(status, [window(3.0, 10.0)], ["abc"], {}, spec, profile, profile.slo, 2, False, T0, startup_seconds=0)
    assert status.observations[0].acceptance_length == 3.0  # kept in status: a restart rescales as before


def test_latency_never_falls_with_load_in_the_model():
    model = fit([Point(1, 50.0), Point(4, 20.0)])  # noise that would fit a falling line
    assert model.itl.slope == 0.0


def predicted_itl(model, demand: float, count: int) -> float | None:
    load = in_flight(model, demand * HEADROOM / count, TOKENS)
    return None if load is None else model.p99_inter_token_latency_ms(load)


def test_the_smallest_count_that_meets_the_slo_is_chosen():
    bounds = Limits(low=1, high=20, budget_cap=None, replica_hourly_usd=2.0)
    decision = decide(3, rps(24.0), [capacity()], SLO, bounds, NO_WAIT, [], T0)
    model = capacity()
    n = decision.replicas
    assert n > 3 and predicted_itl(model, 24.0, n) <= 40
    before = predicted_itl(model, 24.0, n - 1)
    assert before is None or before > 40  # one fewer would break the SLO (or saturate)
    assert decision.recommended == n and "within the SLO" in decision.reason
    assert "24.00 req/s x 100 tokens" in decision.reason


def test_a_backlog_is_sized_to_drain_within_the_time_to_first_token_then_the_demand_alone_sizes():
    """A saturated window's queued requests (vllm:num_requests_waiting at its end) are served within the SLO's TTFT
    on top of the demand; a window that keeps up carries no backlog, whatever its gauge says."""
    slo = api.Slo(p99InterTokenLatencyMs=40, p99TimeToFirstTokenMs=2000)
    queued = Window("a", 30, 2, generated_tokens=6000, finished_requests=60, arrived_requests=150,
                    in_flight_per_replica=40, waiting_per_replica=30, waiting_requests=60)
    demand, _ = demand_of([queued], slo)
    assert (demand.requests_per_second, demand.backlog, demand.drain_seconds) == (5.0, 60, 2.0)
    assert demand.sized_requests_per_second == 5.0 + 60 / 2.0
    bounds = Limits(low=1, high=20, budget_cap=None, replica_hourly_usd=2.0)
    with_backlog = decide(2, demand, [capacity()], slo, bounds, NO_WAIT, [], T0)
    without = decide(2, replace(demand, backlog=0.0), [capacity()], slo, bounds, NO_WAIT, [], T0)
    assert with_backlog.replicas > without.replicas
    assert "a backlog of 60 requests drained within 2 s" in with_backlog.reason
    keeping_up = replace(queued, waiting_per_replica=0.1, waiting_requests=3)
    assert demand_of([keeping_up], slo)[0].backlog == 0.0
    assert demand_of([queued], api.Slo())[0].drain_seconds == DEFAULT_DRAIN_SECONDS  # no TTFT in the SLO


def test_the_budget_is_a_wall_and_says_so():
    spec = api.SpeculativeServingSpec.model_validate({
        "profile": "p", "model": {"name": "m", "uri": "hf://m", "servedName": "m"}, "replicas": {"min": 1, "max": 20}})
    profile = api.ServingProfileSpec.model_validate({
        "tenant": "t", "namespaceSelector": {}, "accelerator": {"pricePerHourUSD": 3.0}, "limits": {"maxReplicas": 20, "maxHourlyCostUSD": 15}})
    bounds = limits(spec, profile, canary=False)
    assert (bounds.low, bounds.high, bounds.budget_cap) == (1, 5, 5)
    decision = decide(5, rps(60.0), [capacity()], SLO, bounds, NO_WAIT, [], T0)
    assert decision.replicas == 5 and decision.budget_limited
    assert "maxHourlyCostUSD pays for 5 replicas ($15.00/h)" in decision.reason
    assert limits(spec, profile, canary=True).low == 2  # one replica of each revision during a canary


def test_no_data_holds_the_current_count():
    bounds = Limits(1, 20, None, 1.0)
    decision = decide(7, None, [capacity()], SLO, bounds, NO_WAIT, [], T0, missing="stable: prometheus outage")
    assert decision.replicas == 7 and decision.recommended is None
    assert "no data (stable: prometheus outage)" in decision.reason


def test_scale_up_waits_for_the_stabilisation_window_and_steps_are_bounded():
    bounds = Limits(1, 100, None, 1.0)
    windows = api.Autoscaling(enabled=True, scaleUpStabilizationSeconds=60, scaleDownStabilizationSeconds=300)
    history = []
    low = decide(2, rps(2.0), [capacity()], SLO, bounds, windows, history, T0)
    history = low.recommendations
    spike = decide(2, rps(60.0), [capacity()], SLO, bounds, windows, history, T0 + datetime.timedelta(seconds=15))
    assert spike.recommended > 6 and spike.replicas == 2  # the low recommendation is still in the 60 s window
    later = decide(2, rps(60.0), [capacity()], SLO, bounds, windows, spike.recommendations, T0 + datetime.timedelta(seconds=90))
    assert later.replicas == min(later.recommended, max_step_up(2)) == 6  # at most double, or +4
    assert max_step_down(10) == 5 and max_step_down(1) == 0


def test_a_clock_with_microseconds_and_no_stabilisation_decides_on_this_recommendation():
    """Recommendations are stored at whole seconds; the operator's clock is not (it crashed on min([]))."""
    bounds = Limits(1, 100, None, 1.0)
    now = T0 + datetime.timedelta(seconds=15, microseconds=250_000)
    decision = decide(2, rps(60.0), [capacity()], SLO, bounds, NO_WAIT, [], now)
    assert decision.replicas == min(decision.recommended, max_step_up(2)) > 2
    quiet = decide(decision.replicas, rps(1.0), [capacity()], SLO, bounds, NO_WAIT, decision.recommendations,
                   now + datetime.timedelta(seconds=30, microseconds=500_000))
    assert quiet.replicas < decision.replicas


def test_scale_down_waits_for_its_window():
    bounds = Limits(1, 100, None, 1.0)
    windows = api.Autoscaling(enabled=True, scaleUpStabilizationSeconds=0, scaleDownStabilizationSeconds=300)
    busy = decide(10, rps(40.0), [capacity()], SLO, bounds, windows, [], T0)
    quiet = decide(busy.replicas, rps(1.0), [capacity()], SLO, bounds, windows, busy.recommendations,
                   T0 + datetime.timedelta(seconds=120))
    assert quiet.recommended < busy.replicas and quiet.replicas == busy.replicas
    after = decide(busy.replicas, rps(1.0), [capacity()], SLO, bounds, windows, quiet.recommendations,
                   T0 + datetime.timedelta(seconds=420))
    assert after.replicas < busy.replicas


def test_recommendations_sized_for_other_revisions_do_not_hold_the_count_unless_demand_rises():
    """The stabilisation windows smooth measurements of the same revisions. A canary's recommendations, sized for
    the worse of two revisions' models, say nothing of the promoted revision alone: after the promotion its own
    recommendation decides at once (still at most halving per decision); while the same revisions decide, the
    scale-down window holds as before, and on a demand rising past the scale-down's tolerance all of them hold."""
    spec, profile = autoscaled_serving()
    spec.autoscaling.scale_down_stabilization_seconds = 300
    # 1 request/s of 100 tokens at 12 ms per token on 8 replicas: 0.15 in flight per replica, one replica is plenty
    window = Window("new", 30, 8, in_flight_per_replica=0.15, p99_inter_token_latency_ms=12.0, generated_tokens=3000,
                    tokens_per_second=100, finished_requests=30)
    prior, later = {"new": Prior(LINEAR)}, T0 + datetime.timedelta(seconds=60)

    def after(recommendation, history=()):
        status = api.AutoscalingStatus(recommendations=[recommendation], demand_history=list(history))
        return tick(status, [window], ["new"], prior, spec, profile, profile.slo, 8, False, later, 0)

    canary = api.Recommendation(at=autoscale.timestamp(T0), replicas=8, revisions=["new", "old"])
    promoted, decision = after(canary)
    assert decision.replicas == 4  # down at once, by the step limit
    assert [r.revisions for r in promoted.recommendations] == [["new"]]
    _, held = after(canary.model_copy(update={"revisions": ["new"]}))
    assert held.replicas == 8 and held.recommended < 8
    assert after(canary.model_copy(update={"revisions": []}))[1].replicas == 8  # a status written before revisions
    rising = [api.DemandPoint(at=autoscale.timestamp(later - datetime.timedelta(seconds=s)), requests_per_second=r)
              for s, r in ((120, 0.2), (90, 0.4), (60, 0.6), (30, 0.8))]
    status, on_the_rise = after(canary, rising)
    assert on_the_rise.demand.measured_requests_per_second == 1.0 and on_the_rise.replicas == 8
    assert [r.revisions for r in status.recommendations] == [["new", "old"], ["new"]]  # each as it was sized


def test_recommendations_sized_for_a_backlog_stop_holding_the_count_once_it_is_served():
    """A backlog's replicas drain it; once a window measures none, the recommendations sized for it say nothing of
    the demand and no longer hold the scale-down window (the count still at most halves per decision). While a
    backlog is still measured they hold it, and each recommendation says whether it was sized for one."""
    spec, profile = autoscaled_serving()
    spec.autoscaling.scale_down_stabilization_seconds = 300
    served = Window("new", 30, 8, in_flight_per_replica=0.15, p99_inter_token_latency_ms=12.0, generated_tokens=3000,
                    tokens_per_second=100, finished_requests=30)
    queued = replace(served, in_flight_per_replica=4.0, waiting_per_replica=2.0, waiting_requests=16)
    prior, later = {"new": Prior(LINEAR)}, T0 + datetime.timedelta(seconds=60)
    drained = api.Recommendation(at=autoscale.timestamp(T0), replicas=8, revisions=["new"], backlog=True)

    def after(window, recommendation=drained):
        status = api.AutoscalingStatus(recommendations=[recommendation])
        return tick(status, [window], ["new"], prior, spec, profile, profile.slo, 8, False, later, 0)

    status, decision = after(served)
    assert decision.replicas == 4  # down at once, by the step limit
    assert [(r.replicas, r.backlog) for r in status.recommendations] == [(decision.recommended, False)]  # dropped
    assert after(served, drained.model_copy(update={"backlog": False}))[1].replicas == 8  # the demand's: it holds
    status, still_queued = after(queued)
    assert still_queued.replicas == 8 and status.recommendations[-1].backlog


def test_the_window_after_a_backlog_sizes_for_what_arrived_not_for_the_drained_queue():
    """The last of a backlog finishes in the window after it: counted as demand it would hold replicas (and read
    as a rising trend) for work that is already served. The status says the last evaluation measured a backlog."""
    spec, profile = autoscaled_serving()
    window = Window("new", 30, 8, in_flight_per_replica=0.15, p99_inter_token_latency_ms=12.0, generated_tokens=3000,
                    tokens_per_second=100, finished_requests=30, arrived_requests=6)

    def demand(status):
        return tick(status, [window], ["new"], {"new": Prior(LINEAR)}, spec, profile, profile.slo, 8, False, T0, 0)[1].demand

    assert demand(api.AutoscalingStatus(backlog_requests=16)).requests_per_second == 0.2
    assert demand(api.AutoscalingStatus()).requests_per_second == 1.0


def test_noisy_measurements_at_steady_demand_do_not_flap():
    """30 minutes of ticks at a steady demand with 10% noise: the count settles and stays."""
    rng = random.Random(7)
    bounds = Limits(1, 50, None, 1.0)
    windows = api.Autoscaling(enabled=True)  # defaults: 60 s up, 300 s down
    current, history, counts = 4, [], []
    for second in range(0, 1800, 15):
        demand = rps(30.0 * rng.uniform(0.9, 1.1))
        decision = decide(current, demand, [capacity()], SLO, bounds, windows, history, T0 + datetime.timedelta(seconds=second))
        current, history = decision.replicas, decision.recommendations
        counts.append(current)
    moves = [b - a for a, b in zip(counts, counts[1:]) if a != b]
    assert len(moves) <= 3, counts
    assert all(move > 0 for move in moves[1:]) or all(move < 0 for move in moves[1:]), counts  # never back and forth


def test_tick_carries_everything_in_status():
    spec, profile = autoscaled_serving()
    prior = {"abc": prior_points([{"concurrency": 1, "tokensPerSecondPerRequest": 100, "ttftMs": 50},
                                  {"concurrency": 8, "tokensPerSecondPerRequest": 50, "ttftMs": 200}])}
    status = api.AutoscalingStatus()
    for index in range(OBSERVATIONS + 5):
        window = Window("abc", 30, 2, in_flight_per_replica=3.0, p99_inter_token_latency_ms=15.0,
                        p99_time_to_first_token_ms=80.0, generated_tokens=9000, tokens_per_second=300,
                        finished_requests=60)
        status, decision = tick(status, [window], ["abc"], prior, spec, profile, profile.slo, 2, False,
                                T0 + datetime.timedelta(seconds=30 * index), startup_seconds=120)
        status = api.AutoscalingStatus.model_validate(status.model_dump(by_alias=True, mode="json"))  # as status stores it
    assert len(status.observations) == OBSERVATIONS  # bounded
    assert status.observations[-1].ms_per_token == pytest.approx(20.0)  # 3 in flight x 2 replicas / 300 tokens/s
    assert status.desired_replicas == decision.replicas
    assert (status.demand_requests_per_second, status.demand_tokens_per_request) == (2.0, 150.0)
    missing = Window("abc", 30, 2, missing="prometheus outage")
    held, no_data = tick(status, [missing], ["abc"], prior, spec, profile, profile.slo, 3, False, T0 + datetime.timedelta(hours=1),
                         startup_seconds=120)
    assert no_data.replicas == 3 and "prometheus outage" in no_data.reason
    assert len(held.observations) == OBSERVATIONS  # nothing recorded from a window without data


def test_the_trend_is_the_least_squares_line_read_ahead():
    line = [(t, 2.0 + 0.1 * t) for t in (-45.0, -30.0, -15.0, 0.0)]
    assert trend(line, 60) == pytest.approx(8.0)  # 2 + 0.1 x 60
    assert trend(line[1:], 60) is None  # too few points to call it a trend
    assert trend([(t, 5.0) for t in (-45.0, -30.0, -15.0, 0.0)], 600) == pytest.approx(5.0)


def test_a_rising_demand_is_planned_for_a_start_up_ahead_and_a_falling_one_is_not():
    spec = api.SpeculativeServingSpec.model_validate({
        "profile": "p", "model": {"name": "m", "uri": "hf://m", "servedName": "m"},
        "replicas": {"min": 1, "max": 40}, "autoscaling": {"enabled": True, "scaleUpStabilizationSeconds": 60}})
    profile = api.ServingProfileSpec.model_validate({
        "tenant": "t", "namespaceSelector": {}, "accelerator": {"pricePerHourUSD": 2.0}, "slo": {"p99InterTokenLatencyMs": 40}})
    prior = {"abc": prior_points([{"concurrency": 1, "tokensPerSecondPerRequest": 100, "ttftMs": 50},
                                  {"concurrency": 8, "tokensPerSecondPerRequest": 50, "ttftMs": 200}])}

    def run(rates):
        status, decisions = api.AutoscalingStatus(), []
        for index, rate in enumerate(rates):
            window = Window("abc", 15, 2, in_flight_per_replica=3.0, p99_inter_token_latency_ms=15.0,
                            p99_time_to_first_token_ms=80.0, generated_tokens=100 * rate * 15, finished_requests=rate * 15)
            status, decision = tick(status, [window], ["abc"], prior, spec, profile, profile.slo, 2, False,
                                    T0 + datetime.timedelta(seconds=15 * index), startup_seconds=120)
            decisions.append(decision)
        return status, decisions

    status, rising = run([2.0 + 0.1 * 15 * i for i in range(20)])  # +0.1 req/s every second
    last = rising[-1].demand
    assert last.measured_requests_per_second == pytest.approx(30.5)
    assert last.requests_per_second == pytest.approx(30.5 + 0.1 * 180)  # 60 s stabilisation + 120 s start-up ahead
    assert "rising trend; measured 30.50 req/s" in rising[-1].reason
    assert len(status.demand_history) == autoscale.TREND_SECONDS // 15  # only the trend window is kept
    _, falling = run([30.0 - 0.1 * 15 * i for i in range(20)])
    assert all(d.demand.measured_requests_per_second is None for d in falling)  # sized on what is measured


# ----- properties over any demand, model and bounds -------------------------------------------------

demands = st.floats(min_value=0.0, max_value=500.0)
slopes = st.floats(min_value=0.5, max_value=50.0)
bounds_ = st.tuples(st.integers(1, 10), st.integers(1, 60), st.one_of(st.none(), st.integers(1, 60))).map(
    lambda t: Limits(min(t[0], t[1], t[2] or t[1]), min(t[1], t[2] or t[1]), t[2], 1.0))


@settings(max_examples=300, deadline=None)
@given(demand=demands, slope=slopes, bounds=bounds_, current=st.integers(0, 80))
def test_decisions_stay_within_bounds_and_the_budget(demand, slope, bounds, current):
    model = fit([], Prior([Point(c, 5 + slope * c) for c in (1, 4)]))
    decision = decide(current, rps(demand), [model], SLO, bounds, NO_WAIT, [], T0)
    assert bounds.low <= decision.replicas <= bounds.high
    if bounds.budget_cap is not None:
        assert decision.replicas <= bounds.budget_cap
    if decision.recommended is not None and not decision.budget_limited and "above the SLO" not in decision.reason:
        assert predicted_itl(model, demand, decision.recommended) <= SLO.p99_inter_token_latency_ms


@settings(max_examples=300, deadline=None)
@given(low=demands, high=demands, slope=slopes)
def test_more_demand_never_recommends_fewer_replicas(low, high, slope):
    low, high = min(low, high), max(low, high)
    model = fit([], Prior([Point(c, 5 + slope * c) for c in (1, 4)]))
    bounds = Limits(1, 200, None, 1.0)
    fewer = decide(1, rps(low), [model], SLO, bounds, NO_WAIT, [], T0).recommended
    more = decide(1, rps(high), [model], SLO, bounds, NO_WAIT, [], T0).recommended
    assert more >= fewer


def test_when_no_count_meets_the_slo_replicas_that_would_not_help_are_not_bought():
    """A floor above the SLO (latency at no load, with a wide margin): going to the maximum would
    predict no better, so the count stops where more replicas improve the prediction by < 5%."""
    floor = [Point(c, 50.0 + 1.0 * c, 100.0) for c in (1, 2, 4, 8, 16)]  # 50 ms at no load: above the 40 ms SLO
    bounds = Limits(1, 40, 40, 1.0)
    decision = decide(4, rps(10.0), [capacity(floor)], SLO, bounds, NO_WAIT, [], T0)
    assert decision.recommended < bounds.high and not decision.budget_limited
    assert "above the SLO at any count; more replicas improve the prediction by less than 5%" in decision.reason
    predicted = [predicted_itl(capacity(floor), 10.0, n) for n in range(1, 41)]
    enough = min(p for p in predicted if p is not None) * (1 + autoscale.FLOOR_TOLERANCE)
    assert predicted[decision.recommended - 1] <= enough
    assert predicted[decision.recommended - 2] is None or predicted[decision.recommended - 2] > enough
    # where more replicas do help all the way, the budget is still the wall and says so
    spike = decide(4, rps(200.0), [capacity()], SLO, Limits(1, 8, 8, 1.0), NO_WAIT, [], T0)
    assert spike.recommended == 8 and spike.budget_limited
