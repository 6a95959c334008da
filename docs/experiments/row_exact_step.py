"""One-off measurement: one step of the int8 target with its attention by torch (RoPE, cache writes, SDPA: the
float32 target's path) or by attention.c, the same weights and int8 products, interleaved in rounds; then the
kernel's cost for a prompt's rows alone (RoPE, cache writes, attention of one layer).

A 300-token prefix of random ids, steps of 1, 4 and 8 rows cropped back to it, 5 rounds of 60 steps (median ms);
prompts of 300 and 1024 rows on random heads of SmolLM2's shape (best of 3).
Run: .venv/bin/python docs/experiments/row_exact_step.py   (results in docs/benchmarks.md, "The target on int8")
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "runtime"))
from specserve_runtime.layers import attention_rows
from specserve_runtime.loader import load_model
from specserve_runtime.model import Segment
from specserve_runtime.store import DEFAULT_MODEL

PREFIX, ROUNDS, STEPS = 300, 5, 60

target = load_model(DEFAULT_MODEL).target
if target.activations != "int8":
    sys.exit("the int8 target is not running here (no AVX-512 VNNI, or SPECSERVE_TARGET_INT8=0)")
torch.manual_seed(0)
cache = target.new_cache(PREFIX + 8)
target.forward(torch.randint(0, target.config.vocab_size, (PREFIX,)), cache, last_logits_only=True)
timings: dict[tuple[str, int], list[float]] = {}
for _ in range(ROUNDS):
    for exact in (False, True):
        target.row_exact_attention = exact  # the products stay int8 either way: only the attention differs
        for rows in (1, 4, 8):
            def step():
                target.forward_batch([Segment(torch.arange(5, 5 + rows), cache, rows)])
                cache.crop(PREFIX)
            for _ in range(10):
                step()
            started = time.perf_counter()
            for _ in range(STEPS):
                step()
            label = "attention.c" if exact else "torch attention"
            timings.setdefault((label, rows), []).append((time.perf_counter() - started) / STEPS * 1000)
target.row_exact_attention = True
print("| rows | torch attention | attention.c |\n| --- | --- | --- |")
for rows in (1, 4, 8):
    print(f"| {rows} | {statistics.median(timings['torch attention', rows]):.1f} | "
          f"{statistics.median(timings['attention.c', rows]):.1f} |")

cfg = target.config
heads, kv_heads, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
for rows in (300, 1024):
    q, k, v = torch.randn(rows, heads, head_dim), torch.randn(rows, kv_heads, head_dim), torch.randn(rows, kv_heads, head_dim)
    cos, sin = target.rotary(torch.arange(rows))
    cache_k, cache_v = torch.zeros(kv_heads, rows, head_dim), torch.zeros(kv_heads, rows, head_dim)
    visible = torch.ones(rows, rows, dtype=torch.bool).tril()
    best = []
    for _ in range(3):
        started = time.perf_counter()
        attention_rows(q, k, v, cos, sin, cache_k, cache_v, 0, visible)
        best.append((time.perf_counter() - started) * 1000)
    print(f"a {rows}-token prompt, one layer's attention.c: {min(best):.1f} ms")
