"""`specserve bench`: the methods side by side in process, under closed-loop load, or served; with baselines."""

import json
import sys
from pathlib import Path

from ..cmdline import UsageError, read_prompt_records
from .options import METHODS, int_list


def cmd_bench(args) -> None:
    from ..bench import (held_out_sample, machine, method_spec, parse_baselines, performance_block, run_bench,
                         scenario_method, summarize, table)
    from ..bench_load import WEIGHT_LAYOUTS, batched_drafting_ms, closed_loop, closed_loop_table, decode_floor
    from ..loader import load_model
    from ..training.prompts import PROMPTS_FILE

    methods = [m for m in args.methods.split(",") if m]
    try:
        specs = {m: method_spec(m) for m in methods}
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    unknown = [m for m, (method, _) in specs.items() if method not in METHODS]
    if unknown:
        raise UsageError(f"unknown method: {', '.join(unknown)} (methods {', '.join(METHODS)})")
    needless = [m for m, (method, options) in specs.items() if options.drafter and method not in ("eagle3", "dflash")]
    if needless:
        raise UsageError(f"only eagle3 and dflash read a drafter folder: {', '.join(needless)}")
    missing = [m for m, (_, options) in specs.items()
               if options.drafter not in (None, "random") and not Path(options.drafter, "config.json").is_file()]
    if missing:
        raise UsageError(f"no drafter (config.json) in the folder of: {', '.join(missing)}")
    try:
        baselines = parse_baselines(args.baselines)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if any(baseline.backend == "llamacpp" for baseline in baselines):  # refused before the run, not after minutes of it
        check_llamacpp_baselines(args.model)
    if any(baseline.backend == "vllm" for baseline in baselines):
        from ..vllm_baseline import vllm_missing

        if (why := vllm_missing()) is not None:
            raise UsageError(why)
    if args.repeats < 1 or args.max_new_tokens < 1:
        raise UsageError("--repeats and --max-new-tokens must be >= 1")
    if args.emit_performance:  # refused before the run, not after minutes of it
        emitted = [scenario_method(m) for m in methods]
        if len(set(emitted)) < len(emitted):
            raise UsageError(f"--emit-performance writes one row per method: --methods {args.methods} has two variants of one")
        if not Path(args.emit_performance).parent.is_dir():
            raise UsageError(f"--emit-performance {args.emit_performance}: no such directory")
    if args.per_category < 1:
        raise UsageError("--per-category must be >= 1")
    # A prompt set (the project's, or v2 from build-prompts): its held-out split, a few of each category.
    records = read_prompt_records(args.prompts_file or str(PROMPTS_FILE))
    prompts = held_out_sample(records, args.per_category)
    if args.concurrency:
        bench_server(args, methods, [record["prompt"] for record in prompts[: args.limit]])
        return
    if args.closed_loop is not None:
        if args.closed_loop < 1:
            raise UsageError(f"--closed-loop {args.closed_loop}: the batch size must be >= 1")
        if args.round_steps < 1:
            raise UsageError(f"--round-steps {args.round_steps}: a round must take at least one step")
        if args.kernels or args.baselines or args.temperature or args.repeats != 1 or args.url or args.emit_performance:
            raise UsageError("--closed-loop measures greedy decoding under load in process: --kernels, --baselines, "
                             "--temperature, --repeats, --url and --emit-performance are for the other modes")
        model = load_model(args.model)
        results = closed_loop(model, methods, [model.encode(r["prompt"]) for r in prompts[: args.limit]], args.closed_loop,
                              max_new_tokens=args.max_new_tokens, round_steps=args.round_steps)
        print(closed_loop_table(results))
        if args.json:
            print(json.dumps(results))
        return
    if args.url:
        raise UsageError("--url benches a running server under load: it needs --concurrency")
    model = load_model(args.model)
    stats = run_bench(model, methods, baselines, prompts[: args.limit], args.max_new_tokens, args.repeats,
                      args.temperature, log=lambda message: print(message, file=sys.stderr, flush=True))
    summary = summarize(stats, machine(model.target))
    if args.kernels:
        summary["kernels"] = decode_floor(model)
        summary["kernels"]["decode_step_ms_by_sequences"] = {
            m: batched_drafting_ms(model, m) for m in methods if method_spec(m)[0] in ("eagle3", "dflash")}
    print(table(summary))
    if args.kernels:
        kernels = summary["kernels"]
        print(f"\none decode step (300-token prefix): {kernels['decode_step_ms']} ms fused, "
              f"{kernels['decode_step_separate_ms']} ms with separate q/k/v and gate/up products; "
              f"bare matrix-product chain: {kernels['matmul_floor_ms']} ms")
        for layout in WEIGHT_LAYOUTS:
            print(f"verify forward (ms) by tokens verified (last token + drafts), {layout} weights: "
                  + ", ".join(f"{n}: {ms}" for n, ms in kernels[f"verify_ms_by_tokens_{layout}"].items()))
            print(f"batched decode step (ms) by sequences, {layout} weights: "
                  + ", ".join(f"{n}: {ms}" for n, ms in kernels[f"batch_ms_by_sequences_{layout}"].items()))
        print("decode step of 8 sequences (ms) by the tokens of a prompt chunk joining it: "
              + ", ".join(f"{n}: {ms}" for n, ms in kernels["decode_8_with_prompt_chunk_ms_by_tokens"].items()))
        for method, modes in kernels["decode_step_ms_by_sequences"].items():
            for mode, by_size in modes.items():
                print(f"{method} decode step (ms) by sequences, drafts {mode.replace('_', ' ')}: "
                      + ", ".join(f"{n}: {ms}" for n, ms in by_size.items()))
    if args.emit_performance:
        write_performance(performance_block(summary), Path(args.emit_performance))
    if args.json:
        print(json.dumps(summary))


