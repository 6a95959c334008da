"""Adaptive speculation: the draft length per step follows measured acceptance per position and the
measured cost of drafting at each batch size, and only the speed changes, never the output."""

import pytest

from specserve_runtime.adaptive import (EXPLORE_BUDGET, EXPLORE_EVERY, MAX_EXPLORE_EVERY, MAX_PAIR_GAP, MIN_GAIN,
                                        MIN_PAIRS, DraftLengthChooser, batch_bucket)
from specserve_runtime.engine import Request

from .test_batching import build, requests, run_batched


def test_batch_sizes_share_a_measurement_within_a_power_of_two():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]


def run(chooser, batch_size, steps, step_seconds, accepted, speed=lambda step: 1.0):
    """Drive the chooser: a step drafting L costs step_seconds[L] / speed(step) (the machine's speed
    drifting), and each of batch_size sequences has its first accepted[L] drafts accepted."""
    chosen, clock = [], 0.0
    for step in range(steps):
        length = chooser.choose(batch_size)
        chosen.append(length)
        seconds = step_seconds[length] / speed(step)
        chooser.record(batch_size, length, clock, seconds, [(length, accepted[length])] * batch_size)
        clock += seconds
    return chosen


def test_each_length_is_paired_with_a_step_without_drafts_then_the_best_is_used():
    chooser = DraftLengthChooser(max_drafts=3)
    # every draft accepted; a step costs 1.0 plain, 1.2 / 1.5 / 2.5 drafting 1 / 2 / 3
    chosen = run(chooser, 1, EXPLORE_EVERY, {0: 1.0, 1: 1.2, 2: 1.5, 3: 2.5}, {0: 0, 1: 1, 2: 2, 3: 3})
    assert chosen[:3] == [3, 3, 0]  # the longest first (a catch-up step, a timed one), then one without drafts
    warmup = 3 * MIN_PAIRS * 3  # at most: every length paired MIN_PAIRS times
    assert sorted(length for (_, length), ratios in chooser.ratios.items() if len(ratios) >= MIN_PAIRS) == [1, 2, 3]
    assert [chooser.cost(1, length) for length in (0, 1, 2, 3)] == pytest.approx([1.0, 1.2, 1.5, 2.5])
    assert chooser.expected_tokens(2) == pytest.approx(3.0)
    assert set(chosen[warmup:EXPLORE_EVERY]) == {2}  # 3 tokens for 1.5x beats 4 for 2.5x, 2 for 1.2x and 1 for 1x


@pytest.mark.parametrize("cost_of_one, pairs_of_one", [(2.2, MIN_PAIRS - 1), (1.8, MIN_PAIRS)])
def test_a_length_that_no_last_pair_could_make_win_is_learned_one_pair_early(cost_of_one, pairs_of_one):
    """Every draft accepted; drafting 2 costs 1.5x a plain step (3 tokens: it wins). Drafting 1 at
    2.2x (2 tokens) loses at each ratio, so a third ratio, however low, could not make it win; at
    1.8x it would (2 / 1.8 beats the margin) and is paired MIN_PAIRS times, as a winner is."""
    chooser = DraftLengthChooser(max_drafts=2)
    chosen = run(chooser, 8, EXPLORE_EVERY, {0: 1.0, 1: cost_of_one, 2: 1.5}, {0: 0, 1: 1, 2: 2})
    learning = [2, 2, 0] * MIN_PAIRS + [1, 1, 0] * pairs_of_one  # longest first: catch-up, timed, plain
    assert chosen[:len(learning)] == learning
    assert len(chooser.ratios[(8, 1)]) == pairs_of_one and len(chooser.ratios[(8, 2)]) == MIN_PAIRS
    assert set(chosen[len(learning):]) == {2}


def test_plain_decoding_wins_when_drafting_does_not_pay():
    chooser = DraftLengthChooser(max_drafts=2)
    # a loaded batch: drafting doubles the step, and only the first draft is accepted half the time
    seconds = {0: 1.0, 1: 1.9, 2: 2.2}
    chosen, clock = [], 0.0
    for step in range(40):
        length = chooser.choose(8)
        chosen.append(length)
        chooser.record(8, length, clock, seconds[length], [(length, min(length, step % 2))] * 8)
        clock += seconds[length]
    warmup = 3 * MIN_PAIRS * 2
    assert chosen[warmup:EXPLORE_EVERY] == [0] * (EXPLORE_EVERY - warmup)  # until the first exploring pair
    assert chooser.choose(1) == 2  # another batch size is measured on its own


