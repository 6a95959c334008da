"""One-off measurement: two builds of attention.c side by side (the rest of the kernels as in the tree), the
target's shape (9 query heads over 3 key heads of 64), one layer's attention for 1, 4 and 8 new rows after
20, 300 and 800 cached keys, interleaved in rounds; medians, and whether both give the same bits.

Run: git show REV:runtime/specserve_runtime/attention.c > /tmp/before.c
     .venv/bin/python docs/experiments/attention_ab.py /tmp/before.c runtime/specserve_runtime/attention.c
(results in docs/benchmarks.md, "Eight keys at a time")
"""

import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

KERNELS = Path(__file__).resolve().parents[2] / "runtime" / "specserve_runtime"
ROUNDS, CALLS = 7, 200


def build(attention_c: str, folder: str, name: str):
    library = Path(folder) / f"{name}.so"
    subprocess.run(["cc", "-O3", "-fopenmp", "-shared", "-fPIC", f"-I{KERNELS}", "-o", str(library),
                    str(KERNELS / "blockquant.c"), attention_c, str(KERNELS / "decoder.c")], check=True)
    kernel = ctypes.CDLL(str(library)).attention_rows
    kernel.restype = ctypes.c_int
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    kernel.argtypes = [pointer, size, size] * 3 + [pointer] * 4 + [size] * 6 + [pointer] * 3
    return kernel


def main(before: str, after: str) -> None:
    heads, kv_heads, d = 9, 3, 64
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        kernels = {"before": build(before, folder, "before"), "after": build(after, folder, "after")}
        print("| cached keys | new rows | before us | after us | after/before | same bits |\n|---|---|---|---|---|---|")
        for cached in (20, 300, 800):
            for rows in (1, 4, 8):
                capacity = cached + rows
                q, k, v = torch.randn(rows, heads, d), torch.randn(rows, kv_heads, d), torch.randn(rows, kv_heads, d)
                cos, sin = torch.randn(rows, d), torch.randn(rows, d)
                cache = torch.randn(2, kv_heads, capacity, d).half()
                visible = torch.ones(rows, rows, dtype=torch.bool).tril().to(torch.uint8)
                outs = {name: torch.empty(rows, heads * d) for name in kernels}

                def call(name):
                    status = kernels[name](
                        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(),
                        v.stride(0), v.stride(1), cos.data_ptr(), sin.data_ptr(), cache[0].data_ptr(),
                        cache[1].data_ptr(), capacity, heads, kv_heads, d, cached, rows, visible.data_ptr(), None,
                        outs[name].data_ptr())
                    assert status == 0

                seconds = {name: [] for name in kernels}
                for round_ in range(ROUNDS):
                    for name in (("before", "after") if round_ % 2 == 0 else ("after", "before")):
                        call(name)
                        started = time.perf_counter()
                        for _ in range(CALLS):
                            call(name)
                        seconds[name].append((time.perf_counter() - started) / CALLS)
                b, a = (1e6 * statistics.median(seconds[name]) for name in ("before", "after"))
                same = torch.equal(outs["before"], outs["after"])
                print(f"| {cached} | {rows} | {b:.1f} | {a:.1f} | {a / b:.2f} | {same} |", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