def check_llamacpp_baselines(model: str) -> None:
    """llama.cpp runs the default target's GGUF files, and needs llama-cpp-python installed."""
    from ..llamacpp import llama_cpp_missing
    from ..store import MODEL_ALIASES

    if model not in MODEL_ALIASES:
        raise UsageError(f"the llama.cpp baselines run the default model's GGUF files only, not --model {model}")
    if (why := llama_cpp_missing()) is not None:
        raise UsageError(why)


def bench_server(args, methods: list[str], prompts: list[str]) -> None:
    """Closed-loop load at each --concurrency: against --url, or a `specserve serve` per method,
    all running, the methods taking turns at each level (--repeats rounds)."""
    from ..load_bench import performance_block, serve_arguments, table

    concurrencies = checked_concurrencies(args)
    if args.propose_schedule:
        bench_schedule(args, methods, prompts, concurrencies)
        return
    if args.url and len(methods) != 1:
        raise UsageError(f"--url benches the one method that server runs: name it with --methods (got {args.methods})")
    servers = None if args.url else {method: serve_arguments(method) for method in methods}
    results = measure(args, servers, {methods[0]: args.url.rstrip("/")} if args.url else None, prompts,
                      concurrencies, args.repeats)
    print(table(results))
    if args.emit_performance:
        write_performance(performance_block(results, max(concurrencies)), Path(args.emit_performance))
    if args.json:
        print(json.dumps({"concurrency": results}))


