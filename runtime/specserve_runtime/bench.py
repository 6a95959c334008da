"""`specserve bench`: the methods side by side in one process, prompt by prompt, with losslessness checked.

Every method runs on the same prompt before the next prompt starts (interleaved), so machine
noise hits all methods alike; each timing is the median of `repeats` runs. Baselines (transformers'
generate(), llama.cpp) decode greedily from the same prompt token ids in the same loop, on the same
number of threads, and are counted against `ar`'s tokens.
"""

import contextlib
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from . import blockquant
from .drafters import ProposerOptions, int8_drafting
from .engine import Request
from .layers import BLOCKQUANT_MAX_ROWS, weight_layouts
from .loader import LoadedModel, build_engine
from .model import Transformer
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
    same_prompts: int = 0  # prompts whose tokens were exactly ar's
    compared_prompts: int = 0
    common_prefix: list[float] = field(default_factory=list)  # per prompt: share of ar's tokens before a difference

    @property
    def acceptance_length(self) -> float:
        return 1 + self.accepted / self.target_forwards if self.target_forwards else 1.0

    def compare(self, tokens: list[int], reference: list[int]) -> None:
        """Count one prompt's tokens against ar's: identical, and how far they agree before they part."""
        common = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b),
                      min(len(tokens), len(reference)))
        self.compared_prompts += 1
        self.same_prompts += tokens == reference
        self.common_prefix.append(common / len(reference) if reference else float(tokens == reference))
        if tokens != reference:
            self.lossless = False


PROMPT_LOOKUP_TOKENS = 10  # drafts per step of both prompt-lookup baselines, transformers' and llama.cpp's


@dataclass(frozen=True)
class Baseline:
    """Another implementation decoding greedily from the engine's prompt token ids, timed end to end."""

    label: str  # its row in the table
    backend: str  # "hf": transformers' generate() on the fp32 folder; "llamacpp": llama.cpp on a GGUF (llamacpp.py);
    #               "engine": the engine's plain decoding with its weights in oneDNN's float32 layout only;
    #               "vllm": vLLM serving the fp32 folder (vllm_baseline.py)
    lookup: bool = False  # prompt-lookup drafting, PROMPT_LOOKUP_TOKENS per step
    quantisation: str | None = None  # llama.cpp's weights; q4_1 holds the very values the engine runs in fp32
    method: str = "none"  # vLLM's speculator: none, or eagle3 / dflash with the bundled drafter


# --baselines names; a group stands for its members
BASELINES = {
    "onednn": Baseline("ar-onednn", "engine"),
    "hf": Baseline("hf-greedy", "hf"),
    "prompt-lookup": Baseline("hf-prompt-lookup", "hf", lookup=True),
    **{f"llamacpp-{q}{lookup}": Baseline(f"llamacpp-{q}{lookup}", "llamacpp", bool(lookup), q)
       for q in ("q4_1", "q8_0") for lookup in ("", "-lookup")},
    **{f"vllm{suffix}": Baseline(f"vllm{suffix}", "vllm", method=method)
       for method, suffix in (("none", ""), ("eagle3", "-eagle3"), ("dflash", "-dflash"))},
}
BASELINE_GROUPS = {backend: [name for name, baseline in BASELINES.items() if baseline.backend == backend]
                   for backend in ("llamacpp", "vllm")}
BASELINE_LABELS = {baseline.label for baseline in BASELINES.values()}
GAP_REFERENCE = "llamacpp-q4_1"  # plain llama.cpp on the engine's own weights: the speed to close


def parse_baselines(text: str | None) -> list[Baseline]:
    """'hf,llamacpp-q4_1' -> the baselines in the order named, groups expanded, each once."""
    names = []
    for name in (text or "").split(","):
        names += BASELINE_GROUPS.get(name.strip(), [name.strip()] if name.strip() else [])
    unknown = [name for name in names if name not in BASELINES]
    if unknown:
        known = ", ".join([*BASELINES, *BASELINE_GROUPS])
        raise ValueError(f"unknown baseline: {', '.join(unknown)} (baselines {known})")
    return [BASELINES[name] for name in dict.fromkeys(names)]


