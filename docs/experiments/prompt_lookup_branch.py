"""One-off measurement: what a prompt-lookup branch beside DFlash's tree of 3 would commit, by the length of the
suffix it matched and by how many tokens it copies, before the branch was built into the engine.

The bundled DFlash drafter runs as it does alone (greedy, 24 of set v2's held-out prompts, 128 new tokens); at
each step, prompt lookup (6- down to 1-token matches) is asked what it would copy, and the plain decoding
reference says how far that copy, and the tree, would have been accepted. "extra tokens" are those the copy
would commit beyond what the tree committed; "new rows" the copy's tokens the tree did not hold already (merged
where they agree), each a row more to verify.

Run: .venv/bin/python docs/experiments/prompt_lookup_branch.py   (results in docs/benchmarks.md, "A prompt-lookup branch")
"""

import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "runtime"))
from specserve_runtime import engine as engine_module  # noqa: E402
from specserve_runtime.bench import held_out_sample, method_spec  # noqa: E402
from specserve_runtime.drafters.ngram import PromptLookup  # noqa: E402
from specserve_runtime.engine import Request  # noqa: E402
from specserve_runtime.loader import build_engine, load_model  # noqa: E402
from specserve_runtime.store import DEFAULT_MODEL  # noqa: E402
from specserve_runtime.training.sources import default_prompt_set  # noqa: E402

MAX_NGRAM, LONGEST_COPY = 6, 8


def accepted_nodes(tree, truth) -> list[int]:
    """The nodes of the tree's branch that `truth` follows from the root, root first."""
    child = {(parent, token): node for node, (token, parent) in enumerate(zip(tree.tokens, tree.parents))}
    nodes, node = [], -1  # -1: the root
    for token in truth:
        if (node, token) not in child:
            break
        node = child[(node, token)]
        nodes.append(node)
    return nodes


def decoded_steps(model, method: str, per_category: int = 8, new_tokens: int = 128) -> list[list[tuple]]:
    """For each of set v2's first `per_category` held-out prompts of each category, every step of `method`'s greedy
    decode as the engine runs it: (the step's draft tree, the tokens committed before it, the next 8 tokens that
    plain decoding wrote there)."""
    records = [json.loads(line) for line in default_prompt_set().read_text().splitlines()]
    speculative, plain = build_engine(model, *method_spec(method)), build_engine(model, "ar")
    propose_all, decodes = engine_module.propose_all, []
    for record in held_out_sample(records, per_category):
        prompt = model.encode(record["prompt"])
        sequence = prompt + plain.generate(Request(prompt, new_tokens)).token_ids
        steps = []

        def observed(prototype, work, batched=True):
            trees = propose_all(prototype, work, batched)
            steps.extend((tree, list(tokens), sequence[len(tokens) : len(tokens) + 8])
                         for tree, (_, tokens, _) in zip(trees, work))
            return trees

        engine_module.propose_all = observed
        try:
            speculative.generate(Request(prompt, new_tokens))
        finally:
            engine_module.propose_all = propose_all
        decodes.append(steps)
    return decodes


def main() -> None:
    model = load_model(DEFAULT_MODEL)
    by_match = collections.defaultdict(lambda: [0, 0, 0])  # (match length, first copied token in the tree) -> steps, new rows, extra tokens
    by_copy = collections.defaultdict(lambda: [0, 0, 0])  # (match >= 3, tokens copied) -> steps, new rows, extra tokens
    steps = 0
    for decode in decoded_steps(model, "dflash+lookup0"):  # the tree of 3 alone
        lookup = PromptLookup(MAX_NGRAM, 1)
        for tree, tokens, truth in decode:
            steps += 1
            copy = lookup.continuation(tokens, LONGEST_COPY)
            if not copy:
                continue
            match = next(n for n in range(min(MAX_NGRAM, len(tokens) - 1), 0, -1) if tuple(tokens[-n:]) in lookup.last_end)
            tree_commits, copy_commits = len(accepted_nodes(tree, truth)), len(accepted_nodes(tree.with_branch(copy), truth))
            in_tree = any(p == -1 and t == copy[0] for t, p in zip(tree.tokens, tree.parents))
            row = by_match[(match, in_tree)]
            row[0], row[1], row[2] = row[0] + 1, row[1] + len(tree.with_branch(copy)) - len(tree), row[2] + copy_commits - tree_commits
            for count in range(1, LONGEST_COPY + 1):
                merged = tree.with_branch(copy[:count])
                row = by_copy[(match >= 3, count)]
                row[0], row[1] = row[0] + 1, row[1] + len(merged) - len(tree)
                row[2] += len(accepted_nodes(merged, truth)) - tree_commits
    print(f"{steps} steps of DFlash's tree of 3; the copy of up to {LONGEST_COPY} tokens:\n")
    print("| suffix matched | copy's first token in the tree | steps | new rows a step | extra tokens a step | extra tokens a new row |")
    print("|---|---|---|---|---|---|")
    for (match, in_tree), (count, rows, extra) in sorted(by_match.items()):
        print(f"| {match} | {'yes' if in_tree else 'no'} | {count} | {rows / count:.2f} | {extra / count:.3f} | {extra / max(rows, 1):.3f} |")
    print("\n| suffix matched | tokens copied | new rows a step | extra tokens a step |\n|---|---|---|---|")
    for (long_match, count), (n, rows, extra) in sorted(by_copy.items()):
        print(f"| {'3 or more' if long_match else '1 or 2'} | {count} | {rows / n:.2f} | {extra / n:.3f} |")


if __name__ == "__main__":
    main()
