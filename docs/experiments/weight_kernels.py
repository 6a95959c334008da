"""One-off measurement: one token through every weight matrix of the target (the tied LM head included),
with the weights as fp32 (what the engine runs), bf16, and torch's weight-only int8 (per channel) and
int4 (groups of 32, scale and zero point: Q4_1's layout) CPU kernels. Interleaved rounds, medians.

The int8/int4 weights hold random values of the right shapes: this times the kernels, nothing else.
Run: .venv/bin/python docs/experiments/weight_kernels.py   (results in docs/benchmarks.md, "llama.cpp")
"""

import statistics
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "runtime"))
from specserve_runtime.store import DEFAULT_MODEL, resolve_model

GROUP = 32

weights = load_file(resolve_model(DEFAULT_MODEL) / "model.safetensors")
matrices = [w for name, w in weights.items() if w.dim() == 2]  # the embedding is also the LM head
print(f"{len(matrices)} matrices, {sum(w.numel() for w in matrices) / 1e6:.1f}M parameters, "
      f"{torch.get_num_threads()} threads")
inputs = {w.shape[1]: torch.randn(1, w.shape[1]) for w in matrices}
bf16 = [(w.to(torch.bfloat16), inputs[w.shape[1]].to(torch.bfloat16)) for w in matrices]
int8 = [(torch.randint(-127, 128, w.shape, dtype=torch.int8), torch.rand(w.shape[0]), inputs[w.shape[1]])
        for w in matrices]
int4 = [(torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, w.shape, dtype=torch.int32), 1),
         torch.rand(w.shape[1] // GROUP, w.shape[0], 2), inputs[w.shape[1]]) for w in matrices]

chains = {
    "fp32": lambda: [torch.nn.functional.linear(inputs[w.shape[1]], w) for w in matrices],
    "bf16": lambda: [torch.nn.functional.linear(x, w) for w, x in bf16],
    "int8 (_weight_int8pack_mm)": lambda: [torch.ops.aten._weight_int8pack_mm(x, q, s) for q, s, x in int8],
    "int4 (_weight_int4pack_mm_for_cpu)": lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(x, q, GROUP, sz)
                                                   for q, sz, x in int4],
}
samples = {name: [] for name in chains}
with torch.inference_mode():
    for chain in chains.values():
        chain()
    for _ in range(30):
        for name, chain in chains.items():
            started = time.perf_counter()
            chain()
            samples[name].append((time.perf_counter() - started) * 1000)
for name, ms in samples.items():
    print(f"{name:36} {statistics.median(ms):6.1f} ms per token (min {min(ms):.1f})")
