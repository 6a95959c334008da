"""The shared decode loop on a tiny target: acceptance, KV rollback, stop conditions, and exact sampling."""

import pytest
import torch
from scipy.stats import chi2

from specserve_runtime.drafters import NoDraft, ProposerOptions, build_proposer
from specserve_runtime.engine import Engine, Request
from specserve_runtime import verify
from specserve_runtime.verify import DraftTree, SamplingParams, accept

from .conftest import ByteTokenizer

PROMPT = [5, 17, 42, 8, 63, 21, 9]


class OracleProposer:
    """Drafts a known continuation, optionally corrupting one draft per step (a test double).

    Unlike random drafters, it gets many drafts accepted, so every acceptance length and
    every KV crop size is exercised.
    """

    tap_layers = ()

    def __init__(self, continuation, prompt_len, k=5, corrupt_every=3, tail=()):
        self.continuation, self.prompt_len, self.k = list(continuation) + list(tail), prompt_len, k
        self.corrupt_every, self.calls = corrupt_every, 0

    def begin(self, capacity):
        self.calls = 0

    def extend_context(self, taps):
        pass

    def propose(self, tokens, max_drafts):
        self.calls += 1
        done = len(tokens) - self.prompt_len
        drafts = self.continuation[done : done + min(self.k, max_drafts)]
        if self.corrupt_every and self.calls % self.corrupt_every == 0 and drafts:
            position = self.calls % len(drafts)
            drafts[position] = (drafts[position] + 1) % 96
        return drafts


