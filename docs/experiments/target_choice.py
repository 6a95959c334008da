"""One-off measurement: greedy verification's argmax (verify.target_tokens) by torch against blockquant.c's, in
one process: first each on 1, 4 and 8 rows of 49,152 logits (the target's vocabulary; interleaved in rounds,
medians), then, with --decode N, whole greedy decodes of 3N held-out prompts by `ar` and the bundled DFlash
drafter, each prompt both ways in turn (paired_decodes.py). With --sampled N instead: seeded decodes at T=0.7
(--top-p P: and top_p P), first top_p's nucleus of the target's own distributions by a sort of the vocabulary
against verify.nucleus's partial selection, then the target's token chosen at every verified row in one call
(verify.accept) against only at the rows the walk reaches, one call a row (measured, not kept).

Run: .venv/bin/python docs/experiments/target_choice.py [--decode 4 | --sampled 4 [--top-p 0.9]]   (results in
docs/benchmarks.md, "The target's choice")
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "runtime"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # paired_decodes
from specserve_runtime import blockquant, engine, verify  # noqa: E402

ROUNDS, CALLS, ROWS, VOCABULARY = 15, 200, (1, 4, 8), 49152
TOP_P = float(sys.argv[sys.argv.index("--top-p") + 1]) if "--top-p" in sys.argv else 1.0
WAYS = {"torch": lambda logits: logits.argmax(dim=-1), "blockquant.c": blockquant.argmax}


def main() -> None:
    logits = {rows: torch.randn(rows, VOCABULARY, generator=torch.Generator().manual_seed(rows)) for rows in ROWS}
    seconds = {}
    for round_ in range(ROUNDS):
        for name, argmax in (WAYS.items() if round_ % 2 == 0 else reversed(WAYS.items())):
            for rows in ROWS:
                argmax(logits[rows])
                started = time.perf_counter()
                for _ in range(CALLS):
                    argmax(logits[rows])
                seconds.setdefault((name, rows), []).append((time.perf_counter() - started) / CALLS)
    same = all(torch.equal(WAYS["torch"](x), WAYS["blockquant.c"](x)) for x in logits.values())
    print(f"| rows of {VOCABULARY} logits | torch, us | blockquant.c, us | ratio |\n|---|---|---|---|")
    for rows in ROWS:
        t, c = (1e6 * statistics.median(seconds[(name, rows)]) for name in WAYS)
        print(f"| {rows} | {t:.1f} | {c:.1f} | {c / t:.3f} |")
    print("same indices:", same)
    if "--decode" in sys.argv or "--sampled" in sys.argv:
        from paired_decodes import engines_for, paired_decodes
        from specserve_runtime.loader import load_model
        from specserve_runtime.store import DEFAULT_MODEL

        model = load_model(DEFAULT_MODEL)
        engines = engines_for(model, ("ar", "dflash"))
        if "--decode" in sys.argv:
            ways = {name: (lambda argmax=argmax: setattr(verify.blockquant, "argmax", argmax))
                    for name, argmax in WAYS.items()}
            try:
                paired_decodes(model, engines, ways, int(sys.argv[sys.argv.index("--decode") + 1]))
            finally:
                verify.blockquant.argmax = WAYS["blockquant.c"]
        else:
            nucleus_by_sort_and_selection(model)
            ways = {"every row": lambda: setattr(engine, "accept", verify.accept),
                    "the walk's rows": lambda: setattr(engine, "accept", accept_at_the_walks_rows)}
            paired_decodes(model, engines, ways, int(sys.argv[sys.argv.index("--sampled") + 1]),
                           sampling=verify.SamplingParams(0.7, TOP_P))


def nucleus_by_sort_and_selection(model) -> None:
    """top_p's nucleus of the target's own distributions at T=0.7 (its logits at every position of 6 held-out
    prompts' greedy continuations): by a sort of the vocabulary (as verify.target_tokens found it before) against
    verify.nucleus's partial selection, one row at a time, as a one-token step takes it."""
    import json

    from specserve_runtime.bench import held_out_sample, method_spec
    from specserve_runtime.engine import Request
    from specserve_runtime.loader import build_engine
    from specserve_runtime.training.sources import default_prompt_set

    records = [json.loads(line) for line in default_prompt_set().read_text().splitlines()]
    plain = build_engine(model, *method_spec("ar"))
    rows = []
    for record in held_out_sample(records, 2):
        prompt = model.encode(record["prompt"])
        tokens = prompt + plain.generate(Request(prompt, 64)).token_ids
        logits = model.target(torch.tensor(tokens), model.target.new_cache(len(tokens))).logits[len(prompt) - 1 :]
        rows += list(torch.softmax(logits.double() / 0.7, dim=-1))

    def by_sort(probs):
        ordered, order = probs.sort(dim=-1, descending=True)
        outside = ordered.cumsum(dim=-1) - ordered >= TOP_P
        return torch.zeros_like(probs).scatter_(-1, order, ordered.masked_fill(outside, 0.0))

    seconds, same, sizes = {"sort": [], "selection": []}, True, []
    for probs in rows[::4]:
        found = {}
        for name, find in (("sort", by_sort), ("selection", lambda p: verify.nucleus(p, TOP_P))):
            started = time.perf_counter()
            found[name] = find(probs[None])
            seconds[name].append(time.perf_counter() - started)
        same = same and torch.equal(found["sort"], found["selection"])
        sizes.append(int((found["selection"] > 0).sum()))
    print(f"\ntop_p {TOP_P} at T=0.7, {len(sizes)} of the target's distributions: nucleus of {min(sizes)}-{max(sizes)} "
          f"tokens (median {statistics.median(sizes)}); the same by both: {same}")
    print("| nucleus by | ms a row, median | 90th percentile |\n|---|---|---|")
    for name, values in seconds.items():
        values = sorted(values)
        print(f"| {name} | {1000 * statistics.median(values):.3f} | {1000 * values[int(0.9 * len(values))]:.3f} |")


def accept_at_the_walks_rows(drafts, logits, params, uniforms=None):
    """verify.accept, the target's token chosen only at the rows the walk reaches, each row alone."""
    depths, chosen = [0] + drafts.depths, {}

    def choice(row: int) -> int:
        if row not in chosen:
            uniform = None if uniforms is None else uniforms[depths[row] : depths[row] + 1]
            chosen[row] = int(verify.target_tokens(logits[row : row + 1], params, uniform)[0])
        return chosen[row]

    accepted = drafts.accepted(choice)
    return [choice(row) for row in [0] + [index + 1 for index in accepted]], accepted


if __name__ == "__main__":
    main()
