"""`specserve bench`: the methods side by side in one process, prompt by prompt, with losslessness checked.

Every method runs on the same prompt before the next prompt starts (interleaved), so machine
noise hits all methods alike; each timing is the median of `repeats` runs.
"""

import contextlib
import statistics
import time
from dataclasses import dataclass, field

import torch

from .drafters import ProposerOptions
from .engine import Request
from .layers import PackedLinear, separate_projections, unpacked_weights
from .loader import LoadedModel, build_engine
from .model import Segment
from .verify import SamplingParams


@dataclass
class MethodStats:
    tokens: int = 0
    target_forwards: int = 0
    accepted: int = 0
    drafts: int = 0
    per_position: list[int] = field(default_factory=list)
    decode_tps: list[float] = field(default_factory=list)  # per prompt: median over repeats
    e2e_tps: list[float] = field(default_factory=list)
    decode_seconds: float = 0.0
    ttft_ms: list[float] = field(default_factory=list)  # per prompt: the prefill that yields the first token
    lossless: bool | None = True  # None: not checkable (a greedy baseline against sampled runs)
    by_category: dict[str, list[float]] = field(default_factory=dict)  # category -> per-prompt tau

    @property
    def acceptance_length(self) -> float:
        return 1 + self.accepted / self.target_forwards if self.target_forwards else 1.0


def _median_run(run, repeats: int):
    results = [run() for _ in range(repeats)]
    return sorted(results, key=lambda r: r[1])[len(results) // 2]


def method_spec(name: str) -> tuple[str, ProposerOptions]:
    """'dflash', or 'dflash:3' for 3 speculative tokens per step -> the method and its proposer options."""
    method, _, tokens = name.partition(":")
    if tokens and not (tokens.isdigit() and int(tokens) >= 1):
        raise ValueError(f"{name!r}: the number after ':' is the speculative tokens per step, an integer >= 1")
    return method, ProposerOptions(num_speculative_tokens=int(tokens) if tokens else None)


def run_bench(model: LoadedModel, methods: list[str], baselines: list[str], prompts: list[dict], max_new_tokens: int,
              repeats: int, temperature: float, log=print) -> dict[str, MethodStats]:
    engines = {m: build_engine(model, *method_spec(m)) for m in methods}  # eagle3 / dflash: the bundled drafters
    stats = {name: MethodStats() for name in methods + [f"hf-{b}" for b in baselines]}
    hf_model = _hf_model(model) if baselines else None
    sampling = SamplingParams(temperature=temperature)
    if temperature > 0:  # transformers' baselines run greedy: nothing to compare a sampled output with
        for baseline in baselines:
            stats[f"hf-{baseline}"].lossless = None
    warmup = model.encode(prompts[0]["prompt"])  # first calls pay for allocation and kernel selection
    for engine in engines.values():
        engine.generate(Request(warmup, 8))
    for baseline in baselines:
        _hf_generate(hf_model, warmup, 8, baseline)
    for index, record in enumerate(prompts):
        ids = model.encode(record["prompt"])
        reference = None
        for method in methods:
            def run(method=method):
                started = time.perf_counter()
                result = engines[method].generate(Request(ids, max_new_tokens, sampling, seed=index))
                return result, time.perf_counter() - started

            result, seconds = _median_run(run, repeats)
            s = stats[method]
            s.tokens += len(result.token_ids)
            s.target_forwards += result.target_forwards
            s.accepted += result.num_accepted_tokens
            s.drafts += result.num_drafts
            s.per_position += [0] * (len(result.accepted_per_position) - len(s.per_position))
            for position, count in enumerate(result.accepted_per_position):
                s.per_position[position] += count
            s.decode_tps.append(len(result.token_ids) / max(result.decode_seconds, 1e-9))
            s.e2e_tps.append(len(result.token_ids) / seconds)
            s.decode_seconds += result.decode_seconds
            s.ttft_ms.append(result.prefill_seconds * 1000)
            s.by_category.setdefault(record.get("category", "all"), []).append(result.acceptance_length)
            if method == "ar":
                reference = result.token_ids
            elif reference is not None and result.token_ids != reference:  # sampled too: same seed, same tokens
                s.lossless = False
        for baseline in baselines:
            tokens, seconds = _median_run(lambda b=baseline: _hf_generate(hf_model, ids, max_new_tokens, b), repeats)
            s = stats[f"hf-{baseline}"]
            s.tokens += len(tokens)
            s.e2e_tps.append(len(tokens) / seconds)
            if reference is not None and temperature == 0 and tokens != reference[: len(tokens)]:
                s.lossless = False
        log(f"[{index + 1}/{len(prompts)}] {record.get('category', '')}: "
            + ", ".join(f"{m} {stats[m].e2e_tps[-1]:.1f} tok/s" for m in stats))
    return stats


def _hf_model(model: LoadedModel):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model.folder, dtype=torch.float32).eval()


