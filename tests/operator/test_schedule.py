"""The live revision's draft-length schedule (schedule.py, health.with_schedule): pure, no cluster."""

import pytest
from specserve_runtime.config import parse_schedule
from specserve_runtime.draft_schedule import describe, propose
from specserve_runtime.performance import CurvePoint

from specserve_operator import api
from specserve_operator.capacity import Prior
from specserve_operator.health import with_schedule
from specserve_operator.measure import Window
from specserve_operator.replicas import candidate_hash, revision_hash
from specserve_operator.schedule import (DraftLengths, capacity_prior, exceeds_limit, propose_for, scheduled, within_limit,
                                         worth_applying)

AT = "2026-12-05T10:00:00Z"


def curve(*rates: float) -> list[CurvePoint]:
    return [CurvePoint.model_validate({"concurrency": c, "tokensPerSecondPerRequest": r, "ttftMs": 20.0 * c})
            for c, r in zip((1, 4, 8, 16), rates)]


# The bench: plain decoding, 3 drafts (tau 2.8) and 7 drafts (tau 4.0).
LENGTHS = DraftLengths(curves={0: curve(80, 76, 70, 60), 3: curve(150, 125, 100, 70), 7: curve(200, 120, 70, 45)},
                       acceptance={0: 1.0, 3: 2.8, 7: 4.0}, batch=16)
SEVEN = api.Speculator(method="dflash", draft_model="hf://z-lab/Qwen3-8B-DFlash-b16", num_speculative_tokens=7)


def window(positions: tuple[float, ...], in_flight: float = 8.0, acceptance: float | None = None) -> Window:
    return Window(revision="live", seconds=60, ready_replicas=2, tokens_per_second=800.0, generated_tokens=48000,
                  acceptance_length=acceptance if acceptance is not None else 1 + sum(positions),
                  accepted_per_position=positions, in_flight_per_replica=in_flight)


# Per-position acceptance as the bench measured it: 3 drafts accept 1.8, 7 drafts 3.0.
AS_BENCHED = (0.8, 0.6, 0.4, 0.35, 0.3, 0.3, 0.25)


def test_on_the_bench_s_acceptance_the_proposal_is_the_bench_s_and_its_gain_is_against_the_live_length():
    status = propose_for(None, SEVEN, "live", window(AS_BENCHED), LENGTHS, AT)
    assert status.proposed == propose(LENGTHS.curves)
    assert describe(status.proposed) == "1-3:7,4-:3"
    assert status.predicted_gain == pytest.approx(100 / 70, abs=0.01)  # 3 drafts against 7 at 8 in flight
    assert status.in_flight_per_replica == 8.0 and status.revision == "live" and status.applied is None
    assert "1-3:7,4-:3: 1.43x the live configuration (7 drafts) at 8.00 in flight" in status.reason


def test_when_the_traffic_accepts_less_the_proposal_drafts_less():
    fallen = tuple(a / 2 for a in AS_BENCHED)  # a drift: every position accepts half as often
    status = propose_for(None, SEVEN, "live", window(fallen), LENGTHS, AT)
    assert describe(status.proposed) == "1-3:7,4-7:3,8-:0"  # as benched: 1-3:7,4-:3
    # without per-position counts, the live acceptance length over the bench's at the live length scales every length
    assert propose_for(None, SEVEN, "live", window((), acceptance=1 + sum(fallen)), LENGTHS, AT).proposed == status.proposed


def test_a_proposal_stands_until_a_new_one_is_predicted_faster_at_the_load_measured():
    first = propose_for(None, SEVEN, "live", window(AS_BENCHED), LENGTHS, AT)  # 1-3:7,4-:3
    wobble = tuple(a * 0.7 for a in AS_BENCHED)  # a boundary moves (1-3:7,4-14:3,15-:0), nothing changes at 8
    assert describe(propose_for(None, SEVEN, "live", window(wobble), LENGTHS, AT).proposed) != describe(first.proposed)
    kept = propose_for(first, SEVEN, "live", window(wobble), LENGTHS, AT)
    assert kept.proposed == first.proposed
    busy = propose_for(first, SEVEN, "live", window(wobble, in_flight=16), LENGTHS, AT)  # where they differ
    assert busy.proposed == propose_for(None, SEVEN, "live", window(wobble, in_flight=16), LENGTHS, AT).proposed != first.proposed


def test_a_revision_drafting_by_a_schedule_is_proposed_from_the_bench_s_acceptance():
    """Its counters mix lengths: a fall in them is not read as a fall of any one length's acceptance."""
    live = scheduled(SEVEN, parse_schedule("1-3:7,4-:3"))
    fallen = tuple(a / 2 for a in AS_BENCHED)
    status = propose_for(None, live, "live", window(fallen), LENGTHS, AT)
    assert status.proposed == propose(LENGTHS.curves) == live.num_speculative_tokens_per_batch_size
    assert status.predicted_gain == 1.0 and "the live revision drafts by a schedule" in status.reason


