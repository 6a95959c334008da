"""One-off measurement: the int8 target's decoder layers in C (decoder.c, native.py) against its torch layers on the
same int8 products (SDPA attention), and the float32 target (SPECSERVE_TARGET_INT8=0) beside them.

Steps of 1, 4 and 8 rows after a 300-token prefix of random ids, cropped back to it, 5 interleaved rounds of 60
steps (median ms); prefills of 300 and 1024 random ids (best of 3, ms).
Run: .venv/bin/python docs/experiments/native_layers.py   (results in docs/benchmarks.md, "The target's layers in C")
"""

import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "runtime"))
from specserve_runtime.model import Segment, load_target
from specserve_runtime.store import DEFAULT_MODEL, resolve_model

PREFIX, ROUNDS, STEPS = 300, 5, 60

folder = resolve_model(DEFAULT_MODEL)
target = load_target(folder)
if target.activations != "int8":
    sys.exit("the int8 target is not running here (no AVX-512 VNNI, or SPECSERVE_TARGET_INT8=0)")
os.environ["SPECSERVE_TARGET_INT8"] = "0"
float32_target = load_target(folder)
native = target.native_layers


def configure(name):
    """-> the model to run: the int8 target with its C or torch layers, or the float32 target."""
    if name == "float32 target":
        return float32_target
    target.native_layers = native if name == "decoder.c" else None
    return target


names = ("float32 target", "int8, torch layers", "decoder.c")
torch.manual_seed(0)
prefix = torch.randint(0, target.config.vocab_size, (PREFIX,))
caches = {}
for name in names:
    model = configure(name)
    caches[name] = model.new_cache(PREFIX + 8)
    model.forward(prefix, caches[name], last_logits_only=True)
steps: dict[tuple[str, int], list[float]] = {}
for _ in range(ROUNDS):
    for name in names:
        model, cache = configure(name), caches[name]
        for rows in (1, 4, 8):
            def step():
                model.forward_batch([Segment(torch.arange(5, 5 + rows), cache, rows)])
                cache.crop(PREFIX)
            for _ in range(10):
                step()
            started = time.perf_counter()
            for _ in range(STEPS):
                step()
            steps.setdefault((name, rows), []).append((time.perf_counter() - started) / STEPS * 1000)

prefills: dict[tuple[str, int], float] = {}
for length in (300, 1024):
    prompt = torch.randint(0, target.config.vocab_size, (length,))
    for name in names:
        model = configure(name)
        best = []
        for _ in range(3):
            cache = model.new_cache(length)
            started = time.perf_counter()
            model.forward(prompt, cache, last_logits_only=True)
            best.append((time.perf_counter() - started) * 1000)
        prefills[name, length] = min(best)
configure("decoder.c")

print(f"| | {' | '.join(names)} |\n| --- |{' --- |' * len(names)}")
for rows in (1, 4, 8):
    print(f"| step, {rows} row{'s' if rows > 1 else ''} (ms) | "
          + " | ".join(f"{statistics.median(steps[name, rows]):.2f}" for name in names) + " |")
for length in (300, 1024):
    print(f"| prefill, {length} tokens (ms) | " + " | ".join(f"{prefills[name, length]:.0f}" for name in names) + " |")
