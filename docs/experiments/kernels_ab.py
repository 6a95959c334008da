"""One-off measurement: two builds of one kernel source (blockquant.c, attention.c or decoder.c: the one the second
file is named for; the other two as in the tree) in one process, on what a decode step runs: the target's forward
of 1, 4, 8 and 12 new rows after 300 cached positions (--prefix N: N; its layers in decoder.c, the taps, the LM
head), and a DFlash drafting step (the bundled drafter's block of 8 through its layers, and its head on 3 rows),
each drafting step timed right after a 4-row verify forward so that the caches hold what they hold in a real step.
Interleaved in rounds; medians. With --decode N, then whole greedy decodes of 3N held-out prompts of set v2 (N a
category, 128 new tokens), each prompt by each build in turn, plain decoding and the bundled DFlash drafter: the
medians of the per-prompt ratios, and whether every output is the same.

Run: git show REV:runtime/specserve_runtime/blockquant.c > /tmp/before.c
     .venv/bin/python docs/experiments/kernels_ab.py /tmp/before.c runtime/specserve_runtime/blockquant.c \
         [--decode 6] [--prefix N]
(results in docs/benchmarks.md, "Tiles of a known size" and, for attention.c, "Keys into registers")
"""

import copy
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "runtime"))
from specserve_runtime import blockquant  # noqa: E402

KERNELS = Path(blockquant.__file__).parent
ROUNDS, CALLS, ROWS = 15, 20, (1, 4, 8, 12)


def build(source: str, replaces: str, folder: str, name: str) -> ctypes.CDLL:
    """The engine's library with `source` in place of its file named `replaces`."""
    library = Path(folder) / f"{name}.so"
    sources = [source if tree.name == replaces else str(tree) for tree in blockquant.SOURCES]
    subprocess.run(["cc", *blockquant.CFLAGS, f"-I{KERNELS}", "-o", str(library), *sources], check=True)
    return blockquant.declare(ctypes.CDLL(str(library)))


def main(before: str, after: str, per_category: int = 0, prefix: int = 300) -> None:
    from specserve_runtime.bench import method_spec
    from specserve_runtime.loader import build_engine, load_model
    from specserve_runtime.model import Segment
    from specserve_runtime.store import DEFAULT_MODEL

    with tempfile.TemporaryDirectory() as folder:
        tree_build = blockquant.library()  # the engine loads the tree's build until a round picks one
        replaces = Path(after).name
        if replaces not in {tree.name for tree in blockquant.SOURCES}:
            sys.exit(f"{after}: not named for one of the kernel sources {[tree.name for tree in blockquant.SOURCES]}")
        builds = {name: build(path, replaces, folder, name)
                  for name, path in (("before", before), ("after", after))}
        current = {"build": tree_build}
        blockquant.library = lambda: current["build"]  # every product and layer call asks for the library anew

        model = load_model(DEFAULT_MODEL)
        target = model.target
        cache = target.new_cache(prefix + max(ROWS))
        target.forward(torch.randint(0, target.config.vocab_size, (prefix,)), cache)
        proposer = build_engine(model, *method_spec("dflash")).proposer
        drafter, taps = proposer.drafter, proposer.tap_layers
        sequence = copy.copy(proposer)
        sequence.begin(prefix + 64)
        sequence.extend_context(torch.randn(prefix, len(taps) * target.config.hidden_size))
        proposer._project_context([sequence])
        block = torch.full((drafter.config.block_size,), drafter.config.mask_token_id)
        block_embeds = target.embed_tokens(block)

        def verify(rows):
            cache.length = prefix
            segment = Segment(torch.randint(0, target.config.vocab_size, (rows,)), cache, rows)
            return target.forward_batch([segment], taps)

        seconds: dict[tuple[str, str], list[float]] = {}
        outputs = {}
        for round_ in range(ROUNDS):
            for name in (("before", "after") if round_ % 2 == 0 else ("after", "before")):
                current["build"] = builds[name]
                for rows in ROWS:
                    verify(rows)
                    started = time.perf_counter()
                    for _ in range(CALLS):
                        verify(rows)
                    seconds.setdefault((name, f"verify {rows}"), []).append((time.perf_counter() - started) / CALLS)
                for _ in range(CALLS):
                    verify(4)
                    started = time.perf_counter()
                    # the block (overwritten) through the layers and the head, in one call as the engine drafts
                    logits = drafter.draft_slots(block_embeds.clone(), [sequence.context_cache], 3, proposer.head)
                    seconds.setdefault((name, "drafting"), []).append(time.perf_counter() - started)
                outputs[name] = logits
        print("| step part | before ms | after ms | after/before |\n|---|---|---|---|")
        for part in [f"verify {rows}" for rows in ROWS] + ["drafting"]:
            b, a = (1000 * statistics.median(seconds[(name, part)]) for name in ("before", "after"))
            print(f"| {part} | {b:.2f} | {a:.2f} | {a / b:.2f} |")
        print("same draft logits from both builds:", torch.equal(outputs["before"], outputs["after"]))
        if per_category:
            decode(model, builds, current, per_category)


def decode(model, builds, current, per_category: int) -> None:
    import json

    from specserve_runtime.bench import held_out_sample, method_spec
    from specserve_runtime.engine import Request
    from specserve_runtime.loader import build_engine
    from specserve_runtime.training.sources import default_prompt_set

    records = [json.loads(line) for line in default_prompt_set().read_text().splitlines()]
    prompts = [model.encode(record["prompt"]) for record in held_out_sample(records, per_category)]
    methods = ("ar", "dflash")
    engines = {method: build_engine(model, *method_spec(method)) for method in methods}
    rates = {(name, method): [] for name in builds for method in methods}
    outputs = set()
    for index, prompt in enumerate(prompts):
        for name in (("before", "after") if index % 2 == 0 else ("after", "before")):
            current["build"] = builds[name]
            for method in methods:
                result = engines[method].generate(Request(prompt, 128))
                rates[(name, method)].append((len(result.token_ids) - 1) / result.decode_seconds)
                outputs.add((index, tuple(result.token_ids)))
    print(f"\n{len(prompts)} prompts, every output the same by both builds and both methods: {len(outputs) == len(prompts)}")
    print("| method | decode tok/s before | after | after/before | vs ar before | vs ar after |\n|---|---|---|---|---|---|")
    for method in methods:
        before, after = rates[("before", method)], rates[("after", method)]
        ratio = statistics.median([a / b for a, b in zip(after, before)])
        versus = [statistics.median([x / y for x, y in zip(rates[(name, method)], rates[(name, "ar")])]) for name in builds]
        print(f"| {method} | {statistics.median(before):.1f} | {statistics.median(after):.1f} | {ratio:.3f} | "
              f"{versus[0]:.3f} | {versus[1]:.3f} |")


if __name__ == "__main__":
    arguments = sys.argv[1:]

    def option(name: str, default: int) -> int:
        return int(arguments[arguments.index(name) + 1]) if name in arguments else default

    main(*arguments[:2], option("--decode", 0), option("--prefix", 300))