def test_a_window_without_acceptance_or_load_keeps_the_last_proposal_of_the_same_revision():
    status = propose_for(None, SEVEN, "live", window(AS_BENCHED), LENGTHS, AT)
    empty = Window(revision="live", seconds=60, ready_replicas=2, missing="no data")
    assert propose_for(status, SEVEN, "live", empty, LENGTHS, AT) == status
    assert propose_for(status, SEVEN, "another", empty, LENGTHS, AT) is None


def test_a_proposal_is_applied_once_when_it_is_predicted_5_percent_faster_and_differs_from_the_live_schedule():
    status = propose_for(None, SEVEN, "live", window(AS_BENCHED), LENGTHS, AT)
    assert worth_applying(status, "live", SEVEN)
    assert not worth_applying(status, "live", scheduled(SEVEN, status.proposed))  # it runs already
    assert not worth_applying(status, "promoted", SEVEN)  # proposed for the revision before
    assert not worth_applying(status.model_copy(update={"predicted_gain": 1.04}), "live", SEVEN)
    applied = api.AppliedSchedule(generation=1, from_revision="live", at=AT, schedule=status.proposed)
    assert not worth_applying(status.model_copy(update={"applied": applied}), "live", SEVEN)
    assert not worth_applying(None, "live", SEVEN)



def test_only_the_lengths_the_profile_allows_are_proposed_and_one_proposed_beyond_them_is_dropped():
    allowed = within_limit(LENGTHS, 3)
    assert sorted(allowed.curves) == sorted(allowed.acceptance) == [0, 3]
    assert within_limit(LENGTHS, None) == LENGTHS and within_limit(LENGTHS, 2) is None  # nothing left to draft
    assert within_limit(None, 3) is None  # the method has no measured draft lengths
    status = propose_for(None, SEVEN, "live", window(AS_BENCHED), allowed, AT)
    assert max(r.num_speculative_tokens for r in status.proposed) <= 3
    assert not exceeds_limit(status, 3)
    longer = propose_for(None, SEVEN, "live", window(AS_BENCHED), LENGTHS, AT)
    assert max(r.num_speculative_tokens for r in longer.proposed) == 7 and exceeds_limit(longer, 3)
    applied = api.AppliedSchedule(generation=1, from_revision="live", at=AT, schedule=longer.proposed)
    assert exceeds_limit(status.model_copy(update={"applied": applied}), 3)  # applied before the limit was lowered
    assert not exceeds_limit(longer, None) and not exceeds_limit(longer, 7)

def test_a_scheduled_speculator_drafts_as_many_as_its_longest_range():
    schedule = parse_schedule("1-2:7,3-:3")
    three = SEVEN.model_copy(update={"num_speculative_tokens": 3})
    assert scheduled(three, schedule).num_speculative_tokens == 7
    assert scheduled(SEVEN.model_copy(update={"num_speculative_tokens": None}), schedule).num_speculative_tokens == 7
    assert scheduled(SEVEN, parse_schedule("1-:0")).num_speculative_tokens == 7  # at least 1; never lowered
    assert scheduled(SEVEN, schedule).num_speculative_tokens_per_batch_size == schedule


SPEC = api.SpeculativeServingSpec.model_validate({
    "profile": "team-a", "model": {"name": "Qwen/Qwen3-8B", "uri": "hf://Qwen/Qwen3-8B", "servedName": "qwen3-8b"},
    "speculator": SEVEN.model_dump(by_alias=True, exclude_none=True), "speculationHealth": {"schedule": "Apply"}})


def test_an_applied_schedule_is_the_rollout_candidate_while_the_spec_keeps_its_generation():
    stable = revision_hash(SPEC.model, SPEC.speculator, SPEC.runtime)
    schedule = parse_schedule("1-2:7,3-11:3,12-:0")
    status = api.DraftScheduleStatus(revision=stable, proposed=parse_schedule("1-:3"), at=AT,  # a later proposal
                                     applied=api.AppliedSchedule(generation=2, from_revision=stable, at=AT, schedule=schedule))
    runs = with_schedule(SPEC, status, 2)
    assert revision_hash(runs.model, runs.speculator, runs.runtime) == stable
    assert runs.rollout.candidate.speculator == scheduled(SEVEN, schedule)  # what was applied, not the later proposal
    assert candidate_hash(runs) != stable
    assert with_schedule(SPEC, status, 3) == SPEC  # the tenant changed the spec
    assert with_schedule(SPEC, status.model_copy(update={"applied": None}), 2) == SPEC


