"""One-off measurement: what the engine's int8 target does to the model, as one number per build. The float32
target (SPECSERVE_TARGET_INT8=0, oneDNN, float32 caches) decodes 8 held-out prompts of each category of set v2
greedily, 128 new tokens; then the mean negative log-likelihood of those continuations, and how often each
target's top token is the continuation's, under both targets. Run it on two commits to compare their int8
arithmetic (the float32 target's numbers are the same on both).

Run: .venv/bin/python docs/experiments/target_nll.py   (results in docs/benchmarks.md, "Keys and values in float16")
"""

import json
import os
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

models = {}
for name, switch in {"float32": "0", "int8": "1"}.items():
    os.environ["SPECSERVE_TARGET_INT8"] = switch
    models[name] = load_model(DEFAULT_MODEL)
records = [json.loads(line) for line in default_prompt_set().read_text().splitlines()]
prompts = [models["float32"].encode(record["prompt"]) for record in held_out_sample(records, 8)]
engine = build_engine(models["float32"], *method_spec("ar"))
continuations = [engine.generate(Request(prompt, 128)).token_ids for prompt in prompts]
count = sum(map(len, continuations))
with torch.inference_mode():
    for name, model in models.items():
        loss = agree = 0.0
        for prompt, continuation in zip(prompts, continuations):
            tokens = torch.tensor(prompt + continuation)
            # the logits at position i predict token i + 1: those of the continuation's tokens
            logits = model.target(tokens, model.target.new_cache(len(tokens))).logits[len(prompt) - 1 : -1]
            loss += F.cross_entropy(logits, tokens[len(prompt) :], reduction="sum").item()
            agree += (logits.argmax(-1) == tokens[len(prompt) :]).sum().item()
        print(f"{name} target: mean NLL {loss / count:.4f}, top token the float32 continuation's {agree / count:.2%} "
              f"({len(prompts)} prompts, {count} tokens)")
