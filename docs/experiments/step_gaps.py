"""One-off measurement: how long a decode step spends between its C calls (Python, torch's small operations) and in
them, per method, as the engine runs it.

Every entry point of the kernels (blockquant.c, decoder.c) is timed where the engine calls it, and so is each step;
what lies between two calls of a step (or between a call and the step's start or end) is a gap, reported by the
calls on either side of it. Greedy, 3N of set v2's held-out prompts (N a category), 128 new tokens, decode steps only
(the prefill's is left out).

Run: .venv/bin/python docs/experiments/step_gaps.py [N] [METHOD ...]   (default 4 ar dflash; results in
     docs/benchmarks.md, "Between the C calls")
"""

import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "runtime"))
from specserve_runtime import blockquant  # noqa: E402
from specserve_runtime import engine as engine_module  # noqa: E402
from specserve_runtime.bench import held_out_sample, method_spec  # noqa: E402
from specserve_runtime.engine import Request  # noqa: E402
from specserve_runtime.loader import build_engine, load_model  # noqa: E402
from specserve_runtime.store import DEFAULT_MODEL  # noqa: E402
from specserve_runtime.training.sources import default_prompt_set  # noqa: E402

ENTRY_POINTS = ["decoder_layers", "dflash_context", "blockquant_linear", "blockquant_argmax", "blockquant_top_log_probs",
                "blockquant_sample"]
events: list[tuple[str, float, float]] = []  # (what, started, ended), in order


def timed(name, function):
    def run(*args):
        started = time.perf_counter()
        try:
            return function(*args)
        finally:
            events.append((name, started, time.perf_counter()))
    return run


def main() -> None:
    per_category, methods = (int(sys.argv[1]), sys.argv[2:]) if len(sys.argv) > 1 else (4, [])
    kernels = blockquant.library()
    for name in ENTRY_POINTS:
        setattr(kernels, name, timed(name, getattr(kernels, name)))
    engine_module.Engine.step = timed("step", engine_module.Engine.step)
    model = load_model(DEFAULT_MODEL)
    records = [json.loads(line) for line in default_prompt_set().read_text().splitlines()]
    prompts = [model.encode(record["prompt"]) for record in held_out_sample(records, per_category)]
    print("| method | steps | step, ms | in C calls | between them | largest gaps, ms a step |\n|---|---|---|---|---|---|")
    for method in methods or ["ar", "dflash"]:
        engine = build_engine(model, *method_spec(method))
        engine.generate(Request(prompts[0], 16))  # warm-up
        gaps, in_calls, total, steps = defaultdict(float), 0.0, 0.0, 0
        for prompt in prompts:
            events.clear()
            engine.generate(Request(prompt, 128))
            calls, first = [], True  # a step's own event comes after its calls'; the first step is the prefill
            for name, started, ended in events:
                if name != "step":
                    calls.append((name, started, ended))
                    continue
                if not first:
                    bounds = [("start", started, started)] + calls + [("end", ended, ended)]
                    for (before, _, done), (after, begun, _) in zip(bounds, bounds[1:]):
                        gaps[f"{before} -> {after}"] += begun - done
                    in_calls += sum(end - begin for _, begin, end in calls)
                    total, steps = total + ended - started, steps + 1
                calls, first = [], False
        largest = sorted(gaps.items(), key=lambda gap: -gap[1])[:4]
        ms = [1000 * x / steps for x in (total, in_calls, total - in_calls)]
        print(f"| {method} | {steps} | " + " | ".join(f"{x:.2f}" for x in ms) + " | "
              + "; ".join(f"{name} {1000 * gap / steps:.2f}" for name, gap in largest) + " |", flush=True)


if __name__ == "__main__":
    main()
