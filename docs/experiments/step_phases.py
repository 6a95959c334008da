"""One-off measurement: where one sequence's decode step goes (drafting, the target's verify forward,
the rest: acceptance, commit, Python), per method, as the engine runs it, with the drafter's products
on float32 weights ("/float32 drafter": SPECSERVE_DRAFTER_INT8=0), its LM head on torch's F.linear
("/unpacked head") or a DFlash drafter's context projection and layers in torch instead of decoder.c ("/torch
layers"), interleaved
in rounds.

Greedy, 6 of set v2's held-out prompts (2 per category), 96 new tokens each, decode only.
Run: .venv/bin/python docs/experiments/step_phases.py [METHOD[/float32 drafter|/unpacked head|/torch layers] ...]   (results in
docs/benchmarks.md, "The drafters' own matrix products" and "int8 activations")
"""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "runtime"))
from specserve_runtime import engine as engine_module
from specserve_runtime.bench import held_out_sample, method_spec
from specserve_runtime.engine import Request
from specserve_runtime.loader import build_engine, load_model
from specserve_runtime.store import DEFAULT_MODEL
from specserve_runtime.training.sources import default_prompt_set

METHODS = sys.argv[1:] or ["ar", "dflash", "dflash/float32 drafter", "eagle3", "eagle3/float32 drafter"]
ROUNDS = 2

model = load_model(DEFAULT_MODEL)
records = [json.loads(line) for line in default_prompt_set().read_text().splitlines()]
prompts = [model.encode(record["prompt"]) for record in held_out_sample(records, 2)]
spent = {"draft": 0.0, "verify": 0.0}


def timed(phase, function):
    def run(*args, **kwargs):
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent[phase] += time.perf_counter() - started
    return run


engine_module.propose_all = timed("draft", engine_module.propose_all)
model.target.forward_batch = timed("verify", model.target.forward_batch)
print("| method | tau | step ms | draft ms | verify ms | rest ms | decode tok/s |\n|---|---|---|---|---|---|---|")
for label in METHODS * ROUNDS:
    spec, _, variant = label.partition("/")
    os.environ["SPECSERVE_DRAFTER_INT8"] = "0" if variant == "float32 drafter" else "1"
    engine = build_engine(model, *method_spec(spec))
    if variant == "unpacked head":
        engine.proposer.head.linear = None  # every sequence's proposer copy shares this head
    if variant == "torch layers":
        engine.proposer.drafter.native_layers = None  # a DFlash drafter's layers in torch, not decoder.c
    engine.generate(Request(prompts[0], 16))  # warm-up
    draft = verify = decode = 0.0
    steps = tokens = 0
    for prompt in prompts:
        spent.update(draft=0.0, verify=0.0)
        result = engine.generate(Request(prompt, 96))
        draft += spent["draft"]
        verify += spent["verify"] - result.prefill_seconds  # the prefill's forward is not a decode step
        decode += result.decode_seconds
        steps, tokens = steps + result.target_forwards, tokens + len(result.token_ids) - 1
    ms = [1000 * x / steps for x in (decode, draft, verify, decode - draft - verify)]
    print(f"| {label} | {tokens / steps:.2f} | " + " | ".join(f"{x:.1f}" for x in ms) + f" | {tokens / decode:.1f} |",
          flush=True)
