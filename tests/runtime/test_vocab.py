"""Reduced draft vocabularies: ranking, the restricted LM head, checkpoints, export, and losslessness."""

import json

import pytest
import torch

from specserve_runtime.drafters import DrafterError, ProposerOptions, build_proposer
from specserve_runtime.drafters.dflash import DFlashConfig, export_speculators, load_dflash, random_drafter, save_dflash
from specserve_runtime.drafters.eagle3 import Eagle3Config, Eagle3Drafter, load_eagle3, save_eagle3
from specserve_runtime.engine import Request
from specserve_runtime.layers import PackedLinear
from specserve_runtime.drafters.vocab import IGNORE, DraftHead, draft_token_ids, frequency_ranked, set_draft_vocab

from .test_dflash import load_with_speculators, speculators_draft_logits
from .test_engine import PROMPT, engine, greedy

DRAFT_VOCAB = torch.tensor([0, 2, 3, 5, 8, 13, 21, 34, 55, 89])


def test_frequency_ranking_keeps_the_most_frequent_tokens_then_fills_by_id():
    responses = [[7, 7, 7, 3, 3, 9], [9, 9, 5]]
    assert frequency_ranked(responses, 3, 12).tolist() == [3, 7, 9]  # counts 3, 3, 2: token 5 (1) is out
    assert frequency_ranked(responses, 6, 12).tolist() == [0, 1, 3, 5, 7, 9]  # all 4 seen, then ids 0, 1
    with pytest.raises(DrafterError, match="within 1..12"):
        frequency_ranked(responses, 13, 12)


def test_draft_head_scores_only_its_rows_and_maps_ids_both_ways():
    weight = torch.randn(96, 16)
    head = DraftHead(weight, DRAFT_VOCAB)
    hidden = torch.randn(4, 16)
    torch.testing.assert_close(head.logits(hidden), (hidden @ weight.T)[:, DRAFT_VOCAB])
    assert head.to_target(torch.tensor([0, 4, 9])).tolist() == [0, 8, 89]
    assert head.to_draft(torch.tensor([8, 89, 1])).tolist() == [4, 9, IGNORE]
    full = DraftHead(weight, None)
    assert full.to_draft(torch.tensor([1, 95])).tolist() == [1, 95]


def test_the_inference_head_scores_on_a_packed_weight_what_the_training_head_scores():
    weight = torch.randn(96, 16)
    lm_head = PackedLinear(weight)
    hidden = torch.randn(3, 2, 16)[:, 1:]  # the slice a draft step scores: 3-D, not contiguous
    for token_ids in (DRAFT_VOCAB, None):
        inference, training = DraftHead.for_inference(lm_head, token_ids), DraftHead(weight, token_ids)
        assert isinstance(inference.linear, PackedLinear) and inference.linear.packed is not None
        torch.testing.assert_close(inference.logits(hidden), training.logits(hidden))
    assert DraftHead.for_inference(lm_head, None).linear is lm_head  # the whole vocabulary: the target's own head


def reduced_dflash(target, seed=0):
    config = DFlashConfig.for_target(target.config, 2, 6, mask_token_id=95, draft_vocab_size=DRAFT_VOCAB.numel())
    drafter = random_drafter(config, seed)
    set_draft_vocab(drafter, DRAFT_VOCAB)
    return drafter


def test_reduced_vocab_checkpoints_round_trip_in_half_precision(tmp_path, tiny_llama):
    drafter = reduced_dflash(tiny_llama)
    save_dflash(drafter, tmp_path / "dflash", dtype=torch.float16)
    assert json.loads((tmp_path / "dflash" / "config.json").read_text())["draft_vocab_size"] == 10
    loaded = load_dflash(tmp_path / "dflash")
    assert loaded.config == drafter.config
    assert draft_token_ids(loaded).tolist() == DRAFT_VOCAB.tolist()  # index buffers are not cast to fp16

    eagle = Eagle3Drafter(Eagle3Config.for_target(tiny_llama.config, draft_vocab_size=10))
    set_draft_vocab(eagle, DRAFT_VOCAB)
    save_eagle3(eagle, tmp_path / "eagle3", dtype=torch.float16)
    assert draft_token_ids(load_eagle3(tmp_path / "eagle3")).tolist() == DRAFT_VOCAB.tolist()


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_reduced_vocab_drafters_draft_inside_it_and_stay_lossless(tmp_path, tiny_llama, method):
    if method == "dflash":
        save_dflash(reduced_dflash(tiny_llama), tmp_path)
    else:
        eagle = Eagle3Drafter(Eagle3Config.for_target(tiny_llama.config, draft_vocab_size=10))
        set_draft_vocab(eagle, DRAFT_VOCAB)
        save_eagle3(eagle, tmp_path)
    proposer = build_proposer(method, tiny_llama, ProposerOptions(str(tmp_path), 4))
    result = engine(tiny_llama, proposer).generate(Request(PROMPT, 40))
    assert result.token_ids == greedy(tiny_llama).token_ids and result.num_draft_tokens > 0

    proposer.begin(128)  # both proposers take the features of every committed token but the last
    proposer.extend_context(tiny_llama(torch.tensor(PROMPT), tiny_llama.new_cache(32), tap_layers=proposer.tap_layers).taps)
    drafts = proposer.propose(PROMPT + [1], 4)
    assert len(drafts) == 4 and set(drafts) <= set(DRAFT_VOCAB.tolist())


def test_speculators_loads_a_reduced_vocab_export(tmp_path, tiny_llama_dir, tiny_llama):
    drafter = reduced_dflash(tiny_llama)
    with pytest.raises(DrafterError, match="needs the target"):
        export_speculators(drafter, tmp_path / "no-target", str(tiny_llama_dir), ["LlamaForCausalLM"])
    export_speculators(drafter, tmp_path / "speculators", str(tiny_llama_dir), ["LlamaForCausalLM"], tiny_llama)
    theirs = load_with_speculators(tmp_path / "speculators")
    assert theirs.config.draft_vocab_size == 10
    assert (torch.arange(10) + theirs.d2t).tolist() == DRAFT_VOCAB.tolist()
    assert theirs.t2d.nonzero().flatten().tolist() == DRAFT_VOCAB.tolist()

    tokens = torch.randint(0, 96, (9,), generator=torch.Generator().manual_seed(5))
    taps = tiny_llama(tokens, tiny_llama.new_cache(32), tap_layers=drafter.config.target_layer_ids).taps
    block = torch.tensor([int(tokens[-1])] + [95] * 5)
    hidden = drafter(tiny_llama.embed_tokens(block), torch.arange(9, 15), [drafter.context_kv(taps, torch.arange(9))])
    ours = DraftHead(tiny_llama.lm_head.weight, draft_token_ids(drafter)).logits(hidden)
    with torch.no_grad():
        torch.testing.assert_close(ours, speculators_draft_logits(theirs, taps, block, context_len=9), atol=1e-4, rtol=1e-4)
