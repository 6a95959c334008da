"""The live revision's continuous analysis, pure: a baseline as it goes live, a sustained fall of
acceptance or of speed against plain decoding degrades it, an outage never does."""

import pytest

from specserve_operator import api
from specserve_operator.capacity import Point, Prior, fit
from specserve_operator.health import (BASELINE_ANALYSES, FALLBACK_STEPS, assess, calls_for_fallback, is_degraded,
                                      retries_fallback, with_fallback)
from specserve_operator.measure import Window

HEALTH = api.SpeculationHealth()  # 0.8 of the baseline's acceptance, no slower than plain decoding, 3 in a row
# Plain decoding: 8 ms per generated token in the system plus 0.8 ms per request in flight per replica.
PLAIN = fit([], Prior([Point(c, 10.0 + c, None, 8.0 + 0.8 * c) for c in (0, 1, 3, 7, 15)]))


def window(acceptance: float | None = 3.0, ms_per_token: float = 7.0, in_flight: float = 4.0, ready: int = 2,
           seconds: float = 60.0, revision: str = "abc123", **fields) -> Window:
    """A revision's window whose requests spend `ms_per_token` in the system per token, at `in_flight` per replica."""
    tokens_per_second = 1000 * in_flight * ready / ms_per_token
    fields = {"waiting_per_replica": 0.0, **fields}
    return Window(revision, seconds, ready, tokens_per_second=tokens_per_second, generated_tokens=tokens_per_second * seconds,
                  acceptance_length=acceptance, in_flight_per_replica=in_flight, **fields)


def run(windows, status=None, plain=PLAIN, health=HEALTH, revision="abc123"):
    for minute, w in enumerate(windows):
        status = assess(status, revision, w, health, plain, f"2026-12-05T10:{minute:02d}:00Z")
    return status


def test_the_baseline_is_the_mean_of_the_first_analyses_and_a_sustained_fall_degrades():
    status = run([window(3.0), window(2.8), window(3.2)])
    assert status.baseline_analyses == BASELINE_ANALYSES and status.baseline_acceptance_length == 3.0
    assert status.last_analysis.verdict == "Healthy" and status.degraded_analyses == 0
    steady = run([window(2.9)] * 5, status)
    assert steady.baseline_acceptance_length == 3.0  # complete: later windows do not move it
    fallen = run([window(2.0)] * 2, status)
    assert fallen.last_analysis.verdict == "Degraded" and fallen.degraded_analyses == 2
    assert not is_degraded(fallen, HEALTH)  # not sustained yet
    fallen = run([window(2.0)], fallen)
    assert is_degraded(fallen, HEALTH)
    assert fallen.last_analysis.acceptance_ratio == 2.0 / 3.0
    assert "acceptanceRatio: 0.67 < 0.8 (acceptance length 2.00, baseline 3.00)" in fallen.last_analysis.reasons
    assert run([window(2.9)], fallen).degraded_analyses == 0  # one healthy analysis clears it


def test_speculation_slower_than_plain_decoding_at_the_load_measured_degrades_at_steady_acceptance():
    """Acceptance can stay flat while concurrency makes every verify step dearer (vLLM discussion #26504):
    the speed against plain decoding at the same load decides, not acceptance alone."""
    status = run([window(3.0)] * BASELINE_ANALYSES)
    busy = run([window(3.0, ms_per_token=25.0, in_flight=15.0)] * 3, status)  # plain: 8 + 0.8 x 15 = 20 ms
    assert is_degraded(busy, HEALTH)
    assert busy.last_analysis.acceptance_ratio == 1.0 and busy.last_analysis.speedup == pytest.approx(20.0 / 25.0)
    assert busy.last_analysis.reasons[1].startswith("speedup: 0.80x < 1x (plain decoding 20 ms per token at 15.00")
    light = run([window(3.0, ms_per_token=5.0, in_flight=1.0)], busy)  # plain: 8.8 ms
    assert light.last_analysis.verdict == "Healthy" and light.last_analysis.speedup == pytest.approx(8.8 / 5.0)
    # the figures a platform team reads: tokens/s per replica and, of those, the goodput (served within the SLO)
    judged = run([window(3.0, ms_per_token=5.0, in_flight=1.0, within_slo=0.9)], busy).last_analysis
    assert judged.tokens_per_second_per_replica == pytest.approx(200.0)
    assert judged.goodput_per_replica == pytest.approx(180.0)
    # Without a prior for plain decoding the speed is not judged: acceptance alone.
    assert not is_degraded(run([window(3.0, ms_per_token=25.0, in_flight=15.0)] * 3, status, plain=None), HEALTH)


