"""One-off measurement: two checkouts of the engine side by side, prompt by prompt. This machine's speed drifts by
10% and more within a minute (runs of the same build differ more than most changes do), so runs of one build after
the other cannot resolve a change of a few percent; here each checkout runs in a worker process of its own, with
its model loaded once, and the two take turns on every prompt (the order reversed every other prompt), only one
running at a time. Greedy (or, with --temperature T, seeded sampled: the seed the prompt's index) decodes of 3N
held-out prompts of set v2 (N a category, 128 new tokens) by each method:
per version the median decode speed, the medians of the per-prompt ratios new / base, and of each method's speed
over `ar` in its own version; and whether both versions gave every prompt the same tokens.

Run: git worktree add /tmp/base REV
     .venv/bin/python docs/experiments/versions_ab.py /tmp/base . [N] [METHODS] [--temperature T]   (METHODS:
     ar,dflash by default; results in docs/benchmarks.md, "Cold operations")
"""

import json
import statistics
import subprocess
import sys
from pathlib import Path


def worker(root: Path, methods: list[str], per_category: int, temperature: float) -> None:
    """Loads the checkout's engines, then for each line of stdin, "<prompt index> <method>", decodes that prompt and
    answers one line of JSON."""
    sys.path.insert(0, str(root / "runtime"))
    from specserve_runtime.bench import held_out_sample, method_spec
    from specserve_runtime.engine import Request
    from specserve_runtime.loader import build_engine, load_model
    from specserve_runtime.store import DEFAULT_MODEL
    from specserve_runtime.training.sources import default_prompt_set
    from specserve_runtime.verify import SamplingParams

    model = load_model(DEFAULT_MODEL)
    records = [json.loads(line) for line in default_prompt_set().read_text().splitlines()]
    prompts = [model.encode(record["prompt"]) for record in held_out_sample(records, per_category)]
    engines = {method: build_engine(model, *method_spec(method)) for method in methods}
    for engine in engines.values():
        engine.generate(Request(prompts[0], 16))  # warm-up
    print(json.dumps({"prompts": len(prompts)}), flush=True)
    for line in sys.stdin:
        index, method = line.split()
        result = engines[method].generate(Request(prompts[int(index)], 128, SamplingParams(temperature), seed=int(index)))
        print(json.dumps({"decode": (len(result.token_ids) - 1) / result.decode_seconds,
                          "tokens": result.token_ids}), flush=True)


def main() -> None:
    temperature = "0"
    if "--temperature" in sys.argv:
        at = sys.argv.index("--temperature")
        temperature = sys.argv.pop(at + 1)
        sys.argv.pop(at)
    base, new = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    per_category = sys.argv[3] if len(sys.argv) > 3 else "4"
    methods = (sys.argv[4] if len(sys.argv) > 4 else "ar,dflash").split(",")
    versions = {"base": base, "new": new}
    workers = {name: subprocess.Popen([sys.executable, __file__, "--worker", str(root), ",".join(methods), per_category,
                                       temperature],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
               for name, root in versions.items()}
    counts = {json.loads(process.stdout.readline())["prompts"] for process in workers.values()}
    (prompts,) = counts
    speeds = {(name, method): [] for name in versions for method in methods}
    same = True
    for index in range(prompts):
        for method in methods:
            tokens = {}
            for name in (("base", "new") if index % 2 == 0 else ("new", "base")):
                process = workers[name]
                process.stdin.write(f"{index} {method}\n")
                process.stdin.flush()
                answer = json.loads(process.stdout.readline())
                speeds[(name, method)].append(answer["decode"])
                tokens[name] = answer["tokens"]
            same = same and tokens["base"] == tokens["new"]
        print(f"prompt {index + 1}/{prompts}", file=sys.stderr, flush=True)
    for process in workers.values():
        process.stdin.close()
        process.wait()
    print(f"\n{prompts} prompts; both versions gave every prompt the same tokens by every method: {same}")
    print("| method | decode tok/s, base | decode tok/s, new | new / base | over ar, base | over ar, new |")
    print("|---|---|---|---|---|---|")
    for method in methods:
        b, n = speeds[("base", method)], speeds[("new", method)]
        over_ar = [statistics.median(s / a for s, a in zip(speeds[(name, method)], speeds[(name, "ar")]))
                   if "ar" in methods else float("nan") for name in versions]
        print(f"| {method} | {statistics.median(b):.1f} | {statistics.median(n):.1f} | "
              f"{statistics.median(x / y for x, y in zip(n, b)):.3f} | {over_ar[0]:.3f} | {over_ar[1]:.3f} |")


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), sys.argv[3].split(","), int(sys.argv[4]), float(sys.argv[5]))
    else:
        main()
