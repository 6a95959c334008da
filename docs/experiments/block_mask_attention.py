"""One-off measurement: DFlash training's attention, forward and backward under bf16 autocast, with
`scaled_dot_product_attention` and an explicit block mask (what training uses) against the same
attention written out (scores, masked softmax, weighted values), at the training shape: 48 blocks
of 8 queries, 9 query heads over 3 KV heads of 64, keys = the context + the blocks; the mean of
20 calls after 5 warm-up calls.

Run: .venv/bin/python docs/experiments/block_mask_attention.py   (results in docs/benchmarks.md,
"The optimiser step")
"""

import time

import torch
import torch.nn.functional as F

torch.manual_seed(0)
QUERIES, HEADS, KV_HEADS, HEAD_DIM = 48 * 8, 9, 3, 64


def written_out(q, k, v, mask):
    group = HEADS // KV_HEADS  # each KV head serves `group` query heads: fold them into the rows
    scores = q.view(1, KV_HEADS, group * QUERIES, HEAD_DIM) @ k.transpose(-1, -2) * HEAD_DIM ** -0.5
    scores = scores.view(1, HEADS, QUERIES, -1).masked_fill(~mask, float("-inf"))
    weights = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
    return (weights.view(1, KV_HEADS, group * QUERIES, -1) @ v).view(1, HEADS, QUERIES, HEAD_DIM)


def sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


print("| context | sdpa, ms | written out, ms | largest difference |")
print("|---|---|---|---|")
for context in (300, 600, 900):
    keys = context + QUERIES
    mask = torch.rand(QUERIES, keys) < 0.5
    mask[:, 0] = True  # every query sees at least one key
    q = torch.randn(1, HEADS, QUERIES, HEAD_DIM, requires_grad=True)
    k = torch.randn(1, KV_HEADS, keys, HEAD_DIM, requires_grad=True)
    v = torch.randn(1, KV_HEADS, keys, HEAD_DIM, requires_grad=True)
    milliseconds = {}
    for attention in (sdpa, written_out):
        for call in range(25):
            if call == 5:
                started = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = attention(q, k, v, mask)
            out.float().sum().backward()
        milliseconds[attention] = (time.perf_counter() - started) / 20 * 1000
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        difference = float((sdpa(q, k, v, mask).float() - written_out(q, k, v, mask).float()).abs().max())
    print(f"| {context} | {milliseconds[sdpa]:.1f} | {milliseconds[written_out]:.1f} | {difference:.3f} |")
