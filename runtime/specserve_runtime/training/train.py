"""`specserve train-drafter`: train a DFlash or EAGLE-3 drafter on self-distilled data.

Both recipes share this loop, the data, the target features (computed once and cached next to
the data), the optimiser and the step budget, so their results compare fairly. Checkpoints
are written every `checkpoint_every` steps and a run resumes from the last one; with the same
seed a run is deterministic (anchors, data order and initialisation are seeded). A run can also
start from a trained drafter (`warm_start`): its weights, with a fresh optimiser and learning-rate
schedule, so a curve that is still rising is extended without repeating the steps behind it.
"""

import hashlib
import json
import math
import sys
import time
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..drafters.dflash import DFlashConfig, DFlashDrafter, load_dflash, save_dflash
from ..drafters.eagle3 import DEFAULT_TOKENS as EAGLE3_DEFAULT_TOKENS
from ..drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Proposer, feature_layer_ids, load_eagle3, save_eagle3
from ..drafters.vocab import DraftHead, draft_token_ids, frequency_ranked, set_draft_vocab
from ..model import Transformer
from ..store import write_atomically
from .distill import read_shards
from .recipes import dflash_loss, eagle3_loss, engine_walk, proposer_accepted


# DFlash's loss weighs block slot k by exp(-(k-1)/gamma). The gammas SpecForge's DFlash recipe
# recommends per block size; other sizes take B/2, which the published 8 and 10 follow.
DECAY_GAMMA = {8: 4.0, 10: 5.0, 16: 7.0}
# Held-out evaluation anchors a DFlash block after every response token: the engine's walk needs them all.
EVERY_POSITION = 1 << 30


@dataclass
class TrainConfig:
    method: str  # dflash | eagle3
    data: str  # a distilled folder, or several joined by commas: their shards one folder after the other
    eval_data: str
    out: str
    steps: int = 1500
    lr: float = 1e-3
    warmup: int = 50
    seed: int = 0
    block_size: int = 8  # dflash
    num_layers: int = 2  # dflash (EAGLE-3 has one layer by design)
    anchors: int = 48  # dflash: blocks per sequence
    gamma: float | None = None  # dflash: position decay of the loss; None: DECAY_GAMMA by block size
    depth: int = 4  # eagle3: drafting steps unrolled in training (= draft tokens at inference)
    draft_vocab_size: int = 8192  # most frequent response tokens the drafter scores; 0: the whole vocabulary
    eval_every: int = 250
    eval_sequences: int = 24
    checkpoint_every: int = 250
    targets: str = "argmax"  # argmax: the data token; logits: the target's distribution (forward KL)
    init: str = "random"  # dflash: random, or target (draft layers start as the target's top layers)
    shards: int = 0  # train on the first N data shards (a hash-ordered prompt set: a sample of the mix); 0: all
    # bf16: the training forward and backward under bf16 autocast (fp32 weights, optimiser and
    # held-out evaluation). Half the time of an fp32 run on a CPU with avx512_bf16; the engine
    # still drafts in fp32, so outputs stay lossless whatever the drafter was trained in.
    precision: str = "fp32"
    # A trained drafter's folder: the run starts from its weights and draft vocabulary (a warm
    # restart: the optimiser and the learning-rate schedule, warm-up included, start afresh).
    warm_start: str = ""

    @property
    def decay_gamma(self) -> float:
        return self.gamma if self.gamma is not None else DECAY_GAMMA.get(self.block_size, self.block_size / 2)

    def __post_init__(self):
        if self.method not in ("dflash", "eagle3"):
            raise ValueError(f"--method must be dflash or eagle3, got {self.method!r}")
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"--precision must be fp32 or bf16, got {self.precision!r}")
        if self.targets not in ("argmax", "logits"):
            raise ValueError(f"--targets must be argmax or logits, got {self.targets!r}")
        if self.init not in ("random", "target") or (self.init == "target" and self.method != "dflash"):
            raise ValueError(f"--init must be random, or target for dflash (EAGLE-3's layer reads [embedding ; "
                             f"features], twice the target's width), got {self.init!r} for {self.method}")
        if self.warm_start and self.init != "random":
            raise ValueError(f"--warm-start and --init {self.init} both choose the starting weights: pass one")
        if (self.block_size < 2 or self.steps < 1 or self.depth < 1 or self.anchors < 1 or self.eval_sequences < 1
                or self.draft_vocab_size < 0 or self.shards < 0):
            raise ValueError("--block-size >= 2, --steps, --depth, --anchors and --eval-sequences >= 1, --draft-vocab-size "
                             "and --shards >= 0 are required")