class TreeOracleProposer(OracleProposer):
    """Drafts a tree whose first child at every depth is wrong and whose second holds the known
    continuation (corrupted as OracleProposer does): the accepted branch is never the first, so
    its keys/values and features must be gathered from scattered slots."""

    def propose(self, tokens, max_drafts):
        budget = min(self.k, max_drafts)  # drafts in all: two per depth
        chain = super().propose(tokens, max(budget // 2, 1))
        drafts, parents, parent = [], [], -1
        for token in chain:
            if len(drafts) + 2 > budget:
                break
            drafts += [(token + 1) % 96, token]  # a wrong sibling first, then the oracle's token
            parents += [parent, parent]
            parent = len(drafts) - 1
        return DraftTree(drafts, parents)


def engine(target, proposer, eos_ids=frozenset()):
    return Engine(target, ByteTokenizer(), proposer, set(eos_ids))


def greedy(target, max_new_tokens=40, eos_ids=frozenset()):
    return engine(target, NoDraft(), eos_ids).generate(Request(PROMPT, max_new_tokens))


def test_accept_commits_the_matching_prefix_and_the_bonus_token():
    logits = torch.full((4, 10), -10.0)
    for row, token in enumerate([1, 2, 9, 4]):  # the target's greedy choices
        logits[row, token] = 10.0
    greedy_params = SamplingParams()
    chain = DraftTree.chain
    assert accept(chain([1, 2, 3]), logits, greedy_params) == ([1, 2, 9], [0, 1])  # third draft rejected
    assert accept(chain([7, 2, 9]), logits, greedy_params) == ([1], [])  # first draft rejected
    assert accept(chain([1, 2, 9]), logits, greedy_params) == ([1, 2, 9, 4], [0, 1, 2])  # all + bonus
    assert accept(chain([]), logits[:1], greedy_params) == ([1], [])  # plain decoding


def test_accept_walks_down_the_branch_the_target_agrees_with():
    # Drafts: 0:'7' and 1:'1' follow the committed tokens; 2:'5' and 3:'2' follow '1'; 4:'9' follows '2'.
    drafts = DraftTree([7, 1, 5, 2, 9], [-1, -1, 1, 1, 3])
    assert drafts.depths == [1, 1, 2, 2, 3]
    choices = {0: 1, 1: 0, 2: 2, 3: 8, 4: 3, 5: 6}  # the target's token at each row (row 1 + i: after draft i)
    logits = torch.full((6, 10), -10.0)
    for row, token in choices.items():
        logits[row, token] = 10.0
    # '1' (the second child), then '2' (again not the first), then the target's 3 after '2': '9' is rejected.
    assert accept(drafts, logits, SamplingParams()) == ([1, 2, 3], [1, 3])


@pytest.mark.parametrize("scale", [0.1, 1.0, 3.0, 10.0])
@pytest.mark.parametrize("top_p", [1e-9, 0.5, 0.9, 0.99])
def test_the_nucleus_is_the_smallest_set_of_most_likely_tokens_reaching_top_p(scale, top_p):
    """verify.nucleus (a partial selection, widened until every row's nucleus is inside it) against the definition
    on a full sort, over distributions from flat (nuclei of tens of thousands of tokens: the search widens many
    times) to peaked (one or two tokens); the top token always stays."""
    logits = torch.randn(4, 49152, generator=torch.Generator().manual_seed(int(scale * 10)), dtype=torch.float64)
    probs = torch.softmax(logits * scale, dim=-1)
    ordered, order = probs.sort(dim=-1, descending=True)
    outside = ordered.cumsum(dim=-1) - ordered >= top_p
    expected = torch.zeros_like(probs).scatter_(-1, order, ordered.masked_fill(outside, 0.0))
    kept = verify.nucleus(probs, top_p)
    assert torch.equal(kept, expected)
    assert torch.equal(kept.argmax(dim=-1), probs.argmax(dim=-1)) and (kept > 0).sum() >= 4


def test_a_draft_tree_needs_each_parent_before_its_children():
    with pytest.raises(ValueError, match="parent must come before"):
        DraftTree([1, 2], [1, -1])
    with pytest.raises(ValueError, match="2 draft tokens but 1 parents"):
        DraftTree([1, 2], [-1])


@pytest.mark.parametrize("corrupt_every", [0, 1, 2, 3])
@pytest.mark.parametrize("k", [1, 4, 7])
def test_oracle_drafts_are_lossless_at_every_acceptance_length(tiny_llama, k, corrupt_every):
    reference = greedy(tiny_llama)
    proposer = OracleProposer(reference.token_ids, len(PROMPT), k, corrupt_every)
    result = engine(tiny_llama, proposer).generate(Request(PROMPT, 40))
    assert result.token_ids == reference.token_ids
    if not (k == 1 and corrupt_every == 1):  # that one corrupts its only draft every time
        assert result.num_accepted_tokens > 0
        assert result.target_forwards < reference.target_forwards
    if corrupt_every == 0:  # perfect drafts: every forward commits k + 1 tokens (but the last)
        assert result.target_forwards == -(-(40 - 1) // (k + 1))


@pytest.mark.parametrize("corrupt_every", [0, 2])
@pytest.mark.parametrize("k", [2, 7])
def test_tree_drafts_are_lossless_and_accepted_off_the_first_branch(tiny_llama, k, corrupt_every):
    reference = greedy(tiny_llama)
    proposer = TreeOracleProposer(reference.token_ids, len(PROMPT), k, corrupt_every)
    result = engine(tiny_llama, proposer).generate(Request(PROMPT, 40))
    assert result.token_ids == reference.token_ids
    assert result.num_accepted_tokens > 0
    assert result.target_forwards < reference.target_forwards
    if corrupt_every == 0:  # every step accepts its whole oracle branch, half of the drafts
        assert result.num_accepted_tokens * 2 == result.num_draft_tokens
        assert result.target_forwards <= -(-(40 - 1) // (k // 2 + 1)) + 1  # +1: the last steps draft less


class FeatureRecorder:
    """Mixed into an oracle: taps the target's first layer and keeps every feature the engine hands it."""

    tap_layers = (0,)

    def begin(self, capacity):
        super().begin(capacity)
        self.features = []

    def extend_context(self, taps):
        self.features.append(taps.clone())


class ChainRecorder(FeatureRecorder, OracleProposer):
    pass


class TreeRecorder(FeatureRecorder, TreeOracleProposer):
    pass


@pytest.mark.parametrize("proposer_class", [ChainRecorder, TreeRecorder])
def test_the_drafter_gets_the_target_features_of_exactly_the_committed_tokens(tiny_llama, proposer_class):
    """After each verify step the drafter's context grows by the features of the tokens kept in the target's cache:
    the last committed token and the accepted drafts, a chain's leading rows or a tree's scattered ones, never a
    rejected draft's. Together they are what one forward over the committed tokens taps."""
    reference = greedy(tiny_llama)
    loop = engine(tiny_llama, proposer_class(reference.token_ids, len(PROMPT), k=6, corrupt_every=2))
    sequence = loop.add(Request(PROMPT, 40))
    while sequence.finish_reason is None:
        loop.step([sequence])
    assert sequence.stats.num_accepted_tokens > 0 and sequence.stats.num_accepted_tokens < sequence.stats.num_draft_tokens
    features = torch.cat(sequence.proposer.features)
    assert len(features) == len(sequence.tokens) - 1  # the last token opens the next block: not in the cache yet
    expected = tiny_llama(torch.tensor(sequence.tokens[:-1]), tiny_llama.new_cache(64), tap_layers=(0,)).taps
    torch.testing.assert_close(features, expected, rtol=1e-4, atol=1e-4)


def test_block_straddling_eos_stops_at_eos(tiny_llama):
    free_run = greedy(tiny_llama).token_ids
    eos = free_run[12]
    first = free_run.index(eos)
    reference = greedy(tiny_llama, eos_ids={eos})
    assert reference.token_ids == free_run[:first] and reference.finish_reason == "stop"
    # The oracle drafts straight through the EOS token and beyond it.
    proposer = OracleProposer(free_run, len(PROMPT), k=6, corrupt_every=0)
    result = engine(tiny_llama, proposer, {eos}).generate(Request(PROMPT, 40))
    assert result.token_ids == reference.token_ids
    assert result.finish_reason == "stop"


def test_max_new_tokens_is_never_exceeded(tiny_llama):
    reference = greedy(tiny_llama, max_new_tokens=10)
    proposer = OracleProposer(greedy(tiny_llama).token_ids, len(PROMPT), k=7, corrupt_every=0)
    result = engine(tiny_llama, proposer).generate(Request(PROMPT, 10))
    assert result.token_ids == reference.token_ids and len(result.token_ids) == 10
    assert result.finish_reason == "length"


def test_stop_string_ends_generation_without_emitting_text_past_it(tiny_llama):
    free_run = greedy(tiny_llama).token_ids
    stop = ByteTokenizer().decode(free_run[9:11])
    proposer = OracleProposer(free_run, len(PROMPT), k=6, corrupt_every=0)
    result = engine(tiny_llama, proposer).generate(Request(PROMPT, 40, stop=(stop,)))
    full_text = ByteTokenizer().decode(free_run)
    assert result.text == full_text[: full_text.index(stop)]
    assert result.finish_reason == "stop"
    assert len(result.token_ids) < len(free_run)


@pytest.mark.parametrize("method", ["ngram", "eagle3", "eagle3-tree", "dflash", "dflash-tree"])
def test_random_drafters_are_lossless_on_a_tiny_target(tiny_target, method):
    method, _, tree = method.partition("-")
    options = ProposerOptions("random", 3 if method != "dflash" else 5, mask_token_id=95, seed=1, draft_tree=bool(tree))
    proposer = build_proposer(method, tiny_target, options)
    result = engine(tiny_target, proposer).generate(Request(PROMPT, 40))
    assert result.token_ids == greedy(tiny_target).token_ids
    assert result.num_draft_tokens > 0


def _chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of observed counts against exact probabilities, pooling cells expected < 5 times."""
    expected = probs * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum().view(1)])
    expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = expected > 0
    statistic = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return float(chi2.sf(statistic, int(keep.sum()) - 1))


def _exact_two_token_distribution(target, prompt, params) -> torch.Tensor:
    """p(t1, t2 | prompt) at the given temperature, by enumerating t1."""
    vocab = target.config.vocab_size
    logits = target(torch.tensor(prompt), target.new_cache(len(prompt) + 1)).logits[-1]
    p1 = torch.softmax(logits / params.temperature, dim=-1)
    joint = torch.zeros(vocab, vocab)
    for t1 in range(vocab):
        next_logits = target(torch.tensor(prompt + [t1]), target.new_cache(len(prompt) + 1)).logits[-1]
        joint[t1] = p1[t1] * torch.softmax(next_logits / params.temperature, dim=-1)
    return joint


class ArgmaxProposer(OracleProposer):
    """Drafts the target's most likely tokens, which sampling accepts often: a strong test of rejection."""

    def __init__(self, target):
        super().__init__([], 0, k=2, corrupt_every=0)
        self.target = target

    def propose(self, tokens, max_drafts):
        drafts = []
        for _ in range(min(self.k, max_drafts)):
            logits = self.target(torch.tensor(tokens + drafts), self.target.new_cache(64)).logits[-1]
            drafts.append(int(logits.argmax()))
        return drafts


@pytest.mark.parametrize("proposer_name", ["argmax", "dflash", "dflash-tree", "eagle3-tree"])
def test_speculative_sampling_follows_the_target_distribution(tiny_target, proposer_name):
    params = SamplingParams(temperature=0.8)
    prompt = PROMPT[:4]
    joint = _exact_two_token_distribution(tiny_target, prompt, params)
    if proposer_name == "argmax":
        proposer = ArgmaxProposer(tiny_target)
    else:
        method, _, tree = proposer_name.partition("-")
        options = ProposerOptions("random", 3, mask_token_id=95, seed=0, draft_tree=bool(tree))
        proposer = build_proposer(method, tiny_target, options)
    spec = engine(tiny_target, proposer)
    counts = torch.zeros_like(joint)
    accepted = 0
    for seed in range(3000):
        result = spec.generate(Request(prompt, 3, params, seed=seed))  # the 2nd comes from a verify
        counts[result.token_ids[0], result.token_ids[1]] += 1
        accepted += result.num_accepted_tokens
    if proposer_name == "argmax":
        assert accepted > 300  # drafts were really accepted, not just rejected every time
    assert _chi_square_pvalue(counts.sum(1), joint.sum(1)) > 1e-3  # first token
    assert _chi_square_pvalue(counts.sum(0), joint.sum(0)) > 1e-3  # second token (marginal)
    assert _chi_square_pvalue(counts.flatten(), joint.flatten()) > 1e-3  # the pair


def test_chi_square_check_rejects_a_biased_sampler(tiny_llama):
    """The statistical test has power: accepting drafts without checking them would be caught."""
    params = SamplingParams(temperature=0.8)
    joint = _exact_two_token_distribution(tiny_llama, PROMPT[:4], params).flatten()
    biased = joint.clone()
    biased[joint.argmax()] += 0.05  # what an always-accept rule does: extra mass on the draft
    biased /= biased.sum()
    counts = torch.bincount(torch.multinomial(biased, 3000, replacement=True, generator=torch.Generator().manual_seed(0)), minlength=joint.numel())
    assert _chi_square_pvalue(counts.float(), joint) < 1e-3


def test_every_bit_of_a_seed_picks_its_own_random_numbers():
    """A request's seed is a 64-bit integer: seeds that agree in their low 32 bits (all torch's CPU generator
    would keep) or differ by one, and each seed's positions, draw different numbers, uniform on [0, 1)."""
    seeds = [5, 5 + 2**32, 5 + 2**48, -5, 6]
    draws = [tuple(verify.position_uniforms(seed, 0, 8).tolist()) for seed in seeds]
    assert len(set(draws)) == len(seeds) and all(len(set(d)) == 8 for d in draws)
    assert verify.position_uniforms(5, 3, 5).tolist() == list(draws[0][3:])  # a function of (seed, position) alone
    many = torch.cat([verify.position_uniforms(seed, 0, 100) for seed in range(500)])
    counts = torch.bincount((many * 10).long(), minlength=10).float()
    assert _chi_square_pvalue(counts, torch.full((10,), 0.1)) > 1e-3 and 0 <= many.min() and many.max() < 1
