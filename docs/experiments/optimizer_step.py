"""One-off measurement: where a drafter training step's time goes (forward, backward, gradient
clipping, the AdamW step), with torch's default AdamW (on a CPU, a loop over the parameters) and
the fused one that training uses, on copies of the same drafter fed the same sequences and
anchors, interleaved step by step, medians; and how far apart the copies' weights are at the end,
against a third copy with the default AdamW again (what two runs of the same thing differ by).

Reads the first shard of the set-v2 training data and its cached target features (computed first if
missing, about 30 s). DFlash warm-started from the bundled drafter, bf16 autocast as in training.

Run: .venv/bin/python docs/experiments/optimizer_step.py [threads] [dflash|eagle3]
(results in docs/benchmarks.md, "The optimiser step")
"""

import copy
import statistics
import time

import torch
from training_setup import arguments, first_shard  # beside this script: its folder is on sys.path

from specserve_runtime.drafters import DEFAULT_DRAFTERS
from specserve_runtime.training.train import sequence_loss

threads, method = arguments()
target, cfg, data, drafter, taps, head = first_shard(method, precision="bf16", warm_start=str(DEFAULT_DRAFTERS[method]))
drafters = {"default": drafter, "default, again": copy.deepcopy(drafter), "fused": copy.deepcopy(drafter)}
optimizers = {name: torch.optim.AdamW(d.parameters(), lr=2.5e-4, betas=(0.9, 0.95), weight_decay=0.0,
                                      fused=name == "fused")
              for name, d in drafters.items()}

phases = ("forward", "backward", "clip", "optimiser")
times = {name: {phase: [] for phase in phases} for name in drafters}
for step in range(44):
    for name, drafter in drafters.items():
        generator = torch.Generator().manual_seed(step)  # the same anchors both ways
        marks = [time.perf_counter()]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = sequence_loss(cfg, drafter, target, head, data[step], taps[step], generator)
        marks.append(time.perf_counter())
        loss.backward()
        marks.append(time.perf_counter())
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        marks.append(time.perf_counter())
        optimizers[name].step()
        optimizers[name].zero_grad(set_to_none=True)
        marks.append(time.perf_counter())
        if step >= 4:  # the first steps warm the allocator and oneDNN's kernel cache
            for phase, begin, end in zip(phases, marks[:-1], marks[1:], strict=True):
                times[name][phase].append(end - begin)

print(f"{method}, {threads} threads, one sequence a step, milliseconds, median of 40 steps:")
print("| AdamW | " + " | ".join(phases) + " | step |")
print("|---" * (len(phases) + 2) + "|")
for name in drafters:
    medians = [1000 * statistics.median(times[name][phase]) for phase in phases]
    print(f"| {name} | " + " | ".join(f"{m:.1f}" for m in medians) + f" | {sum(medians):.1f} |")
for name in ("default, again", "fused"):
    with torch.no_grad():
        gap = max(float((a - b).abs().max())
                  for a, b in zip(drafters["default"].parameters(), drafters[name].parameters(), strict=True))
    print(f"largest weight difference from the first copy after 44 steps, {name}: {gap:.2e}")
