"""One-off measurement: what decoder.c's `kept` rows save, in one process, interleaved in rounds, medians.

- DFlash drafting: the bundled drafter's block of 8 through its two layers after a context of 300 positions, every
  row through the last layer's output projection and MLP (before) against only the 3 slots that a tree of 3 drafts
  (`kept`, what DFlashDrafter.draft_slots now asks for), then the head on those 3 rows.
- A prompt's forward (prefill) of 64 and 256 tokens through the target's 30 layers: every row through the last
  layer against the last row only (Transformer.forward_batch for a prompt's last logits).

Also checks that the kept rows' outputs are the same bits both ways. With --decode N, then whole greedy decodes
of 3N held-out prompts of set v2 (N a category, 128 new tokens) by the bundled DFlash drafter, each prompt both
ways in turn (every row: every slot drafted and the prompt's every row through the last layer, then sliced):
the medians of the per-prompt ratios of decode speed and of prefill time, and whether every output is the same.
Run: .venv/bin/python docs/experiments/kept_rows.py [--decode 4]   (results in docs/benchmarks.md, "Rows nobody
reads")
"""

import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "runtime"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # paired_decodes
from specserve_runtime import blockquant  # noqa: E402
from specserve_runtime.bench import method_spec  # noqa: E402
from specserve_runtime.loader import build_engine, load_model  # noqa: E402
from specserve_runtime.store import DEFAULT_MODEL  # noqa: E402

ROUNDS, CALLS, CONTEXT, SLOTS, PROMPTS = 15, 20, 300, 3, (64, 256)


def main() -> None:
    model = load_model(DEFAULT_MODEL)
    target = model.target
    proposer = build_engine(model, *method_spec("dflash")).proposer
    drafter, native = proposer.drafter, proposer.drafter.native_layers
    assert native is not None and target.native_layers is not None, "needs decoder.c's layers (AVX-512 VNNI)"

    sequence = copy.copy(proposer)  # as the engine gives each sequence its copy
    sequence.begin(CONTEXT + 64)
    taps = target(torch.randint(0, target.config.vocab_size, (CONTEXT,)), target.new_cache(CONTEXT + 8),
                  tap_layers=proposer.tap_layers).taps
    drafter.project_context([(sequence.context_cache, taps)])
    block = drafter.config.block_size
    embeds = target.embed_tokens(torch.tensor([42] + [drafter.config.mask_token_id] * (block - 1)))
    cos, sin = drafter.rotary.tables(CONTEXT + block)
    block_positions = torch.arange(CONTEXT, CONTEXT + block)
    everything = torch.ones(block, block, dtype=torch.bool)
    drafting = torch.zeros(block, dtype=torch.bool)
    drafting[1 : 1 + SLOTS] = True

    def draft(kept):
        x = embeds.clone()
        _, normed = native.run(x, cos, sin, block_positions, [(sequence.context_cache, everything, None)], kept=kept,
                               norm=drafter.norm)
        return proposer.head.logits(normed if kept is not None else normed[1 : 1 + SLOTS])

    prompts = {n: torch.randint(0, target.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
               for n in PROMPTS}

    def prefill(n, kept):
        x = target.embed_tokens(prompts[n])
        cos, sin = target.rotary.tables(n)
        native_layers = target.native_layers
        _, normed = native_layers.run(x, cos, sin, torch.arange(n),
                                      [(target.new_cache(n), torch.ones(n, n, dtype=torch.bool).tril(), None)], kept=kept,
                                      norm=target.norm)
        return target.lm_head(normed[-1:])

    last_only = {n: torch.arange(n) == n - 1 for n in PROMPTS}
    parts = {"drafting (block of 8, head on 3)": (lambda: draft(None), lambda: draft(drafting), CALLS)}
    for n in PROMPTS:
        parts[f"prefill of {n} tokens"] = (lambda n=n: prefill(n, None), lambda n=n: prefill(n, last_only[n]),
                                           max(2, CALLS // (n // 32)))
    seconds, same = {}, {}
    for round_ in range(ROUNDS):
        for part, (before, after, calls) in parts.items():
            order = (("before", before), ("after", after)) if round_ % 2 == 0 else (("after", after), ("before", before))
            outputs = {}
            for name, function in order:
                started = time.perf_counter()
                for _ in range(calls):
                    outputs[name] = function()
                seconds.setdefault((part, name), []).append((time.perf_counter() - started) / calls)
            same[part] = same.get(part, True) and torch.equal(outputs["before"], outputs["after"])
    print("| part | every row, ms | kept rows, ms | kept / every | same bits |\n|---|---|---|---|---|")
    for part in parts:
        b, a = (1000 * statistics.median(seconds[(part, name)]) for name in ("before", "after"))
        print(f"| {part} | {b:.3f} | {a:.3f} | {a / b:.2f} | {'yes' if same[part] else 'NO'} |")
    if "--decode" in sys.argv:
        decode(model, int(sys.argv[sys.argv.index("--decode") + 1]))


def decode(model, per_category: int) -> None:
    from paired_decodes import engines_for, paired_decodes

    engines = engines_for(model, ("dflash",))
    drafter, native = engines["dflash"].proposer.drafter, model.target.native_layers
    draft_slots, run, block = drafter.draft_slots, native.run, drafter.config.block_size

    def every_row_run(*args, kept=None, head=None, **kwargs):  # every row through the last layer, then the rows read
        taps, normed = run(*args, **kwargs)
        normed = normed if kept is None else normed[kept]
        return taps, normed if head is None else blockquant.linear(normed, head)

    def every_row():  # what was computed before: every slot through the last layer, every prompt row
        drafter.draft_slots = lambda embeds, caches, slots, head: head.logits(
            draft_slots(embeds, caches, block - 1)[:, :slots])
        native.run = every_row_run

    def kept_rows():  # the methods of their classes again
        drafter.__dict__.pop("draft_slots", None)
        native.__dict__.pop("run", None)

    paired_decodes(model, engines, {"every row": every_row, "kept rows": kept_rows}, per_category)


if __name__ == "__main__":
    main()
