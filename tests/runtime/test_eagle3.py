"""EAGLE-3 drafting: the chain of the drafter's top guesses, and the tree of its most likely branches."""

import heapq
import json

import pytest
import torch

from specserve_runtime import blockquant
from specserve_runtime.drafters import ProposerOptions, build_proposer
from specserve_runtime.drafters.eagle3 import DraftsBestFirst, Eagle3Config, Eagle3Drafter, save_eagle3
from specserve_runtime.kv_cache import KVCache
from specserve_runtime.native import CACHE_DTYPE, cache_dtype
from specserve_runtime.verify import DraftTree

SHARPEN = 2.0
CONTEXT = 9  # target features of the first 9 tokens; the drafter's last position guesses token 11


def drafting_setup(target, num_drafts: int, tree: bool, seed: int):
    proposer = build_proposer("eagle3", target, ProposerOptions("random", num_drafts, seed=seed, draft_tree=tree))
    with torch.no_grad():  # sharpen the random drafter: confident guesses make deep trees, sharp attention
        proposer.drafter.norm.weight.mul_(SHARPEN)  # makes what a draft sees change its guesses
        for projection in (proposer.drafter.midlayer.self_attn.q_proj, proposer.drafter.midlayer.self_attn.k_proj):
            projection.weight.mul_(8)
    tokens = torch.randint(0, 96, (CONTEXT + 1,), generator=torch.Generator().manual_seed(seed)).tolist()
    taps = target(torch.tensor(tokens), target.new_cache(32), tap_layers=proposer.tap_layers).taps
    return proposer, tokens, taps[:CONTEXT]


def log_probs_after(proposer, tokens, taps, branch: tuple[int, ...]) -> list[float]:
    """The drafter's log-probabilities for the token after `branch`, on a cache of its own that holds
    the context and that branch only: what a tree's draft must see, without any mask."""
    drafter, target = proposer.drafter, proposer.target
    cache = KVCache(1, drafter.config.num_key_value_heads, drafter.config.head_dim, 64, cache_dtype(drafter.native_layers))
    with torch.inference_mode():
        hidden = drafter(target.embed_tokens(torch.tensor(tokens[1:])), drafter.fc(taps), [cache], [CONTEXT])[-1:]
        for token in branch:
            hidden = drafter(target.embed_tokens(torch.tensor([token])), hidden, [cache], [1])
        return torch.log_softmax(proposer.head.logits(drafter.norm(hidden)).float(), -1)[0].tolist()


def best_first(after, num_drafts: int) -> DraftTree:
    """The `num_drafts` most likely branches by brute force: every token of every expanded draft."""
    tokens, parents = [], []
    candidates = [(-log_prob, (token,), -1) for token, log_prob in enumerate(after(()))]
    heapq.heapify(candidates)
    while len(tokens) < num_drafts:
        cost, branch, parent = heapq.heappop(candidates)
        tokens.append(branch[-1])
        parents.append(parent)
        for token, log_prob in enumerate(after(branch)):
            heapq.heappush(candidates, (cost - log_prob, branch + (token,), len(tokens) - 1))
    return DraftTree(tokens, parents)


@pytest.mark.parametrize("seed", [0, 1, 3])  # trees more than one draft deep and more than one wide
def test_a_tree_holds_the_drafters_most_likely_branches_each_read_as_if_alone(tiny_llama, seed, monkeypatch):
    read = {}  # draft (-1: the committed tokens) -> the top log-probabilities of its children, as the tree saw them
    expand = DraftsBestFirst.expand

    def recording(self, draft, hidden, log_probs, tokens):
        read[draft] = log_probs
        expand(self, draft, hidden, log_probs, tokens)

    monkeypatch.setattr(DraftsBestFirst, "expand", recording)
    proposer, tokens, taps = drafting_setup(tiny_llama, 6, True, seed)
    proposer.begin(64)
    proposer.extend_context(taps)
    drafted = proposer.propose(tokens, 6)
    assert not drafted.is_chain and max(drafted.depths) > 1  # branches were read beside each other

    def branch(draft: int) -> tuple[int, ...]:
        return branch(drafted.parents[draft]) + (drafted.tokens[draft],) if draft >= 0 else ()

    expected = best_first(lambda prefix: log_probs_after(proposer, tokens, taps, prefix), 6)
    assert (drafted.tokens, drafted.parents) == (expected.tokens, expected.parents)
    for draft, log_probs in read.items():  # masks and positions: each draft saw its own branch, no other
        alone = sorted(log_probs_after(proposer, tokens, taps, branch(draft)), reverse=True)
        assert log_probs == pytest.approx(alone[: len(log_probs)], abs=1e-5)


