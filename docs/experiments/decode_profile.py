"""One-off measurement: where one plain decode step of the target goes, by torch operator.

A 300-token prefix (random ids), then one-token steps, each cropped back to the prefix so every
step sees the same cache; 20 warm-up steps, 50 timed, 20 under torch's profiler.
Run: .venv/bin/python docs/experiments/decode_profile.py   (results in docs/benchmarks.md, "llama.cpp")
"""

import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "runtime"))
from specserve_runtime.loader import load_model
from specserve_runtime.store import DEFAULT_MODEL

PREFIX, WARMUP, TIMED, PROFILED = 300, 20, 50, 20

target = load_model(DEFAULT_MODEL).target
torch.manual_seed(0)
cache = target.new_cache(PREFIX + 1)
target.forward(torch.randint(0, target.config.vocab_size, (PREFIX,)), cache, last_logits_only=True)


def step() -> None:
    target.forward(torch.tensor([5]), cache, last_logits_only=True)
    cache.crop(PREFIX)


for _ in range(WARMUP):
    step()
started = time.perf_counter()
for _ in range(TIMED):
    step()
print(f"one decode step: {(time.perf_counter() - started) / TIMED * 1000:.1f} ms")
with profile(activities=[ProfilerActivity.CPU]) as profiled:
    for _ in range(PROFILED):
        step()
print(f"totals over {PROFILED} profiled steps:")
print(profiled.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
