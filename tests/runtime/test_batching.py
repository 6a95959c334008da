"""Continuous batching: sequences join and leave a batch between steps, and each one's output is
exactly what it is alone (tokens, finish reason and acceptance), for every method."""

import pytest
import torch

from specserve_runtime.drafters import NoDraft, ProposerOptions, build_proposer
from specserve_runtime.engine import Engine, Request
from specserve_runtime.model import Segment
from specserve_runtime.verify import SamplingParams

from .conftest import ByteTokenizer

PROPOSERS = {
    "ar": None,
    "ngram": ProposerOptions(num_speculative_tokens=4),
    "eagle3": ProposerOptions("random", 3, seed=1),
    "eagle3-tree": ProposerOptions("random", 4, seed=1, draft_tree=True),
    "dflash": ProposerOptions("random", 5, mask_token_id=95, seed=2),
    "dflash-tree": ProposerOptions("random", 5, mask_token_id=95, seed=2, draft_tree=True),
}


def requests() -> list[Request]:
    """Different lengths, limits, stop strings and sampling: a batch whose members diverge."""
    generator = torch.Generator().manual_seed(7)

    def prompt(length):
        return torch.randint(3, 90, (length,), generator=generator).tolist()

    return [
        Request(prompt(5), 30),
        Request(prompt(40), 12),  # longer than the small token budget below: prefilled in chunks
        Request(prompt(3) * 4, 25),  # repetitive, so n-gram drafts get accepted
        Request(prompt(9), 40, SamplingParams(temperature=0.8), seed=3),
        Request(prompt(17), 20, SamplingParams(temperature=0.7, top_p=0.9), seed=11),
        Request(prompt(6), 30, stop=("C",)),
        Request(prompt(2), 1),
    ]


def build(target, method: str, token_budget: int = 512, adaptive: bool = False) -> Engine:
    options = PROPOSERS[method]
    proposer = NoDraft() if options is None else build_proposer(method.removesuffix("-tree"), target, options)
    return Engine(target, ByteTokenizer(), proposer, {2}, token_budget, adaptive)


def run_batched(engine: Engine, requests: list[Request], joins: dict[int, int]):
    """Decode requests together; request i joins the batch at step joins.get(i, 0). Returns the results
    and, per step, how many sequences were in the batch."""
    sequences, batch, sizes = {}, [], []
    step_number = 0
    while len(sequences) < len(requests) or batch:
        for i, request in enumerate(requests):
            if i not in sequences and joins.get(i, 0) <= step_number:
                sequences[i] = engine.add(request)
                batch.append(sequences[i])
        if batch:
            sizes.append(len(batch))
            engine.step(batch)
            batch = [sequence for sequence in batch if sequence.finish_reason is None]
        step_number += 1
    return [sequences[i].stats for i in range(len(requests))], sizes


@pytest.mark.parametrize("method", PROPOSERS)
@pytest.mark.parametrize("token_budget", [512, 16])
def test_each_sequence_of_a_batch_decodes_exactly_as_it_would_alone(tiny_target, method, token_budget):
    engine = build(tiny_target, method, token_budget)
    alone = [engine.generate(request) for request in requests()]
    together, sizes = run_batched(engine, requests(), joins={1: 2, 4: 5, 6: 9})
    assert max(sizes) >= 5 and len(set(sizes)) > 2  # a real batch, joined and left as it ran
    for single, batched in zip(alone, together):
        assert batched.token_ids == single.token_ids
        assert batched.finish_reason == single.finish_reason
        assert (batched.num_draft_tokens, batched.num_accepted_tokens) == (single.num_draft_tokens,
                                                                           single.num_accepted_tokens)
    if method == "ngram":
        assert sum(result.num_accepted_tokens for result in together) > 0  # verify blocks were really batched