def checked_concurrencies(args) -> list[int]:
    concurrencies = int_list(args.concurrency, "--concurrency")
    if not concurrencies or min(concurrencies) < 1 or concurrencies != sorted(set(concurrencies)):
        raise UsageError(f"--concurrency takes increasing integers >= 1, got {args.concurrency!r}")
    if args.requests_per_client < 1:
        raise UsageError(f"--requests-per-client must be >= 1, got {args.requests_per_client}")
    if args.kernels or args.baselines or args.temperature:
        raise UsageError("--concurrency measures greedy serving: --kernels, --baselines and --temperature are "
                         "for the in-process bench")
    return concurrencies


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def measure(args, servers: dict[str, list[str]] | None, urls: dict[str, str] | None, prompts: list[str],
            concurrencies: list[int], repeats: int) -> dict[str, dict]:
    """measure_servers over `urls`, or over a `specserve serve` per label of `servers` (label -> its flags), all
    started first and stopped after."""
    from contextlib import ExitStack

    from ..cmdline import ChildFailed
    from ..load_bench import local_server, measure_servers

    batch = max(concurrencies)
    labels = list(urls or servers)
    log(f"{', '.join(labels)}: {len(prompts)} prompts, {args.requests_per_client} requests per client, "
        f"concurrency {', '.join(map(str, concurrencies))}, {repeats} round(s) per level")
    with ExitStack() as running:
        if urls is None:
            try:
                urls = {label: running.enter_context(local_server(label, args.model, batch, flags))
                        for label, flags in servers.items()}
            except ChildFailed as exc:  # a server did not start: its log's last lines name why
                raise UsageError(f"bench --concurrency: {exc}") from exc
        return measure_servers(urls, prompts, concurrencies, repeats, args.requests_per_client,
                               args.max_new_tokens, log)


def bench_schedule(args, methods: list[str], prompts: list[str], concurrencies: list[int]) -> None:
    """--propose-schedule K1,K2,...: measure the method at each fixed draft length and plain decoding (--repeats
    rounds a level), propose the draft-length schedule from those curves (draft_schedule.propose), then measure plain
    decoding, every fixed length and the schedule side by side (--repeats rounds a level): the proposal is judged
    on measurements it was not fitted to."""
    from ..bench import scenario_method
    from ..draft_schedule import describe, propose
    from ..load_bench import schedule_table, serve_arguments, table
    from ..performance import Performance, draft_length_curves

    lengths = int_list(args.propose_schedule, "--propose-schedule")
    if not lengths or min(lengths) < 1 or lengths != sorted(set(lengths)):
        raise UsageError(f"--propose-schedule takes increasing draft lengths >= 1, got {args.propose_schedule!r}")
    drafting = [m for m in methods if m != "ar"]
    if args.url or len(drafting) != 1 or "ar" not in methods or ":" in drafting[0]:
        raise UsageError("--propose-schedule compares one speculative method with plain decoding on servers it starts: "
                         f"--methods ar,METHOD without :K (got {args.methods}{' and --url' if args.url else ''})")
    method = drafting[0]
    fixed = {f"{method}:{k}": serve_arguments(method) + ["--num-speculative-tokens", str(k), "--speculation", "fixed"]
             for k in lengths}
    servers = {"ar": serve_arguments("ar")} | fixed
    log("calibration: each draft length at every concurrency")
    calibration = schedule_performance_block(measure(args, servers, None, prompts, concurrencies, args.repeats), method,
                                             lengths, max(concurrencies))
    schedule = propose(draft_length_curves(Performance.model_validate(calibration), scenario_method(method)))
    log(f"proposed schedule: {describe(schedule)}")
    label = f"{method} schedule"
    servers[label] = serve_arguments(method) + ["--num-speculative-tokens", str(max(lengths)),
                                                "--num-speculative-tokens-per-batch-size", describe(schedule)]
    log("comparison: plain decoding, each draft length and the schedule, side by side")
    results = measure(args, servers, None, prompts, concurrencies, args.repeats)
    print(table(results))
    print()
    print(schedule_table(results, method, lengths, label))
    print(f"\nproposed schedule (numSpeculativeTokensPerBatchSize): {describe(schedule)}")
    if args.emit_performance:
        write_performance(schedule_performance_block(results, method, lengths, max(concurrencies)),
                          Path(args.emit_performance))
    if args.json:
        print(json.dumps({"concurrency": results, "schedule": describe(schedule)}))


def schedule_performance_block(results: dict[str, dict], method: str, lengths: list[int], max_num_seqs: int) -> dict:
    """The `performance` block of a schedule bench: plain decoding, and the method at its largest fixed length with
    every fixed length as its draftLengths."""
    from ..bench import scenario_method
    from ..load_bench import performance_block, performance_row

    block = performance_block({"ar": results["ar"], method: results[f"{method}:{max(lengths)}"]}, max_num_seqs)
    name = scenario_method(method)
    block[name]["draftLengths"] = []
    for k in lengths:
        row = performance_row(results[f"{method}:{k}"], max_num_seqs)
        block[name]["draftLengths"].append({"numSpeculativeTokens": k, "acceptanceLength": row["acceptanceLength"],
                                            "curve": row["curve"]})
    return block


