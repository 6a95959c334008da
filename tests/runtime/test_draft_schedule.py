"""The draft-length schedule proposed from measured curves (specserve_runtime.draft_schedule): pure, no model."""

import pytest
from pydantic import ValidationError
from specserve_runtime.config import parse_schedule, schedule_problems, scheduled_tokens
from specserve_runtime.draft_schedule import describe, propose, rate, scheduled_curve
from specserve_runtime.performance import CurvePoint, Performance, draft_length_curves


def curve(*rates: float, at=(1, 2, 4, 8, 16)) -> list[CurvePoint]:
    return [CurvePoint.model_validate({"concurrency": c, "tokensPerSecondPerRequest": r, "ttftMs": 10.0 * c})
            for c, r in zip(at, rates)]


# Plain decoding slows a little with the batch; three drafts pay most alone and cost most in a big batch.
CURVES = {0: curve(100, 95, 85, 70, 50), 1: curve(130, 120, 100, 72, 45), 3: curve(170, 140, 95, 60, 35)}


def test_each_batch_size_drafts_the_length_with_the_most_tokens_per_second_and_the_last_range_is_open():
    schedule = propose(CURVES)
    assert describe(schedule) == "1-3:3,4-10:1,11-:0"
    assert schedule_problems(schedule, "dflash", 3, "schedule") == []  # what the runtime and the API accept
    for b in range(1, 40):
        best = max(CURVES, key=lambda k: rate(CURVES[k], b))
        assert scheduled_tokens(schedule, b) == best  # monotone here: argmax everywhere


def test_a_longer_length_that_wins_only_at_a_larger_batch_is_noise_and_is_not_drafted():
    noisy = CURVES | {3: curve(170, 140, 95, 60, 75)}  # a lucky round at 16 for three drafts
    assert describe(propose(noisy)) == "1-3:3,4-10:1,11-:0"  # never more drafts at a larger batch


def test_ties_go_to_fewer_drafts_and_a_schedule_needs_a_curve():
    assert describe(propose({0: curve(100, 90), 2: curve(100, 90)})) == "1-:0"
    with pytest.raises(ValueError, match="at least one measured curve"):
        propose({})


def test_the_command_line_form_reads_back_as_the_same_schedule():
    schedule = propose(CURVES)
    assert parse_schedule(describe(schedule)) == schedule


def test_a_scheduled_curve_takes_each_batch_size_from_its_length_s_curve():
    rows = scheduled_curve(CURVES, parse_schedule("1-3:3,4-:0"))
    assert [r.concurrency for r in rows] == list(range(1, 17))
    assert rows[0].tokens_per_second_per_request == 170 and rows[3].tokens_per_second_per_request == 85
    assert rows[2].tokens_per_second_per_request == pytest.approx(117.5)  # between 140 at 2 and 95 at 4
    with pytest.raises(ValueError, match=r"draft length\(s\) \[2\]"):
        scheduled_curve(CURVES, parse_schedule("1-:2"))


def performance(draft_lengths: list[dict], none: bool = True) -> dict:
    rows = [{"concurrency": 1, "tokensPerSecondPerRequest": 100, "ttftMs": 10}]
    return ({"none": {"curve": rows}} if none else {}) | {"dflash": {"acceptanceLength": 3, "curve": rows, "draftLengths": draft_lengths}}


def test_the_performance_block_carries_fixed_draft_lengths_once_each_and_plain_decoding_as_length_0():
    rows = [{"concurrency": 1, "tokensPerSecondPerRequest": 120, "ttftMs": 10}]
    block = Performance.model_validate(performance([{"numSpeculativeTokens": 2, "acceptanceLength": 2.1, "curve": rows}]))
    assert sorted(draft_length_curves(block, "dflash")) == [0, 2]
    assert draft_length_curves(block, "eagle3") == {}
    alone = Performance.model_validate(performance([{"numSpeculativeTokens": 2, "curve": rows}], none=False))
    assert sorted(draft_length_curves(alone, "dflash")) == [2]  # without plain decoding measured, no length 0
    with pytest.raises(ValidationError, match="each numSpeculativeTokens once"):
        Performance.model_validate(performance([{"numSpeculativeTokens": 2, "curve": rows}] * 2))