@pytest.mark.parametrize("method", ["ngram", "eagle3", "eagle3-tree", "dflash", "dflash-tree"])
def test_a_seeded_sample_is_the_same_text_with_and_without_speculation(tiny_llama, method):
    """Every position's token is drawn with a number fixed by (seed, position), so speculation, like
    batching, changes nothing of a seeded sampled request, not just its distribution."""
    plain, speculative = build(tiny_llama, "ar"), build(tiny_llama, method)
    for seed in range(5):
        request = Request([5, 17, 42, 8, 5, 17], 30, SamplingParams(temperature=0.9, top_p=0.95), seed=seed)
        assert speculative.generate(request).token_ids == plain.generate(request).token_ids
    other_seed = Request([5, 17, 42, 8, 5, 17], 30, SamplingParams(temperature=0.9, top_p=0.95), seed=99)
    assert plain.generate(other_seed).token_ids != plain.generate(request).token_ids  # the seed matters


def test_a_long_prompt_is_prefilled_in_chunks_while_running_sequences_keep_decoding(tiny_llama):
    engine = build(tiny_llama, "ar", token_budget=8)
    running = engine.add(Request([5, 6, 7], 30))
    while running.prefilling:
        engine.step([running])
    long_prompt = engine.add(Request(list(range(3, 43)), 5))  # 40 tokens: 7 per step beside the decode
    chunk_steps = 0
    while long_prompt.prefilling:
        decode, prefill = engine.step([running, long_prompt])
        assert decode is not None and len(decode.token_ids) == 1  # the running sequence never waits
        chunk_steps += prefill is None
    assert chunk_steps == 5  # 7 + 7 + 7 + 7 + 7 prompt tokens, then the last 5 with the first new token
    assert long_prompt.stats.token_ids == [] and len(long_prompt.tokens) == 41


def test_verify_blocks_are_batched_into_one_forward(tiny_llama):
    """The engine calls the target once per step, whatever the batch size."""
    engine = build(tiny_llama, "ngram")
    calls = []
    forward_batch = tiny_llama.forward_batch

    def counting(batch, tap_layers=()):
        calls.append(len(batch))
        return forward_batch(batch, tap_layers)

    tiny_llama.forward_batch = counting
    try:
        run_batched(engine, requests()[:4], joins={})
    finally:
        del tiny_llama.forward_batch
    assert max(calls) == 4


def test_a_batched_forward_equals_separate_forwards(tiny_llama):
    """Equal up to float32 rounding: a matrix product over more rows may sum in another order."""
    prompts = [torch.tensor([5, 17, 42, 8]), torch.tensor([9, 3]), torch.tensor([60, 61, 62, 63, 64, 65])]
    caches = [tiny_llama.new_cache(16) for _ in prompts]
    batched = tiny_llama.forward_batch([Segment(p, c, p.shape[0]) for p, c in zip(prompts, caches)], (1, 3))
    for prompt, cache, out in zip(prompts, caches, batched):
        alone = tiny_llama(prompt, tiny_llama.new_cache(16), (1, 3))
        assert cache.length == prompt.shape[0]
        torch.testing.assert_close(out.logits, alone.logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out.taps, alone.taps, rtol=1e-4, atol=1e-4)
    last_only = tiny_llama.forward_batch([Segment(prompts[0], tiny_llama.new_cache(16), 1),
                                          Segment(prompts[1], tiny_llama.new_cache(16), 0)])
    assert [out.logits.shape[0] for out in last_only] == [1, 0]
    torch.testing.assert_close(last_only[0].logits, batched[0].logits[-1:], rtol=1e-4, atol=1e-4)


def test_on_int8_a_batched_forward_has_each_sequences_bits_alone(tiny_llama_int8):
    """decoder.c runs attention for every row of every sequence in one parallel loop per layer (attention.c's
    attention_segments): each sequence's logits, taps and cache are bit for bit what it gets alone, whatever
    its neighbours' lengths and shapes (a prompt, one decode row, a chain, a tree)."""
    model = tiny_llama_int8
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 90, (n,), generator=generator) for n in (11, 3, 27, 6)]
    steps = [Segment(torch.randint(3, 90, (n,), generator=generator), None, n, parents)
             for n, parents in ((9, None), (1, None), (4, None), (5, [-1, 0, 0, 1, 1]))]

    def run(indices):
        caches = {i: model.new_cache(48) for i in indices}
        prompted = model.forward_batch([Segment(prompts[i], caches[i], 1) for i in indices], (1, 3))
        stepped = model.forward_batch([Segment(steps[i].tokens, caches[i], steps[i].num_logits, steps[i].parents)
                                       for i in indices], (2,))
        return {i: (a.logits, a.taps, b.logits, b.taps, caches[i]) for i, a, b in zip(indices, prompted, stepped)}

    batched = run(range(4))
    for i in range(4):
        *outputs, cache = run([i])[i]
        *batched_outputs, batched_cache = batched[i]
        assert all(torch.equal(ours, alone) for ours, alone in zip(batched_outputs, outputs))
        assert batched_cache.length == cache.length
        assert torch.equal(batched_cache.k[:, :, : cache.length], cache.k[:, :, : cache.length])
        assert torch.equal(batched_cache.v[:, :, : cache.length], cache.v[:, :, : cache.length])