def _hf_generate(hf_model, ids: list[int], max_new_tokens: int, baseline: str):
    extra = {"prompt_lookup_num_tokens": 10} if baseline == "prompt-lookup" else {}
    started = time.perf_counter()
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, **extra)
    tokens = out[0, len(ids):].tolist()
    eos = hf_model.generation_config.eos_token_id
    eos = set(eos) if isinstance(eos, list) else {eos}
    tokens = next((tokens[:i] for i, t in enumerate(tokens) if t in eos), tokens)
    return tokens, time.perf_counter() - started


def summarize(stats: dict[str, MethodStats]) -> dict:
    ar = stats.get("ar")
    ar_decode = statistics.median(ar.decode_tps) if ar else None
    summary = {}
    for name, s in stats.items():
        tps = statistics.median(s.e2e_tps) if s.e2e_tps else 0.0
        entry = {
            "acceptance_length": round(s.acceptance_length, 3) if not name.startswith("hf-") else None,
            "tokens_per_second": round(tps, 2),
            "decode_tokens_per_second": round(statistics.median(s.decode_tps), 2) if s.decode_tps else None,
            "ttft_ms": round(statistics.median(s.ttft_ms), 1) if s.ttft_ms else None,
            "speedup_vs_ar": round(statistics.median(s.decode_tps) / ar_decode, 3) if s.decode_tps and ar_decode else
            (round(tps / statistics.median(ar.e2e_tps), 3) if ar else None),
            "lossless": s.lossless,
            "acceptance_per_position": [round(c / s.drafts, 3) for c in s.per_position] if s.drafts else [],
            "acceptance_length_by_category": {c: round(statistics.mean(v), 3) for c, v in sorted(s.by_category.items())},
        }
        summary[name] = entry
    return {"methods": summary}


# A bench method as a SpeculativeServing names it: plain decoding (`ar`) is method `none` there.
SCENARIO_METHODS = {"ar": "none", "ngram": "ngram", "eagle3": "eagle3", "dflash": "dflash"}


def scenario_method(name: str) -> str:
    return SCENARIO_METHODS[method_spec(name)[0]]


def performance_block(summary: dict) -> dict:
    """The measured methods as a `performance` block (docs/simulator.md), what `specserve simulate`
    scenarios and the operator's SPECSERVE_CAPACITY_PRIORS read; one bench variant per method.

    The in-process bench decodes one sequence at a time, so a method's curve is one row at
    concurrency 1, its median decode tokens/s and prefill time over the prompts, and
    maxConcurrency 1: further requests wait, which the simulator counts in their TTFT. Bench
    requests do not fail: errorRate 0. `bench --concurrency` measures whole curves under load
    (load_bench.performance_block).
    """
    block = {}
    for name, entry in summary["methods"].items():
        if name.startswith("hf-"):
            continue
        row = {"concurrency": 1, "tokensPerSecondPerRequest": entry["decode_tokens_per_second"], "ttftMs": entry["ttft_ms"]}
        block[scenario_method(name)] = {"acceptanceLength": entry["acceptance_length"], "errorRate": 0.0,
                                        "maxConcurrency": 1, "curve": [row]}
    return block


