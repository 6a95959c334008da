"""Shared by the training-step experiments (bf16_training_step.py, optimizer_step.py): the default
target, a training configuration, the first shard of set v2's training data with its cached target
features (computed first if missing, about 30 s), a drafter for it, and the draft head."""

import sys

import torch

from specserve_runtime.drafters.vocab import DraftHead, draft_token_ids
from specserve_runtime.loader import load_model
from specserve_runtime.store import DEFAULT_MODEL
from specserve_runtime.training.distill import read_shards
from specserve_runtime.training.train import TargetFeatures, TrainConfig, new_drafter, tap_layers


def arguments() -> tuple[int, str]:
    """[threads] [dflash|eagle3] from the command line, 2 and dflash by default; sets torch's threads."""
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    torch.set_num_threads(threads)
    return threads, sys.argv[2] if len(sys.argv) > 2 else "dflash"


def first_shard(method: str, **settings):
    """-> (target, cfg, sequences, drafter in training mode, their target features, draft head)."""
    model = load_model(DEFAULT_MODEL)
    target = model.target
    cfg = TrainConfig(method=method, data="runtime/data/distill-v2", eval_data="runtime/data/distill-v2-eval",
                      out="-", **settings)
    shards = read_shards(cfg.data, target.config.vocab_size)[:1]
    sequences = [record for _, records in shards for record in records]
    drafter = new_drafter(cfg, target, model.mask_token_id(), sequences).train()
    taps = TargetFeatures(target, shards, tap_layers(cfg, target), print)
    return target, cfg, sequences, drafter, taps, DraftHead(target.lm_head.weight, draft_token_ids(drafter))
