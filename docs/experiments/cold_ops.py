"""One-off measurement: the torch operations that ran between a decode step's C calls, against what replaced them.

- The model's final norm before an LM head (the target's, a DFlash drafter's): torch's RMSNorm on the layers' output
  (before) against decoder.c's, applied to the rows read as the layers finish (NativeLayers.run's `norm`).
- A drafter's guesses: torch's log_softmax and topk over its 8,192-token vocabulary against
  blockquant.top_log_probs.
- RoPE: the rows of the cos/sin tables gathered by torch for each forward (RotaryEmbedding.forward) against the
  whole tables and each row's position, which decoder.c reads (RotaryEmbedding.tables).

First each part alone, warm (called again and again) and cold (right after 64 MB were written, as a step's products
stream the weights through the caches), medians of interleaved rounds. With --decode N, then whole greedy decodes
of 3N held-out prompts of set v2 (N a category, 128 new tokens), plain decoding and the bundled DFlash and EAGLE-3
drafters, each prompt with the final norm and the guesses in torch and in C in turn (paired_decodes; RoPE's change
is in the C interface: docs/experiments/versions_ab.py compares whole checkouts). The two norms differ in their
last bits (another summation order), which the head's int8 rounding can turn into another token now and then: the
outputs line may say no.

Run: .venv/bin/python docs/experiments/cold_ops.py [--decode N]   (results in docs/benchmarks.md, "Cold operations")
"""

import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "runtime"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # paired_decodes
from specserve_runtime import blockquant  # noqa: E402
from specserve_runtime.layers import RMSNorm, RotaryEmbedding  # noqa: E402
from specserve_runtime.loader import load_model  # noqa: E402
from specserve_runtime.store import DEFAULT_MODEL  # noqa: E402

ROUNDS, CALLS = 15, 20


def torch_top(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    top = torch.log_softmax(x.float(), dim=-1).topk(k, dim=-1)
    return top.values, top.indices


def warm_and_cold(cases: dict[str, Callable[[], object]], rounds: int = ROUNDS, calls: int = CALLS
                  ) -> dict[str, tuple[float, float]]:
    """Each case's seconds a call, warm (called again and again) and cold (right after 64 MB were written, as a
    step's products stream the weights through the caches): medians of `rounds` interleaved rounds of `calls`."""
    streamed = torch.empty(64 << 20, dtype=torch.uint8)
    warm, cold = {name: [] for name in cases}, {name: [] for name in cases}
    for _ in range(rounds):
        for name, case in cases.items():
            started = time.perf_counter()
            for _ in range(calls):
                case()
            warm[name].append((time.perf_counter() - started) / calls)
            spent = 0.0
            for _ in range(calls):
                streamed.fill_(1)
                started = time.perf_counter()
                case()
                spent += time.perf_counter() - started
            cold[name].append(spent / calls)
    return {name: (statistics.median(warm[name]), statistics.median(cold[name])) for name in cases}


def parts() -> None:
    generator = torch.Generator().manual_seed(0)
    norm, rows = RMSNorm(576, 1e-5), torch.randn(4, 576, generator=generator)
    logits = torch.randn(3, 8192, generator=generator) * 3
    rotary, positions = RotaryEmbedding(64, 100000.0), torch.arange(300, 308)
    rotary.tables(1024)
    cases = {
        "final norm, 4 rows of 576: torch's RMSNorm": lambda: norm(rows),
        "guesses, 3 rows of 8,192: torch's log_softmax + topk(3)": lambda: torch_top(logits, 3),
        "guesses, 3 rows of 8,192: blockquant.top_log_probs": lambda: blockquant.top_log_probs(logits, 3),
        "RoPE, 8 positions: torch's gather of cos and sin rows": lambda: rotary(positions),
        "RoPE, 8 positions: the whole tables (RotaryEmbedding.tables)": lambda: rotary.tables(308),
    }
    with torch.inference_mode():
        seconds = warm_and_cold(cases)
    print("| operation | warm, us | after 64 MB written, us |\n|---|---|---|")
    for name, (warm, cold) in seconds.items():
        print(f"| {name} | {1e6 * warm:.1f} | {1e6 * cold:.1f} |")


def decode(per_category: int) -> None:
    from paired_decodes import engines_for, paired_decodes

    model = load_model(DEFAULT_MODEL)
    engines = engines_for(model, ("ar", "dflash", "eagle3"))
    natives = [model.target.native_layers, engines["dflash"].proposer.drafter.native_layers]
    top_log_probs = blockquant.top_log_probs

    def in_torch():  # the layers without their final norm, then torch's on the rows read; torch's guesses
        for native in natives:
            run = type(native).run.__get__(native)

            def unnormed(x, *args, kept=None, norm=None, run=run, **kwargs):
                taps, _ = run(x, *args, kept=kept, **kwargs)
                return taps, None if norm is None else norm(x if kept is None else x[kept])
            native.run = unnormed
        blockquant.top_log_probs = torch_top

    def in_c():  # the method of its class, the C kernel, again
        for native in natives:
            native.__dict__.pop("run", None)
        blockquant.top_log_probs = top_log_probs

    paired_decodes(model, engines, {"torch": in_torch, "C": in_c}, per_category)


if __name__ == "__main__":
    parts()
    if "--decode" in sys.argv:
        decode(int(sys.argv[sys.argv.index("--decode") + 1]))
