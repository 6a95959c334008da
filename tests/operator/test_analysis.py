"""The canary analysis: one interval's windows -> Pass / Fail / Inconclusive, gate by gate."""

from dataclasses import replace

import pytest

from specserve_operator import api
from specserve_operator.analysis import LOAD_TOLERANCE, MIN_GENERATED_TOKENS, analyse
from specserve_operator.measure import Pricing, Target, Window

GATES = api.Analysis(minAcceptanceLength=2.0, maxP99LatencyRatio=1.05, minTokensPerDollarGain=1.1, maxErrorRate=0.01)
NO_SLO = api.Slo()


def window(revision="s", **fields) -> Window:
    base = dict(revision=revision, seconds=60, ready_replicas=2, tokens_per_second=400.0, generated_tokens=24000,
                p99_inter_token_latency_ms=30.0, p99_time_to_first_token_ms=200.0, acceptance_length=None,
                finished_requests=100, error_rate=0.0, in_flight_per_replica=4.0)
    return Window(**{**base, **fields})


STABLE = window("s", acceptance_length=2.1)
GOOD = window("c", ready_replicas=1, tokens_per_second=300.0, p99_inter_token_latency_ms=20.0, acceptance_length=3.2)


def gate(report, name):
    return next(g for g in report.gates if g.name == name)


def test_a_better_candidate_at_matched_load_passes_every_gate():
    report = analyse(STABLE, GOOD, GATES, NO_SLO, "dflash")
    assert report.verdict == "Pass", report.reasons
    assert [g.name for g in report.gates] == ["errorRate", "acceptanceLength", "p99LatencyRatio", "tokensPerDollarGain"]
    # tokens/$ compares tokens/s per replica (same price per replica): 300/1 vs 400/2
    assert report.tokens_per_dollar_gain == pytest.approx(1.5)
    assert report.latency_ratio == pytest.approx(20 / 30)
    assert "3.2 >= 2" in gate(report, "acceptanceLength").reason


@pytest.mark.parametrize("change, failing", [
    ({"acceptance_length": 1.4}, "acceptanceLength"),
    ({"error_rate": 0.05}, "errorRate"),
    ({"p99_inter_token_latency_ms": 33.0}, "p99LatencyRatio"),
    ({"tokens_per_second": 210.0}, "tokensPerDollarGain"),
])
def test_each_gate_fails_on_its_own_number(change, failing):
    report = analyse(STABLE, replace(GOOD, **change), GATES, NO_SLO, "dflash")
    assert report.verdict == "Fail"
    assert [g.name for g in report.gates if g.verdict == "Fail"] == [failing]


def test_unmatched_load_makes_only_the_comparative_gates_inconclusive():
    light = replace(GOOD, in_flight_per_replica=4.0 * (1 - LOAD_TOLERANCE) - 0.1)  # no arrivals measured
    report = analyse(STABLE, light, GATES, NO_SLO, "dflash")
    assert report.verdict == "Inconclusive"
    assert gate(report, "p99LatencyRatio").verdict == gate(report, "tokensPerDollarGain").verdict == "Inconclusive"
    assert "load not matched" in gate(report, "p99LatencyRatio").reason
    assert gate(report, "acceptanceLength").verdict == "Pass"
    # acceptance length and error rate still decide: a bad drafter fails even at unmatched load
    assert analyse(STABLE, replace(light, acceptance_length=1.1), GATES, NO_SLO, "dflash").verdict == "Fail"
    # a canary offered a third of the stable's arrivals per replica and holding fewer in flight: not comparable
    stable, canary = replace(STABLE, arrived_requests=1200), replace(light, arrived_requests=200)
    assert analyse(stable, canary, GATES, NO_SLO, "dflash").verdict == "Inconclusive"


def test_a_faster_candidate_offered_the_same_arrivals_holds_fewer_in_flight_and_is_compared():
    """Open-loop traffic: the same arrival rate per replica; the candidate, faster, holds half as many requests in
    flight (Little's law). That is the outcome of its speed, not a lighter load: it passes."""
    stable = replace(STABLE, arrived_requests=1200, in_flight_per_replica=4.6)  # 10 per second per replica
    faster = replace(GOOD, arrived_requests=600, in_flight_per_replica=2.3)  # its one replica: 10 per second
    report = analyse(stable, faster, GATES, NO_SLO, "dflash")
    assert report.verdict == "Pass", report.reasons
    assert "arrivals per replica: stable 10/s, candidate 10/s" in gate(report, "p99LatencyRatio").reason


def test_closed_loop_clients_offer_the_same_requests_in_flight():
    """`specserve canary`: each runtime has the same clients, so the faster one completes (and receives) more."""
    stable = replace(STABLE, ready_replicas=1, tokens_per_second=200.0, arrived_requests=300, in_flight_per_replica=4.0)
    faster = replace(GOOD, arrived_requests=500, in_flight_per_replica=4.0)
    report = analyse(stable, faster, GATES, NO_SLO, "dflash")
    assert report.verdict == "Pass" and "in flight per replica" in gate(report, "tokensPerDollarGain").reason


