"""One-off measurement: what the reduced draft vocabulary costs the bundled DFlash drafter in acceptance.

The drafter shares the target's LM head; its draft vocabulary only chooses which rows it scores,
so the same trained weights can be evaluated with more rows. Teacher-forced, on the held-out
sequences of runtime/data/distill-v2-eval (after every response token, as training evaluates), per category:
the bundled 8,192 tokens against the 16,384 / 32,768 most frequent training-response tokens and the
whole vocabulary, with each vocabulary's coverage of the held-out response tokens.
Run: .venv/bin/python docs/experiments/draft_vocab.py [SEQUENCES]   (results in docs/benchmarks.md)
"""

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "runtime"))
from specserve_runtime.drafters.dflash import load_dflash
from specserve_runtime.drafters.eagle3 import feature_layer_ids
from specserve_runtime.drafters.vocab import DraftHead, draft_token_ids, frequency_ranked
from specserve_runtime.loader import load_model
from specserve_runtime.store import DEFAULT_MODEL
from specserve_runtime.training.distill import read_shards
from specserve_runtime.training.train import TargetFeatures, TrainConfig, evaluate, first_sequences

SEQUENCES = int(sys.argv[1]) if len(sys.argv) > 1 else 256

target = load_model(DEFAULT_MODEL).target
vocab_size = target.config.vocab_size
drafter = load_dflash(ROOT / "runtime/specserve_runtime/drafters/weights/smollm2-135m-instruct-dflash")
train_responses = [r["response_ids"] for _, records in read_shards(ROOT / "runtime/data/distill-v2", vocab_size)
                   for r in records]
eval_shards, records = first_sequences(read_shards(ROOT / "runtime/data/distill-v2-eval", vocab_size), SEQUENCES)
taps = TargetFeatures(target, eval_shards, feature_layer_ids(target.config.num_hidden_layers), print)
held_out_tokens = torch.tensor([t for r in records for t in r["response_ids"]])

vocabularies = {"8,192 (bundled)": draft_token_ids(drafter)}
for size in (16384, 32768):
    vocabularies[f"{size:,}"] = frequency_ranked(train_responses, size, vocab_size)
vocabularies[f"{vocab_size:,} (whole)"] = None

# Training's own held-out evaluation (teacher-forced after every response token; block 8).
cfg = TrainConfig(method="dflash", data="", eval_data="", out="")
print(f"{len(records)} held-out sequences, {held_out_tokens.numel():,} response tokens")
print("| draft vocabulary | held-out coverage | tau | " + " | ".join(sorted({r['category'] for r in records})) + " |")
for name, token_ids in vocabularies.items():
    head = DraftHead(target.lm_head.weight, token_ids)
    coverage = 1.0 if token_ids is None else float(torch.isin(held_out_tokens, token_ids).float().mean())
    result = evaluate(cfg, drafter, target, head, records, taps)
    cells = [f"{category['tau']:.2f}" for category in result["by_category"].values()]
    print(f"| {name} | {coverage:.1%} | {result['tau']:.2f} | " + " | ".join(cells) + " |")
