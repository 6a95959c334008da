"""What the decode A/B experiments share: whole greedy (or seeded sampled) decodes of 3N held-out prompts of set v2 (N a category, 128
new tokens), each prompt by each method every way in turn (the order reversed every other prompt, so that neither
way always runs first), and a table of the medians of the per-prompt ratios against the first way. A way is a
function that puts its variant in place (a patch); the first way is the baseline."""

import json
import statistics
from typing import Callable

from specserve_runtime.bench import held_out_sample, method_spec
from specserve_runtime.engine import Request
from specserve_runtime.loader import build_engine
from specserve_runtime.training.sources import default_prompt_set
from specserve_runtime.verify import SamplingParams


def engines_for(model, methods: tuple[str, ...]) -> dict:
    return {method: build_engine(model, *method_spec(method)) for method in methods}


def paired_decodes(model, engines: dict, ways: dict[str, Callable[[], None]], per_category: int,
                   max_tokens: int = 128, sampling: SamplingParams = SamplingParams()) -> None:
    """engines: method -> the engine (engines_for) whose parts the ways patch; sampling: greedy, or seeded samples
    (the seed the prompt's index, as the bench seeds them)."""
    records = [json.loads(line) for line in default_prompt_set().read_text().splitlines()]
    prompts = [model.encode(record["prompt"]) for record in held_out_sample(records, per_category)]
    methods = tuple(engines)
    names = list(ways)
    rates = {(way, method): [] for way in names for method in methods}
    prefills = {(way, method): [] for way in names for method in methods}
    outputs = set()
    for index, prompt in enumerate(prompts):
        for way in (names if index % 2 == 0 else names[::-1]):
            ways[way]()
            for method in methods:
                result = engines[method].generate(Request(prompt, max_tokens, sampling, seed=index))
                rates[(way, method)].append((len(result.token_ids) - 1) / result.decode_seconds)
                prefills[(way, method)].append(result.prefill_seconds)
                outputs.add((index, tuple(result.token_ids)))
    ways[names[0]]()
    print(f"\n{len(prompts)} prompts, every output the same every way and by every method: {len(outputs) == len(prompts)}")
    print(f"| method | {' | '.join(f'decode tok/s, {way}' for way in names)} | "
          f"{' | '.join(f'{way} / {names[0]}: decode speed, prefill time' for way in names[1:])} |")
    print("|---" * (1 + 2 * len(names) - 1) + "|")
    for method in methods:
        speeds = " | ".join(f"{statistics.median(rates[(way, method)]):.1f}" for way in names)
        ratios = " | ".join(
            f"{statistics.median([a / b for a, b in zip(rates[(way, method)], rates[(names[0], method)])]):.3f}, "
            f"{statistics.median([a / b for a, b in zip(prefills[(way, method)], prefills[(names[0], method)])]):.3f}"
            for way in names[1:])
        print(f"| {method} | {speeds} | {ratios} |")
