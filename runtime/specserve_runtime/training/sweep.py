"""`specserve sweep-drafter`: short training runs that choose a DFlash drafter's shape by measurement.

One factor at a time around a base recipe (block size, then number of draft layers), each run
at the same short budget, each scored by the held-out teacher-forced acceptance length that
training reports. Runs are ordinary resumable training runs under one folder, so an
interrupted sweep continues where it stopped and a finished one only prints its table.
"""

import json
from dataclasses import replace
from pathlib import Path

from ..model import Transformer
from .train import TrainConfig, train


def sweep_configs(base: TrainConfig, block_sizes: list[int], num_layers: list[int]) -> list[TrainConfig]:
    """The base recipe, then each block size and each layer count varied alone (no repeats)."""
    variants = [{}] + [{"block_size": b} for b in block_sizes] + [{"num_layers": n} for n in num_layers]
    configs: list[TrainConfig] = []
    for variant in variants:
        config = replace(base, **variant)
        config = replace(config, out=str(Path(base.out) / f"b{config.block_size}-l{config.num_layers}"))
        if config not in configs:
            configs.append(config)
    return configs


def sweep(base: TrainConfig, block_sizes: list[int], num_layers: list[int], target: Transformer, mask_token_id: int,
          log=print) -> list[dict]:
    rows = []
    for config in sweep_configs(base, block_sizes, num_layers):
        log(f"sweep: block size {config.block_size}, {config.num_layers} draft layers, {config.steps} steps")
        summary = train(config, target, mask_token_id, log)
        held_out = summary["history"][-1]
        rows.append({
            "block_size": config.block_size,
            "num_layers": config.num_layers,
            "steps": config.steps,
            "tau": held_out["tau"],
            "accuracy": held_out["accuracy"],
            "seconds_per_step": round(summary["train_seconds"] / config.steps, 3),
        })
    (Path(base.out) / "sweep.json").write_text(json.dumps(rows, indent=2) + "\n")
    return rows


def sweep_table(rows: list[dict]) -> str:
    lines = ["| block size | draft layers | steps | held-out tau | accuracy | s/step |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['block_size']} | {r['num_layers']} | {r['steps']} | {r['tau']:.3f} | {r['accuracy']:.3f} | "
              f"{r['seconds_per_step']:.2f} |" for r in rows]
    return "\n".join(lines)
