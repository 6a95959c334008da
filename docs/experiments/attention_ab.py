"""One-off measurement: two builds of attention.c side by side (the rest of the kernels as in the tree), the
target's shape (9 query heads over 3 key heads of 64), one layer's attention for 1, 4 and 8 new rows after
20, 300 and 800 cached keys, interleaved in rounds; medians, and whether both give the same bits. Then the
same-bits check alone over other shapes: head sizes 16-128, 1-5 query heads a key head, key counts around
the kernels' groups of 8 and 16, with and without a cached-slot mask.

Run: git show REV:runtime/specserve_runtime/attention.c > /tmp/before.c
     .venv/bin/python docs/experiments/attention_ab.py /tmp/before.c runtime/specserve_runtime/attention.c
(results in docs/benchmarks.md, "Eight keys at a time" and "Keys into registers")
"""

import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # kernels_ab
from kernels_ab import build  # noqa: E402

ROUNDS, CALLS = 7, 200


def case(heads, kv_heads, d, cached, rows, masked=False):
    """Random inputs of one layer's attention, and a function that runs a build on them into its own output."""
    capacity = cached + rows
    q, k, v = torch.randn(rows, heads, d), torch.randn(rows, kv_heads, d), torch.randn(rows, kv_heads, d)
    cos, sin = torch.randn(rows, d), torch.randn(rows, d)
    positions = torch.arange(rows)  # row r's RoPE at table row r
    visible = torch.ones(rows, rows, dtype=torch.bool).tril().to(torch.uint8)
    cached_visible = (torch.rand(rows, cached) < 0.7).to(torch.uint8) if masked and cached else None
    cache = torch.randn(2, kv_heads, capacity, d).half()  # every run writes the same new rows at slots cached..

    def run(kernel, out):
        status = kernel(
            q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0),
            v.stride(1), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), cache[0].data_ptr(), cache[1].data_ptr(),
            capacity, heads, kv_heads, d, cached, rows, visible.data_ptr(),
            None if cached_visible is None else cached_visible.data_ptr(), out.data_ptr())
        assert status == 0

    return run, torch.empty(rows, heads * d)


def timings(kernels) -> None:
    print("| cached keys | new rows | before us | after us | after/before | same bits |\n|---|---|---|---|---|---|")
    for cached in (20, 300, 800):
        for rows in (1, 4, 8):
            run, out = case(9, 3, 64, cached, rows)
            outs = {name: out.clone() for name in kernels}
            seconds = {name: [] for name in kernels}
            for round_ in range(ROUNDS):
                for name in (("before", "after") if round_ % 2 == 0 else ("after", "before")):
                    run(kernels[name], outs[name])
                    started = time.perf_counter()
                    for _ in range(CALLS):
                        run(kernels[name], outs[name])
                    seconds[name].append((time.perf_counter() - started) / CALLS)
            b, a = (1e6 * statistics.median(seconds[name]) for name in ("before", "after"))
            same = torch.equal(outs["before"], outs["after"])
            print(f"| {cached} | {rows} | {b:.1f} | {a:.1f} | {a / b:.2f} | {same} |", flush=True)


def same_bits(kernels) -> None:
    shapes = [(3, 3, 64), (9, 3, 64), (8, 2, 64), (10, 2, 32), (4, 4, 16), (6, 2, 48), (8, 8, 80), (16, 8, 128)]
    differing, cases = [], 0
    for (heads, kv_heads, d), cached, rows, masked in itertools.product(
            shapes, (0, 1, 7, 8, 9, 15, 16, 17, 63, 300), (1, 3, 8), (False, True)):
        run, out = case(heads, kv_heads, d, cached, rows, masked)
        before, after = out, out.clone()
        run(kernels["before"], before)
        run(kernels["after"], after)
        cases += 1
        if not torch.equal(before, after):
            differing.append((heads, kv_heads, d, cached, rows, masked))
    print(f"same bits in {cases - len(differing)} of {cases} cases" + (f"; differing: {differing}" if differing else ""))


def main(before: str, after: str) -> None:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        kernels = {name: build(path, "attention.c", folder, name).attention_rows
                   for name, path in (("before", before), ("after", after))}
        timings(kernels)
        same_bits(kernels)


if __name__ == "__main__":
    main(*sys.argv[1:3])