class TargetFeatures:
    """The target's tapped hidden states of each sequence (float16), one safetensors file per shard.

    Computed once per tap set, beside the data, and read lazily from memory-mapped files: the
    features of a 2M-token set (~9 GB) need not fit in memory. A file that does not match its shard
    (truncated, or computed from an earlier version of the shard) or the target's arithmetic (int8
    or float32 activations, float16 or float32 keys and values: their features differ in the last bits)
    is computed again.
    """

    def __init__(self, target: Transformer, shards: list[tuple[Path, list[dict]]], layers: tuple[int, ...], log):
        caches = [path.parent / f"taps-{'-'.join(map(str, layers))}" / path.with_suffix(".safetensors").name
                  for path, _ in shards]
        metadata = [{"shard_sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "target_activations": target.activations,
                     "target_cache": str(target.cache_dtype).removeprefix("torch.")} for path, _ in shards]
        self.handles = [self._open(cache, expected, len(records))
                        for cache, expected, (_, records) in zip(caches, metadata, shards, strict=True)]
        missing = [index for index, handle in enumerate(self.handles) if handle is None]
        # Hours for a large set on a CPU: say how far along it is, and (by tokens, since shards
        # differ in length) about how long is left.
        tokens = {index: sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in shards[index][1])
                  for index in missing}
        if missing:
            log(f"computing target features of layers {list(layers)}: {len(missing)} of {len(shards)} shards "
                f"({sum(tokens.values()):,} tokens; the others are cached)")
        seconds, done_tokens = 0.0, 0
        for count, index in enumerate(missing, 1):
            path, records = shards[index]
            started = time.perf_counter()
            self.handles[index] = self._compute(target, records, layers, caches[index], metadata[index])
            seconds += time.perf_counter() - started
            done_tokens += tokens[index]
            left = seconds / max(done_tokens, 1) * sum(tokens[i] for i in missing[count:])
            log(f"target features for {path.name}: {len(records)} sequences, {tokens[index]:,} tokens "
                f"({count} of {len(missing)} shards to compute, about {left / 60:.0f} min left)")
        self.keys = [(shard, str(n)) for shard, (_, records) in enumerate(shards) for n in range(len(records))]

    @staticmethod
    def _compute(target: Transformer, records: list[dict], layers: tuple[int, ...], cache: Path, metadata: dict):
        from safetensors import safe_open

        taps = {}
        for number, record in enumerate(records):
            tokens = torch.tensor(record["prompt_ids"] + record["response_ids"])
            out = target(tokens, target.new_cache(tokens.shape[0]), tap_layers=layers, last_logits_only=True)
            taps[str(number)] = out.taps.half().contiguous()
        cache.parent.mkdir(exist_ok=True)
        write_atomically(cache, lambda partial: save_file(taps, partial, metadata=metadata))  # a file that is there is whole
        return safe_open(cache, "pt")

    @staticmethod
    def _open(cache: Path, expected: dict, count: int):
        from safetensors import SafetensorError, safe_open

        if not cache.exists():
            return None
        try:
            handle = safe_open(cache, "pt")
        except (SafetensorError, OSError):  # truncated or not a safetensors file
            return None
        if handle.metadata() != expected or len(handle.keys()) != count:
            return None
        return handle

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: int) -> torch.Tensor:
        handle, key = self.keys[index]
        return self.handles[handle].get_tensor(key)


def new_drafter(cfg: TrainConfig, target: Transformer, mask_token_id: int, sequences: list[dict]):
    """The run's first drafter: a fresh one, whose reduced draft vocabulary is the training responses'
    most frequent tokens, or with `warm_start` a trained one's weights and vocabulary."""
    torch.manual_seed(cfg.seed)
    vocab_size = target.config.vocab_size
    # 0 or the full size: score every token. Out of range: add_vocab_buffers names the problem.
    draft_vocab_size = None if cfg.draft_vocab_size in (0, vocab_size) else cfg.draft_vocab_size
    if cfg.method == "dflash":
        # Three taps, the same low/mid/high layers as EAGLE-3's, so both read identical features.
        config = DFlashConfig.for_target(
            target.config, cfg.num_layers, cfg.block_size, mask_token_id, num_taps=3, draft_vocab_size=draft_vocab_size
        )
        assert config.target_layer_ids == feature_layer_ids(target.config.num_hidden_layers)
        drafter = DFlashDrafter(config)
        if cfg.init == "target":
            copy_top_layers(drafter, target)
    else:
        drafter = Eagle3Drafter(Eagle3Config.for_target(target.config, draft_vocab_size))
    if cfg.warm_start:  # weights and draft vocabulary both come from the trained drafter
        load_trained(drafter, cfg.warm_start)
    elif draft_vocab_size:
        set_draft_vocab(drafter, frequency_ranked((r["response_ids"] for r in sequences), draft_vocab_size, vocab_size))
    return drafter


