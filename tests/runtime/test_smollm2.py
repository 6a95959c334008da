"""Losslessness on the real default target (SmolLM2-135M-Instruct) with random drafters."""

import json
import shutil
import subprocess
import sys

import pytest

from specserve_runtime.drafters import DEFAULT_DRAFTERS, ProposerOptions, build_proposer
from specserve_runtime.engine import Request
from specserve_runtime.loader import build_engine
from specserve_runtime.verify import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = {
    "chat": "Give me three tips for sleeping better.",
    "code": "Write a Python function that checks whether a number is prime.",
    "math": "A train travels 60 km in 45 minutes. What is its speed in km per hour?",
    "list": "List the planets of the solar system in order.",
    "short": "How many legs does a dog have?",  # answered in 16 tokens, then <|im_end|>
}
SPECULATIVE = {
    "ngram": ProposerOptions(num_speculative_tokens=4),
    "eagle3": ProposerOptions("random", 3, seed=1),
    "dflash": ProposerOptions("random", 7, seed=2),  # block size 8
    "dflash-b4": ProposerOptions("random", 3, seed=3),
    # The bundled trained drafters (reduced draft vocabulary) at their default and full lengths.
    "eagle3-bundled": ProposerOptions(),
    "dflash-bundled": ProposerOptions(),
    "dflash-bundled-7": ProposerOptions(num_speculative_tokens=7),
    "dflash-bundled-tree8": ProposerOptions(num_speculative_tokens=8, draft_tree=True),
    # ... with prompt lookup's copy as one more branch of their trees, and without it.
    "dflash-bundled-lookup": ProposerOptions(prompt_lookup=6),
    "eagle3-bundled-lookup": ProposerOptions(prompt_lookup=6),
    "dflash-bundled-nolookup": ProposerOptions(prompt_lookup=0),
}


@pytest.fixture(scope="module")
def engines(smollm2):
    built = {"ar": build_engine(smollm2, "ar")}
    for name, options in SPECULATIVE.items():
        built[name] = build_engine(smollm2, name.split("-")[0], options)
    return built


@pytest.fixture(scope="module")
def reference(smollm2, engines):
    return {kind: engines["ar"].generate(Request(smollm2.encode(p), 24)) for kind, p in PROMPTS.items()}


@pytest.mark.parametrize("method", list(SPECULATIVE))
@pytest.mark.parametrize("kind", list(PROMPTS))
def test_greedy_speculative_output_is_token_identical_to_ar(smollm2, engines, reference, method, kind):
    result = engines[method].generate(Request(smollm2.encode(PROMPTS[kind]), 24))
    assert result.token_ids == reference[kind].token_ids
    assert result.finish_reason == reference[kind].finish_reason
    assert result.num_draft_tokens > 0 or method == "ngram"


def test_bundled_drafters_verify_their_measured_number_of_drafts(engines):
    for method in ("dflash", "eagle3"):  # config.json's specserve_operating_point: trees of 3, copies of up to 4
        proposer = engines[f"{method}-bundled"].proposer
        assert (proposer.num_speculative_tokens, proposer.tree, proposer.prompt_lookup) == (3, True, 4)
    whole_block = engines["dflash-bundled-7"].proposer  # a count on request: a chain, the whole block, no copies
    assert (whole_block.num_speculative_tokens, whole_block.tree, whole_block.prompt_lookup) == (7, False, 0)



def test_a_bundled_drafter_given_by_path_runs_at_its_operating_point_too(smollm2, tmp_path):
    """A copy of a bundled drafter's folder, given as a --drafter path (as a pvc:// mount is): the operating point
    travels in its config.json."""
    for method, point in [("dflash", (3, True, 4)), ("eagle3", (3, True, 4))]:
        copy = shutil.copytree(DEFAULT_DRAFTERS[method], tmp_path / method)
        proposer = build_proposer(method, smollm2.target, ProposerOptions(str(copy)))
        assert (proposer.num_speculative_tokens, proposer.tree, proposer.prompt_lookup) == point

def test_short_answer_stops_at_eos_inside_a_block(smollm2, engines, reference):
    """The short answer ends with <|im_end|> well before max tokens, inside a drafted block."""
    assert reference["short"].finish_reason == "stop" and len(reference["short"].token_ids) < 24
    for method in SPECULATIVE:
        result = engines[method].generate(Request(smollm2.encode(PROMPTS["short"]), 24))
        assert result.token_ids == reference["short"].token_ids and result.finish_reason == "stop"


def test_max_new_tokens_cuts_every_method_at_the_same_token(smollm2, engines):
    ids = smollm2.encode(PROMPTS["code"])
    expected = engines["ar"].generate(Request(ids, 7)).token_ids
    for method in SPECULATIVE:
        result = engines[method].generate(Request(ids, 7))
        assert result.token_ids == expected and result.finish_reason == "length"


def test_ngram_accepts_drafts_on_repetitive_text(smollm2, engines):
    prompt = "Repeat exactly, five times: the quick brown fox jumps over the lazy dog."
    result = engines["ngram"].generate(Request(smollm2.encode(prompt), 48))
    assert result.acceptance_length > 1.5


def test_a_drafters_lookup_branch_commits_copies_its_guesses_miss(smollm2, engines):
    """Text that repeats itself: prompt lookup's copies are accepted where the drafter's own guesses are not,
    so the same drafter commits more tokens per step with the branch than without it."""
    ids = smollm2.encode("Repeat exactly, five times: the quick brown fox jumps over the lazy dog.")
    with_copies = engines["dflash-bundled-lookup"].generate(Request(ids, 48))
    without = engines["dflash-bundled-nolookup"].generate(Request(ids, 48))
    assert with_copies.token_ids == without.token_ids == engines["ar"].generate(Request(ids, 48)).token_ids
    assert with_copies.acceptance_length > without.acceptance_length + 0.3


def test_sampling_is_reproducible_with_a_seed(smollm2, engines):
    request = Request(smollm2.encode(PROMPTS["chat"]), 16, SamplingParams(temperature=0.7), seed=11)
    assert engines["dflash"].generate(request).token_ids == engines["dflash"].generate(request).token_ids


def test_generate_command_json_contract():
    """The README's first command: dflash with a random drafter, JSON output, from the installed entry point."""
    specserve = shutil.which("specserve") or str(__import__("pathlib").Path(sys.executable).parent / "specserve")
    run = subprocess.run(
        [specserve, "generate", "--method", "dflash", "--drafter", "random", "--prompt", "hello", "--json",
         "--max-new-tokens", "12"],
        capture_output=True, text=True, check=True, timeout=300,
    )
    record = json.loads(run.stdout.strip().splitlines()[-1])
    for field in ("index", "text", "token_ids", "num_generated", "target_forwards", "acceptance_length", "decode_seconds"):
        assert field in record
    assert record["index"] == 0 and record["num_generated"] == len(record["token_ids"]) > 0
    assert record["acceptance_length"] >= 1.0 and record["target_forwards"] >= 1
