"""One-off measurement: the target's matrix products in bf16 (oneDNN, weights packed as bf16, inputs
rounded to bf16, fp32 accumulation, outputs back to fp32; norms, attention, the KV cache and sampling
stay fp32) against the engine's fp32 products, on a CPU with avx512_bf16.

Prints (1) every matrix product of one step at 1, 8 and 16 rows, fp32 and bf16, interleaved, medians;
(2) plain decoding end to end on the held-out sample (2 prompts per category, 128 tokens), both ways
interleaved prompt by prompt; (3) whether the outputs stay what they must: bf16 against fp32, and,
within bf16, speculative decoding and a batch of all prompts against one-token plain decoding; (4)
whether one product gives a row the same result alone as among 64 rows, fp32 and bf16.

Run: .venv/bin/python docs/experiments/bf16_matmuls.py   (results in docs/benchmarks.md, "bf16")
"""

import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.benchmark import Timer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "runtime"))
from specserve_runtime.bench import held_out_sample  # noqa: E402
from specserve_runtime.cli import read_prompt_records  # noqa: E402
from specserve_runtime.engine import Request  # noqa: E402
from specserve_runtime.layers import PackedLinear  # noqa: E402
from specserve_runtime.loader import build_engine, load_model  # noqa: E402
from specserve_runtime.training.prompts import PROMPTS_FILE  # noqa: E402

model = load_model("SmolLM2-135M-Instruct")
prompts = [model.encode(r["prompt"]) for r in held_out_sample(read_prompt_records(str(PROMPTS_FILE)), 2)]
linears = [m for m in model.target.modules() if isinstance(m, PackedLinear)]  # the target's, not the drafters'
layouts = {"fp32": {id(m): m.packed for m in linears},
           "bf16": {id(m): torch.ops.mkldnn._reorder_linear_weight(m.weight.detach().to(torch.bfloat16), None)
                    for m in linears}}
fp32_forward = PackedLinear.forward


def bf16_forward(self, x):
    if layouts["bf16"].get(id(self)) is not self.packed:  # a drafter's layer: fp32 as always
        return fp32_forward(self, x)
    return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), self.packed, None, "none", [], "").to(x.dtype)


def use(precision: str) -> None:
    for m in linears:
        m.packed = layouts[precision][id(m)]
    PackedLinear.forward = fp32_forward if precision == "fp32" else bf16_forward


def median_ms(fn, runs=15) -> float:
    fn()  # the first call pays for allocation
    return Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()).timeit(runs).median * 1000


print(f"{len(linears)} matrix products per step, {torch.get_num_threads()} threads")
with torch.inference_mode():
    for rows in (1, 8, 16):
        inputs = {m.weight.shape[1]: torch.randn(rows, m.weight.shape[1]) for m in linears}
        timings = {}
        for precision in ("fp32", "bf16"):
            use(precision)
            timings[precision] = median_ms(lambda: [m(inputs[m.weight.shape[1]]) for m in linears])
        print(f"matrix products, {rows:2} rows: fp32 {timings['fp32']:.1f} ms, bf16 {timings['bf16']:.1f} ms "
              f"({timings['fp32'] / timings['bf16']:.2f}x)")

outputs, rates = {"fp32": [], "bf16": []}, {"fp32": [], "bf16": []}
for prompt in prompts:
    for precision in ("fp32", "bf16"):
        use(precision)
        started = time.perf_counter()
        result = build_engine(model, "ar").generate(Request(prompt, 128))
        rates[precision].append(len(result.token_ids) / (time.perf_counter() - started))
        outputs[precision].append(result.token_ids)
fp32_rate, bf16_rate = statistics.median(rates["fp32"]), statistics.median(rates["bf16"])
print(f"plain decoding: fp32 {fp32_rate:.1f} tok/s, bf16 {bf16_rate:.1f} tok/s ({bf16_rate / fp32_rate:.2f}x)")
first_differences = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                     for x, y in zip(outputs["fp32"], outputs["bf16"])]
print(f"bf16 against fp32: {sum(x == y for x, y in zip(outputs['fp32'], outputs['bf16']))} of {len(prompts)} "
      f"outputs identical; first different token at {[d for d in first_differences if d is not None]}")


def batched(engine) -> list[list[int]]:
    sequences = [engine.add(Request(prompt, 128)) for prompt in prompts]
    running = list(sequences)
    while running:
        engine.step(running)
        running = [s for s in running if s.finish_reason is None]
    return [s.stopper.token_ids for s in sequences]


for precision in ("fp32", "bf16"):
    use(precision)
    reference = outputs[precision]
    checks = {method: [build_engine(model, method).generate(Request(p, 128)).token_ids for p in prompts]
              for method in ("ngram", "eagle3", "dflash")}
    checks["ar, all prompts in one batch"] = batched(build_engine(model, "ar"))
    checks["dflash, all prompts in one batch"] = batched(build_engine(model, "dflash"))
    for label, got in checks.items():
        print(f"{precision}: {label}: {sum(a == b for a, b in zip(got, reference))} of {len(prompts)} "
              "identical to one-token plain decoding")

# Where the bf16 differences come from: one product of the same rows, alone or among 64.
torch.manual_seed(0)
for out_features, in_features in ((3072, 576), (576, 1536)):
    weight = torch.randn(out_features, in_features) * 0.05
    for dtype in (torch.float32, torch.bfloat16):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype), None)
        x = torch.randn(64, in_features).to(dtype)
        full = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        differing = {rows: int((torch.ops.mkldnn._linear_pointwise(x[:rows], packed, None, "none", [], "")
                                != full[:rows]).any(dim=1).sum()) for rows in (1, 2, 3, 8, 16)}
        print(f"{out_features}x{in_features} {str(dtype).removeprefix('torch.')}: rows differing from the same "
              f"rows among 64, by rows in the product: {differing}")