def write_performance(block: dict, path: Path) -> None:
    """Checked by the scenario file's own model before it is written: what simulate will read."""
    import yaml

    from ..performance import Performance

    Performance.model_validate(block)
    path.write_text(yaml.safe_dump(block, sort_keys=False))
    print(f"wrote the performance block of {', '.join(block)} to {path}", file=sys.stderr)


def add_commands(commands) -> None:
    from ..store import DEFAULT_MODEL

    bench = commands.add_parser("bench", help="methods side by side: acceptance, tokens/s, speed-up, losslessness")
    bench.add_argument("--methods", default="ar,ngram,eagle3,dflash",
                       help="comma list; METHOD:K drafts K tokens per step (e.g. dflash:3), METHOD:treeK a tree of K, "
                       "else the drafter's default; ...+lookupN with a prompt-lookup branch of up to N tokens (0: none); "
                       "METHOD[:K]@FOLDER benches the drafter in FOLDER (e.g. a training run's drafter/) instead of the bundled one")
    bench.add_argument("--baselines", help="comma list: onednn (ar with float32 weights, without blockquant), "
                       "hf (transformers generate), prompt-lookup (its assisted mode), "
                       "llamacpp-q4_1 and llamacpp-q8_0 (llama.cpp on the GGUF weights; pip install "
                       "'specserve[llamacpp]'), each with -lookup for llama.cpp's prompt lookup; llamacpp: all four; "
                       "vllm, vllm-eagle3, vllm-dflash (vLLM on the float32 folder, plain or with the bundled "
                       "drafter; SPECSERVE_VLLM or `vllm`); vllm: all three")
    bench.add_argument("--model", default=DEFAULT_MODEL)
    bench.add_argument("--prompts-file", help='JSONL with a "prompt" field (default: the project\'s prompt set v1); '
                       'with "split", its eval split; with "category", --per-category of each')
    bench.add_argument("--per-category", type=int, default=4, help="held-out prompts per category (default 4)")
    bench.add_argument("--limit", type=int)
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--repeats", type=int, default=1,
                       help="in process: each timing the median of R runs; with --concurrency: R rounds per "
                            "level, the methods taking turns (default 1)")
    bench.add_argument("--temperature", type=float, default=0.0)
    bench.add_argument("--kernels", action="store_true", help="also time one decode step against the matmul floor")
    bench.add_argument("--json", action="store_true", help="the last line of stdout is a JSON summary")
    bench.add_argument("--emit-performance", metavar="FILE",
                       help="write the methods' measured `performance` block (docs/simulator.md) to FILE")
    bench.add_argument("--concurrency", metavar="C1,C2,...",
                       help="serving under closed-loop load at each concurrency (OpenAI streaming clients)")
    bench.add_argument("--propose-schedule", metavar="K1,K2,...",
                       help="with --concurrency and --methods ar,METHOD: measure METHOD at each fixed draft length, "
                            "propose the draft-length schedule (numSpeculativeTokensPerBatchSize) with the most tokens/s "
                            "at each batch size, then measure it beside plain decoding and every fixed length")
    bench.add_argument("--url", help="with --concurrency: bench this running server instead of starting one per method")
    bench.add_argument("--requests-per-client", type=int, default=2, help="with --concurrency (default 2)")
    bench.add_argument("--closed-loop", type=int, metavar="B",
                       help="in process: B sequences decoding at once, each method fixed and adaptive, "
                            "interleaved in rounds (speculation under load without a server); a finished "
                            "sequence (--max-new-tokens) is replaced by the next prompt")
    bench.add_argument("--round-steps", type=int, default=15,
                       help="with --closed-loop: engine steps per configuration in each of its 6 rounds (default 15)")
    bench.set_defaults(run=cmd_bench)