@pytest.mark.parametrize("gain, drafts", [(1.02, False), (1.08, True)])
def test_drafting_must_beat_plain_decoding_by_a_margin(gain, drafts):
    """Near break-even the estimates' noise picks the winner, and a loaded batch would draft at a
    small loss: a length is drafted only if it promises MIN_GAIN times plain decoding's tokens/s."""
    assert MIN_GAIN == 1.05
    chooser = DraftLengthChooser(max_drafts=1)
    # every draft accepted: 2 tokens for a step that costs 2 / gain times a plain one
    chosen = run(chooser, 16, EXPLORE_EVERY, {0: 1.0, 1: 2.0 / gain}, {0: 0, 1: 1})
    assert chooser.cost(16, 1) == pytest.approx(2.0 / gain)
    settled = chosen[3 * MIN_PAIRS:EXPLORE_EVERY]
    assert settled == ([1] * len(settled) if drafts else [0] * len(settled))


def test_a_bigger_batch_neither_learns_nor_explores_lengths_that_lost_at_a_smaller_one():
    """Drafting only gets dearer with the batch: lengths that cannot beat the margin at the cost
    measured at 8 sequences are not paired at 16, not even to explore. Once the text gets easier
    (every draft accepted) and 8 sequences find drafting pays, 16 learns it again."""
    chooser = DraftLengthChooser(max_drafts=2)
    rejected, all_accepted = {0: 0, 1: 0, 2: 0}, {0: 0, 1: 1, 2: 2}
    run(chooser, 8, 40, {0: 1.0, 1: 1.5, 2: 2.0}, rejected)  # learned at 8: drafting loses
    assert chooser.choose(8) == 0
    at_16 = run(chooser, 16, 4 * MAX_EXPLORE_EVERY, {0: 1.0, 1: 1.6, 2: 2.2}, rejected)
    assert at_16 == [0] * len(at_16)  # no learning pairs, no exploring ones
    run(chooser, 8, 3 * MAX_EXPLORE_EVERY, {0: 1.0, 1: 1.5, 2: 2.0}, all_accepted)
    assert chooser.choose(8) == 2  # 3 tokens for 2x now wins at 8
    at_16 = run(chooser, 16, EXPLORE_EVERY, {0: 1.0, 1: 1.6, 2: 2.2}, all_accepted)
    assert at_16[:3] == [2, 2, 0] and at_16[-1] == 2  # learned, longest first, and drafted


def test_a_drifting_machine_speed_does_not_decide():
    """The machine is three times faster when the longer length is first timed than when the
    shorter one is (its speed falls steadily, as this VM's does over a minute): raw tokens per
    second would pick the one timed fast, the ratio of adjacent steps does not."""
    chooser = DraftLengthChooser(max_drafts=2)
    seconds, accepted = {0: 1.0, 1: 1.1, 2: 1.6}, {0: 0, 1: 1, 2: 1}  # the second draft is never accepted
    chosen = run(chooser, 4, 3 * EXPLORE_EVERY, seconds, accepted, speed=lambda step: 1.5 / (1 + step / 48))
    assert chooser.cost(4, 2) == pytest.approx(1.6, rel=0.05) and chooser.cost(4, 1) == pytest.approx(1.1, rel=0.05)
    settled = chosen[6 * MIN_PAIRS:]
    assert settled.count(1) > 0.9 * len(settled)  # 2 tokens for 1.1x, not 2 tokens for 1.6x


def test_exploring_backs_off_while_it_confirms_the_choice():
    """Drafting loses throughout: each exploring pair (a catch-up step, a timed one, one without
    drafts) confirms it, so the wait to the next one doubles, up to MAX_EXPLORE_EVERY."""
    chooser = DraftLengthChooser(max_drafts=1)
    chosen = run(chooser, 1, 1000, {0: 1.0, 1: 2.2}, {0: 0, 1: 1})  # drafting costs 2.2x for 2 tokens
    warmup = 3 * (MIN_PAIRS - 1)  # it loses at both ratios: a third could not make it win
    assert chosen[:warmup] == [1, 1, 0] * (MIN_PAIRS - 1) and chosen[warmup] == 0
    starts = [i for i in range(warmup, len(chosen)) if chosen[i] == 1 and chosen[i - 1] == 0]
    assert all(chosen[i:i + 3] == [1, 1, 0] for i in starts)
    assert [b - a for a, b in zip(starts, starts[1:])] == [64, 128, 256, 256, 256]
    assert MAX_EXPLORE_EVERY == 256 and starts[0] == EXPLORE_EVERY


