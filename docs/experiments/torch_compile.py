"""One-off measurement: does torch.compile speed up the target's one-token decode step on this CPU?

Run: .venv/bin/python docs/experiments/torch_compile.py   (results in docs/benchmarks.md)
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "runtime"))
from specserve_runtime.loader import load_model  # noqa: E402

PREFIX = 300


def median_ms(fn, runs=30) -> float:
    fn(), fn()  # compile and warm up
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


target = load_model("SmolLM2-135M-Instruct").target
cache = target.new_cache(PREFIX + 8)
target(torch.randint(0, 1000, (PREFIX,)), cache)


def decode_step():
    target(torch.tensor([5]), cache)
    cache.crop(PREFIX)


print(f"eager: {median_ms(decode_step):.1f} ms")
for layer in target.layers:  # static shapes at one token: the easy case for the compiler
    layer.mlp.forward = torch.compile(layer.mlp.forward, dynamic=False)
print(f"MLPs compiled: {median_ms(decode_step):.1f} ms")
for layer in target.layers:
    layer.forward = torch.compile(layer.forward, dynamic=True)
print(f"decoder layers compiled: {median_ms(decode_step):.1f} ms")
