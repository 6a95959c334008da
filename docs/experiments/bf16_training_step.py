"""One-off measurement: a drafter training step's forward and backward in fp32 against bf16 autocast
(`train-drafter --precision bf16`), interleaved step by step on the same sequences, medians.

Reads the first shard of the set-v2 training data and its cached target features (computed first if
missing, about 30 s). No optimiser step: that part is the same fp32 AdamW either way.

Run: .venv/bin/python docs/experiments/bf16_training_step.py [threads] [dflash|eagle3]
(results in docs/benchmarks.md, "Training in bf16")
"""

import statistics
import time

import torch
from training_setup import arguments, first_shard  # beside this script: its folder is on sys.path

from specserve_runtime.training.train import sequence_loss

threads, method = arguments()
target, cfg, data, drafter, taps, head = first_shard(method, init="target" if method == "dflash" else "random")

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