def test_an_exploring_pair_waits_as_long_as_its_cost_needs():
    """A drafter that sat out pays a catch-up of many plain steps when it drafts again: the next
    exploring pair waits at least the pair's cost (in plain steps) over EXPLORE_BUDGET, so a loaded
    server spends about 1% of its steps exploring, not one catch-up every few dozen steps."""
    assert EXPLORE_BUDGET == 0.01
    chooser = DraftLengthChooser(max_drafts=1)
    chosen, clock = [], 0.0
    for step in range(5000):
        length = chooser.choose(1)
        catch_up = length and (not chosen or chosen[-1] == 0)
        seconds = 10.0 if catch_up else 2.0 if length else 1.0  # drafting: 2 tokens for 2x, after a 10x catch-up
        chooser.record(1, length, clock, seconds, [(length, length)])
        chosen.append(length)
        clock += seconds
    starts = [i for i in range(1, len(chosen)) if chosen[i] == 1 and chosen[i - 1] == 0]
    # the pair: 12 plain steps' time for 4 tokens, 8 plain steps beyond plain decoding, so 800 steps
    assert [b - a for a, b in zip(starts[MIN_PAIRS:], starts[MIN_PAIRS + 1:])] == [800] * (len(starts) - MIN_PAIRS - 1)
    assert len(starts) - MIN_PAIRS >= 5


def test_a_length_that_became_cheaper_is_found_again_by_exploring():
    chooser = DraftLengthChooser(max_drafts=1)
    run(chooser, 1, 600, {0: 1.0, 1: 3.0}, {0: 0, 1: 1})  # drafting costs 3x for 2 tokens: plain wins
    assert chooser.choose(1) == 0 and chooser.explore_every[1] == MAX_EXPLORE_EVERY  # backed off
    # now 1.2x for 2 tokens: the next exploring pair (within MAX_EXPLORE_EVERY) says so on its own,
    # the wait falls back to EXPLORE_EVERY, and two more pairs move the median
    chosen = run(chooser, 1, MAX_EXPLORE_EVERY + 4 * EXPLORE_EVERY, {0: 1.0, 1: 1.2}, {0: 0, 1: 1})
    assert chooser.explore_every[1] == EXPLORE_EVERY
    assert chosen[-EXPLORE_EVERY:].count(1) > EXPLORE_EVERY - 3  # and then kept (a re-pairing step at 0 aside)


def test_steps_apart_in_time_are_not_paired():
    """An idle server between a step with drafts and one without: the machine's speed may have
    changed in between, so their ratio is not a cost."""
    chooser = DraftLengthChooser(max_drafts=1)
    chooser.record(1, 1, started_at=0.0, seconds=2.0, verified=[(1, 1)])
    chooser.record(1, 1, started_at=2.0, seconds=1.5, verified=[(1, 1)])
    chooser.record(1, 0, started_at=3.5 + MAX_PAIR_GAP + 0.5, seconds=1.0, verified=[])
    assert chooser.ratios == {}
    chooser.record(1, 1, started_at=5.0 + MAX_PAIR_GAP, seconds=2.0, verified=[(1, 0)])
    chooser.record(1, 1, started_at=7.0 + MAX_PAIR_GAP, seconds=1.5, verified=[(1, 0)])
    chooser.record(1, 0, started_at=8.5 + MAX_PAIR_GAP, seconds=1.0, verified=[])
    assert chooser.ratios == {(1, 1): [1.5]}  # adjacent: 1.5 s drafting against the 1.0 s step just after


def test_a_drafting_step_after_steps_without_drafts_is_not_timed():
    """A drafter that sat out steps first catches up on the features committed meanwhile: that
    step is not what drafting every step costs, so the pair times the drafting step after it."""
    chooser = DraftLengthChooser(max_drafts=1)
    for step in range(3):
        chooser.record(4, 0, started_at=float(step), seconds=1.0, verified=[(0, 0)] * 4)
    chooser.record(4, 1, started_at=3.0, seconds=2.5, verified=[(1, 1)] * 4)  # with the catch-up
    assert chooser.ratios == {}  # a step without drafts and then one drafting: not a pair
    assert chooser.choose(4) == 1  # the timed drafting step
    chooser.record(4, 1, started_at=5.5, seconds=1.3, verified=[(1, 1)] * 4)
    assert chooser.choose(4) == 0  # and the step without drafts beside it
    chooser.record(4, 0, started_at=6.8, seconds=1.0, verified=[(0, 0)] * 4)
    assert chooser.ratios == {(4, 1): [1.3]}


