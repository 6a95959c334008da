"""The rollout state machine, driven interval by interval with a simulated clock and scripted verdicts."""

import datetime

from specserve_operator import api
from specserve_operator.analysis import Report
from specserve_operator.measure import Window
from specserve_operator.rollout import (
    ABORT, HISTORY_LENGTH, INCONCLUSIVE_LIMIT, PROMOTE, RETRY, analysis_due, decide, timestamp,
)

T0 = datetime.datetime(2026, 11, 23, 10, 0, 0, tzinfo=datetime.timezone.utc)
ROLLOUT = api.Rollout.model_validate({
    "candidate": {"speculator": {"method": "dflash", "draftModel": "hf://z/d", "numSpeculativeTokens": 7}},
    "steps": [{"weight": 10, "analysisSeconds": 120}, {"weight": 50, "analysisSeconds": 60}],
    "analysis": {"intervalSeconds": 60, "failureLimit": 2},
})


def report(verdict: str, error_rate: float | None = 0.0) -> Report:
    stable = Window("s", 60, 1, acceptance_length=None)
    candidate = Window("c", 60, 1, acceptance_length=3.0, error_rate=error_rate)
    return Report(verdict, (), stable, candidate, 0.9, 1.3)


class Run:
    """Carries the state between calls exactly as the operator does: through status alone."""

    def __init__(self, rollout=ROLLOUT):
        self.rollout, self.canary, self.last, self.now = rollout, None, None, T0

    def step(self, verdict: str | None = None, annotations=None, seconds=0, candidate="c", error_rate=0.0):
        self.now += datetime.timedelta(seconds=seconds)
        due = analysis_due(self.rollout, self.canary, candidate, self.now, self.last)
        decision = decide(self.rollout, "s", candidate, self.canary, self.last, annotations or {},
                          report(verdict, error_rate) if verdict and due else None, self.now)
        self.canary, self.last = decision.canary, decision.last_rollout
        return decision


def test_no_rollout_or_a_candidate_equal_to_stable_is_stable():
    assert decide(None, "s", None, None, None, {}, None, T0).stage == "Stable"
    assert decide(ROLLOUT, "s", "s", None, None, {}, None, T0).stage == "Stable"


def test_passing_intervals_walk_the_steps_then_promote():
    run = Run()
    first = run.step()
    assert first.stage == "Canary" and first.weight == 10 and first.canary.step_started_at == timestamp(T0)
    assert [e.reason for e in first.events] == ["RolloutStarted"]
    assert run.step("Pass", seconds=60).weight == 10  # step 0 holds for 120 s
    advanced = run.step("Pass", seconds=60)
    assert advanced.weight == 50 and advanced.canary.step == 1 and [e.reason for e in advanced.events] == ["StepAdvanced"]
    assert run.step("Pass", seconds=30).weight == 50  # not due: 30 s since the last analysis
    promoted = run.step("Pass", seconds=30)
    assert promoted.stage == "Promoted" and promoted.last_rollout.outcome == "Promoted"
    assert promoted.last_rollout.candidate_revision == "c" and promoted.canary is None
    assert run.step(seconds=600).stage == "Promoted"  # stays promoted, with nothing more to decide


def test_failure_limit_consecutive_fails_abort_with_the_numbers():
    run = Run()
    run.step()
    once = run.step("Fail", seconds=60)
    assert once.stage == "Canary" and once.canary.failed_checks == 1
    assert once.events[0].type == "Warning" and "1/2 failed" in once.events[0].message
    aborted = run.step("Fail", seconds=60)
    assert aborted.stage == "Aborted" and aborted.last_rollout.outcome == "Aborted"
    assert aborted.conditions["RolloutAborted"][:2] == (True, "AnalysisFailed")
    assert "failed 2 times in a row" in aborted.last_rollout.message
    assert len(aborted.canary.history) == 2  # kept for inspection
    # not retried while the candidate is unchanged, however long
    assert run.step("Pass", seconds=3600).stage == "Aborted"


def test_a_candidate_that_lost_without_errors_drains_and_the_abort_reason_holds_after_the_abort():
    run = Run()
    run.step()
    run.step("Fail", seconds=60)
    aborted = run.step("Fail", seconds=60)
    assert aborted.stage == "Aborted" and aborted.last_rollout.reason == "AnalysisFailed"
    assert aborted.drain_candidate  # lossless: it answers as the stable would while the stable's pods start
    later = run.step(seconds=60)  # rebuilt from status alone: the same reason and the same drain
    assert later.conditions["RolloutAborted"][:2] == (True, "AnalysisFailed") and later.drain_candidate


def test_a_candidate_with_errors_or_aborted_by_hand_leaves_at_once():
    run = Run()
    run.step()
    run.step("Fail", seconds=60, error_rate=0.2)
    assert not run.step("Fail", seconds=60, error_rate=0.2).drain_candidate  # maxErrorRate 0.01 failed
    by_hand = Run()
    by_hand.step()
    by_hand.step("Fail", seconds=60)
    aborted = by_hand.step(annotations={ABORT: "true"}, seconds=5)
    assert aborted.last_rollout.reason == "Aborted" and not aborted.drain_candidate


