"""`specserve simulate`: the shipped scenarios end to end, bad input, determinism, faults, the fleet model."""

import contextlib
import io
import json
from pathlib import Path

import pytest
import yaml
from specserve_operator import replicas, rollout
from specserve_operator.health import FALLBACK_STEPS
from specserve_operator.local import scenario as scenario_module
from specserve_operator.local import fleet_model, simulate
from specserve_operator.replicas import replica_budget, revision_hash
from specserve.cli import main
from specserve_runtime.adaptive import EXPLORE_BUDGET
from specserve_runtime.config import scheduled_tokens
from specserve_runtime.draft_schedule import highest_concurrency, propose, rate
from specserve_runtime.performance import draft_length_curves

SCENARIOS = Path(__file__).resolve().parents[2] / "docs" / "scenarios"
SHIPPED = sorted(path.stem for path in SCENARIOS.glob("*.yaml"))
SUMMARY_KEYS = {"sloAttainment", "sloAttainmentWithinBudget", "costUSD", "tokensPerDollar", "maxHourlyCostUSD",
                "budgetLimitedSeconds", "generatedTokens", "failedRequests"}
_results: dict[str, dict] = {}
_five_seeds: dict[str, dict] = {}


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["simulate", *argv])
    return code, out.getvalue(), err.getvalue()


def result_of(name: str) -> dict:
    """The JSON of a shipped scenario at its own seed (each simulated once per test session)."""
    if name not in _results:
        code, out, err = run("--scenario", str(SCENARIOS / f"{name}.yaml"))
        assert code == 0, err
        _results[name] = json.loads(out.strip().splitlines()[-1])
    return _results[name]


def five_seeds_of(name: str) -> dict:
    """The aggregate JSON of a shipped scenario over seeds 1..5 (each simulated once per test session)."""
    if name not in _five_seeds:
        code, out, err = run("--scenario", str(SCENARIOS / f"{name}.yaml"), "--seeds", "5")
        assert code == 0, err
        _five_seeds[name] = json.loads(out.strip().splitlines()[-1])
    return _five_seeds[name]


def health_interval(doc: dict) -> float:
    return doc["serving"]["speculationHealth"]["intervalSeconds"]


def document(name: str) -> dict:
    return yaml.safe_load((SCENARIOS / f"{name}.yaml").read_text())


