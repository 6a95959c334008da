"""`specserve pull`, `generate`, `serve` and `launch`: the model, the engine, and a runtime configuration run on its
engine."""

import argparse
import errno
import json
import os
import sys
from pathlib import Path

from ..cmdline import UsageError, read_prompts
from ..config import DEFAULT_MAX_NUM_SEQS, DEFAULT_TOKEN_BUDGET
from .options import METHODS, OPERATING_POINT_HELP, PROMPT_LOOKUP_HELP


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
    from ..store import pull

    pull(force=args.force, log=lambda message: print(message, file=sys.stderr))


def cmd_generate(args) -> None:
    from ..drafters import ProposerOptions
    from ..engine import Request
    from ..loader import build_engine, load_model
    from ..verify import SamplingParams

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


def cmd_serve(args) -> None:
    from ..config import read_config

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
    from ..config import parse_schedule, schedule_problems

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
    from ..drafters import ProposerOptions
    from ..loader import build_engine, load_model
    from ..server.app import Server, serve

    for flag in ("max_concurrency", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not 1 <= args.port <= 65535:
        raise UsageError(f"--port must be 1..65535, got {args.port}")
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
    try:
        serve(server, args.host, args.port)
    except OSError as exc:
        if exc.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            raise
        raise UsageError(f"--host {args.host} --port {args.port}: cannot listen there ({os.strerror(exc.errno)})") from None


def cmd_launch(args) -> None:
    import shlex

    from ..config import read_config
    from ..launch import vllm_command

    config = read_config(args.config)
    if config.engine == "embedded":
        command = ["specserve", "serve", "--config", args.config]
    else:
        command = vllm_command(config)
    if args.dry_run:
        print(shlex.join(command))
        return
    if config.engine == "embedded":
        cmd_serve(serve_arguments(["--config", args.config]))
        return
    os.execvp(command[0], command)  # an argument list, never a shell


def add_commands(commands) -> None:
    from ..store import DEFAULT_MODEL

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


def serve_arguments(argv: list[str]) -> argparse.Namespace:
    """`specserve serve`'s arguments from `argv` (its flags only)."""
    from ..cmdline import Parser

    parser = Parser(prog="specserve")
    add_commands(parser.add_subparsers(dest="command", required=True, parser_class=Parser))
    return parser.parse_args(["serve", *argv])