def test_windows_without_evidence_neither_count_nor_clear():
    status = run([window(3.0)] * BASELINE_ANALYSES + [window(2.0)] * 2)
    assert status.degraded_analyses == 2
    outage = Window("abc123", 60, 2, missing="measurement failed: connection refused")
    quiet = window(2.0, in_flight=0.02, seconds=10)  # 57 tokens generated: fewer than 100
    held = run([outage, quiet], status)
    assert held.degraded_analyses == 2 and held.last_analysis.verdict == "Inconclusive"
    assert held.baseline_acceptance_length == 3.0
    assert [r.split(":")[0] for r in run([outage], status).last_analysis.reasons] == ["data"]
    assert is_degraded(run([window(2.0)], held), HEALTH)  # the third degraded analysis, the holes between


def test_a_new_live_revision_gets_a_baseline_of_its_own_and_judges_nothing_on_acceptance_before_it():
    status = run([window(3.0)] * BASELINE_ANALYSES + [window(2.0)] * 3)
    assert is_degraded(status, HEALTH)
    promoted = run([window(1.6, revision="def456")], status, revision="def456")
    assert promoted.revision == "def456" and promoted.degraded_analyses == 0
    assert promoted.baseline_analyses == 1 and promoted.baseline_acceptance_length == 1.6
    assert promoted.last_analysis.acceptance_ratio == 1.0
    assert promoted.last_analysis.verdict == "Healthy"  # judged on speed alone while its baseline forms
    unjudged = run([window(1.6, revision="def456")], None, plain=None, revision="def456")
    assert unjudged.last_analysis.verdict == "Inconclusive"
    assert unjudged.last_analysis.reasons == ["acceptanceRatio: baseline from 1 of 3 analyses"]


def test_a_severe_fall_of_acceptance_degrades_at_once_and_holds_until_a_healthy_analysis():
    """Below severeAcceptanceRatio (0.5 of the baseline) one analysis is enough; an outage after it neither clears
    nor counts, a milder degraded analysis keeps it, one healthy analysis clears it. 0 turns the fast path off."""
    status = run([window(3.0)] * BASELINE_ANALYSES)
    mild = run([window(1.8)], status)  # 0.6: degraded, not severe
    assert mild.degraded_analyses == 1 and not mild.severe and not is_degraded(mild, HEALTH)
    fallen = run([window(1.2)], status)  # 0.4
    assert fallen.degraded_analyses == 1 and fallen.severe and is_degraded(fallen, HEALTH)
    outage = Window("abc123", 60, 2, missing="measurement failed: connection refused")
    held = run([outage, window(1.8)], fallen)
    assert held.severe and is_degraded(held, HEALTH) and held.degraded_analyses == 2
    cleared = run([window(2.9)], held)
    assert not cleared.severe and not is_degraded(cleared, HEALTH)
    assert not is_degraded(run([window(1.8)], cleared), HEALTH)  # a mild fall starts over from one
    patient = api.SpeculationHealth(severeAcceptanceRatio=0)
    assert not is_degraded(run([window(1.2)], status, health=patient), patient)
    # While the baseline forms, a ratio is not judged, so nothing is severe.
    forming = run([window(3.0), window(1.0)])
    assert not forming.severe and not is_degraded(forming, HEALTH)
    # A quiet window (about 690 tokens, a few requests) is judged, but cannot act alone.
    quiet = run([window(1.2, in_flight=0.04)], status)
    assert quiet.last_analysis.verdict == "Degraded" and not quiet.severe and not is_degraded(quiet, HEALTH)


def test_severe_must_be_below_min():
    with pytest.raises(ValueError, match=r"severeAcceptanceRatio: 0.8 must be below minAcceptanceRatio \(0.8\)"):
        api.SpeculationHealth(severeAcceptanceRatio=0.8)


def test_thresholds_are_the_spec_s():
    strict = api.SpeculationHealth(minAcceptanceRatio=0.95, sustainedAnalyses=1)
    status = run([window(3.0)] * BASELINE_ANALYSES + [window(2.8)], health=strict)
    assert is_degraded(status, strict) and not is_degraded(run([window(3.0)] * BASELINE_ANALYSES + [window(2.8)]), HEALTH)