def load_trained(drafter: DFlashDrafter | Eagle3Drafter, folder: str) -> None:
    """A warm start: `drafter` takes the weights and draft vocabulary of the trained drafter in
    `folder`, whose shape must be the one this run's settings build."""
    trained = (load_dflash if isinstance(drafter, DFlashDrafter) else load_eagle3)(folder)
    differences = [f"{f.name} {getattr(trained.config, f.name)} (this run: {getattr(drafter.config, f.name)})"
                   for f in fields(drafter.config) if getattr(trained.config, f.name) != getattr(drafter.config, f.name)]
    if differences:
        raise ValueError(f"--warm-start {folder}: the drafter has " + ", ".join(differences))
    drafter.load_state_dict(trained.state_dict())


def copy_top_layers(drafter: DFlashDrafter, target: Transformer) -> None:
    """Draft layer i starts as target layer (L - n + i), and the final norm as the target's.

    Every tensor of the same name and shape is copied; the draft layers' query/key norms (Qwen3
    style) have no counterpart in a Llama target and keep their initial ones.
    """
    first = len(target.layers) - len(drafter.layers)
    for layer, source in zip(drafter.layers, target.layers[first:]):
        theirs = source.state_dict()
        with torch.no_grad():
            for name, tensor in layer.state_dict().items():
                if name in theirs and theirs[name].shape == tensor.shape:
                    tensor.copy_(theirs[name])
    drafter.norm.load_state_dict(target.norm.state_dict())


def tap_layers(cfg: TrainConfig, target: Transformer) -> tuple[int, ...]:
    """The drafters' feature layers, and with logit targets the last layer too (its normed output x the LM head)."""
    layers = feature_layer_ids(target.config.num_hidden_layers)
    return layers + (target.config.num_hidden_layers - 1,) if cfg.targets == "logits" else layers


def sequence_loss(cfg: TrainConfig, drafter, target, head: DraftHead, record: dict, taps: torch.Tensor, generator,
                  tree_nodes: int | None = None):
    tokens = torch.tensor(record["prompt_ids"] + record["response_ids"])
    start = len(record["prompt_ids"])
    taps, teacher = taps.float(), None
    if cfg.targets == "logits":  # the last tap is the target's last layer: what its LM head reads, once normed
        width = target.config.hidden_size
        taps, teacher = taps[:, :-width], target.norm(taps[:, -width:])
    if cfg.method == "dflash":
        return dflash_loss(drafter, target, head, tokens, taps, start, cfg.anchors, cfg.decay_gamma, generator, teacher,
                           tree_nodes)
    return eagle3_loss(drafter, target, head, tokens, taps, start, cfg.depth, teacher)


def has_drafts(record: dict) -> bool:
    """Whether a response has a position with a next token to draft: 2 tokens or more. A continuation
    can end at once (7 of set v2's 6,322 did), and a 1-token response gives no anchor and no step."""
    return len(record["response_ids"]) >= 2


