"""One-off measurement: the target's batched decode forward (one new row per sequence, each sequence after PREFIX
cached positions of its own) at 1, 2, 4, 8 and 16 sequences, median of 40 forwards, as the engine's batched
steps call it (model.forward_batch, taps of the drafters' layers included).

Run: OMP_NUM_THREADS=2 .venv/bin/python docs/experiments/batch_forward.py [PREFIX]   (default 300; results in
docs/benchmarks.md, "Attention for the whole batch in one loop")
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "runtime"))
from specserve_runtime.loader import load_model
from specserve_runtime.model import Segment
from specserve_runtime.store import DEFAULT_MODEL

PREFIX = int(sys.argv[1]) if len(sys.argv) > 1 else 300
FORWARDS = 40

target = load_model(DEFAULT_MODEL).target
print(f"| sequences | forward ms (prefix {PREFIX}) | ms per sequence |\n|---|---|---|")
with torch.inference_mode():
    for batch in (1, 2, 4, 8, 16):
        caches = [target.new_cache(PREFIX + 1) for _ in range(batch)]
        for cache in caches:
            target(torch.randint(100, 1000, (PREFIX,)), cache, last_logits_only=True)
        times = []
        for _ in range(FORWARDS):
            segments = [Segment(torch.randint(100, 1000, (1,)), cache, 1) for cache in caches]
            started = time.perf_counter()
            target.forward_batch(segments, (1, 14, 27))
            times.append(time.perf_counter() - started)
            for cache in caches:
                cache.crop(PREFIX)
        median = 1000 * sorted(times)[FORWARDS // 2]
        print(f"| {batch} | {median:.2f} | {median / batch:.2f} |")