def markdown_table(rows: list[tuple[str, ...]]) -> list[str]:
    """A header row and data rows as the lines of an aligned Markdown table."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(cell.ljust(width) for cell, width in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (width + 2) for width in widths) + "|")
    return lines


def table(summary: dict) -> str:
    rows = [("method", "tau", "tok/s", "decode tok/s", "speed-up vs ar", "lossless", "per-position acceptance")]
    for name, e in summary["methods"].items():
        rows.append((
            name,
            "-" if e["acceptance_length"] is None else f"{e['acceptance_length']:.2f}",
            f"{e['tokens_per_second']:.1f}",
            "-" if e["decode_tokens_per_second"] is None else f"{e['decode_tokens_per_second']:.1f}",
            "-" if e["speedup_vs_ar"] is None else f"{e['speedup_vs_ar']:.2f}x",
            {True: "yes", False: "NO", None: "n/a (T>0)"}[e["lossless"]],
            " ".join(f"{p:.2f}" for p in e["acceptance_per_position"][:8]) or "-",
        ))
    lines = markdown_table(rows)
    categories = sorted({c for e in summary["methods"].values() for c in e["acceptance_length_by_category"]})
    if len(categories) > 1:
        lines.append("")
        lines.append("| tau by category | " + " | ".join(categories) + " |")
        lines.append("|---|" + "---|" * len(categories))
        for name, e in summary["methods"].items():
            if e["acceptance_length"] is not None:
                lines.append(f"| {name} | " + " | ".join(f"{e['acceptance_length_by_category'].get(c, 0):.2f}" for c in categories) + " |")
    return "\n".join(lines)



def decode_floor(model: LoadedModel, prefix: int = 300, runs: int = 20) -> dict:
    """One-token decode step of the engine (fused and separate projections) against the bare
    chain of the model's matrix products (every weight once, one token, inputs preallocated);
    the verify forward by tokens and the batched decode step by sequences, with packed weights
    and with torch's plain F.linear (layers.PackedLinear)."""
    target = model.target
    linears = [(name, m) for name, m in target.named_modules() if isinstance(m, (torch.nn.Linear, PackedLinear))]
    weights = [m.weight for name, m in linears if not name.endswith((".qkv", ".gate_up"))]  # fused: counted apart
    inputs = {w.shape[1]: torch.randn(1, w.shape[1]) for w in weights}  # the MLP down projection is wider

    def matmul_chain():
        for w in weights:
            torch.nn.functional.linear(inputs[w.shape[1]], w)

    caches = [target.new_cache(prefix + 8) for _ in range(8)]  # every step is cropped back to the prefix
    for cache in caches:
        target(torch.randint(0, 1000, (prefix,)), cache)

    def decode_step():
        target(torch.tensor([5]), caches[0])
        caches[0].crop(prefix)

    def decode_step_separate():
        with separate_projections(target):
            decode_step()

    def verify_step(num_tokens: int):  # [last token, drafts...]: what one speculative step verifies
        target(torch.arange(5, 5 + num_tokens), caches[0])
        caches[0].crop(prefix)

    def batch_step(num_sequences: int):  # one decode token for each of several sequences, one forward
        target.forward_batch([Segment(torch.tensor([5]), cache, 1) for cache in caches[:num_sequences]])
        for cache in caches[:num_sequences]:
            cache.crop(prefix)

    timings = {}
    for layout, context in (("packed", contextlib.nullcontext), ("plain", lambda: unpacked_weights(target))):
        with context():
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
                rounds: int = 6, round_steps: int = 15, max_new_tokens: int = 400) -> dict:
    """Engine steps over `batch_size` sequences, in process: a finished sequence is replaced by the
    next prompt. Plain decoding, and every speculative method both with its fixed draft length and
    with adaptive speculation, run round_steps steps each in turn, `rounds` times, so the machine's
    speed drift falls on all of them alike. Per configuration: committed tokens/s of each round and
    how often adaptive speculation chose each draft length."""
    configs = {"ar": build_engine(model, "ar")}
    for method in methods:
        name, options = method_spec(method)
        if name != "ar":
            configs[f"{method} fixed"] = build_engine(model, name, options)
            configs[f"{method} adaptive"] = build_engine(model, name, options, adaptive=True)
    state = {label: {"batch": [], "next": 0, "rates": [], "lengths": []} for label in configs}

    def run_round(label: str) -> float:
        engine, entry = configs[label], state[label]
        batch = entry["batch"]
        committed, started = 0, time.perf_counter()
        for _ in range(round_steps):
            while len(batch) < batch_size:
                batch.append(engine.add(Request(prompts[entry["next"] % len(prompts)], max_new_tokens)))
                entry["next"] += 1
            steps = engine.step(batch)
            committed += sum(len(step.token_ids) for step in steps if step is not None)
            if engine.draft_length is not None:
                entry["lengths"].append(engine.draft_length)
            batch[:] = [sequence for sequence in batch if sequence.finish_reason is None]
        return committed / (time.perf_counter() - started)

    for label in configs:  # prompts prefilled, kernels chosen: not timed
        run_round(label)
        state[label]["lengths"].clear()
    for _ in range(rounds):
        for label in configs:
            state[label]["rates"].append(round(run_round(label), 2))
    return {label: {"tokens_per_second": statistics.median(entry["rates"]), "rounds": entry["rates"],
                    "lengths": {n: entry["lengths"].count(n) for n in sorted(set(entry["lengths"]))}}
            for label, entry in state.items()}


def closed_loop_table(results: dict) -> str:
    base = results["ar"]["tokens_per_second"]
    rows = [("configuration", "tok/s (median of rounds)", "vs ar", "rounds", "draft lengths chosen")]
    for label, r in results.items():
        lengths = ", ".join(f"{n}: {count}" for n, count in r["lengths"].items()) or "-"
        rows.append((label, f"{r['tokens_per_second']:.1f}", f"{r['tokens_per_second'] / base:.2f}x",
                     " ".join(f"{x:.0f}" for x in r["rounds"]), lengths))
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
