"""One-off measurement: the bundled drafters with their weights rounded to Q4_1 (blockquant.ROUNDING, the default)
against Q8_0 (the rounding before), in one process: whole greedy decodes of 3N held-out prompts of set v2 (N a
category, 128 new tokens), each prompt by every engine in turn (the order reversed every other prompt). Prints tau
(over the same tokens: every output is the target's), the median decode speed, and the medians of the per-prompt
ratios against `ar` and between the two roundings.

Run: .venv/bin/python docs/experiments/drafter_blocks.py [N]   (default 16; results in docs/benchmarks.md, "A
drafter on Q4_1")
"""

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "runtime"))
from specserve_runtime import blockquant  # noqa: E402
from specserve_runtime.bench import held_out_sample, method_spec  # noqa: E402
from specserve_runtime.engine import Request  # noqa: E402
from specserve_runtime.loader import build_engine, load_model  # noqa: E402
from specserve_runtime.store import DEFAULT_MODEL  # noqa: E402
from specserve_runtime.training.sources import default_prompt_set  # noqa: E402

ROUNDINGS = {"Q4_1": blockquant.q4_1_blocks, "Q8_0": blockquant.q8_0_blocks}
METHODS = ("dflash", "eagle3")


def main(per_category: int) -> None:
    model = load_model(DEFAULT_MODEL)
    records = [json.loads(line) for line in default_prompt_set().read_text().splitlines()]
    prompts = [model.encode(record["prompt"]) for record in held_out_sample(records, per_category)]
    engines = {"ar": build_engine(model, *method_spec("ar"))}
    for name, rounding in ROUNDINGS.items():
        blockquant.ROUNDING = rounding  # read when a drafter's weights are packed, at build
        for method in METHODS:
            engine = engines[f"{method} {name}"] = build_engine(model, *method_spec(method))
            assert engine.proposer.drafter.fc.int8_blocks.format == name  # the feature projection, like every layer
    blockquant.ROUNDING = ROUNDINGS["Q4_1"]
    rates = {name: [] for name in engines}
    counts = {name: [0, 0] for name in engines}  # accepted drafts, verify forwards (tau as the bench counts it)
    same = True
    for index, prompt in enumerate(prompts):
        outputs = set()
        for name in (list(engines) if index % 2 == 0 else list(reversed(engines))):
            result = engines[name].generate(Request(prompt, 128))
            rates[name].append((len(result.token_ids) - 1) / result.decode_seconds)
            counts[name][0] += result.num_accepted_tokens
            counts[name][1] += result.target_forwards
            outputs.add(tuple(result.token_ids))
        same = same and len(outputs) == 1
    print(f"{len(prompts)} prompts, every output the same: {same}")
    print("| engine | tau | decode tok/s | vs ar | Q4_1 / Q8_0 |\n|---|---|---|---|---|")
    for name in engines:
        versus = statistics.median([a / b for a, b in zip(rates[name], rates["ar"])])
        method, _, rounding = name.partition(" ")
        between = ""
        if rounding == "Q4_1":
            between = f"{statistics.median([a / b for a, b in zip(rates[name], rates[method + ' Q8_0'])]):.3f}"
        print(f"| {name} | {1 + counts[name][0] / counts[name][1]:.3f} | {statistics.median(rates[name]):.1f} | "
              f"{versus:.3f} | {between} |")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 16)