@torch.no_grad()
def evaluate(cfg: TrainConfig, drafter, target, head: DraftHead, sequences, taps, drafts: int | None = None,
             tree: bool = False) -> dict:
    """Held-out acceptance, teacher-forced after every response token (deterministic: comparable across steps).

    tau: the mean over those positions of 1 + the drafts accepted there. engine_tau: tokens per verify
    step of the walk the engine takes through each response at T=0 (recipes.engine_walk), what
    `specserve bench` measures on the same prompts; engine_per_position: how often that walk's steps
    accept draft 1, 2, .... Both in all and per category of prompt (chat, code, math). `drafts` caps
    the drafts per step (the engine's METHOD:K); by default a DFlash block's B-1, or EAGLE-3's depth.
    `tree`: the drafts are a draft tree of `drafts` nodes (the engine's METHOD:treeK): a DFlash
    block's, from its teacher-forced logits; EAGLE-3's grown by the engine's own proposer at every
    position (recipes.proposer_accepted), since each of its drafts needs a drafter forward.
    """
    kept = [(record, features) for record, features in zip(sequences, taps) if has_drafts(record)]
    if not kept:
        raise ValueError("no held-out sequence has a response of 2 tokens or more to draft in")
    sequences, taps = zip(*kept)
    drafter.eval()
    every_position = replace(cfg, anchors=EVERY_POSITION)
    generator = torch.Generator().manual_seed(1234)
    drafts = drafts or most_drafts(cfg)
    results = [sequence_loss(every_position, drafter, target, head, r, t, generator, drafts if tree else None)
               for r, t in zip(sequences, taps)]
    if tree and cfg.method == "eagle3":
        proposer = Eagle3Proposer(target, drafter, drafts, tree=True)
        for record, features, (_, stats) in zip(sequences, taps, results):
            stats["accepted"] = proposer_accepted(proposer, record["prompt_ids"] + record["response_ids"],
                                                  features.float(), len(record["prompt_ids"]), drafts)
    drafter.train()
    groups = {}
    for record, (loss, stats) in zip(sequences, results):
        accepted = [min(a, drafts) for a in stats["accepted"]]
        for group in ("all", record.get("category")):
            if group is not None:
                groups.setdefault(group, []).append((float(loss), stats["accuracy"], accepted))
    summary = {name: _acceptance(rows, drafts) for name, rows in groups.items()}
    everything = summary.pop("all")
    return {**everything, "by_category": dict(sorted(summary.items()))}


def most_drafts(cfg: TrainConfig) -> int:
    """The drafts per step a drafter of these settings makes at most: a DFlash block's B-1, or EAGLE-3's depth."""
    return cfg.block_size - 1 if cfg.method == "dflash" else cfg.depth


def _acceptance(rows: list[tuple[float, float, list[int]]], drafts: int) -> dict:
    positions = [a for _, _, accepted in rows for a in accepted]
    steps = [a for _, _, accepted in rows for a in engine_walk(accepted)]
    return {
        "loss": sum(loss for loss, _, _ in rows) / len(rows),
        "accuracy": sum(accuracy for _, accuracy, _ in rows) / len(rows),
        "tau": 1 + sum(positions) / len(positions),
        "engine_tau": 1 + sum(steps) / len(steps),
        "engine_per_position": [sum(a >= k for a in steps) / len(steps) for k in range(1, drafts + 1)],
    }


def first_sequences(shards: list[tuple[Path, list[dict]]], count: int) -> tuple[list[tuple[Path, list[dict]]], list[dict]]:
    """The first `count` sequences of `shards`, and the shards that hold them: only their features are needed."""
    needed, total = [], 0
    for shard in shards:
        if total >= count:
            break
        needed.append(shard)
        total += len(shard[1])
    return needed, [record for _, records in needed for record in records][:count]


def evaluate_drafter(method: str, folder: str, target: Transformer, eval_data: str, sequences: int,
                     drafts: int | None = None, tree: bool = False, log=print) -> dict:
    """`specserve eval-drafter`: a trained drafter's held-out acceptance (`evaluate`) on the first
    `sequences` of a distilled folder: what the engine would measure at T=0 on their prompts, from
    one teacher-forced pass per sequence instead of decoding them."""
    from ..drafters import DrafterError, check_matches_target

    if drafts is not None and drafts < 1:
        raise DrafterError(f"--drafts must be >= 1, got {drafts}")
    drafter = (load_dflash if method == "dflash" else load_eagle3)(folder)
    check_matches_target(method, drafter.config, target.config)
    if method == "dflash":
        cfg = TrainConfig(method=method, data="", eval_data=eval_data, out="", block_size=drafter.config.block_size)
        if drafts is not None and drafts > most_drafts(cfg) and not tree:
            raise DrafterError(f"--drafts {drafts}: a DFlash block of {cfg.block_size} drafts 1 to {most_drafts(cfg)}")
    else:  # EAGLE-3 chains as many drafts as asked: unroll that many steps
        cfg = TrainConfig(method=method, data="", eval_data=eval_data, out="", depth=drafts or EAGLE3_DEFAULT_TOKENS)
    drafts = drafts or most_drafts(cfg)
    shards, records = first_sequences(read_shards(eval_data, target.config.vocab_size), sequences)
    # The layers this drafter reads (a drafter trained elsewhere may tap others than training's).
    taps = TargetFeatures(target, shards, tuple(drafter.config.target_layer_ids), log)
    head = DraftHead(target.lm_head.weight, draft_token_ids(drafter))
    return {"sequences": len(records), "drafts": drafts, "tree": tree,
            **_rounded(evaluate(cfg, drafter, target, head, records, taps, drafts, tree))}