def test_a_finished_sequence_cannot_take_another_step(tiny_llama):
    engine = build(tiny_llama, "ar")
    sequence = engine.add(Request([5, 6], 1))
    (step,) = engine.step([sequence])
    assert step.finish_reason == "length"
    with pytest.raises(ValueError, match="finished sequence"):
        engine.step([sequence])


def test_the_token_budget_must_be_positive(tiny_llama):
    with pytest.raises(ValueError, match="token budget"):
        Engine(tiny_llama, ByteTokenizer(), NoDraft(), set(), token_budget=0)


@pytest.mark.parametrize("method, rows", [("dflash", [4 * 6]), ("eagle3", [None, 4, 4]), ("eagle3-tree", [None, 4, 4, 4])])
def test_a_model_drafter_drafts_for_the_whole_batch_in_one_forward_per_pass(tiny_llama, method, rows, monkeypatch):
    """DFlash: one forward over the four sequences' blocks (block size 6); EAGLE-3: one forward per
    draft after the first (3 drafts; a tree of 4) for all four, whatever the batch size. (Counted at the
    drafter's entry for drafting, which runs its torch layers or decoder.c's.)"""
    engine = build(tiny_llama, method)
    batch = [engine.add(Request(list(range(5 + i, 12 + 2 * i)), 20)) for i in range(4)]
    engine.step(batch)  # the prompts
    calls = []
    drafter = engine.proposer.drafter
    entry = "draft_slots" if method == "dflash" else "forward"
    drafting = getattr(drafter, entry)
    monkeypatch.setattr(drafter, entry, lambda rows, *args, **kwargs: calls.append(rows.shape[0]) or drafting(rows, *args, **kwargs))
    engine.step(batch)
    assert len(calls) == len(rows)
    assert [n for n, expected in zip(calls, rows) if expected is not None] == [r for r in rows if r is not None]
    assert calls[0] >= 4  # the first pass carries every sequence's new positions


def test_a_batch_size_schedule_drafts_what_it_gives_the_batch_and_stays_lossless(tiny_llama):
    """numSpeculativeTokensPerBatchSize on the embedded engine: alone a sequence drafts 3, two together draft none,
    three or more 1 each (of the 5 its proposer offers); what each sequence says is what it says alone."""
    from specserve_runtime.config import parse_schedule

    from .test_engine import OracleProposer

    prompt = [5, 17, 42, 8, 63, 21, 9]
    alone = build(tiny_llama, "ar").generate(Request(prompt, 30)).token_ids
    proposer = OracleProposer(alone, len(prompt), k=5, corrupt_every=0)
    proposer.num_speculative_tokens = 5
    engine = Engine(tiny_llama, ByteTokenizer(), proposer, {2}, schedule=parse_schedule("1-1:3,2-2:0,3-:1"))
    sequences = [engine.add(Request(prompt, 30)) for _ in range(3)]
    for sequence in sequences:  # each prompt prefilled first: then every step of the batch decodes all of it
        engine.step([sequence])
    drafted = {}
    for size in (1, 2, 3):
        for _ in range(3):
            steps = engine.step(sequences[:size])
            drafted.setdefault(size, set()).update(step.num_draft_tokens for step in steps if step is not None)
    assert drafted == {1: {3}, 2: {0}, 3: {1}}
    for sequence in sequences:
        while sequence.finish_reason is None:
            engine.step([sequence])
        assert sequence.stopper.token_ids == alone