def test_only_steps_of_the_same_batch_size_are_paired():
    """Served, a request ends or a prompt joins every few steps: a step of 12 sequences is a third
    faster than one of 16 whatever it drafts, so pairing them would measure the batch size."""
    chooser = DraftLengthChooser(max_drafts=1)
    chooser.record(16, 1, started_at=0.0, seconds=2.2, verified=[(1, 1)] * 16)
    chooser.record(16, 1, started_at=2.2, seconds=2.0, verified=[(1, 1)] * 16)
    chooser.record(12, 0, started_at=4.2, seconds=1.2, verified=[(0, 0)] * 12)
    assert chooser.ratios == {}  # 2.0 s against 1.2 s would make drafting look dearer than it is
    assert chooser.choose(16) == 1  # no pair under way at 16: 1 is still unpaired
    chooser.record(16, 1, started_at=5.4, seconds=2.2, verified=[(1, 1)] * 16)
    assert chooser.choose(16) == 1  # the step before was at 12: this one catches up, the next is timed
    chooser.record(16, 1, started_at=7.6, seconds=2.0, verified=[(1, 1)] * 16)
    assert chooser.choose(16) == 0  # its pair is due now
    chooser.record(16, 0, started_at=9.6, seconds=1.6, verified=[(0, 0)] * 16)
    assert chooser.ratios == {(16, 1): [2.0 / 1.6]}  # both 16 sequences: a cost, kept for the bucket 9-16


def test_a_step_with_a_prompt_chunk_drafts_the_best_length_and_begins_no_pair():
    """Such a step is not recorded: a catch-up or an exploring length there would never be measured."""
    chooser = DraftLengthChooser(max_drafts=2)
    assert (chooser.choose(8), chooser.choose(8, timed=False)) == (2, 0)  # learning 2; nothing trusted yet
    chosen = run(chooser, 8, EXPLORE_EVERY, {0: 1.0, 1: 1.3, 2: 1.6}, {0: 0, 1: 0, 2: 0})  # drafting never pays
    assert chosen[-1] == 0 and chooser.choose(8) > 0  # plain decoding, until an exploring pair is due ...
    assert chooser.choose(8, timed=False) == 0  # ... in a step that can time it


def test_an_engine_step_with_a_prompt_chunk_is_neither_paired_nor_recorded(tiny_llama):
    engine = build(tiny_llama, "ngram", adaptive=True)
    running = engine.add(Request([5, 6, 7, 5, 6, 7, 5, 6], 20))
    engine.step([running])  # its prompt
    joining = engine.add(Request([9, 8, 7], 20))
    engine.step([running, joining])  # one decode, and the other's prompt
    assert engine.draft_length == 0 and engine.chooser.steps == {}  # not the learning length, and not timed
    engine.step([running, joining])
    assert engine.draft_length == engine.proposer.num_speculative_tokens and engine.chooser.steps == {2: 1}


def test_acceptance_counts_every_sequence_offered_a_position():
    """An n-gram drafter often finds no guess: the sequence commits one token, and the expected
    tokens per step must say so, or drafting looks better than it is."""
    chooser = DraftLengthChooser(max_drafts=2)
    chooser.record(4, 2, started_at=0.0, seconds=1.0, verified=[(2, 2), (0, 0), (0, 0), (1, 1)])
    assert [chooser.acceptance(1), chooser.acceptance(2)] == pytest.approx([0.5, 0.25])
    assert chooser.expected_tokens(2) == pytest.approx(1.75)  # the tokens those four committed: (3 + 1 + 1 + 2) / 4


def test_a_proposer_that_does_not_draft_cannot_adapt():
    with pytest.raises(ValueError, match="needs a proposer that drafts"):
        DraftLengthChooser(0)


@pytest.mark.parametrize("method", ["ngram", "dflash"])
def test_adaptive_batches_decode_exactly_what_each_request_decodes_alone(tiny_llama, method):
    """Sampled ones too: the token at each position is drawn with a number fixed by the seed and the
    position, whatever the draft length."""
    fixed, adaptive = build(tiny_llama, method), build(tiny_llama, method, adaptive=True)
    alone = [fixed.generate(request) for request in requests()]
    together, _ = run_batched(adaptive, requests(), joins={1: 2, 4: 5})
    for single, batched in zip(alone, together):
        assert batched.token_ids == single.token_ids and batched.finish_reason == single.finish_reason
    paired = {length for bucket, length in adaptive.chooser.ratios}
    assert len(paired) >= 2  # the batch ran at several lengths: each pair is a drafting length and 0
    assert adaptive.draft_length in paired | {0}


def test_plain_decoding_has_nothing_to_adapt(tiny_llama):
    engine = build(tiny_llama, "ar", adaptive=True)
    assert engine.chooser is None
    engine.generate(Request([5, 6, 7], 4))
    assert engine.draft_length is None
