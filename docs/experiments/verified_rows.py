"""One-off measurement: what each row a step adds costs, and what fewer drafter rows would give up.

- The target's forward (decoder.c's layers and the LM head, as a verify step runs it) over 1 to 8 new rows after a
  300-token prefix, warm, medians of interleaved rounds: every draft a step verifies is one more row.
- The bundled DFlash drafter's block forward (draft_slots: its 8 rows, the 3 drafting slots kept) against the
  same block cut to its first 4 and 5 rows, warm and cold (right after 64 MB were written).
- With --tau N, the bundled DFlash (its tree of 3 and prompt lookup's copy) on 3N held-out prompts of set v2
  (N a category, 128 new tokens, T=0), its drafter fed blocks of 8, 5 and 4 rows: the drafts verified a step and
  the mean of the prompts' acceptance lengths, in all and per category (greedy: the same every run).
- With --repeat ROWS STEPS, only that many forwards of ROWS rows, for a sampling profiler:
  perf record -o rows8.data .venv/bin/python docs/experiments/verified_rows.py --repeat 8 1500
  perf report -i rows8.data --sort dso,symbol --stdio

Run: .venv/bin/python docs/experiments/verified_rows.py [--tau N]   (results in docs/benchmarks.md, "What a
verified row costs")
"""

import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "runtime"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # cold_ops
from cold_ops import warm_and_cold  # noqa: E402
from specserve_runtime.bench import held_out_sample, method_spec  # noqa: E402
from specserve_runtime.engine import Request  # noqa: E402
from specserve_runtime.loader import build_engine, load_model  # noqa: E402
from specserve_runtime.model import Segment  # noqa: E402
from specserve_runtime.store import DEFAULT_MODEL  # noqa: E402
from specserve_runtime.training.sources import default_prompt_set  # noqa: E402

PREFIX, ROUNDS, CALLS = 300, 7, 10
ROWS = (1, 2, 4, 6, 8)
BLOCK_ROWS = (8, 5, 4)


def verify(target, cache, rows: int):
    """One verify forward of `rows` new rows after the prefix, then the cache cut back to it."""
    target.forward_batch([Segment(torch.randint(0, target.config.vocab_size, (rows,)), cache, rows)])
    cache.crop(PREFIX)


def costs(model, engine) -> None:
    target = model.target
    cache = target.new_cache(PREFIX + max(ROWS))
    target.forward_batch([Segment(torch.randint(0, target.config.vocab_size, (PREFIX,)), cache, 1)])
    proposer = engine.proposer
    proposer.begin(PREFIX + 64)
    drafter = proposer.drafter
    features = torch.randn(PREFIX, len(proposer.tap_layers) * target.config.hidden_size)
    drafter.project_context([(proposer.context_cache, features)])
    block = torch.full((drafter.config.block_size,), drafter.config.mask_token_id)
    block[0] = 100
    embeds = target.embed_tokens(block)
    cases = {f"target, {rows} rows": (lambda rows=rows: verify(target, cache, rows)) for rows in ROWS}
    cases |= {f"DFlash block, {rows} rows": (lambda rows=rows: drafter.draft_slots(embeds[:rows].clone(),
                                                                                   [proposer.context_cache], 3))
              for rows in BLOCK_ROWS}
    seconds = warm_and_cold(cases, ROUNDS, CALLS)
    one = seconds["target, 1 rows"][0]
    print("| forward | warm, ms | after 64 MB written, ms | warm / the target's 1 row |\n|---|---|---|---|")
    for name, (warm, cold) in seconds.items():
        print(f"| {name} | {1000 * warm:.2f} | {1000 * cold:.2f} | {warm / one:.2f} |")


def acceptance(model, engine, per_category: int) -> None:
    records = [json.loads(line) for line in default_prompt_set().read_text().splitlines()]
    sample = held_out_sample(records, per_category)
    prompts = [model.encode(record["prompt"]) for record in sample]
    drafter = engine.proposer.drafter
    trained = drafter.config
    print("| block rows | drafts verified a step | tau | "
          + " | ".join(sorted({record["category"] for record in sample})) + " |")
    for rows in BLOCK_ROWS:
        drafter.config = dataclasses.replace(trained, block_size=rows)  # the proposer builds blocks of this size
        by_category: dict[str, list[float]] = {}
        drafts = steps = 0
        for record, prompt in zip(sample, prompts):
            result = engine.generate(Request(prompt, 128))
            by_category.setdefault(record["category"], []).append(result.acceptance_length)
            drafts, steps = drafts + result.num_draft_tokens, steps + result.num_drafts
        every = [tau for taus in by_category.values() for tau in taus]
        print(f"| {rows} | {drafts / steps:.2f} | {statistics.mean(every):.3f} | "
              + " | ".join(f"{statistics.mean(by_category[c]):.3f}" for c in sorted(by_category)) + " |", flush=True)
    drafter.config = trained


def main() -> None:
    model = load_model(DEFAULT_MODEL)
    if "--repeat" in sys.argv:
        at = sys.argv.index("--repeat")
        rows, steps = int(sys.argv[at + 1]), int(sys.argv[at + 2])
        cache = model.target.new_cache(PREFIX + rows)
        model.target.forward_batch([Segment(torch.randint(0, model.target.config.vocab_size, (PREFIX,)), cache, 1)])
        for _ in range(steps):
            verify(model.target, cache, rows)
        return
    engine = build_engine(model, *method_spec("dflash"))
    engine.generate(Request(model.encode("Hello"), 8))  # warm-up
    with torch.inference_mode():
        costs(model, engine)
    if "--tau" in sys.argv:
        acceptance(model, engine, int(sys.argv[sys.argv.index("--tau") + 1]))


if __name__ == "__main__":
    main()
