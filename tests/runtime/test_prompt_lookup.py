"""Prompt lookup: the n-gram index, and its copy as one more branch of a drafter model's tree (lossless)."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve_runtime.bench import method_spec
from specserve_runtime.drafters import DrafterError, ProposerOptions, build_proposer, propose_all
from specserve_runtime.drafters.dflash import save_dflash
from specserve_runtime.drafters.ngram import PromptLookup
from specserve_runtime.engine import Request
from specserve_runtime.verify import DraftTree, SamplingParams

from .test_dflash import record_operating_point, tiny_drafter
from .test_engine import _chi_square_pvalue, _exact_two_token_distribution, engine


def scanned_continuation(tokens, count, max_ngram, min_ngram):
    """Prompt lookup by its definition: for the longest suffix first, scan back for its most recent earlier
    occurrence and copy what followed it."""
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + count]
    return []


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), max_size=60), cuts=st.lists(st.integers(0, 60), max_size=6),
       ngrams=st.sampled_from([(1, 1), (3, 1), (3, 2), (6, 3)]), count=st.integers(0, 5))
def test_the_index_finds_what_a_scan_back_finds_as_the_sequence_grows(tokens, cuts, ngrams, count):
    max_ngram, min_ngram = ngrams
    lookup = PromptLookup(max_ngram, min_ngram)
    for end in sorted(cuts) + [len(tokens)]:  # one sequence, looked up after each step's tokens
        seen = tokens[:end]
        assert lookup.continuation(seen, count) == scanned_continuation(seen, count, max_ngram, min_ngram)


def test_lookup_prefers_the_longest_and_then_the_latest_match():
    lookup = PromptLookup(max_ngram=3, min_ngram=1)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [7, 1, 2, 9, 5, 1, 2, 8, 7, 1, 2]
    # "7 1 2" occurred at 0..2 (then 9); "1 2" more recently at 5..6 (then 8): the longer match wins.
    assert lookup.continuation(tokens, 3) == [9, 5, 1]
    assert PromptLookup(max_ngram=2).continuation(tokens, 3) == [8, 7, 1]
    assert lookup.continuation(tokens + [4], 2) == []  # 4 never occurred before


def test_a_lookup_that_matches_fewer_than_min_ngram_tokens_copies_nothing():
    assert PromptLookup(max_ngram=6, min_ngram=3).continuation([1, 2, 5, 6, 2], 4) == []
    assert PromptLookup(max_ngram=6, min_ngram=3).continuation([1, 2, 3, 4, 1, 2, 3], 4) == [4, 1, 2, 3]
    with pytest.raises(ValueError, match="1 <= min <= max"):
        PromptLookup(max_ngram=2, min_ngram=3)


def test_a_branch_follows_the_tree_as_far_as_it_agrees_then_hangs_below():
    tree = DraftTree([10, 11, 20, 12], [-1, 0, -1, 1])  # 10 -> 11 -> 12, and 20
    merged = tree.with_branch([10, 11, 30, 31])
    assert merged.tokens == [10, 11, 20, 12, 30, 31]
    assert merged.parents == [-1, 0, -1, 1, 1, 4]  # 30 after 11 (a sibling of 12), 31 after 30
    assert tree.with_branch([20, 21]).parents == [-1, 0, -1, 1, 2]
    assert tree.with_branch([10, 11, 12]) == tree  # already in the tree: nothing to add
    assert tree.with_branch([]) == tree
    assert DraftTree.chain([]).with_branch([4, 5]) == DraftTree.chain([4, 5])


def test_propose_all_adds_the_lookup_branch_to_a_model_drafters_drafts_within_its_limit(tiny_llama):
    """The drafter's tree first (its own nodes, as many as the limit allows), then the copy, no deeper than the
    limit either; a sequence offered no drafts gets neither."""
    proposer = build_proposer("dflash", tiny_llama, ProposerOptions("random", 3, mask_token_id=95, seed=0,
                                                                    draft_tree=True, prompt_lookup=4))
    tokens = [5, 17, 42, 8, 63, 21, 9, 5, 17, 42]  # "5 17 42" again: lookup copies "8 63 21 9"
    taps = tiny_llama(torch.tensor(tokens), tiny_llama.new_cache(32), tap_layers=proposer.tap_layers).taps
    drafts = {}
    for limit in (7, 2, 0):
        sequence = copy.copy(proposer)
        sequence.begin(64)
        sequence.extend_context(taps[:-1])  # the context covers every committed token but the last
        (drafts[limit],) = propose_all(proposer, [(sequence, tokens, limit)])
    assert drafts[7] == DraftTree(drafts[7].tokens[:3], drafts[7].parents[:3]).with_branch([8, 63, 21, 9])
    assert drafts[2] == DraftTree(drafts[2].tokens[:2], drafts[2].parents[:2]).with_branch([8, 63])
    assert len(drafts[0]) == 0


@pytest.mark.parametrize("method", ["dflash", "eagle3"])
def test_a_drafter_with_a_lookup_branch_is_lossless(tiny_target, method):
    """Steps verify copies beside the drafter's guesses, and commit what plain decoding does. The tiny random
    target seldom repeats three tokens: the copies follow a repeated single token here (test_smollm2 shows
    copies accepted on the real target)."""
    prompt = [5, 17, 42, 8, 63, 21, 9] * 3

    def run(prompt_lookup):
        options = ProposerOptions("random", 3, mask_token_id=95, seed=1, draft_tree=True, prompt_lookup=prompt_lookup)
        proposer = build_proposer(method, tiny_target, options)
        proposer.lookup_ngrams = (3, 1)
        return engine(tiny_target, proposer).generate(Request(prompt, 40))

    plain = engine(tiny_target, build_proposer("ar", tiny_target)).generate(Request(prompt, 40))
    with_copies, without = run(6), run(0)
    assert with_copies.token_ids == without.token_ids == plain.token_ids
    # Steps verified the copies too: more drafts at once than the drafter's tree of 3.
    assert len(with_copies.accepted_per_position) > 3 == len(without.accepted_per_position)


def test_sampling_with_a_lookup_branch_follows_the_target_distribution(tiny_llama):
    """The second token comes from a verify step whose drafts hold a copy: the prompt holds every token, so the
    first one sampled always occurred before (a single token's match, as in the test above). One target: the
    branch is drafts like any other to verification, whose arithmetic test_engine runs on each."""
    params = SamplingParams(temperature=0.8)
    prompt = torch.randperm(tiny_llama.config.vocab_size, generator=torch.Generator().manual_seed(0)).tolist()
    joint = _exact_two_token_distribution(tiny_llama, prompt, params)
    options = ProposerOptions("random", 3, mask_token_id=95, seed=0, draft_tree=True, prompt_lookup=4)
    proposer = build_proposer("dflash", tiny_llama, options)
    proposer.lookup_ngrams = (3, 1)
    spec = engine(tiny_llama, proposer)
    counts = torch.zeros_like(joint)
    for seed in range(3000):
        result = spec.generate(Request(prompt, 3, params, seed=seed))
        counts[result.token_ids[0], result.token_ids[1]] += 1
    assert _chi_square_pvalue(counts.sum(1), joint.sum(1)) > 1e-3
    assert _chi_square_pvalue(counts.sum(0), joint.sum(0)) > 1e-3
    assert _chi_square_pvalue(counts.flatten(), joint.flatten()) > 1e-3


def test_the_operating_point_records_a_lookup_branch_and_a_count_alone_asks_for_none(tmp_path, tiny_llama):
    save_dflash(tiny_drafter(tiny_llama), tmp_path)
    record_operating_point(tmp_path, {"num_speculative_tokens": 3, "draft_tree": True, "prompt_lookup": 4})
    assert build_proposer("dflash", tiny_llama, ProposerOptions(str(tmp_path))).prompt_lookup == 4
    assert build_proposer("dflash", tiny_llama, ProposerOptions(str(tmp_path), prompt_lookup=0)).prompt_lookup == 0
    assert build_proposer("dflash", tiny_llama, ProposerOptions(str(tmp_path), 3)).prompt_lookup == 0
    assert build_proposer("dflash", tiny_llama, ProposerOptions(str(tmp_path), 3, prompt_lookup=2)).prompt_lookup == 2


@pytest.mark.parametrize("lookup", [-1, 17, True, "4"])
def test_a_malformed_recorded_lookup_branch_is_refused_with_the_file_named(tmp_path, tiny_llama, lookup):
    save_dflash(tiny_drafter(tiny_llama), tmp_path)
    record_operating_point(tmp_path, {"num_speculative_tokens": 3, "prompt_lookup": lookup})
    with pytest.raises(DrafterError, match=rf"drafter {tmp_path}: config.json's specserve_operating_point must be"):
        build_proposer("dflash", tiny_llama, ProposerOptions(str(tmp_path)))


def test_a_lookup_branch_needs_a_drafter_model_and_a_count_in_range(tiny_llama):
    with pytest.raises(DrafterError, match="joins the drafts of a drafter model .dflash, eagle3., not of method 'ngram'"):
        build_proposer("ngram", tiny_llama, ProposerOptions(num_speculative_tokens=3, prompt_lookup=4))
    with pytest.raises(DrafterError, match="prompt_lookup is the most tokens a prompt-lookup branch copies, 0..16"):
        build_proposer("dflash", tiny_llama, ProposerOptions("random", 3, mask_token_id=95, prompt_lookup=17))
    assert build_proposer("ar", tiny_llama, ProposerOptions(prompt_lookup=0)).num_speculative_tokens == 0


def test_bench_method_names_take_a_lookup_branch():
    assert method_spec("dflash+lookup4") == ("dflash", ProposerOptions(prompt_lookup=4))
    assert method_spec("eagle3:tree3+lookup0@runs/x") == (
        "eagle3", ProposerOptions("runs/x", 3, draft_tree=True, prompt_lookup=0))
    with pytest.raises(ValueError, match=r"'\+lookup' is followed by"):
        method_spec("dflash+lookup")
