"""Adaptive speculation: the draft length per step follows measured tokens per second at each batch size,
and only the speed changes, never the output."""

import pytest

from specserve_runtime.adaptive import EXPLORE_EVERY, DraftLengthChooser, batch_bucket
from specserve_runtime.engine import Request

from .test_batching import build, requests, run_batched


def test_batch_sizes_share_a_measurement_within_a_power_of_two():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]


def test_every_length_is_tried_once_then_the_fastest_is_used():
    chooser = DraftLengthChooser(max_drafts=3)
    rates = {3: 9.0, 2: 14.0, 1: 12.0, 0: 10.0}  # tokens per second each length measures
    tried = []
    for _ in range(4):
        length = chooser.choose(batch_size=1)
        tried.append(length)
        chooser.record(1, length, committed_tokens=rates[length], seconds=1.0)
    assert tried == [3, 2, 1, 0]  # the proposer's own setting first
    assert chooser.choose(1) == 2


def test_plain_decoding_wins_when_drafting_does_not_pay():
    chooser = DraftLengthChooser(max_drafts=2)
    for length, rate in ((2, 6.0), (1, 8.0), (0, 11.0)):
        assert chooser.choose(8) == length
        chooser.record(8, length, rate, 1.0)
    assert chooser.choose(8) == 0
    assert chooser.choose(1) == 2  # another batch size is measured on its own


def test_a_length_that_became_faster_is_found_again_by_exploring():
    chooser = DraftLengthChooser(max_drafts=1)
    chooser.record(1, 1, 5.0, 1.0)
    chooser.record(1, 0, 10.0, 1.0)
    choices = []
    for _ in range(3 * EXPLORE_EVERY):
        length = chooser.choose(1)
        choices.append(length)
        chooser.record(1, length, 20.0 if length == 1 else 10.0, 1.0)  # drafting now pays double
    assert 1 in choices[:EXPLORE_EVERY]  # explored within one period
    assert choices[-EXPLORE_EVERY:].count(1) > EXPLORE_EVERY - 2  # and then kept


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
    lengths = {length for bucket, length in adaptive.chooser.rates}
    assert lengths == set(range(adaptive.proposer.num_speculative_tokens + 1))  # every length was measured
    assert adaptive.draft_length in lengths


def test_plain_decoding_has_nothing_to_adapt(tiny_llama):
    engine = build(tiny_llama, "ar", adaptive=True)
    assert engine.chooser is None
    engine.generate(Request([5, 6, 7], 4))
    assert engine.draft_length is None
