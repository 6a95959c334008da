"""One-off measurement: a drafter training step's forward and backward in fp32 against bf16 autocast
(`train-drafter --precision bf16`), interleaved step by step on the same sequences, medians.

Reads the first shard of the set-v2 training data and its cached target features (computed first if
missing, about 30 s). No optimiser step: that part is the same fp32 AdamW either way.

Run: .venv/bin/python docs/experiments/bf16_training_step.py [threads] [dflash|eagle3]
(results in docs/benchmarks.md, "Training in bf16")
"""

import statistics
import sys
import time

import torch

from specserve_runtime.drafters.vocab import DraftHead, draft_token_ids
from specserve_runtime.loader import load_model
from specserve_runtime.store import DEFAULT_MODEL
from specserve_runtime.training.distill import read_shards
from specserve_runtime.training.train import TargetFeatures, TrainConfig, new_drafter, sequence_loss, tap_layers

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
method = sys.argv[2] if len(sys.argv) > 2 else "dflash"
torch.set_num_threads(threads)
model = load_model(DEFAULT_MODEL)
target = model.target
cfg = TrainConfig(method=method, data="runtime/data/distill-v2", eval_data="runtime/data/distill-v2-eval", out="-",
                  init="target" if method == "dflash" else "random")
shards = read_shards(cfg.data, target.config.vocab_size)[:1]
data = [record for _, records in shards for record in records]
drafter = new_drafter(cfg, target, model.mask_token_id(), data).train()
taps = TargetFeatures(target, shards, tap_layers(cfg, target), print)
head = DraftHead(target.lm_head.weight, draft_token_ids(drafter))

times, losses = {"fp32": [], "bf16": []}, {"fp32": [], "bf16": []}
for step in range(24):
    for precision in ("fp32", "bf16"):
        generator = torch.Generator().manual_seed(step)  # the same anchors both ways
        started = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss, _ = sequence_loss(cfg, drafter, target, head, data[step], taps[step], generator)
        loss.backward()
        drafter.zero_grad(set_to_none=True)
        if step >= 4:  # the first steps warm the allocator and oneDNN's kernel cache
            times[precision].append(time.perf_counter() - started)
            losses[precision].append(loss.item())
fp32, bf16 = statistics.median(times["fp32"]), statistics.median(times["bf16"])
print(f"{method}, {threads} threads, forward + backward of one sequence, median of 20 steps:")
print(f"fp32 {1000 * fp32:.0f} ms, bf16 {1000 * bf16:.0f} ms ({fp32 / bf16:.2f}x); "
      f"mean loss fp32 {statistics.mean(losses['fp32']):.4f}, bf16 {statistics.mean(losses['bf16']):.4f}")
