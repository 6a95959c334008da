"""One-off measurement: what a datastore branch (retrieval drafting, as REST does) would add beside the bundled
DFlash operating point (its tree of 3 and prompt lookup's copy), before building one.

The datastore is every training response the drafters learned from (runtime/data's train folders, none of the
held-out split): after the longest suffix of the sequence (MAX_NGRAM down to 2 tokens) found there, the branch
follows the most frequent next token among the matches, then among those that continued with it, and so on. A
policy verifies a token of that path only while its match is at least `min_ngram` tokens long and its share of
the matches at least `min_share`, up to `length` tokens. The bundled DFlash runs as it does alone (greedy, 24 of
set v2's held-out prompts, 128 new tokens); at every step each policy's path is merged into the step's tree
(DraftTree.with_branch), and plain decoding's output says how far it would have been accepted. A step's cost is
estimated from docs/benchmarks.md, "What a verified row costs": 1.49 plain steps at the bundled point, and 0.087
of one for each row more.

Run: .venv/bin/python docs/experiments/datastore_branch.py   (results in docs/benchmarks.md, "A datastore branch")
"""

import itertools
import sys
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "runtime"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompt_lookup_branch import accepted_nodes, decoded_steps  # noqa: E402
from specserve_runtime.loader import load_model  # noqa: E402
from specserve_runtime.store import DEFAULT_MODEL  # noqa: E402
from specserve_runtime.training.distill import read_shards  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "runtime" / "data"
TRAIN = ["distill-v2", "distill-v2-continued", "distill-v2-turns"]
MAX_NGRAM, LONGEST = 8, 4
DFLASH_NODES = 3  # the bundled tree's; the copy's nodes follow them
STEP_COST, ROW_COST = 1.49, 0.087  # plain steps: the bundled point's step, and each further verified row


class Datastore:
    """The training responses end to end (-1 between them), and for each n-gram length its hashes sorted, with
    the position after each occurrence."""

    def __init__(self, responses: list[list[int]]):
        self.tokens = np.concatenate([np.array(r + [-1], dtype=np.int64) for r in responses])
        self.index = {}
        for n in range(2, MAX_NGRAM + 1):
            hashes, ends = self._hashes(n)
            order = np.argsort(hashes, kind="stable")
            self.index[n] = (hashes[order], ends[order] + 1)

    def _hashes(self, n):
        count = len(self.tokens) - n  # n-grams followed by a token
        hashes, crosses = np.zeros(count, dtype=np.int64), np.zeros(count, dtype=bool)
        with np.errstate(over="ignore"):  # a hash modulo 2**64
            for j in range(n):
                part = self.tokens[j : j + count]
                hashes, crosses = hashes * 1_000_003 + part, crosses | (part < 0)
        return hashes[~crosses], np.arange(n - 1, n - 1 + count)[~crosses]

    def path(self, tokens: list[int]) -> list[tuple[int, int, float]]:
        """(token, suffix length matched, its share of the matches) along the most frequent continuation."""
        for n in range(min(MAX_NGRAM, len(tokens)), 1, -1):
            hashes, after = self.index[n]
            with np.errstate(over="ignore"):
                key = np.int64(0)
                for token in tokens[-n:]:
                    key = key * 1_000_003 + np.int64(token)
            lo, hi = np.searchsorted(hashes, key), np.searchsorted(hashes, key, side="right")
            if hi == lo:
                continue
            positions, path = after[lo:hi], []
            while len(path) < LONGEST and len(positions):
                following = self.tokens[positions]
                token, count = Counter(following.tolist()).most_common(1)[0]
                if token < 0:
                    break
                path.append((token, n, count / len(positions)))
                positions = positions[following == token] + 1
            return path
        return []


def main() -> None:
    responses = [record["response_ids"] for folder in TRAIN for _, records in read_shards(DATA / folder)
                 for record in records]
    store = Datastore(responses)
    print(f"datastore: {len(responses)} training responses, {len(store.tokens) - len(responses)} tokens\n")
    model = load_model(DEFAULT_MODEL)
    # (the step's tree, its accepted depth, the datastore's path, what plain decoding wrote next)
    steps = [(tree, len(accepted_nodes(tree, truth)), store.path(tokens), truth)
             for decode in decoded_steps(model, "dflash") for tree, tokens, truth in decode]
    tau = 1 + sum(depth for _, depth, _, _ in steps) / len(steps)
    print(f"{len(steps)} steps of the bundled DFlash point: tau {tau:.3f}")
    # How often each row of the step's own tree is on the accepted branch: DFlash's nodes come first (the tree
    # of 3), then the nodes prompt lookup's copy added.
    on_branch, verified = Counter(), Counter()
    for tree, _, _, truth in steps:
        kept = accepted_nodes(tree, truth)
        for node in range(len(tree)):
            kind = f"DFlash node {node + 1}" if node < DFLASH_NODES else "prompt lookup"
            verified[kind], on_branch[kind] = verified[kind] + 1, on_branch[kind] + (node in kept)
    print(", ".join(f"{kind} accepted {on_branch[kind] / verified[kind]:.3f}" for kind in sorted(verified)) + "\n")
    print("| min_ngram | min_share | length | extra tokens a step | new rows a step | extra tokens a new row | "
          "estimated speed |\n|---|---|---|---|---|---|---|")
    results = []
    for min_ngram, min_share, length in itertools.product([2, 3, 4, 6], [0.0, 0.5, 0.7, 0.9], [1, 2, 3, 4]):
        extra = rows = 0
        for tree, depth, path, truth in steps:
            chain = list(itertools.takewhile(lambda hop: hop[1] >= min_ngram and hop[2] >= min_share, path))[:length]
            merged = tree.with_branch([token for token, _, _ in chain])
            extra, rows = extra + len(accepted_nodes(merged, truth)) - depth, rows + len(merged) - len(tree)
        speed = (tau + extra / len(steps)) / (STEP_COST + ROW_COST * rows / len(steps)) / (tau / STEP_COST)
        results.append((speed, min_ngram, min_share, length, extra / len(steps), rows / len(steps), extra / max(rows, 1)))
    ungated = next(result for result in results if result[1:4] == (2, 0.0, LONGEST))
    for speed, min_ngram, min_share, length, extra, rows, per_row in sorted(results, reverse=True)[:12] + [ungated]:
        print(f"| {min_ngram} | {min_share} | {length} | {extra:.3f} | {rows:.2f} | {per_row:.3f} | {speed:.3f}x |")


if __name__ == "__main__":
    main()