def machine(target: Transformer | None = None) -> dict:
    """The CPU model, its logical cores, the threads every method and baseline runs on, and the engine's weight layouts
    and arithmetic (the target's, the drafters')."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    kernel = blockquant.kernel_name()
    if target is not None and target.activations == "int8":
        weights = f"target on int8 products of the GGUF blocks ({kernel}) in C layers (decoder.c)"
    elif kernel:
        weights = f"GGUF blocks on the {kernel} kernel up to {BLOCKQUANT_MAX_ROWS} rows, oneDNN float32 otherwise"
    else:
        weights = "oneDNN float32"
    drafters = "int8 products" if int8_drafting() else "float32 products"
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "weights": f"{weights}; drafters on {drafters}"}


def held_out_sample(records: list[dict], per_category: int) -> list[dict]:
    """A prompt set's held-out split (when its records name splits), the first `per_category` prompts
    of each category in the file's order (when they name categories), else every prompt."""
    if any("split" in record for record in records):
        records = [record for record in records if record.get("split") == "eval"]
    if not any("category" in record for record in records):
        return records
    categories = dict.fromkeys(record.get("category", "other") for record in records)
    return [record for category in categories
            for record in [r for r in records if r.get("category", "other") == category][:per_category]]


def _median_run(run, repeats: int):
    results = [run() for _ in range(repeats)]
    return sorted(results, key=lambda r: r[1])[len(results) // 2]


def method_spec(name: str) -> tuple[str, ProposerOptions]:
    """'dflash', 'dflash:3' for 3 speculative tokens per step, 'dflash:tree5' for a tree of 5 drafts
    (the drafter's most likely continuations; eagle3 too), '...+lookup4' with a prompt-lookup branch of up to 4
    tokens beside them ('+lookup0': none), 'dflash@FOLDER' or 'dflash:3@FOLDER' for a drafter other than the
    bundled one (a training run's drafter/) -> the method and its proposer options."""
    spec, _, folder = name.partition("@")
    spec, plus, lookup = spec.partition("+lookup")
    if plus and not lookup.isdigit():
        raise ValueError(f"{name!r}: '+lookup' is followed by the prompt-lookup branch's most tokens, an integer >= 0")
    method, _, tokens = spec.partition(":")
    tree = tokens.startswith("tree")
    tokens = tokens.removeprefix("tree")
    if tokens and not (tokens.isdigit() and int(tokens) >= 1):
        raise ValueError(f"{name!r}: the number after ':' (or ':tree') is the speculative tokens per step, an integer >= 1")
    if "@" in name and not folder:
        raise ValueError(f"{name!r}: a drafter folder follows '@'")
    return method, ProposerOptions(drafter=folder or None, num_speculative_tokens=int(tokens) if tokens else None,
                                   draft_tree=True if tree else None, prompt_lookup=int(lookup) if plus else None)


def run_bench(model: LoadedModel, methods: list[str], baselines: list[Baseline], prompts: list[dict],
              max_new_tokens: int, repeats: int, temperature: float, log=print) -> dict[str, MethodStats]:
    with contextlib.ExitStack() as servers:  # the baselines that run as servers, stopped at the end
        return _run_bench(model, methods, baselines, prompts, max_new_tokens, repeats, temperature, servers, log)


def _run_bench(model: LoadedModel, methods: list[str], baselines: list[Baseline], prompts: list[dict],
               max_new_tokens: int, repeats: int, temperature: float, servers: contextlib.ExitStack,
               log) -> dict[str, MethodStats]:
    engines = {m: build_engine(model, *method_spec(m)) for m in methods}  # eagle3 / dflash: bundled unless @FOLDER
    encoded = [model.encode(record["prompt"]) for record in prompts]
    context = max(map(len, encoded)) + max_new_tokens + PROMPT_LOOKUP_TOKENS + 1  # the last step's drafts fit
    runners = baseline_runners(model, baselines, context, torch.get_num_threads(), servers, log)
    stats = {name: MethodStats() for name in methods + list(runners)}
    sampling = SamplingParams(temperature=temperature)
    if temperature > 0:  # the baselines run greedy: nothing to compare a sampled output with
        for label in runners:
            stats[label].lossless = None
    warmup = encoded[0]  # first calls pay for allocation and kernel selection
    for engine in engines.values():
        engine.generate(Request(warmup, 8))
    for runner in runners.values():
        runner(warmup, 8)
    for index, (record, ids) in enumerate(zip(prompts, encoded)):
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
            elif reference is not None:  # sampled too: same seed, same tokens
                s.compare(result.token_ids, reference)
        for label, runner in runners.items():
            tokens, seconds, first_token = _median_run(partial(runner, ids, max_new_tokens), repeats)
            s = stats[label]
            s.tokens += len(tokens)
            s.e2e_tps.append(len(tokens) / seconds)
            s.decode_tps.append(len(tokens) / max(seconds - first_token, 1e-9))  # as the engine counts it
            s.ttft_ms.append(first_token * 1000)
            if reference is not None and temperature == 0:
                s.compare(tokens, reference)
        log(f"[{index + 1}/{len(prompts)}] {record.get('category', '')}: "
            + ", ".join(f"{m} {stats[m].e2e_tps[-1]:.1f} tok/s" for m in stats))
    return stats


# A baseline runner: (prompt token ids, max new tokens) -> (tokens without the end token, seconds in all,
# seconds to the first token), prefill included.
Runner = Callable[[list[int], int], tuple[list[int], float, float]]


def baseline_runners(model: LoadedModel, baselines: list[Baseline], context: int, threads: int,
                     servers: contextlib.ExitStack, log=print) -> dict[str, Runner]:
    """A runner per baseline, by label, in the order given; each backend loads its models once (a server's
    lifetime is `servers`')."""
    runners = {}
    for backend, open_runners in BACKENDS.items():
        mine = [baseline for baseline in baselines if baseline.backend == backend]
        if mine:
            runners |= open_runners(model, mine, context, threads, servers, log)
    return {baseline.label: runners[baseline.label] for baseline in baselines}


def _hf_runners(model: LoadedModel, baselines: list[Baseline], context: int, threads: int, servers,
                log) -> dict[str, Runner]:
    hf_model = _hf_model(model)  # torch's threads: already `threads`
    return {b.label: partial(_hf_generate, hf_model, lookup=b.lookup, eos_ids=model.eos_ids) for b in baselines}


def _llamacpp_runners(model: LoadedModel, baselines: list[Baseline], context: int, threads: int, servers,
                      log) -> dict[str, Runner]:
    from . import llamacpp

    runners = {}
    for b in baselines:
        llm = llamacpp.open_model(llamacpp.ensure_gguf(b.quantisation, log), threads, context,
                                  PROMPT_LOOKUP_TOKENS if b.lookup else None)
        runners[b.label] = partial(llamacpp.generate, llm, eos_ids=model.eos_ids)
    return runners


def _engine_runners(model: LoadedModel, baselines: list[Baseline], context: int, threads: int, servers,
                    log) -> dict[str, Runner]:
    """`ar` as the engine ran before blockquant: every matrix product on oneDNN's float32 layout."""
    engine = build_engine(model, "ar")

    def generate(ids: list[int], max_new_tokens: int):
        started = time.perf_counter()
        with weight_layouts(model.target, onednn=True):
            result = engine.generate(Request(ids, max_new_tokens))
        return result.token_ids, time.perf_counter() - started, result.prefill_seconds

    return {baseline.label: generate for baseline in baselines}


def _vllm_runners(model: LoadedModel, baselines: list[Baseline], context: int, threads: int,
                  servers: contextlib.ExitStack, log) -> dict[str, Runner]:
    """One vLLM server per baseline, started in turn (each holds its memory until the bench ends)."""
    from . import vllm_baseline

    runners = {}
    for b in baselines:
        log(f"[vLLM] starting {b.label} on {threads} thread(s)")
        url = servers.enter_context(vllm_baseline.serve(b.method, model.folder, threads, context))
        runners[b.label] = partial(vllm_baseline.generate, url, eos_ids=model.eos_ids)
    return runners


BACKENDS = {"engine": _engine_runners, "hf": _hf_runners, "llamacpp": _llamacpp_runners, "vllm": _vllm_runners}


def _hf_model(model: LoadedModel):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model.folder, dtype=torch.float32).eval()