def test_a_window_queued_beyond_the_batch_is_judged_at_the_batch_not_on_its_wait():
    """Its time in the system is mostly the backlog's wait, which plain decoding would queue as well: the speed is
    the batch's (the requests decoding, their time per token without the wait) against plain decoding's at that
    batch; its acceptance is the drafter's all the same."""
    status = run([window(3.0)] * BASELINE_ANALYSES)
    # 20 in flight per replica, 17 of them queued: 60 ms per token in the system, 9 ms for the 3 decoding
    fast_batch = run([window(3.0, ms_per_token=60.0, in_flight=20.0, waiting_per_replica=17.0)], status)
    assert fast_batch.last_analysis.verdict == "Healthy"
    assert fast_batch.last_analysis.speedup == pytest.approx((8.0 + 0.8 * 3) / 9.0)  # not 10.4 / 60
    assert fast_batch.last_analysis.reasons[1].startswith(
        "speedup: 1.16x >= 1x (plain decoding 10.4 ms per token at 3.00 decoding (the rest queued) per replica, measured 9)")
    # 5 decoding: 15 ms per token, plain decoding 12 ms
    slow_batch = run([window(3.0, ms_per_token=60.0, in_flight=20.0, waiting_per_replica=15.0)], status)
    assert slow_batch.last_analysis.verdict == "Degraded" and slow_batch.last_analysis.speedup == pytest.approx(0.8)
    fallen = run([window(2.0, ms_per_token=60.0, in_flight=20.0, waiting_per_replica=17.0)], status)
    assert fallen.last_analysis.verdict == "Degraded" and fallen.last_analysis.acceptance_ratio == pytest.approx(2 / 3)


# ---- fallback ----------------------------------------------------------------------------------


def test_a_fallback_is_called_for_once_the_degraded_drafter_measures_slower_than_plain_decoding():
    """Degraded on acceptance while still faster than plain decoding, a drafter would beat its fallback's canary, and
    the lost fallback would not be retried: the fallback waits for a window that measures it slower (a saturated
    one at its batch). Without a prior for plain decoding acceptance alone calls for it."""
    status = run([window(3.0)] * BASELINE_ANALYSES)
    still_faster = run([window(2.0, ms_per_token=5.0, in_flight=1.0)] * 3, status)  # plain: 8.8 ms per token
    assert is_degraded(still_faster, HEALTH) and not calls_for_fallback(still_faster, HEALTH, judges_speed=True)
    assert calls_for_fallback(still_faster, HEALTH, judges_speed=False)
    slower = run([window(2.0, ms_per_token=25.0, in_flight=15.0)], still_faster)  # plain: 20 ms
    assert calls_for_fallback(slower, HEALTH, judges_speed=True)
    queued_fast = run([window(2.0, ms_per_token=60.0, in_flight=20.0, waiting_per_replica=17.0)], still_faster)
    assert is_degraded(queued_fast, HEALTH) and not calls_for_fallback(queued_fast, HEALTH, judges_speed=True)
    queued_slow = run([window(2.0, ms_per_token=60.0, in_flight=20.0, waiting_per_replica=15.0)], still_faster)
    assert calls_for_fallback(queued_slow, HEALTH, judges_speed=True)  # a backlog does not hide a slow batch
    healthy = run([window(3.0, ms_per_token=25.0, in_flight=15.0)] * 2, status)  # slower, but not sustained yet
    assert not calls_for_fallback(healthy, HEALTH, judges_speed=True)

SPEC = api.SpeculativeServingSpec.model_validate({
    "profile": "team-a", "model": {"name": "Qwen/Qwen3-8B", "uri": "hf://Qwen/Qwen3-8B", "servedName": "qwen3-8b"},
    "speculator": {"method": "dflash", "draftModel": "hf://z-lab/Qwen3-8B-DFlash-b16", "numSpeculativeTokens": 15},
    "speculationHealth": {"fallback": {"speculator": {"method": "ngram", "numSpeculativeTokens": 4}}}})


def started(spec: api.SpeculativeServingSpec, degraded: str, generation: int = 3) -> api.FallbackStatus:
    return api.FallbackStatus(generation=generation, from_revision=degraded, at="2026-12-05T10:00:00Z")


