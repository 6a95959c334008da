"""One-off measurement: the default target's 121 fused matrix products (every PackedLinear once, weights read from
memory) on the GGUF file's blocks (blockquant.py) and on oneDNN's float32 layout, by rows of input; medians of 7
passes, the two layouts timed in turn at each row count. Every product runs on blocks, whatever the row count,
to show where oneDNN takes over (layers.BLOCKQUANT_MAX_ROWS).
Run: OMP_NUM_THREADS=2 .venv/bin/python docs/experiments/blockquant_chain.py   (docs/benchmarks.md, "Item 1 done")
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "runtime"))
from specserve_runtime import layers
from specserve_runtime.layers import PackedLinear, weight_layouts
from specserve_runtime.loader import load_model

target = load_model("SmolLM2-135M-Instruct").target
linears = [m for m in target.modules() if isinstance(m, PackedLinear)]
print(f"{len(linears)} products, {sum(m.blocks is not None for m in linears)} on blocks")
layers.BLOCKQUANT_MAX_ROWS = 1 << 30


def chain_ms(rows: int, **layouts) -> float:
    inputs = [torch.randn(rows, m.weight.shape[1]) for m in linears]
    samples = []
    with weight_layouts(target, **layouts):
        for _ in range(7):
            started = time.perf_counter()
            for linear, x in zip(linears, inputs):
                linear(x)
            samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1000


print("| rows | blocks (ms) | oneDNN float32 (ms) |\n|---|---|---|")
for rows in (1, 2, 4, 8, 16, 32, 64):
    print(f"| {rows} | {chain_ms(rows, blocks=True, onednn=True):.1f} | {chain_ms(rows, onednn=True):.1f} |")