class _FirstTokenClock:
    """A generate() streamer that notes when the first new tokens arrive (its first put() is the prompt)."""

    def __init__(self):
        self.puts, self.at = 0, None

    def put(self, value):
        self.puts += 1
        if self.puts == 2:
            self.at = time.perf_counter()

    def end(self):
        pass


def _hf_generate(hf_model, ids: list[int], max_new_tokens: int, lookup: bool, eos_ids: set[int]):
    extra = {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS} if lookup else {}
    clock = _FirstTokenClock()
    started = time.perf_counter()
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, streamer=clock,
                                **extra)
    seconds = time.perf_counter() - started
    tokens = out[0, len(ids):].tolist()
    tokens = next((tokens[:i] for i, t in enumerate(tokens) if t in eos_ids), tokens)
    return tokens, seconds, (clock.at or started + seconds) - started


def summarize(stats: dict[str, MethodStats], hardware: dict | None = None) -> dict:
    ar = stats.get("ar")
    ar_decode = statistics.median(ar.decode_tps) if ar else None
    summary = {}
    for name, s in stats.items():
        tps = statistics.median(s.e2e_tps) if s.e2e_tps else 0.0
        entry = {
            "acceptance_length": round(s.acceptance_length, 3) if name not in BASELINE_LABELS else None,
            "tokens": s.tokens,
            "tokens_per_second": round(tps, 2),
            "decode_tokens_per_second": round(statistics.median(s.decode_tps), 2) if s.decode_tps else None,
            "ttft_ms": round(statistics.median(s.ttft_ms), 1) if s.ttft_ms else None,
            "speedup_vs_ar": round(statistics.median(s.decode_tps) / ar_decode, 3) if s.decode_tps and ar_decode else
            (round(tps / statistics.median(ar.e2e_tps), 3) if ar else None),
            "lossless": s.lossless,
            "same_as_ar": {"prompts": s.same_prompts, "of": s.compared_prompts,
                           "common_prefix": round(statistics.mean(s.common_prefix), 3)} if s.compared_prompts else None,
            "acceptance_per_position": [round(c / s.drafts, 3) for c in s.per_position] if s.drafts else [],
            "acceptance_length_by_category": {c: round(statistics.mean(v), 3) for c, v in sorted(s.by_category.items())},
        }
        summary[name] = entry
    return {"methods": summary} | ({"hardware": hardware} if hardware else {})


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
        if name in BASELINE_LABELS:
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
    rows = [("method", "tau", "tok/s", "decode tok/s", "speed-up vs ar", "same tokens as ar",
             "per-position acceptance")]
    for name, e in summary["methods"].items():
        rows.append((
            name,
            "-" if e["acceptance_length"] is None else f"{e['acceptance_length']:.2f}",
            f"{e['tokens_per_second']:.1f}",
            "-" if e["decode_tokens_per_second"] is None else f"{e['decode_tokens_per_second']:.1f}",
            "-" if e["speedup_vs_ar"] is None else f"{e['speedup_vs_ar']:.2f}x",
            _agreement(name, e),
            " ".join(f"{p:.2f}" for p in e["acceptance_per_position"][:8]) or "-",
        ))
    lines = markdown_table(rows)
    if any(e["lossless"] is False for e in summary["methods"].values()):
        lines.append("NO (k/n same, p% prefix): k of n prompts gave exactly ar's tokens; on average the first p% of "
                     "ar's tokens came before the first difference")
    if (hardware := summary.get("hardware")):
        threads = hardware["threads"]
        lines.append(f"hardware: {hardware['cpu']}, {hardware['cores']} logical cores; every method and baseline on "
                     f"{threads} thread{'s' if threads != 1 else ''}"
                     + (f"; engine weights: {hardware['weights']}" if hardware.get("weights") else ""))
    methods = summary["methods"]
    if "ar" in methods and methods.get(GAP_REFERENCE, {}).get("tokens"):
        ar, reference = methods["ar"], methods[GAP_REFERENCE]
        lines.append(f"ar / {GAP_REFERENCE} (plain llama.cpp, the same weights): "
                     f"{ar['tokens_per_second'] / reference['tokens_per_second']:.2f}x end to end, "
                     f"{ar['decode_tokens_per_second'] / reference['decode_tokens_per_second']:.2f}x decode")
    categories = sorted({c for e in summary["methods"].values() for c in e["acceptance_length_by_category"]})
    if len(categories) > 1:
        lines.append("")
        lines.append("| tau by category | " + " | ".join(categories) + " |")
        lines.append("|---|" + "---|" * len(categories))
        for name, e in summary["methods"].items():
            if e["acceptance_length"] is not None:
                lines.append(f"| {name} | " + " | ".join(f"{e['acceptance_length_by_category'].get(c, 0):.2f}" for c in categories) + " |")
    return "\n".join(lines)


def _agreement(name: str, entry: dict) -> str:
    """yes: every prompt gave ar's tokens (ar is the reference); -: nothing was compared."""
    same = entry["same_as_ar"]
    if entry["lossless"] is None:
        return "n/a (T>0)"
    if same and same["prompts"] < same["of"]:
        return f"NO ({same['prompts']}/{same['of']} same, {same['common_prefix']:.0%} prefix)"
    if entry["lossless"] is False:
        return "NO"
    return "yes" if same or name == "ar" else "-"