def test_a_fallback_that_lost_its_canary_is_retried_while_still_called_for_each_time_twice_as_late():
    """A drift that goes on can make the drafter slower than the fallback that lost to it: once an analysis
    sustainedAnalyses x intervalSeconds x 2^attempts after the loss still calls for the fallback, it is rolled out
    again. Not on an abort by hand, not for another candidate, not while the drafter measures faster."""
    status = run([window(3.0)] * BASELINE_ANALYSES)
    slower = run([window(2.0, ms_per_token=25.0, in_flight=15.0)] * 12, status)  # analyses at minutes 0..11
    faster = run([window(2.0, ms_per_token=5.0, in_flight=1.0)] * 12, status)
    fallback = api.FallbackStatus(generation=3, from_revision="abc123", at="2026-12-05T09:59:00Z")
    lost = api.RolloutRecord(candidate_revision="f00", outcome="Aborted", reason="AnalysisFailed", at="2026-12-05T10:05:00Z")
    assert retries_fallback(fallback, lost, "f00", slower, HEALTH, True)  # 3 x 60 s x 2 = 6 min: the analysis at 10:11
    assert not retries_fallback(fallback.model_copy(update={"attempts": 2}), lost, "f00", slower, HEALTH, True)  # 12 min
    assert not retries_fallback(fallback, lost, "f00", faster, HEALTH, True)
    assert not retries_fallback(fallback, lost.model_copy(update={"reason": "Aborted"}), "f00", slower, HEALTH, True)
    assert not retries_fallback(fallback, lost, "other", slower, HEALTH, True)
    assert not retries_fallback(fallback, lost.model_copy(update={"outcome": "Promoted", "reason": None}), "f00", slower,
                                HEALTH, True)
    assert not retries_fallback(fallback, None, "f00", slower, HEALTH, True)


def test_a_fallback_is_the_rollout_of_the_spec_the_operator_runs_while_the_spec_keeps_its_generation():
    from specserve_operator.replicas import candidate_hash, revision_hash

    stable = revision_hash(SPEC.model, SPEC.speculator, SPEC.runtime)
    assert with_fallback(SPEC, None, 3) == SPEC
    runs = with_fallback(SPEC, started(SPEC, stable), 3)
    assert runs.speculator == SPEC.speculator and runs.runtime == SPEC.runtime  # the degraded revision stays stable
    assert runs.rollout.candidate.speculator == SPEC.speculation_health.fallback.speculator
    assert runs.rollout.steps == FALLBACK_STEPS and runs.rollout.analysis == api.Analysis()  # the default gates
    assert revision_hash(runs.model, runs.speculator, runs.runtime) == stable
    assert candidate_hash(runs) != stable
    assert with_fallback(SPEC, started(SPEC, stable), 4) == SPEC  # the tenant changed the spec: it runs as written
    assert with_fallback(SPEC.model_copy(update={"speculation_health": api.SpeculationHealth()}), started(SPEC, stable), 3) \
        == SPEC.model_copy(update={"speculation_health": api.SpeculationHealth()})


def test_a_promoted_candidate_that_degrades_falls_back_with_the_rollout_s_own_steps_and_gates():
    from specserve_operator.replicas import candidate_hash

    rollout = api.Rollout.model_validate({
        "candidate": {"speculator": {"method": "eagle3", "draftModel": "hf://org/eagle3", "numSpeculativeTokens": 3}},
        "steps": [{"weight": 10, "analysisSeconds": 60}, {"weight": 50}], "analysis": {"minTokensPerDollarGain": 1.1},
        "autoPromote": False})
    spec = SPEC.model_copy(update={"rollout": rollout})
    runs = with_fallback(spec, started(spec, candidate_hash(spec)), 3)
    assert runs.speculator == rollout.candidate.speculator  # the promoted candidate is what degraded
    assert runs.rollout.candidate.speculator.method == "ngram"
    assert (runs.rollout.steps, runs.rollout.analysis, runs.rollout.auto_promote) == (rollout.steps, rollout.analysis, False)


def test_a_fallback_the_profile_does_not_allow_is_refused_naming_the_field(example_documents):
    from specserve_operator.validate import check_against_profile, parse_profile, parse_serving

    by_kind = {d["kind"]: d for d in example_documents}
    body = by_kind["SpeculativeServing"]
    body = {**body, "spec": {**body["spec"], "speculationHealth": {"fallback": {"speculator": {"method": "ngram"}}}}}
    serving, _ = parse_serving(body)
    profile, _ = parse_profile(by_kind["ServingProfile"])
    limits = profile.spec.limits.model_copy(update={"allowed_methods": ["eagle3", "dflash"]})
    strict = profile.__class__(profile.name, profile.spec.model_copy(update={"limits": limits}))
    assert "spec.speculationHealth.fallback.speculator.method: method ngram is not allowed by ServingProfile " \
           "'team-a-h100' (allowed: eagle3, dflash)" in check_against_profile(serving, strict, {"specserve.io/tenant": "team-a"})
