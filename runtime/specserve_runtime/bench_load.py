"""`specserve bench --kernels` and `--closed-loop`: one decode step against its matrix products' floor, a model
drafter's batched drafting, and the methods under load in process (B sequences at once, fixed and adaptive drafts,
interleaved in rounds)."""

import statistics
import time

import torch

from .bench import markdown_table, method_spec
from .engine import Request
from .layers import PackedLinear, separate_projections, weight_layouts
from .loader import LoadedModel, build_engine
from .model import Segment

# The PackedLinear layouts `bench --kernels` times side by side: the engine's (GGUF blocks where the weights are
# exactly blocks, oneDNN's layout otherwise and past BLOCKQUANT_MAX_ROWS rows), oneDNN's alone, torch's F.linear.
WEIGHT_LAYOUTS = {"blocks": {"blocks": True, "onednn": True}, "onednn": {"onednn": True}, "plain": {}}


def decode_floor(model: LoadedModel, prefix: int = 300, runs: int = 20) -> dict:
    """One-token decode step of the engine (fused and separate projections) against the bare
    chain of the model's matrix products (every weight once, one token, inputs preallocated);
    the verify forward by tokens and the batched decode step by sequences, in each of WEIGHT_LAYOUTS
    (layers.PackedLinear); and a decode step of 8 sequences that a
    prompt chunk joins, by the chunk's tokens (what chunked prefill adds to the others' ITL)."""
    target = model.target
    linears = [(name, m) for name, m in target.named_modules() if isinstance(m, (torch.nn.Linear, PackedLinear))]
    weights = [m.weight for name, m in linears if not name.endswith((".qkv", ".gate_up"))]  # fused: counted apart
    inputs = {w.shape[1]: torch.randn(1, w.shape[1]) for w in weights}  # the MLP down projection is wider

    def matmul_chain():
        for w in weights:
            torch.nn.functional.linear(inputs[w.shape[1]], w)

    chunks = (0, 16, 32, 64, 128)
    vocab = min(1000, target.config.vocab_size)  # token ids do not change a step's cost
    caches = [target.new_cache(prefix + max(chunks)) for _ in range(9)]  # every step is cropped back to the prefix
    for cache in caches:
        target(torch.randint(0, vocab, (prefix,)), cache)

    def decode_step():
        target(torch.tensor([5]), caches[0])
        caches[0].crop(prefix)

    def decode_step_separate():
        with separate_projections(target):
            decode_step()

    def verify_step(num_tokens: int):  # [last token, drafts...]: what one speculative step verifies
        target(torch.arange(5, 5 + num_tokens) % vocab, caches[0])
        caches[0].crop(prefix)

    def batch_step(num_sequences: int):  # one decode token for each of several sequences, one forward
        target.forward_batch([Segment(torch.tensor([5]), cache, 1) for cache in caches[:num_sequences]])
        for cache in caches[:num_sequences]:
            cache.crop(prefix)

    def chunked_step(num_prompt_tokens: int):  # 8 decode tokens and one prompt's chunk, one forward
        segments = [Segment(torch.tensor([5]), cache, 1) for cache in caches[:8]]
        if num_prompt_tokens:
            segments.append(Segment(torch.arange(5, 5 + num_prompt_tokens) % vocab, caches[8], 1))
        target.forward_batch(segments)
        for cache in caches:
            cache.crop(prefix)

    timings = {"decode_8_with_prompt_chunk_ms_by_tokens": {n: _median_ms(lambda n=n: chunked_step(n), runs)
                                                            for n in chunks}}
    for layout, kept in WEIGHT_LAYOUTS.items():
        with weight_layouts(target, **kept):
            timings[f"verify_ms_by_tokens_{layout}"] = {n: _median_ms(lambda n=n: verify_step(n), runs) for n in range(1, 9)}
            timings[f"batch_ms_by_sequences_{layout}"] = {n: _median_ms(lambda n=n: batch_step(n), runs) for n in (1, 2, 4, 8)}
    for name, fn in (("decode_step_ms", decode_step), ("decode_step_separate_ms", decode_step_separate),
                     ("matmul_floor_ms", matmul_chain)):
        timings[name] = _median_ms(fn, runs)
    return timings