def test_a_chain_follows_the_drafters_top_guess(tiny_llama):
    proposer, tokens, taps = drafting_setup(tiny_llama, 4, False, 0)
    proposer.begin(64)
    proposer.extend_context(taps)
    branch: tuple[int, ...] = ()
    for _ in range(4):
        after = log_probs_after(proposer, tokens, taps, branch)
        branch += (max(range(len(after)), key=after.__getitem__),)
    assert proposer.propose(tokens, 4) == list(branch)


def test_a_recorded_operating_point_may_be_a_tree(tmp_path, tiny_llama):
    save_eagle3(Eagle3Drafter(Eagle3Config.for_target(tiny_llama.config)), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    point = {"num_speculative_tokens": 5, "draft_tree": True}
    (tmp_path / "config.json").write_text(json.dumps({**config, "specserve_operating_point": point}))
    proposer = build_proposer("eagle3", tiny_llama, ProposerOptions(str(tmp_path)))
    assert (proposer.num_speculative_tokens, proposer.tree) == (5, True)
    chain = build_proposer("eagle3", tiny_llama, ProposerOptions(str(tmp_path), 3))
    assert (chain.num_speculative_tokens, chain.tree) == (3, False)


@pytest.mark.skipif(not blockquant.int8_enabled(), reason="decoder.c's layers need AVX-512 VNNI")
def test_drafting_in_c_layers_computes_what_the_torch_layer_computes(tiny_llama):
    """An EAGLE-3 drafter on int8 products runs its layer in decoder.c ([normed embeddings ; normed features],
    the features' residual): the context's rows (causal), then two drafts read with masks that hide each other's
    slots, against the torch layer on the same products (a last-bit difference may round one int8 activation a
    step apart: test_model's test_native_layers_compute_what_the_torch_layers_compute)."""
    proposer, tokens, taps = drafting_setup(tiny_llama, 3, True, 0)
    drafter, target = proposer.drafter, proposer.target
    native = drafter.native_layers
    assert native is not None
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():  # norms of their own (ones at init), so that mixing them up shows; in place: C reads them too
        for norm in (drafter.midlayer.input_layernorm, drafter.midlayer.hidden_norm, drafter.midlayer.post_attention_layernorm):
            norm.weight.uniform_(0.5, 1.5, generator=generator)

    def draft(layers):
        drafter.native_layers = layers
        cache = KVCache(1, drafter.config.num_key_value_heads, drafter.config.head_dim, 64, CACHE_DTYPE)  # decoder.c's
        with torch.inference_mode():
            context = drafter(target.embed_tokens(torch.tensor(tokens[1:])), drafter.fc(taps), [cache], [CONTEXT])
            reads = []
            for token, hidden in ((5, context[-1:]), (7, context[-1:])):  # two siblings: the second must not see the first
                slot = cache.length
                mask = torch.zeros(1, slot + 1, dtype=torch.bool)
                mask[0, :CONTEXT] = True
                mask[0, slot] = True
                reads.append(drafter(target.embed_tokens(torch.tensor([token])), hidden, [cache], [1],
                                     [CONTEXT], [mask]))
        return [context, *reads], cache

    try:
        (outputs, cache), (expected, expected_cache) = draft(native), draft(None)
    finally:
        drafter.native_layers = native
    for ours, theirs in zip(outputs, expected):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0.05 * theirs.abs().max().item())
    for ours, theirs in ((cache.k, expected_cache.k), (cache.v, expected_cache.v)):
        torch.testing.assert_close(ours[:, :, : cache.length], theirs[:, :, : cache.length], rtol=0,
                                   atol=0.05 * theirs.abs().max().item())
    # The second sibling, its first sibling's slot masked, computes what it computes read first: the same keys.
    drafter.native_layers = native
    alone = KVCache(1, drafter.config.num_key_value_heads, drafter.config.head_dim, 64, CACHE_DTYPE)
    with torch.inference_mode():
        context = drafter(target.embed_tokens(torch.tensor(tokens[1:])), drafter.fc(taps), [alone], [CONTEXT])
        first = drafter(target.embed_tokens(torch.tensor([7])), context[-1:], [alone], [1], [CONTEXT])
    assert cache.length == CONTEXT + 2 and torch.equal(first, outputs[2])