def test_a_light_window_is_matched_within_its_counting_noise():
    """12 and 7 arrivals in a window differ by 42%, well within the noise of counting so few (3 sigma ~ 11)."""
    stable = replace(STABLE, ready_replicas=1, tokens_per_second=200.0, arrived_requests=12, in_flight_per_replica=1.0)
    canary = replace(GOOD, arrived_requests=7, in_flight_per_replica=0.3)
    assert analyse(stable, canary, GATES, NO_SLO, "dflash").verdict == "Pass"
    many = analyse(replace(stable, arrived_requests=1200), replace(canary, arrived_requests=700), GATES, NO_SLO, "dflash")
    assert "load not matched" in gate(many, "p99LatencyRatio").reason  # the same 42% is a real difference here


def test_load_within_tolerance_is_matched():
    near = replace(GOOD, in_flight_per_replica=4.0 * (1 - LOAD_TOLERANCE) + 0.05)
    assert analyse(STABLE, near, GATES, NO_SLO, "dflash").verdict == "Pass"


def test_no_data_is_inconclusive_never_a_pass_or_a_fail():
    missing = Window.no_data(Target("team-a", "qwen", "c", 1), 60, "no series for revision c")
    report = analyse(STABLE, missing, GATES, NO_SLO, "dflash")
    assert report.verdict == "Inconclusive"
    assert report.reasons == ["data: Inconclusive (candidate: no series for revision c)"]


def test_too_few_generated_tokens_is_inconclusive():
    report = analyse(STABLE, replace(GOOD, generated_tokens=MIN_GENERATED_TOKENS - 1, acceptance_length=1.0), GATES,
                     NO_SLO, "dflash")
    assert report.verdict == "Inconclusive" and "tokens <" in report.reasons[0]


def test_nothing_finished_leaves_the_error_rate_inconclusive():
    report = analyse(STABLE, replace(GOOD, finished_requests=0, error_rate=None), GATES, NO_SLO, "dflash")
    assert gate(report, "errorRate").verdict == "Inconclusive" and report.verdict == "Inconclusive"


def test_the_slo_is_a_gate_on_the_candidate():
    slo = api.Slo(p99InterTokenLatencyMs=15, p99TimeToFirstTokenMs=500)
    report = analyse(STABLE, GOOD, GATES, slo, "dflash")
    assert gate(report, "sloInterTokenLatency").verdict == "Fail"
    assert gate(report, "sloTimeToFirstToken").verdict == "Pass"
    assert report.verdict == "Fail"


def test_gate_reasons_print_large_figures_whole():
    report = analyse(STABLE, replace(GOOD, p99_time_to_first_token_ms=1234.5), GATES,
                     api.Slo(p99TimeToFirstTokenMs=1500), "dflash")
    assert gate(report, "sloTimeToFirstToken").reason == "1234ms <= 1500ms"


def test_a_rollout_that_names_no_gate_still_fails_a_measurably_worse_candidate():
    defaults = api.Analysis()
    assert analyse(STABLE, GOOD, defaults, NO_SLO, "dflash").verdict == "Pass"
    slower = analyse(STABLE, replace(GOOD, p99_inter_token_latency_ms=95.0), defaults, NO_SLO, "dflash")
    assert [g.name for g in slower.gates if g.verdict == "Fail"] == ["p99LatencyRatio"]
    costlier = analyse(STABLE, replace(GOOD, tokens_per_second=185.0), defaults, NO_SLO, "dflash")
    assert [g.name for g in costlier.gates if g.verdict == "Fail"] == ["tokensPerDollarGain"]
    untrained = analyse(STABLE, replace(GOOD, acceptance_length=1.05), defaults, NO_SLO, "dflash")
    assert [g.name for g in untrained.gates if g.verdict == "Fail"] == ["acceptanceLength"]
    assert gate(untrained, "acceptanceLength").reason == f"1.05 < {api.DEFAULT_MIN_ACCEPTANCE_LENGTH}"
    # no acceptance floor for a candidate that drafts nothing; a user loosens a gate by setting it
    plain = analyse(STABLE, replace(GOOD, acceptance_length=None), defaults, NO_SLO, "none")
    assert "acceptanceLength" not in [g.name for g in plain.gates] and plain.verdict == "Pass"
    loose = api.Analysis(maxP99LatencyRatio=4.0, minAcceptanceLength=1.0)
    assert analyse(STABLE, replace(GOOD, p99_inter_token_latency_ms=95.0, acceptance_length=1.05), loose, NO_SLO,
                   "dflash").verdict == "Pass"


def test_pricing_gives_hourly_cost_and_tokens_per_dollar():
    priced = window(tokens_per_second=500.0, ready_replicas=2).priced(Pricing(1, 2.5))
    assert priced.hourly_cost_usd == 5.0
    assert priced.tokens_per_dollar == pytest.approx(500 / (5.0 / 3600))
    assert window().priced(Pricing(1, 0.0)).tokens_per_dollar is None  # free accelerators: undefined, not infinite
