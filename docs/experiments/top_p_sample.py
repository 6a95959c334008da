"""One-off measurement: the target's choice at T=0.7 with top_p 0.9 by torch (a float64 softmax, verify.nucleus's
partial selection, a cumulative sum and a search) against blockquant.sample's nucleus in C, in one process.

First each on 1 and 6 rows of the target's own logits (the last rows of a held-out prompt's forward), warm,
medians of interleaved rounds. With --decode N, then seeded decodes (T=0.7, top_p 0.9; the seed the prompt's index)
of 3N held-out prompts of set v2 by `ar` and the bundled DFlash drafter, each prompt both ways in turn
(paired_decodes.py). The two ways sum in other orders: a uniform number within about 1e-7 of an edge between two
tokens may draw the neighbour, so the outputs line may say no.

Run: .venv/bin/python docs/experiments/top_p_sample.py [--decode N]   (results in docs/benchmarks.md, "top_p in C")
"""

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "runtime"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # paired_decodes
from specserve_runtime import blockquant  # noqa: E402
from specserve_runtime.bench import held_out_sample  # noqa: E402
from specserve_runtime.loader import load_model  # noqa: E402
from specserve_runtime.model import Segment  # noqa: E402
from specserve_runtime.store import DEFAULT_MODEL  # noqa: E402
from specserve_runtime.training.sources import default_prompt_set  # noqa: E402
from specserve_runtime.verify import SamplingParams, target_tokens  # noqa: E402

ROUNDS, CALLS = 15, 20
SAMPLING = SamplingParams(temperature=0.7, top_p=0.9)
C_SAMPLE = blockquant.sample


def in_torch() -> None:
    """blockquant.sample declines top_p < 1, so verify.target_tokens takes torch's path for it."""
    blockquant.sample = lambda x, temperature, uniforms, top_p=1.0: (
        None if top_p < 1 else C_SAMPLE(x, temperature, uniforms, top_p))


def in_c() -> None:
    blockquant.sample = C_SAMPLE


def parts(model) -> None:
    records = [json.loads(line) for line in default_prompt_set().read_text().splitlines()]
    prompt = torch.tensor(model.encode(held_out_sample(records, 1)[0]["prompt"]))
    target = model.target
    logits = target.forward_batch([Segment(prompt, target.new_cache(len(prompt)), 6)])[0].logits
    uniforms = torch.rand(6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    seconds: dict[tuple[str, int], list[float]] = {}
    for _ in range(ROUNDS):
        for name, way in (("torch", in_torch), ("blockquant.c", in_c)):
            way()
            for rows in (1, 6):
                started = time.perf_counter()
                for _ in range(CALLS):
                    target_tokens(logits[:rows], SAMPLING, uniforms[:rows])
                seconds.setdefault((name, rows), []).append((time.perf_counter() - started) / CALLS)
    in_c()
    print("| rows of the target's logits, T=0.7, top_p 0.9 | torch, us | blockquant.c, us |\n|---|---|---|")
    for rows in (1, 6):
        print(f"| {rows} | {1e6 * statistics.median(seconds[('torch', rows)]):.0f} | "
              f"{1e6 * statistics.median(seconds[('blockquant.c', rows)]):.0f} |")


def main() -> None:
    model = load_model(DEFAULT_MODEL)
    with torch.inference_mode():
        parts(model)
    if "--decode" in sys.argv:
        from paired_decodes import engines_for, paired_decodes

        engines = engines_for(model, ("ar", "dflash"))
        paired_decodes(model, engines, {"torch": in_torch, "C": in_c}, int(sys.argv[sys.argv.index("--decode") + 1]),
                       sampling=SAMPLING)


if __name__ == "__main__":
    main()
