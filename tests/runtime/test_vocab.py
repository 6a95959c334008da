"""Reduced draft vocabularies: ranking, the restricted LM head, checkpoints, export, and losslessness."""

import json

import pytest
import torch

from specserve_runtime.drafters import DrafterError, ProposerOptions, build_proposer
from specserve_runtime.drafters.checkpoint import export_speculators, read_config
from specserve_runtime.drafters.dflash import DFlashConfig, load_dflash, random_drafter, save_dflash
from specserve_runtime.drafters.eagle3 import Eagle3Config, Eagle3Drafter, load_eagle3, save_eagle3
from specserve_runtime.engine import Request
from specserve_runtime.launch import check_vllm_drafter
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


def reduced_eagle3(target, seed=0):
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(Eagle3Config.for_target(target.config, draft_vocab_size=DRAFT_VOCAB.numel())).eval()
    set_draft_vocab(drafter, DRAFT_VOCAB)
    return drafter


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_the_speculators_layout_round_trips_both_drafters_with_their_own_lm_head(tmp_path, tiny_llama_dir, tiny_llama,
                                                                                  method):
    """What the bundled drafters ship in: vLLM can load it (check_vllm_drafter), and the embedded engine loads it
    back to the same drafter, scoring with the head rows it carries, so it drafts exactly what the original does."""
    drafter = reduced_eagle3(tiny_llama) if method == "eagle3" else reduced_dflash(tiny_llama)
    (save_eagle3 if method == "eagle3" else save_dflash)(drafter, tmp_path / "own")
    source = tmp_path / "own" / "config.json"
    source.write_text(json.dumps({**json.loads(source.read_text()), "specserve_operating_point": {
        "num_speculative_tokens": 3, "draft_tree": True}}))
    export_speculators((load_eagle3 if method == "eagle3" else load_dflash)(tmp_path / "own"), tmp_path / "speculators",
                       str(tiny_llama_dir), ["LlamaForCausalLM"], tiny_llama, str(tmp_path / "own"))
    config = check_vllm_drafter(tmp_path / "speculators", method)
    assert config["speculators_model_type"] == method and config["draft_vocab_size"] == 10
    assert config["specserve_operating_point"] == {"num_speculative_tokens": 3, "draft_tree": True}
    aux = config["eagle_aux_hidden_state_layer_ids" if method == "eagle3" else "aux_hidden_state_layer_ids"]
    assert aux == [i + 1 for i in drafter.config.target_layer_ids]  # vLLM taps layer inputs, the drafters outputs

    loaded = (load_eagle3 if method == "eagle3" else load_dflash)(tmp_path / "speculators")
    assert loaded.config.target_layer_ids == drafter.config.target_layer_ids
    assert loaded.config.draft_vocab_size == drafter.config.draft_vocab_size
    torch.testing.assert_close(loaded.lm_head.weight, tiny_llama.lm_head.weight[DRAFT_VOCAB])
    original = {name: tensor for name, tensor in loaded.state_dict().items() if name != "lm_head.weight"}
    assert original.keys() == drafter.state_dict().keys()
    for name, tensor in drafter.state_dict().items():
        torch.testing.assert_close(original[name], tensor)

    drafts = []
    for folder in (tmp_path / "own", tmp_path / "speculators"):
        proposer = build_proposer(method, tiny_llama, ProposerOptions(str(folder), 4))
        proposer.begin(128)
        proposer.extend_context(tiny_llama(torch.tensor(PROMPT), tiny_llama.new_cache(32),
                                           tap_layers=proposer.tap_layers).taps)
        drafts.append(proposer.propose(PROMPT + [1], 4))
    assert drafts[0] == drafts[1] and len(drafts[0]) == 4
    # Training's own layouts: vLLM cannot load EAGLE-3's, and would score DFlash's drafts with the target's head.
    refusal = "no speculators_model_type" if method == "eagle3" else "model.safetensors: no lm_head.weight for the 10-token"
    with pytest.raises(ValueError, match=refusal):
        check_vllm_drafter(tmp_path / "own", method)
    assert read_config(tmp_path / "own").get("speculators_model_type") is None