def _rounded(value):
    if isinstance(value, dict):
        return {key: _rounded(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_rounded(item) for item in value]
    return round(value, 4)


def learning_rate(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(cfg: TrainConfig, target: Transformer, mask_token_id: int, log=print) -> dict:
    from tqdm import tqdm

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    layers = tap_layers(cfg, target)
    vocab_size = target.config.vocab_size
    shards = [shard for folder in cfg.data.split(",") for shard in read_shards(folder, vocab_size)]
    eval_shards = read_shards(cfg.eval_data, vocab_size)
    if cfg.shards > len(shards):
        raise ValueError(f"--shards {cfg.shards}: {cfg.data} has only {len(shards)} shards")
    shards = shards[: cfg.shards or None]
    data = [record for _, records in shards for record in records]
    # Skipped here, not dropped from `data`, so the features stay indexed as the data.
    trainable = [i for i, record in enumerate(data) if has_drafts(record)]
    if len(trainable) < len(data):
        log(f"skipping {len(data) - len(trainable)} of {len(data)} sequences: responses under 2 tokens")
    if not trainable:
        raise ValueError(f"{cfg.data}: no sequence has a response of 2 tokens or more to train on")
    shuffled = torch.randperm(len(trainable), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    order = [trainable[i] for i in shuffled]
    eval_shards, eval_data = first_sequences(eval_shards, cfg.eval_sequences)
    drafter = new_drafter(cfg, target, mask_token_id, data).train()  # before the slow feature pass: bad settings fail fast
    taps = TargetFeatures(target, shards, layers, log)
    eval_taps = TargetFeatures(target, eval_shards, layers, log)

    # fused: one kernel over all parameters, 5 ms instead of 16; a DFlash bf16 step 179 ms instead of 200 (measured
    # on the 2-core development machine). Not bit-identical to the default: Adam amplifies rounding.
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    generator = torch.Generator().manual_seed(cfg.seed)
    start_step, history, seconds = 0, [], 0.0
    state_file = out / "train-state.pt"
    if state_file.exists():  # resume
        state = torch.load(state_file, weights_only=False)
        # A setting added after the run was written ran with its default: compare with it filled in.
        defaults = {f.name: f.default for f in fields(TrainConfig) if f.default is not MISSING}
        if {**defaults, **state["config"]} != asdict(cfg):
            raise ValueError(f"{state_file} was written with other settings; use another --out or the same flags")
        drafter.load_state_dict(state["drafter"])
        optimizer.load_state_dict(state["optimizer"])
        generator.set_state(state["generator"])
        start_step, history, seconds = state["step"], state["history"], state["seconds"]
        log(f"resuming {cfg.method} training at step {start_step}")
    head = DraftHead(target.lm_head.weight, draft_token_ids(drafter))

    progress = tqdm(range(start_step, cfg.steps), initial=start_step, total=cfg.steps, dynamic_ncols=True)
    for step in progress:
        started = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(cfg, step)
        index = order[step % len(order)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.precision == "bf16"):
            loss, stats = sequence_loss(cfg, drafter, target, head, data[index], taps[index], generator)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds += time.perf_counter() - started
        progress.set_postfix(loss=f"{loss.item():.3f}", acc=f"{stats['accuracy']:.2f}")
        done = step + 1
        if done % cfg.eval_every == 0 or done == cfg.steps:
            held_out = evaluate(cfg, drafter, target, head, eval_data, eval_taps)
            history.append({"step": done, "seconds": round(seconds, 1), **_rounded(held_out)})
            categories = ", ".join(f"{c} {a['engine_tau']:.2f}" for c, a in held_out["by_category"].items())
            message = (f"step {done}: held-out tau {held_out['tau']:.2f}, in the engine {held_out['engine_tau']:.2f} "
                       f"({categories}), accuracy {held_out['accuracy']:.3f}, loss {held_out['loss']:.3f}")
            progress.write(message, file=sys.stderr)  # beside the bar: stdout carries only the result
        if done % cfg.checkpoint_every == 0 or done == cfg.steps:
            state = {"config": asdict(cfg), "step": done, "drafter": drafter.state_dict(), "optimizer": optimizer.state_dict(),
                     "generator": generator.get_state(), "history": history, "seconds": seconds}
            # a run killed while saving keeps its last whole checkpoint
            write_atomically(state_file, lambda partial: torch.save(state, partial))
    drafter.eval().requires_grad_(False)
    (save_dflash if cfg.method == "dflash" else save_eagle3)(drafter, out / "drafter", dtype=torch.float16)
    summary = {"config": asdict(cfg), "train_seconds": round(seconds, 1), "history": history}
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
