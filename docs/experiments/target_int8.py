"""One-off measurement: the target on float32 activations (SDPA) against int8 activations (row-exact attention),
side by side in one process, for plain decoding and the bundled drafters, interleaved in rounds.

Greedy, 6 of set v2's held-out prompts (2 per category), 96 new tokens each; decode tokens per second,
median of the rounds, and whether each method's outputs are plain decoding's on the same target. Then what
int8 does to the model: the mean negative log-likelihood, under each target, of the float32 target's own
greedy continuations.
Run: .venv/bin/python docs/experiments/target_int8.py   (results in docs/benchmarks.md, "The target on int8")
"""

import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "runtime"))
from specserve_runtime.bench import held_out_sample, method_spec
from specserve_runtime.engine import Request
from specserve_runtime.loader import build_engine, load_model
from specserve_runtime.store import DEFAULT_MODEL
from specserve_runtime.training.sources import default_prompt_set

METHODS, ROUNDS, NEW_TOKENS = ["ar", "eagle3", "dflash"], 3, 96
TARGETS = {"float32": "0", "int8": "1"}

models = {}
for name, switch in TARGETS.items():
    os.environ["SPECSERVE_TARGET_INT8"] = switch
    models[name] = load_model(DEFAULT_MODEL)
records = [json.loads(line) for line in default_prompt_set().read_text().splitlines()]
prompts = [models["float32"].encode(record["prompt"]) for record in held_out_sample(records, 2)]
engines = {(target, method): build_engine(models[target], *method_spec(method)) for target in TARGETS for method in METHODS}
for engine in engines.values():
    engine.generate(Request(prompts[0], 8))  # warm-up
rates, outputs = {key: [] for key in engines}, {}
for _ in range(ROUNDS):
    for key, engine in engines.items():
        results = [engine.generate(Request(prompt, NEW_TOKENS)) for prompt in prompts]
        rates[key].append(sum(len(r.token_ids) - 1 for r in results) / sum(r.decode_seconds for r in results))
        outputs[key] = [r.token_ids for r in results]
print("| target | method | decode tok/s (median of rounds) | rounds | vs float32 `ar` | same as its `ar` |")
print("| --- | --- | --- | --- | --- | --- |")
base = statistics.median(rates["float32", "ar"])
for (target, method), values in rates.items():
    same = sum(a == b for a, b in zip(outputs[target, method], outputs[target, "ar"]))
    print(f"| {target} | {method} | {statistics.median(values):.1f} | {' / '.join(f'{v:.1f}' for v in values)} | "
          f"{statistics.median(values) / base:.2f}x | {same} of {len(prompts)} |")

continuations = outputs["float32", "ar"]
for target, model in models.items():
    losses = []
    for prompt, continuation in zip(prompts, continuations):
        tokens = torch.tensor(prompt + continuation)
        logits = model.target(tokens, model.target.new_cache(len(tokens))).logits
        # the logits at position i predict token i + 1: those of the continuation's tokens
        losses.append(F.cross_entropy(logits[len(prompt) - 1 : -1], tokens[len(prompt) :], reduction="sum").item())
    print(f"{target} target: mean NLL of the float32 greedy continuations {sum(losses) / sum(map(len, continuations)):.4f}")