def write(tmp_path: Path, doc: dict, name: str = "scenario.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def json_of(path: Path, *extra: str) -> dict:
    code, out, err = run("--scenario", str(path), "--json", *extra)
    assert code == 0, err
    return json.loads(out)


# ---- the shipped scenarios ---------------------------------------------------------------------


def test_the_five_scenarios_are_shipped():
    assert set(SHIPPED) >= {"diurnal-dflash", "dflash-loses-at-high-concurrency", "prometheus-outage-mid-step",
                            "operator-restart-mid-step", "budget-cap-spike"}


@pytest.mark.parametrize("name", SHIPPED)
def test_never_above_the_budget_and_every_run_reports_the_same_keys(name):
    result = result_of(name)
    budget = document(name)["profile"]["limits"]["maxHourlyCostUSD"]
    drifts = any(fault["kind"] == "drift" for fault in document(name).get("faults") or [])
    assert SUMMARY_KEYS | {"decision", "decisionAtSeconds", "speculationDegradedAtSeconds", "seed", "baselines"} | (
        {"afterDrift"} if drifts else set()) == set(result)
    if not drifts:
        assert result["speculationDegradedAtSeconds"] is None  # the live revision's speculation pays throughout
    assert set(result["baselines"]) == {"staticPeak", "inFlight", "hpaRequestRate"}
    for summary in [result, *result["baselines"].values()]:
        assert SUMMARY_KEYS <= set(summary)
        assert 0 < summary["maxHourlyCostUSD"] <= budget
        assert 0 <= summary["sloAttainment"] <= 1
        assert summary["costUSD"] > 0
    # the same requests for every run: all of them generate (almost) the same tokens
    tokens = [s["generatedTokens"] for s in [result, *result["baselines"].values()]]
    assert max(tokens) - min(tokens) <= 0.35 * max(tokens)


def test_diurnal_promotes_and_costs_less_than_provisioning_for_the_peak():
    result = result_of("diurnal-dflash")
    assert result["decision"] == "Promoted"
    assert result["costUSD"] < result["baselines"]["staticPeak"]["costUSD"]
    assert result["sloAttainment"] >= 0.95
    assert result["tokensPerDollar"] > result["baselines"]["staticPeak"]["tokensPerDollar"]


def test_a_candidate_slower_at_high_concurrency_is_aborted():
    result = result_of("dflash-loses-at-high-concurrency")
    assert result["decision"] == "Aborted"
    assert result["decisionAtSeconds"] is not None


def test_a_candidate_that_lost_only_on_speed_serves_until_the_stables_replacements_are_ready():
    """Lossless decoding: its answers are the stable's, so it leaves as the stable's pods become
    ready rather than at once (which left one stable pod carrying the load for a start-up)."""
    scenario = scenario_module.Scenario.model_validate(document("dflash-loses-at-high-concurrency"))
    spec = scenario.serving
    stable, candidate = revision_hash(spec.model, spec.speculator, spec.runtime), replicas.candidate_hash(spec)
    ticks = simulate.simulate(scenario, simulate.arrivals(scenario, scenario.seed), scenario.seed).ticks
    after = [t for t in ticks if t.stage != "Progressing"]
    assert after[0].stage == "RollingBack"
    assert after[0].desired[candidate] >= 1 and after[0].ready[stable] < after[0].desired[stable]
    kept = [t.desired.get(candidate, 0) for t in after]
    assert kept == sorted(kept, reverse=True) and kept[-1] == 0  # it never grows, and it goes
    for tick in after:  # never more than the stable pods still starting
        assert tick.desired.get(candidate, 0) <= max(tick.desired[stable] - tick.ready.get(stable, 0), 0)


def test_a_drift_degrades_the_speculation_in_every_seed_at_its_first_analysis_and_never_before():
    """Acceptance falls from 4.2 to 1.4 at 1800 s, a third of its baseline: a severe fall, so SpeculationDegraded at
    the first analysis whose window the drift fills (the windows that queue behind it judge acceptance all the
    same), not before it, and without waiting for sustainedAnalyses."""
    doc = document("drift-acceptance-falls")
    (drift,), health = doc["faults"], doc["serving"]["speculationHealth"]
    degraded = five_seeds_of("drift-acceptance-falls")["speculationDegradedAtSeconds"]
    assert degraded["seeds"] == 5 and health["sustainedAnalyses"] > 1
    latest = drift["atSeconds"] + 2 * health["intervalSeconds"]  # the analysis at the drift, or the one after it
    assert drift["atSeconds"] < degraded["min"] and degraded["max"] <= latest
    scenario = scenario_module.Scenario.model_validate(doc)
    run_ = simulate.simulate(scenario, simulate.arrivals(scenario, scenario.seed), scenario.seed)
    assert {t.stage for t in run_.ticks if t.t < run_.degraded_at} <= {"Serving", "Pending"}
    assert {t.stage for t in run_.ticks if t.t >= run_.degraded_at} <= {"Degraded", "Pending"}  # Pending: scaling up
    assert run_.ticks[-1].stage == "Degraded"


def test_a_degraded_drafter_falls_back_through_a_canary_and_then_decodes_with_the_headroom_the_drafter_lacks():
    """The same drift with `fallback: {speculator: {method: none}}`: plain decoding is rolled out as a candidate once
    the drafter is degraded (judged at its batch while its queue drains: no interval lost waiting for a window
    without a queue), passes the canary against it and is promoted in every seed. The minutes lost at the drift are
    the same for both fleets; over the hour the fallback meets the SLO at least as often at less cost (more tokens
    per dollar), and once it serves alone it decodes well inside the SLO on no more replicas than the drafter
    needs at its edge."""
    kept, fell_back = five_seeds_of("drift-acceptance-falls"), five_seeds_of("drift-fallback")
    assert fell_back["decisions"] == {"Promoted": 5}
    degraded = fell_back["speculationDegradedAtSeconds"]
    assert degraded["max"] < fell_back["decisionAtSeconds"]["min"]
    startup, (step,) = document("drift-fallback")["startupSeconds"], FALLBACK_STEPS
    # degraded, the canary's pods started, its one step analysed, and the promotion's next tick
    assert fell_back["decisionAtSeconds"]["max"] <= degraded["max"] + startup + step.analysis_seconds + 2 * 60
    assert fell_back["sloAttainment"]["min"] >= kept["sloAttainment"]["min"]
    assert fell_back["costVsStaticPeak"] < kept["costVsStaticPeak"]  # the same staticPeak: the drafter before the drift
    assert fell_back["tokensPerDollarVsInFlight"] > kept["tokensPerDollarVsInFlight"]
    assert fell_back["afterDrift"]["tokensPerDollarVsBest"]["median"] > kept["afterDrift"]["tokensPerDollarVsBest"]["median"]
    late = {}
    for name in ("drift-fallback", "drift-acceptance-falls"):
        scenario = scenario_module.Scenario.model_validate(document(name))
        run_ = simulate.simulate(scenario, simulate.arrivals(scenario, scenario.seed), scenario.seed)
        start = scenario.duration_seconds - 900  # the last quarter hour: both fleets settled
        ticks = [t for t in run_.ticks if t.t > start]
        late[name] = (run_.fleet.truth(start, scenario.duration_seconds)[0], max(sum(t.ready.values()) for t in ticks))
    (fallback_itl, fallback_replicas), (drafter_itl, drafter_replicas) = late["drift-fallback"], late["drift-acceptance-falls"]
    assert fallback_replicas <= drafter_replicas and fallback_itl < 0.8 * drafter_itl
    assert drafter_itl > 0.8 * document("drift-fallback")["profile"]["slo"]["p99InterTokenLatencyMs"]


def test_a_gradual_drift_falls_back_once_the_drafter_is_slower_than_plain_decoding_not_when_its_acceptance_falls(
        tmp_path):
    """drift-gradual.yaml ramps the same drift over 1800 s. The drafter's acceptance falls below minAcceptanceRatio
    early, while it still decodes faster than plain decoding would: a fallback then would lose its canary and not
    be retried, leaving the drafter in place when it later costs more than it saves. The canary starts only after
    the ramp takes the drafter below plain decoding at some batch size, and is promoted in every seed; the fleet
    meets its SLO more often over the hour than the same serving keeping its drafter, and from three intervals after
    the ramp it serves at 0.95 or more of the best tokens per dollar (plain decoding from the start) with the SLO
    met throughout, at the median seed (the recovery target of docs/benchmarks.md), where keeping the drafter stays
    far below."""
    doc = document("drift-gradual")
    scenario = scenario_module.Scenario.model_validate(doc)
    (drift,) = scenario.faults
    plain = {row.concurrency: row.tokens_per_second_per_request for row in scenario.performance.none.curve}

    def slower_than_plain(t: float) -> bool:
        now = drift.drifted(scenario.performance.dflash, t).curve
        return any(row.tokens_per_second_per_request < plain[row.concurrency] for row in now)

    crossover = next(t for t in simulate.tick_times(scenario) if t >= drift.at_seconds and slower_than_plain(t))
    run_ = simulate.simulate(scenario, simulate.arrivals(scenario, scenario.seed), scenario.seed)
    assert run_.degraded_at < crossover  # degraded on its acceptance...
    canary = [t.t for t in run_.ticks if t.stage == "Progressing"]
    assert canary and min(canary) > crossover  # ...but rolled back only once slower than plain decoding
    fell_back = five_seeds_of("drift-gradual")
    assert fell_back["decisions"] == {"Promoted": 5}
    kept = doc["serving"]["speculationHealth"].pop("fallback")
    assert kept == {"speculator": {"method": "none"}}
    code, out, err = run("--scenario", str(write(tmp_path, doc)), "--seeds", "5")
    assert code == 0, err
    keeping = json.loads(out.strip().splitlines()[-1])
    assert fell_back["sloAttainment"]["median"] > keeping["sloAttainment"]["median"]
    recovered, kept_after = fell_back["afterDrift"], keeping["afterDrift"]
    assert recovered["fromSeconds"] == drift.at_seconds + drift.ramp_seconds + 3 * health_interval(doc)
    assert recovered["sloAttainment"]["min"] >= 0.99 and recovered["tokensPerDollarVsBest"]["median"] >= 0.95
    assert kept_after["tokensPerDollarVsBest"]["median"] < 0.85


def test_after_a_drift_the_fleet_is_measured_against_the_fallback_run_from_the_start():
    """afterDrift: from RECOVERY_INTERVALS analysis intervals after the drift (its ramp's end) to the end, the SLO
    met and tokens per dollar, against the same serving running its fallback's speculator from the start on the
    same requests (no drift touches it). Tokens and cost are those of that span alone."""
    doc = document("drift-fallback")
    scenario = scenario_module.Scenario.model_validate(doc)
    (drift,) = scenario.faults
    deadline = simulate.recovery_deadline(scenario)
    assert deadline == drift.at_seconds + simulate.RECOVERY_INTERVALS * scenario.serving.speculation_health.interval_seconds
    best = simulate.best_after_drift(scenario)
    assert best.serving.speculator.method == "none" and best.serving.speculation_health.fallback is None
    result, run_ = simulate.run_all(scenario, 3)
    after = result["afterDrift"]
    assert after["fromSeconds"] == deadline and after["best"]["speculator"] == "none"
    later = [t for t in run_.ticks if t.t > deadline]
    expected_cost = sum(t.hourly_usd for t in later) * scenario.tick_seconds / 3600  # billed pods, tick by tick
    assert run_.fleet.cost_usd(deadline) == pytest.approx(expected_cost, rel=0.05)
    assert round(run_.fleet.generated_tokens()) == result["generatedTokens"]
    assert 0 < run_.fleet.generated_tokens(deadline) < run_.fleet.generated_tokens()
    assert after["tokensPerDollar"] == pytest.approx(run_.fleet.generated_tokens(deadline) / run_.fleet.cost_usd(deadline), rel=1e-3)
    assert after["tokensPerDollarVsBest"] == pytest.approx(after["tokensPerDollar"] / after["best"]["tokensPerDollar"], rel=1e-3)
    assert after["best"]["sloAttainment"] == 1.0  # plain decoding from the start never met the drift
    # the queue at the drift still costs its minutes after the deadline: below the best, not above it
    assert after["tokensPerDollarVsBest"] < 1.0 and after["sloAttainment"] < 1.0
    assert simulate.recovery_deadline(scenario_module.Scenario.model_validate(document("diurnal-dflash"))) is None
    gradual = scenario_module.Scenario.model_validate(document("drift-gradual"))
    (ramp,) = gradual.faults
    assert simulate.recovery_deadline(gradual) == ramp.at_seconds + ramp.ramp_seconds + 3 * 60


@pytest.mark.parametrize("name, seed", [("drift-fallback", 3), ("dflash-loses-at-high-concurrency", 3)])
def test_once_a_rollout_is_over_a_scale_up_is_pending_not_the_rollout_again(name, seed):
    """The rollout's stage stays Promoted (or Aborted) after it ends; the phase says Promoting (RollingBack) only
    while the old revision's (the candidate's) pods remain or the stable is not yet back, so a scale-up an hour
    later is Pending, as any other."""
    scenario = scenario_module.Scenario.model_validate(document(name))
    ticks = simulate.simulate(scenario, simulate.arrivals(scenario, seed), seed).ticks
    rollout_phase = {"drift-fallback": "Promoting", "dflash-loses-at-high-concurrency": "RollingBack"}[name]
    ended = next(i for i, t in enumerate(ticks) if i and ticks[i - 1].stage == rollout_phase and t.stage != rollout_phase)
    later = ticks[ended:]
    scale_ups = [t for t in later if sum(t.ready.values()) < sum(t.desired.values())]
    assert scale_ups, "the seed scales up after its rollout: the case under test"
    assert {t.stage for t in scale_ups} == {"Pending"}
    assert rollout_phase not in {t.stage for t in later}


def test_a_fallback_that_loses_its_canary_is_retried_later_and_promoted():
    """drift-gradual.yaml with minSpeedup 1.5: the fallback starts while the drafter is still faster than plain
    decoding (less than 1.5x), and loses its canary. The drift goes on, the drafter becomes slower, and after the
    back-off (sustainedAnalyses x intervalSeconds x 2) the fallback is rolled out again and promoted."""
    doc = document("drift-gradual")
    doc["serving"]["speculationHealth"]["minSpeedup"] = 1.5
    scenario = scenario_module.Scenario.model_validate(doc)
    health = scenario.serving.speculation_health
    run_ = simulate.simulate(scenario, simulate.arrivals(scenario, 2), 2)
    stages = [(t.t, t.stage) for t in run_.ticks]
    lost = next(t for t, stage in stages if stage == "RollingBack")
    retried = next(t for t, stage in stages if stage == "Progressing" and t > lost)
    assert retried - lost >= health.sustained_analyses * health.interval_seconds * 2
    assert run_.decision == "Promoted" and run_.decision_at > retried


def test_a_fallback_started_by_a_two_minute_dip_loses_its_canary_and_the_drafter_serves_on(tmp_path):
    """drift-transient.yaml: the drift of drift-fallback.yaml lasts two minutes; acceptance at a third of its
    baseline is a severe fall, judged on one analysis. The drafter is degraded at the first analysis of the dip and
    its fallback rolled out; against the recovered drafter the fallback loses its canary in every seed and is not
    retried, so the drafter serves on, healthy. Waiting for three analyses in a row (severeAcceptanceRatio: 0) the
    dip degrades nothing; the false alarm costs neither SLO nor more than a few percent of the hour's cost: the
    canary's pods start in the slots that the replicas bought for the dip's queue take in the run that waits."""
    doc = document("drift-transient")
    dip, recovery = doc["faults"]
    fast = five_seeds_of("drift-transient")
    assert fast["decisions"] == {"Aborted": 5}
    degraded = fast["speculationDegradedAtSeconds"]
    assert degraded["seeds"] == 5 and dip["atSeconds"] < degraded["min"] and degraded["max"] <= recovery["atSeconds"]
    scenario = scenario_module.Scenario.model_validate(doc)
    ticks = simulate.simulate(scenario, simulate.arrivals(scenario, scenario.seed), scenario.seed).ticks
    rolled_back = max(t.t for t in ticks if t.stage == "RollingBack")
    assert {t.stage for t in ticks if t.t > rolled_back} <= {"Serving", "Pending"}  # healthy, and no second canary
    serving = {revision for revision, replicas in ticks[-1].desired.items() if replicas}  # the aborted one kept at 0
    assert serving == set(ticks[0].desired)  # the drafter's revision, as before the dip
    doc["serving"]["speculationHealth"]["severeAcceptanceRatio"] = 0
    code, out, err = run("--scenario", str(write(tmp_path, doc)), "--seeds", "5")
    assert code == 0, err
    default = json.loads(out.strip().splitlines()[-1])
    assert default["decisions"] == {"None": 5} and default["speculationDegradedAtSeconds"] is None
    assert fast["sloAttainment"]["min"] == pytest.approx(default["sloAttainment"]["min"], abs=0.01)
    assert fast["costVsStaticPeak"] == pytest.approx(default["costVsStaticPeak"], rel=0.05)


def test_on_the_embedded_engine_the_pods_stop_drafting_at_the_drift_and_the_fallback_still_replaces_the_drafter():
    """drift-embedded.yaml is drift-fallback.yaml on the embedded engine, whose pods choose their draft length from
    what they measure: from the drift they decode at plain decoding's speed (less what exploring costs), where
    vLLM's pods decode at the drifted drafter's until the fallback replaces them. The operator still degrades the
    drafter and promotes plain decoding in every seed, and the hour meets the SLO more often than on vLLM."""
    embedded, on_vllm = five_seeds_of("drift-embedded"), five_seeds_of("drift-fallback")
    assert embedded["decisions"] == {"Promoted": 5} and embedded["speculationDegradedAtSeconds"]["seeds"] == 5
    assert embedded["sloAttainment"]["min"] > on_vllm["sloAttainment"]["min"]
    itl = {}
    for name in ("drift-embedded", "drift-fallback"):
        scenario = scenario_module.Scenario.model_validate(document(name))
        (drift,) = scenario.faults
        run_ = simulate.simulate(scenario, simulate.arrivals(scenario, scenario.seed), scenario.seed)
        itl[name] = run_.fleet.truth(drift.at_seconds + 60, drift.at_seconds + 120)[0]  # before any new pod is ready
    slowest = scenario.performance.none.curve[-1].tokens_per_second_per_request * (1 - EXPLORE_BUDGET)
    drifted = drift.performance.curve[-1].tokens_per_second_per_request
    assert itl["drift-embedded"] == pytest.approx(1000 / slowest, rel=0.01)  # plain decoding at a full batch
    assert itl["drift-fallback"] == pytest.approx(1000 / drifted, rel=0.01)  # the drifted drafter at a full batch


def test_an_adaptive_revision_decodes_at_the_best_of_its_lengths_and_plain_decoding_at_each_batch_size():
    """fleet_model.speculator_model: the embedded engine without a schedule drafts adaptively; vLLM, or a schedule,
    does not. An adaptive revision's rate at each batch size is the best of plain decoding's, its own length's and the
    measured shorter lengths' (the schedule `propose` gives those curves), times 1 - EXPLORE_BUDGET."""
    performance = scenario_module.Scenario.model_validate(document("draft-schedule")).performance
    curves = draft_length_curves(performance, "dflash")
    assert fleet_model.drafts_adaptively("embedded", "dflash", None)
    assert not fleet_model.drafts_adaptively("vllm", "dflash", None)
    assert not fleet_model.drafts_adaptively("embedded", "none", None)
    schedule = propose(curves)
    assert not fleet_model.drafts_adaptively("embedded", "dflash", schedule)
    drafts = max(k for k in curves if k)
    model = fleet_model.speculator_model("r", "dflash", None, performance, "embedded", drafts)
    assert model.engine == "embedded" and model.schedule == ()
    for batch_size in range(1, highest_concurrency(curves) + 1):
        best = rate(curves[scheduled_tokens(schedule, batch_size)], batch_size)
        assert best >= rate(curves[0], batch_size)  # never slower than plain decoding
        assert model.curve.speed(batch_size) == pytest.approx(best * (1 - EXPLORE_BUDGET))
    fixed = fleet_model.speculator_model("r", "dflash", None, performance, "vllm", drafts)
    assert fixed.curve.speed(1) == performance.dflash.curve[0].tokens_per_second_per_request


def test_an_applied_draft_length_schedule_is_promoted_and_pays_more_than_the_fixed_length_it_replaces(tmp_path):
    """draft-schedule.yaml: `schedule: Apply` rolls the schedule proposed from the bench's draft lengths out as a
    canary candidate against the fixed 7 drafts, promoted in every seed within budget; the same serving proposing only
    keeps 7 drafts and serves the same requests at fewer tokens per dollar."""
    applied = five_seeds_of("draft-schedule")
    doc = document("draft-schedule")
    doc["serving"]["speculationHealth"]["schedule"] = "Propose"
    code, out, err = run("--scenario", str(write(tmp_path, doc)), "--seeds", "5")
    assert code == 0, err
    proposed = json.loads(out.strip().splitlines()[-1])
    assert applied["decisions"] == {"Promoted": 5} and proposed["decisions"] == {"None": 5}
    assert applied["maxHourlyCostUSD"] <= doc["profile"]["limits"]["maxHourlyCostUSD"]
    assert applied["sloAttainment"]["min"] >= 0.99
    assert applied["tokensPerDollarVsInFlight"] > 1.2 * proposed["tokensPerDollarVsInFlight"]  # the same inFlight baseline


def test_an_applied_schedule_never_drafts_more_a_step_than_the_profile_allows():
    """The bench measured 7 drafts, but the tenant's profile allows 3: the schedule the operator proposes and rolls
    out (schedule Apply: 3 drafts alone, none from the load where 3 drafts are slower than plain decoding) drafts at
    most 3 a step in every revision it creates."""
    doc = document("draft-schedule")
    doc["profile"]["limits"]["maxNumSpeculativeTokens"] = 3
    doc["serving"]["speculator"]["numSpeculativeTokens"] = 3
    (three, _) = doc["performance"]["dflash"]["draftLengths"]
    for point, slower in zip(three["curve"][1:], (70, 60, 40, 30)):
        point["tokensPerSecondPerRequest"] = slower
    doc["performance"]["dflash"].update(curve=three["curve"], acceptanceLength=three["acceptanceLength"])  # it runs 3
    scenario = scenario_module.Scenario.model_validate(doc)
    run = simulate.simulate(scenario, simulate.arrivals(scenario, 1), 1)
    created = [m for m in run.fleet.models.values() if m.schedule]
    assert created, "no schedule was rolled out"
    assert all(m.drafts <= 3 and all(r.num_speculative_tokens <= 3 for r in m.schedule) for m in run.fleet.models.values())

def test_a_schedule_drafting_a_length_the_bench_did_not_measure_is_a_scenario_error(tmp_path):
    doc = document("draft-schedule")
    doc["serving"]["speculator"]["numSpeculativeTokensPerBatchSize"] = [
        {"minBatchSize": 1, "maxBatchSize": 4, "numSpeculativeTokens": 5}, {"minBatchSize": 5, "numSpeculativeTokens": 0}]
    code, _, err = run("--scenario", str(write(tmp_path, doc)))
    assert code != 0
    assert "performance.dflash.draftLengths" in err and "[5]" in err


@pytest.mark.parametrize("name", ["prometheus-outage-mid-step", "operator-restart-mid-step"])
def test_nothing_is_promoted_during_the_fault_and_no_step_is_lost(name):
    result = result_of(name)
    (fault,) = document(name)["faults"]
    assert result["decision"] == "Promoted"  # the rollout still completes
    assert result["decisionAtSeconds"] >= fault["atSeconds"] + fault["durationSeconds"]


FASTER_CANDIDATE = ["diurnal-2h-faster-candidate", "diurnal-2h-prometheus-outage", "diurnal-2h-operator-restart"]


@pytest.mark.parametrize("name", FASTER_CANDIDATE)
def test_a_faster_candidate_is_promoted_in_every_seed_at_less_cost_while_the_slo_holds(name):
    """Two hours of a day, a DFlash candidate faster than the EAGLE-3 stable at its first step of 10%, a rollout
    that names no gate: compared at the same arrivals per replica (it holds fewer requests in flight: that is its
    speed), it is promoted in every seed, never inside a fault, the SLO held outside the budget's cap."""
    result = five_seeds_of(name)
    assert result["decisions"] == {"Promoted": 5}, result
    for fault in document(name)["faults"]:
        assert result["decisionAtSeconds"]["min"] >= fault["atSeconds"] + fault["durationSeconds"]
    assert result["sloAttainmentWithinBudget"]["min"] >= 0.99, result
    assert result["costVsStaticPeak"] <= 0.70 and result["tokensPerDollarVsInFlight"] >= 1.15, result


def test_a_slower_candidate_is_aborted_in_every_seed_by_its_gates_and_by_the_defaults(tmp_path):
    assert five_seeds_of("dflash-loses-at-high-concurrency")["decisions"] == {"Aborted": 5}
    doc = document("dflash-loses-at-high-concurrency")
    doc["serving"]["rollout"]["analysis"] = {"intervalSeconds": 60}  # no gate named
    code, out, err = run("--scenario", str(write(tmp_path, doc)), "--seeds", "5")
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["decisions"] == {"Aborted": 5}


def test_a_cold_start_under_load_drains_its_backlog_within_the_budget():
    """From one replica under 18 requests/s: the queue built while replicas start is sized for (drained within the
    SLO's time to first token, up to the budget), so the SLO holds whenever the budget does not cap the fleet. The
    replicas bought for the queue go as it is served, not a scale-down window (300 s) later."""
    result = five_seeds_of("cold-start-under-load")
    assert result["sloAttainmentWithinBudget"]["min"] >= 0.99 and result["budgetLimitedSeconds"]["max"] <= 600, result
    scenario = scenario_module.Scenario.model_validate(document("cold-start-under-load"))
    run_ = simulate.simulate(scenario, simulate.arrivals(scenario, 1), 1)
    ticks = run_.ticks
    assert max(sum(t.desired.values()) for t in ticks if t.t <= 60) == 12  # the budget's cap, within a minute
    assert max(sum(t.desired.values()) for t in ticks if t.t >= 1800) <= 5  # then what 18 requests/s need
    ttft_slo = scenario.profile.slo.p99_time_to_first_token_ms
    served = next(m for m in range(120, 1800, 60) if run_.fleet.truth(m - 60, m)[1] <= ttft_slo)  # the queue's last minute
    assert max(t.t for t in ticks if sum(t.desired.values()) == 12) <= served + 60


def test_during_an_outage_the_autoscaler_measures_the_pods_and_the_rollout_holds(monkeypatch):
    """Prometheus cannot be asked: the canary's analyses are Inconclusive (a step's evidence comes from one
    source), while the autoscaler scales the rising load on windows from the pods' own /metrics, and says so."""
    scenario = scenario_module.Scenario.model_validate(document("diurnal-2h-prometheus-outage"))
    measured_by, events = {}, []
    original = simulate.Operator.tick

    def spy(self, now_s, outage):
        record, tick_events = original(self, now_s, outage)
        measured_by[now_s] = (self.cluster.status().get("autoscaling") or {}).get("measuredBy")
        events.extend((now_s, e) for e in tick_events)
        return record, tick_events

    monkeypatch.setattr(simulate.Operator, "tick", spy)
    simulate.simulate(scenario, simulate.arrivals(scenario, 1), 1)
    (fault,) = scenario.faults
    inside = [t for t in measured_by if fault.at_seconds < t < fault.at_seconds + fault.duration_seconds]
    assert {measured_by[t] for t in inside[1:]} == {"Pods"}  # the first scrape is a baseline
    assert {measured_by[t] for t in measured_by if t < fault.at_seconds} == {"Prometheus"}
    assert any(e.reason == "Scaled" for t, e in events if t in inside[1:])  # the load rose: it scaled
    failed = [e.message for t, e in events if t in inside and e.reason == "MeasurementFailed"]
    assert failed and all("Prometheus unreachable" in m for m in failed)
    assert any(m.endswith("measured the pods' /metrics directly") for m in failed)


def test_prometheus_outage_makes_the_analysis_inconclusive_until_it_ends(monkeypatch):
    """The operator's own outage path runs: every analysis in the outage is Inconclusive, the
    condition MetricsAvailable is False and a MeasurementFailed Event is emitted."""
    scenario = scenario_module.Scenario.model_validate(document("prometheus-outage-mid-step"))
    seen = []
    original = simulate.Operator.tick

    def spy(self, now_s, outage):
        record, events = original(self, now_s, outage)
        status = self.cluster.status()
        last = (status.get("canary") or {}).get("lastAnalysis")
        if last is not None and last["at"] == rollout.timestamp(fleet_model.at(now_s)):
            metrics = next(c for c in status["conditions"] if c["type"] == "MetricsAvailable")
            seen.append((now_s, last["verdict"], " ".join(last["reasons"]), metrics["status"],
                         {e.reason for e in events}))
        return record, events

    monkeypatch.setattr(simulate.Operator, "tick", spy)
    simulate.simulate(scenario, simulate.arrivals(scenario, scenario.seed), scenario.seed)
    fault = scenario.faults[0]
    during = [entry for entry in seen if fault.active(entry[0])]
    assert len(during) == fault.duration_seconds // 60  # one analysis per intervalSeconds
    for _, verdict, why, metrics_available, reasons in during:
        assert verdict == "Inconclusive" and "Prometheus unreachable" in why
        assert metrics_available == "False" and "MeasurementFailed" in reasons
    before = [entry for entry in seen if entry[0] < fault.at_seconds]
    assert before and all(entry[3] == "True" for entry in before)


def test_the_budget_binds_during_the_spike():
    result = result_of("budget-cap-spike")
    assert result["maxHourlyCostUSD"] <= document("budget-cap-spike")["profile"]["limits"]["maxHourlyCostUSD"]
    assert result["budgetLimitedSeconds"] > 0
    assert result["decision"] is None and result["decisionAtSeconds"] is None


def test_after_the_spike_the_backlog_holds_the_replicas_and_then_the_count_comes_down():
    """The spike's windows, hundreds of requests queued per replica, measure the backlog: they are
    demand (what arrived), not capacity observations, so once the backlog is served the count
    returns to what 3 requests/s need instead of the 4-5 replicas those windows used to hold."""
    doc = document("budget-cap-spike")
    scenario = scenario_module.Scenario.model_validate(doc)
    ticks = simulate.simulate(scenario, simulate.arrivals(scenario, scenario.seed), scenario.seed).ticks
    spike_ends = max(point["atSeconds"] for point in doc["load"]["requestsPerSecond"])
    at_the_budget = [t for t in ticks if sum(t.desired.values()) == 6]
    assert at_the_budget and at_the_budget[-1].t > spike_ends  # held while the backlog drained
    last_minutes = [sum(t.desired.values()) for t in ticks if t.t >= doc["durationSeconds"] - 180]
    assert last_minutes and max(last_minutes) <= 2


# ---- determinism and flags ------------------------------------------------------------------


def test_the_same_seed_gives_the_same_json_and_seed_overrides_it(tmp_path):
    path = SCENARIOS / "prometheus-outage-mid-step.yaml"
    first, second = json_of(path), json_of(path)
    assert first == second
    other = json_of(path, "--seed", "99")
    assert other["seed"] == 99 and other != first
    assert json_of(path, "--seed", str(first["seed"])) == first


def test_the_last_stdout_line_is_the_json_and_a_table_goes_to_stderr():
    code, out, err = run("--scenario", str(SCENARIOS / "operator-restart-mid-step.yaml"))
    assert code == 0
    lines = out.strip().splitlines()
    assert len(lines) > 1 and json.loads(lines[-1])["decision"] == "Promoted"
    assert "p99 ITL" in err and "Progressing" in err and "Promoting" in err and "Serving" in err
    assert sum(1 for line in err.splitlines() if line.strip()[:1].isdigit()) == 20  # one row per simulated minute


def test_plot_writes_a_png(tmp_path):
    png = tmp_path / "fleet.png"
    code, _, err = run("--scenario", str(SCENARIOS / "operator-restart-mid-step.yaml"), "--json", "--plot", str(png))
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- faults -------------------------------------------------------------------------------------


def test_an_operator_restart_resumes_the_step_from_status(monkeypatch):
    """Down for 300 s mid-step: nothing reconciles meanwhile; back, the operator (which keeps no state
    but the serving's status) resumes the same step, with its start time, and finishes the rollout:
    no step replayed, none skipped."""
    scenario = scenario_module.Scenario.model_validate(document("operator-restart-mid-step"))
    (fault,) = scenario.faults
    seen = []  # (t, step, stepStartedAt)
    original = simulate.Operator.tick

    def spy(self, now_s, outage):
        record, events = original(self, now_s, outage)
        canary = self.cluster.status().get("canary")
        if canary is not None:
            seen.append((now_s, canary["step"], canary["stepStartedAt"]))
        return record, events

    monkeypatch.setattr(simulate.Operator, "tick", spy)
    run_ = simulate.simulate(scenario, simulate.arrivals(scenario, scenario.seed), scenario.seed)
    assert not [t for t, _, _ in seen if fault.active(t)]
    steps = [step for _, step, _ in seen]
    assert steps == sorted(steps) and set(steps) == set(range(len(scenario.serving.rollout.steps)))
    for step in set(steps):
        assert len({started for _, s, started in seen if s == step}) == 1  # never restarted
    before = [step for t, step, _ in seen if t < fault.at_seconds][-1]
    after = [step for t, step, _ in seen if t >= fault.at_seconds + fault.duration_seconds][0]
    assert after == before  # the step the operator went down in
    assert run_.decision == "Promoted" and run_.decision_at > fault.at_seconds + fault.duration_seconds


def test_node_loss_fails_the_lost_requests_and_the_replicas_come_back(tmp_path):
    doc = document("budget-cap-spike")
    doc["load"]["requestsPerSecond"] = [{"atSeconds": 0, "requestsPerSecond": 8}]
    doc["serving"]["autoscaling"]["enabled"] = False
    doc["serving"]["replicas"]["desired"] = 4
    doc["durationSeconds"] = 600
    scenario = scenario_module.Scenario.model_validate(doc)
    requests = simulate.arrivals(scenario, scenario.seed)
    healthy = simulate.simulate(scenario, requests, scenario.seed)
    doc["faults"] = [{"atSeconds": 200, "kind": "nodeLoss", "durationSeconds": 30}]
    scenario = scenario_module.Scenario.model_validate(doc)
    hurt = simulate.simulate(scenario, requests, scenario.seed)
    lost = [p for p in hurt.fleet.pods if p.removed == 200]
    assert len(lost) == 2  # half of 4
    replacements = [p for p in hurt.fleet.pods if p.created > 0]
    assert [p.created for p in replacements] == [230.0, 230.0]  # after the node is back, then startupSeconds to ready
    assert hurt.fleet.failed_requests() > healthy.fleet.failed_requests()
    assert hurt.fleet.cost_usd() < healthy.fleet.cost_usd()  # 30 s with two replicas fewer billed
    assert all(sum(r.desired.values()) == 4 for r in hurt.ticks)


def test_a_scale_up_within_a_drain_waits_for_the_draining_pods_and_the_budget_holds(monkeypatch):
    """`kubectl scale` from 6 (the budget's count) to 2 and back to 6 fifteen seconds later, while the
    4 removed pods still finish their long requests (billed): the new pods wait for them to go, the
    condition says why, and the fleet never runs more than the budget pays for."""
    doc = document("budget-cap-spike")
    doc["load"] = {"requestsPerSecond": [{"atSeconds": 0, "requestsPerSecond": 1.5}],
                   "promptTokens": 200, "outputTokens": {"mean": 3000, "stddev": 100}}
    doc["serving"]["autoscaling"]["enabled"] = False
    doc["serving"]["replicas"]["desired"] = 6
    doc["durationSeconds"] = 450
    scenario = scenario_module.Scenario.model_validate(doc)
    assert replica_budget(scenario.serving, scenario.profile) == 6
    seen = {}  # t -> (replicas the Deployment has, pods draining, BudgetLimited reason)
    original = simulate.Operator.tick

    def scale_and_watch(self, now_s, outage):
        if now_s in (120, 135):
            replicas = scenario.serving.replicas.model_copy(update={"desired": 2 if now_s == 120 else 6})
            self.cluster.update_spec(scenario.serving.model_copy(update={"replicas": replicas}))
        record, events = original(self, now_s, outage)
        conditions = {c["type"]: c for c in self.cluster.status()["conditions"]}
        seen[now_s] = (sum(record.desired.values()), sum(p.draining for p in self.cluster.fleet.live),
                       conditions["BudgetLimited"]["reason"])
        return record, events

    monkeypatch.setattr(simulate.Operator, "tick", scale_and_watch)
    run_ = simulate.simulate(scenario, simulate.arrivals(scenario, 1), 1)
    assert seen[120] == (2, 4, "MaxHourlyCost")  # replicas.max is 10; the budget pays for 6
    assert seen[135] == (2, 4, "DrainingPods")  # held: 4 still drain
    drained = min(t for t, (_, draining, _) in seen.items() if t > 120 and draining == 0)
    assert drained > 135 and seen[drained] == (6, 0, "MaxHourlyCost")  # all 6 once they are gone, not before
    assert all(replicas + draining <= 6 for replicas, draining, _ in seen.values())
    assert run_.fleet.max_billed == 6


def test_without_autoscaling_the_replicas_stay_at_the_budgeted_count():
    doc = document("budget-cap-spike")
    doc["serving"]["autoscaling"]["enabled"] = False
    doc["serving"]["replicas"]["desired"] = 3
    doc["durationSeconds"] = 300
    scenario = scenario_module.Scenario.model_validate(doc)
    run_ = simulate.simulate(scenario, simulate.arrivals(scenario, 1), 1)
    assert replica_budget(scenario.serving, scenario.profile) == 3
    assert {sum(r.desired.values()) for r in run_.ticks} == {3}


# ---- the fleet model ------------------------------------------------------------------------------


def test_measured_windows_follow_the_curve_and_littles_law():
    """One replica, a flat curve (100 tokens/s per request, no prefill), 100-token outputs at 2 requests/s:
    each request is in the system 0.99 s, so 1.98 in flight; every inter-token latency is 10 ms."""
    doc = document("budget-cap-spike")
    doc.update(durationSeconds=1200, startupSeconds=0)
    doc["serving"]["autoscaling"]["enabled"] = False
    doc["load"] = {"requestsPerSecond": [{"atSeconds": 0, "requestsPerSecond": 2}],
                   "promptTokens": 100, "outputTokens": 100}
    doc["performance"]["eagle3"] = {"acceptanceLength": 2.5, "curve": [
        {"concurrency": 1, "tokensPerSecondPerRequest": 100, "ttftMs": 0},
        {"concurrency": 64, "tokensPerSecondPerRequest": 100, "ttftMs": 0}]}
    scenario = scenario_module.Scenario.model_validate(doc)
    fleet = simulate.Fleet(scenario, simulate.arrivals(scenario, 3), simulate.revision_models(scenario), 3)
    revision = revision_hash(scenario.serving.model, scenario.serving.speculator, scenario.serving.runtime)
    fleet.create(revision, 0.0, ready=True)
    fleet.desired = {revision: 1}
    fleet.advance_to(1200)
    window = fleet.window(revision, 1000, 1200)
    assert window.missing is None and window.ready_replicas == 1
    assert window.in_flight_per_replica == pytest.approx(1.98, rel=0.05)
    assert window.tokens_per_second == pytest.approx(200, rel=0.05)
    assert window.finished_requests == pytest.approx(2000, rel=0.05)
    assert window.p99_inter_token_latency_ms == pytest.approx(10, rel=0.2)  # lognormal noise, sigma 0.05
    assert window.acceptance_length == pytest.approx(2.5)  # decoded tokens over their verify steps
    assert fleet.window(revision, 60, 1200, missing="prometheus outage").missing == "prometheus outage"
    assert window.within_slo is None  # no objectives asked for
    # every token at 10 ms and no wait for the first: all within 20 ms / 100 ms, none within 5 ms
    assert fleet.window(revision, 1000, 1200, itl_objective_ms=20, ttft_objective_ms=100).within_slo == 1.0
    assert fleet.window(revision, 1000, 1200, itl_objective_ms=5).within_slo == 0.0


def test_a_full_batch_queues_and_the_wait_counts_in_ttft():
    doc = document("budget-cap-spike")
    doc.update(durationSeconds=200, startupSeconds=0)
    doc["load"] = {"requestsPerSecond": [{"atSeconds": 0, "requestsPerSecond": 20}],
                   "promptTokens": 100, "outputTokens": 100}
    doc["performance"]["eagle3"] = {"curve": [{"concurrency": 1, "tokensPerSecondPerRequest": 100, "ttftMs": 10}],
                                    "maxConcurrency": 4}
    scenario = scenario_module.Scenario.model_validate(doc)
    fleet = simulate.Fleet(scenario, simulate.arrivals(scenario, 3), simulate.revision_models(scenario), 3)
    revision = next(iter(fleet.models))
    fleet.create(revision, 0.0, ready=True)
    fleet.advance_to(200)
    window = fleet.window(revision, 100, 200)
    # 4 at a time, ~1 s each: ~4 requests/s served of 20 offered; the queue grows without bound
    assert window.finished_requests / 100 == pytest.approx(4, rel=0.1)
    assert window.p99_time_to_first_token_ms > 10_000
    assert window.p99_inter_token_latency_ms == pytest.approx(10, rel=0.2)
    # goodput: the first requests were served within a 1 s objective, none once the queue had grown
    assert fleet.window(revision, 3, 3, ttft_objective_ms=1000).within_slo > 0
    assert fleet.window(revision, 100, 200, ttft_objective_ms=1000).within_slo == 0.0


# ---- bad input ----------------------------------------------------------------------------------


def bad(tmp_path, change) -> tuple[int, str, str]:
    doc = document("diurnal-dflash")
    change(doc)
    return run("--scenario", str(write(tmp_path, doc)))


@pytest.mark.parametrize("change, names", [
    (lambda d: d["load"].update(requestPerSecond=d["load"].pop("requestsPerSecond")), "load.requestPerSecond"),
    (lambda d: d["load"]["requestsPerSecond"][1].update(requestsPerSecond=-4),
     "load.requestsPerSecond[1].requestsPerSecond"),
    (lambda d: d["performance"].pop("dflash"), "performance.dflash"),
    (lambda d: d["serving"]["replicas"].update(min=9), "serving.replicas.min"),
    (lambda d: d["serving"]["rollout"]["candidate"]["speculator"].pop("draftModel"),
     "serving.rollout.candidate.speculator.draftModel"),
    (lambda d: d["performance"]["eagle3"].update(acceptance=3), "performance.eagle3.acceptance"),
    (lambda d: d.update(faults=[{"atSeconds": 5, "kind": "diskFull"}]), "faults[0].kind"),
    (lambda d: d.update(faults=[{"atSeconds": 5, "kind": "drift", "method": "dflash"}]), "faults[0].performance"),
    (lambda d: d.update(faults=[{"atSeconds": 5, "kind": "nodeLoss", "method": "dflash"}]), "faults[0].method"),
    (lambda d: d.update(faults=[{"atSeconds": 5, "kind": "nodeLoss", "rampSeconds": 60}]), "faults[0].rampSeconds"),
    (lambda d: d.update(faults=[{"atSeconds": 5, "kind": "drift", "method": "dflash", "rampSeconds": 60, "performance": {
        "acceptanceLength": 2, "curve": [{"concurrency": 3, "tokensPerSecondPerRequest": 9, "ttftMs": 90}]}}]),
     "faults[0].performance.curve"),
    (lambda d: d["profile"]["limits"].update(allowedMethods=["eagle3"]), "serving.rollout.candidate.speculator.method"),
    (lambda d: d["performance"]["eagle3"]["curve"].reverse(), "performance.eagle3.curve[1].concurrency"),
    # Read as the operator reads a resource: camelCase keys only, no quoted numbers.
    (lambda d: d["serving"]["replicas"].update(max="4"), "serving.replicas.max"),
    (lambda d: d["serving"]["model"].update(served_name=d["serving"]["model"].pop("servedName")),
     "serving.model.servedName"),
])
def test_bad_scenarios_exit_2_naming_the_field_and_simulate_nothing(tmp_path, change, names):
    code, out, err = bad(tmp_path, change)
    assert code == 2
    assert out == ""
    assert names in err, err
    assert all(line.startswith(str(tmp_path / "scenario.yaml")) for line in err.strip().splitlines())


def test_unreadable_and_invalid_yaml_name_the_file(tmp_path):
    missing = tmp_path / "absent.yaml"
    code, out, err = run("--scenario", str(missing))
    assert code == 2 and out == "" and str(missing) in err
    broken = tmp_path / "broken.yaml"
    broken.write_text("load: [1,\n")
    code, out, err = run("--scenario", str(broken))
    assert code == 2 and out == "" and str(broken) in err and "invalid YAML" in err
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n")
    code, out, err = run("--scenario", str(listed))
    assert code == 2 and str(listed) in err


def test_seeds_runs_each_seed_and_aggregates():
    code, out, err = run("--scenario", str(SCENARIOS / "operator-restart-mid-step.yaml"), "--seeds", "2")
    assert code == 0, err
    aggregate = json.loads(out.strip().splitlines()[-1])
    assert aggregate["seeds"] == 2 and aggregate["decisions"] == {"Promoted": 2}
    assert aggregate["sloAttainment"]["min"] <= aggregate["sloAttainment"]["median"] <= 1
    assert [line.split()[0] for line in err.strip().splitlines()[1:]] == ["1", "2"]
    singles = [json_of(SCENARIOS / "operator-restart-mid-step.yaml", "--seed", str(seed)) for seed in (1, 2)]
    assert aggregate["maxHourlyCostUSD"] == max(s["maxHourlyCostUSD"] for s in singles)
    assert run("--scenario", str(SCENARIOS / "operator-restart-mid-step.yaml"), "--seeds", "0")[0] == 2


def test_the_operators_capacity_prior_file_is_a_performance_block(tmp_path):
    """SPECSERVE_CAPACITY_PRIORS: the same `performance` block as a scenario's; a bad one names the file and key."""
    good = write(tmp_path, document("diurnal-dflash")["performance"], "priors.yaml")
    from specserve_operator.capacity import Point
    from specserve_operator.priors import capacity_priors, load_performance
    from specserve_operator.validate import InputProblems

    priors = capacity_priors(load_performance(good))
    assert set(priors) == {"eagle3", "dflash"}
    # a request at concurrency 1 finds no other in flight; ms per token (p99 and mean alike), TTFT, at the
    # acceptance length the table states (the capacity model rescales it to the revision's)
    acceptance = document("diurnal-dflash")["performance"]["dflash"]["acceptanceLength"]
    assert priors["dflash"].points[0] == Point(0, 1000 / 230, 50, 1000 / 230, acceptance)
    assert priors["dflash"].batch == 32  # no maxConcurrency: the curve's highest concurrency
    unstated = document("diurnal-dflash")["performance"]
    del unstated["dflash"]["acceptanceLength"]  # its default (1) is no measurement: nothing to rescale from
    priors = capacity_priors(load_performance(write(tmp_path, unstated, "unstated.yaml")))
    assert {p.acceptance_length for p in priors["dflash"].points} == {None}
    bad = write(tmp_path, {"dflash": {"curve": [{"concurrency": 1, "tokensPerSecond": 5, "ttftMs": 1}]}}, "bad.yaml")
    with pytest.raises(InputProblems) as caught:
        capacity_priors(load_performance(bad))
    assert str(bad) in str(caught.value) and "dflash.curve[0].tokensPerSecond" in str(caught.value)
    with pytest.raises(InputProblems, match="absent.yaml: cannot read"):
        capacity_priors(load_performance(tmp_path / "absent.yaml"))