def batched_drafting_ms(model: LoadedModel, method: str, sizes=(1, 4, 8), steps: int = 16) -> dict:
    """Median ms of an engine decode step of B sequences (drafting and verifying, fixed draft
    length), with the drafter run once per pass for the batch (drafters.propose_all) and with one
    propose() per sequence, side by side. Each measurement starts B fresh sequences on one prompt."""
    engine = build_engine(model, *method_spec(method))
    prompt = model.encode("Explain how a bicycle stays upright, step by step.")
    timings = {"batched": {}, "one_by_one": {}}
    for size in sizes:
        for mode in timings:
            engine.batch_drafts = mode == "batched"
            batch = [engine.add(Request(prompt, 8 * steps)) for _ in range(size)]
            while any(sequence.prefilling for sequence in batch):
                engine.step(batch)
            engine.step(batch)  # the first decode step pays for allocation
            samples = []
            for _ in range(steps):
                started = time.perf_counter()
                engine.step(batch)
                samples.append((time.perf_counter() - started) * 1000)
            timings[mode][size] = round(statistics.median(samples), 2)
    return timings


def closed_loop(model: LoadedModel, methods: list[str], prompts: list[list[int]], batch_size: int,
                max_new_tokens: int, rounds: int = 6, round_steps: int = 15) -> dict:
    """Engine steps over `batch_size` sequences, in process: a finished sequence is replaced by the
    next prompt. Plain decoding, and every speculative method both with its fixed draft length and
    with adaptive speculation, run round_steps steps each in turn, `rounds` times, so the machine's
    speed drift falls on all of them alike. Per configuration: committed tokens/s of each round, how
    often adaptive speculation chose each draft length, and the median time of a step with no prompt
    chunk in it by its draft length (what a length costs against plain decoding's step, unaffected
    by which round was slow)."""
    configs = {"ar": build_engine(model, "ar")}
    for method in methods:
        name, options = method_spec(method)
        if name != "ar":
            configs[f"{method} fixed"] = build_engine(model, name, options)
            configs[f"{method} adaptive"] = build_engine(model, name, options, adaptive=True)
    state = {label: {"batch": [], "next": 0, "rates": [], "lengths": [], "decode_seconds": {}} for label in configs}

    def run_round(label: str) -> float:
        engine, entry = configs[label], state[label]
        batch = entry["batch"]
        committed, started = 0, time.perf_counter()
        for _ in range(round_steps):
            while len(batch) < batch_size:
                batch.append(engine.add(Request(prompts[entry["next"] % len(prompts)], max_new_tokens)))
                entry["next"] += 1
            decode_only = not any(sequence.prefilling for sequence in batch)
            step_started = time.perf_counter()
            steps = engine.step(batch)
            seconds = time.perf_counter() - step_started
            committed += sum(len(step.token_ids) for step in steps if step is not None)
            if engine.draft_length is not None:
                entry["lengths"].append(engine.draft_length)
            if decode_only:  # fixed configurations offer their proposer's drafts every step
                length = engine.proposer.num_speculative_tokens if engine.draft_length is None else engine.draft_length
                entry["decode_seconds"].setdefault(length, []).append(seconds)
            batch[:] = [sequence for sequence in batch if sequence.finish_reason is None]
        return committed / (time.perf_counter() - started)

    for label in configs:  # prompts prefilled, kernels chosen: not timed
        run_round(label)
        state[label]["lengths"].clear()
        state[label]["decode_seconds"].clear()
    for _ in range(rounds):
        for label in configs:
            state[label]["rates"].append(round(run_round(label), 2))
    return {label: {"tokens_per_second": statistics.median(entry["rates"]), "rounds": entry["rates"],
                    "lengths": {n: entry["lengths"].count(n) for n in sorted(set(entry["lengths"]))},
                    "decode_step_ms": {n: round(1000 * statistics.median(entry["decode_seconds"][n]), 1)
                                       for n in sorted(entry["decode_seconds"])}}
            for label, entry in state.items()}


def closed_loop_table(results: dict) -> str:
    base = results["ar"]["tokens_per_second"]
    rows = [("configuration", "tok/s (median of rounds)", "vs ar", "rounds", "draft lengths chosen",
             "decode step ms by drafts")]
    for label, r in results.items():
        lengths = ", ".join(f"{n}: {count}" for n, count in r["lengths"].items()) or "-"
        step_ms = ", ".join(f"{n}: {ms:.0f}" for n, ms in r["decode_step_ms"].items()) or "-"
        rows.append((label, f"{r['tokens_per_second']:.1f}", f"{r['tokens_per_second'] / base:.2f}x",
                     " ".join(f"{x:.0f}" for x in r["rounds"]), lengths, step_ms))
    return "\n".join(markdown_table(rows))


def _median_ms(fn, runs: int) -> float:
    fn()  # the first call pays for allocation and kernel selection
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        with torch.inference_mode():
            fn()
        samples.append((time.perf_counter() - started) * 1000)
    return round(statistics.median(samples), 2)