def test_the_autoscaler_s_prior_for_a_scheduled_revision_is_the_schedule_s_curve():
    method_prior = Prior(batch=16)
    priors = {"dflash": method_prior}
    assert capacity_prior(SEVEN, priors, {"dflash": LENGTHS}, step_gaps=False) is method_prior
    prior = capacity_prior(scheduled(SEVEN, parse_schedule("1-4:7,5-:0")), priors, {"dflash": LENGTHS}, step_gaps=False)
    assert len(prior.points) == 16 and prior.batch == 16
    # a request at batch 1 finds no other in flight: 200 tok/s drafting 7; at batch 8, plain decoding's 70 tok/s
    assert prior.points[0].p99_inter_token_latency_ms == pytest.approx(1000 / 200)
    assert prior.points[7].p99_inter_token_latency_ms == pytest.approx(1000 / 70)
    unmeasured = scheduled(SEVEN, parse_schedule("1-:5"))
    assert capacity_prior(unmeasured, priors, {"dflash": LENGTHS}, step_gaps=False) is method_prior  # 5 drafts were not benched


def test_a_drafter_s_prior_predicts_the_gap_between_its_verify_steps_which_is_what_the_runtimes_measure():
    """vLLM and the runtime observe one inter-token gap per verify step and request: a step yielding 4 tokens comes
    4x the time per token after the last. The prior says so (the operator's default); the time per token, which
    sizes the queue, and the TTFT stay the table's."""
    from specserve_runtime.performance import Performance

    from specserve_operator.priors import capacity_priors
    from specserve_operator.render import Settings

    rows = [{"concurrency": c, "tokensPerSecondPerRequest": r, "ttftMs": 20.0 * c} for c, r in ((1, 200), (8, 70))]
    priors = capacity_priors(Performance.model_validate({"none": {"curve": rows}, "dflash": {"acceptanceLength": 4.0, "curve": rows}}))
    assert Settings().inter_token_latency_per_step  # what the operator runs with; the simulator's windows count per token
    per_token, per_step = capacity_prior(SEVEN, priors, {}, step_gaps=False), capacity_prior(SEVEN, priors, {})
    assert [p.p99_inter_token_latency_ms for p in per_step.points] == pytest.approx([4 * 1000 / 200, 4 * 1000 / 70])
    assert [p.p99_inter_token_latency_ms for p in per_token.points] == pytest.approx([1000 / 200, 1000 / 70])
    assert [(p.ms_per_token, p.p99_time_to_first_token_ms, p.acceptance_length) for p in per_step.points] == \
        [(p.ms_per_token, p.p99_time_to_first_token_ms, p.acceptance_length) for p in per_token.points]
    plain = api.Speculator(method="none")
    assert capacity_prior(plain, priors, {}) == capacity_prior(plain, priors, {}, step_gaps=False) == priors["none"]
    # Under a schedule a step yields the acceptance length of the draft length it gives the batch.
    prior = capacity_prior(scheduled(SEVEN, parse_schedule("1-1:7,2-4:3,5-:0")), priors, {"dflash": LENGTHS})
    assert prior.points[0].p99_inter_token_latency_ms == pytest.approx(4.0 * 1000 / 200)  # batch 1: 7 drafts, tau 4.0
    assert prior.points[2].p99_inter_token_latency_ms == pytest.approx(2.8 * 1000 / (150 + (125 - 150) * 2 / 3))  # 3: tau 2.8
    assert prior.points[7].p99_inter_token_latency_ms == pytest.approx(1000 / 70)  # batch 8: plain decoding


def test_the_bench_s_example_block_gives_the_operator_draft_lengths_and_a_valid_schedule():
    """docs/examples/performance-draft-lengths-embedded-cpu.yaml, written by `specserve bench --propose-schedule`
    (docs/benchmarks.md): on that 2-core CPU every fixed length lost to plain decoding from 4 clients up."""
    from pathlib import Path

    from specserve_runtime.config import schedule_problems, scheduled_tokens

    from specserve_operator.priors import load_performance
    from specserve_operator.schedule import draft_lengths

    example = Path(__file__).resolve().parents[2] / "docs" / "examples" / "performance-draft-lengths-embedded-cpu.yaml"
    lengths = draft_lengths(load_performance(example))["dflash"]
    assert sorted(lengths.curves) == [0, 1, 2, 3]
    schedule = propose(lengths.curves)
    assert schedule_problems(schedule, "dflash", 3, "schedule") == []
    assert scheduled_tokens(schedule, 1) > 0 and [scheduled_tokens(schedule, b) for b in (4, 8, 16, 64)] == [0, 0, 0, 0]