def test_a_pass_resets_the_consecutive_fails():
    run = Run()
    run.step()
    run.step("Fail", seconds=60)
    assert run.step("Pass", seconds=60).canary.failed_checks == 0
    assert run.step("Fail", seconds=60).stage == "Canary"


def test_inconclusive_holds_the_step_and_raises_a_condition():
    run = Run()
    run.step()
    for index in range(1, INCONCLUSIVE_LIMIT + 2):
        decision = run.step("Inconclusive", seconds=60)
        assert decision.stage == "Canary" and decision.canary.step == 0  # never advances, never promotes
        assert decision.conditions["AnalysisInconclusive"][0] is (index >= INCONCLUSIVE_LIMIT)
    assert decision.canary.inconclusive_checks == INCONCLUSIVE_LIMIT + 1
    # Held 120 s+ already, but time without evidence completes nothing: step 0 needs 2 passes.
    assert run.step("Pass", seconds=60).canary.step == 0
    assert run.step("Pass", seconds=60).canary.step == 1


def test_inconclusive_analyses_neither_count_nor_erase_the_passes_before_them():
    run = Run()
    run.step()
    assert run.step("Pass", seconds=60).canary.passed_checks == 1
    held = run.step("Inconclusive", seconds=60)
    assert held.canary.step == 0 and held.canary.passed_checks == 1  # an outage: a hole, not a restart
    assert run.step("Pass", seconds=60).canary.step == 1  # the second pass completes the step


def test_a_step_needs_one_pass_per_interval_with_no_failure_between():
    run = Run()
    run.step()
    assert run.step("Pass", seconds=60).canary.passed_checks == 1
    assert run.step("Fail", seconds=60).canary.passed_checks == 0  # 120 s held, but not all passed
    assert run.step("Pass", seconds=60).canary.step == 0
    advanced = run.step("Pass", seconds=60)
    assert advanced.canary.step == 1 and advanced.canary.passed_checks == 0  # the next step counts afresh


def test_abort_annotation_aborts_at_once_and_is_consumed():
    run = Run()
    run.step()
    decision = run.step(annotations={ABORT: "true"}, seconds=5)
    assert decision.stage == "Aborted" and decision.consumed_annotations == [ABORT]
    assert "aborted by annotation" in decision.last_rollout.message
    # By hand, before any analysis: the condition says so ("no analysis yet" is not a failed analysis).
    assert decision.conditions["RolloutAborted"][:2] == (True, "Aborted")


def test_retry_annotation_restarts_an_aborted_candidate_at_step_zero():
    run = Run()
    run.step()
    run.step(annotations={ABORT: "true"})
    retried = run.step(annotations={RETRY: "true"}, seconds=10)
    assert retried.stage == "Canary" and retried.canary.step == 0 and retried.last_rollout is None
    assert RETRY in retried.consumed_annotations
    assert [e.reason for e in retried.events] == ["RolloutRetried", "RolloutStarted"]


def test_a_changed_candidate_starts_over():
    run = Run()
    run.step()
    run.step("Pass", seconds=60)
    run.step("Pass", seconds=60)
    assert run.canary.step == 1
    restarted = run.step("Pass", seconds=60, candidate="d")
    assert restarted.canary.revision == "d" and restarted.canary.step == 0 and restarted.canary.history == []
    assert "replaces candidate c" in restarted.events[0].message


def test_without_auto_promote_the_last_step_waits_for_the_annotation():
    run = Run(ROLLOUT.model_copy(update={"auto_promote": False}))
    run.step()
    run.step("Pass", seconds=60)
    run.step("Pass", seconds=60)
    waiting = run.step("Pass", seconds=60)
    assert waiting.stage == "Canary" and waiting.canary.state == "AwaitingPromotion"
    assert run.step("Pass", seconds=60).stage == "Canary"  # still analysing, still waiting
    assert run.step("Fail", seconds=60).stage == "Canary"
    promoted = run.step(annotations={PROMOTE: "yes"}, seconds=1)  # only "true" counts
    assert promoted.stage == "Canary"
    promoted = run.step(annotations={PROMOTE: "true"}, seconds=1)
    assert promoted.stage == "Promoted" and promoted.consumed_annotations == [PROMOTE]


def test_a_restart_resumes_mid_step_from_status_alone():
    """Drop everything but what status holds (a JSON round trip) between every call."""
    run = Run()
    verdicts = [None, "Pass", "Fail", "Pass", "Pass", "Pass"]
    stages = []
    for verdict in verdicts:
        decision = run.step(verdict, seconds=60 if verdict else 0)
        stages.append((decision.stage, decision.canary.step if decision.canary else None))
        if run.canary is not None:
            run.canary = api.CanaryStatus.model_validate(run.canary.model_dump(by_alias=True, mode="json"))
    uninterrupted = Run()
    expected = []
    for verdict in verdicts:
        decision = uninterrupted.step(verdict, seconds=60 if verdict else 0)
        expected.append((decision.stage, decision.canary.step if decision.canary else None))
    assert stages == expected
    assert stages[-1] == ("Promoted", None)


def test_history_is_bounded():
    run = Run(ROLLOUT.model_copy(update={"auto_promote": False}))
    run.step()
    for _ in range(HISTORY_LENGTH + 5):
        decision = run.step("Inconclusive", seconds=60)
    assert len(decision.canary.history) == HISTORY_LENGTH
