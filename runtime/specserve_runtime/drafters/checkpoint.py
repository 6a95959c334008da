"""Drafter checkpoints: a config.json and one safetensors file, in the layout the drafter's users expect."""

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from ..config import MAX_PROMPT_LOOKUP
from ..model import load_state_dict
from . import DrafterError, OperatingPoint, ProposerOptions


def read_config(folder: str | Path) -> dict:
    config_file = Path(folder) / "config.json"
    if not config_file.is_file():
        raise DrafterError(f"drafter {folder}: no config.json (expected a drafter checkpoint folder or 'random')")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise DrafterError(f"drafter {config_file}: invalid JSON ({exc})") from exc


OPERATING_POINT_KEY = "specserve_operating_point"


def recorded_operating_point(folder: str) -> OperatingPoint | None:
    """The operating point a drafter's config.json records, e.g. "specserve_operating_point":
    {"num_speculative_tokens": 4, "draft_tree": true, "prompt_lookup": 4}, if it records one."""
    recorded = read_config(folder).get(OPERATING_POINT_KEY)
    if recorded is None:
        return None
    fields = recorded if isinstance(recorded, dict) else {}
    count, tree = fields.get("num_speculative_tokens"), fields.get("draft_tree", False)
    lookup = fields.get("prompt_lookup", 0)
    # type() is: JSON true is not a count, nor 1 a flag.
    if not fields or set(fields) - {"num_speculative_tokens", "draft_tree", "prompt_lookup"} or type(count) is not int \
            or count < 1 or type(tree) is not bool or type(lookup) is not int or not 0 <= lookup <= MAX_PROMPT_LOOKUP:
        raise DrafterError(f"drafter {folder}: config.json's {OPERATING_POINT_KEY} must be "
                           f'{{"num_speculative_tokens": K >= 1, "draft_tree": true|false, '
                           f'"prompt_lookup": 0..{MAX_PROMPT_LOOKUP} (optional)}}, got {json.dumps(recorded)}')
    return OperatingPoint(count, tree, lookup)


def operating_point(folder: str, options: ProposerOptions, default_count: int) -> OperatingPoint:
    """What a proposer runs: the user's count, tree and prompt-lookup branch where given; without a
    count, what the drafter records (a count alone asks for a chain and no branch); else `default_count`
    drafts as a chain."""
    recorded = None if options.num_speculative_tokens or folder == "random" else recorded_operating_point(folder)
    count = options.num_speculative_tokens or (recorded.num_speculative_tokens if recorded else default_count)
    tree = options.draft_tree if options.draft_tree is not None else recorded is not None and recorded.draft_tree
    lookup = options.prompt_lookup if options.prompt_lookup is not None else recorded.prompt_lookup if recorded else 0
    return OperatingPoint(count, tree, lookup)


def load_weights(module: nn.Module, folder: str | Path) -> None:
    """Load every weight of `module` from the folder; missing, extra or misshapen tensors are errors."""
    state = load_state_dict(Path(folder))
    expected = module.state_dict()
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        raise DrafterError(f"drafter {folder}: weights missing {missing[:4]}, unexpected {extra[:4]}")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise DrafterError(
                f"drafter {folder}: {name} has shape {list(tensor.shape)}, config implies {list(expected[name].shape)}"
            )
    module.load_state_dict({name: t.to(expected[name].dtype) for name, t in state.items()})


def load(folder: str | Path, build: Callable[[dict], nn.Module]) -> nn.Module:
    """The drafter `build` makes from the folder's config.json, with the folder's weights, frozen."""
    module = build(read_config(folder))
    load_weights(module, folder)
    return module.eval().requires_grad_(False)


def save(
    module: nn.Module, config: dict, folder: str | Path, dtype: torch.dtype | None = None, extra: dict | None = None
) -> Path:
    """Weights (floating-point ones cast to `dtype`, index buffers kept) and config.json."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {**module.state_dict(), **(extra or {})}
    state = {name: (t.to(dtype) if dtype and t.is_floating_point() else t).detach().contiguous() for name, t in state.items()}
    if dtype and "dtype" in config:  # z-lab's config.json records the weights' precision
        config = {**config, "dtype": str(dtype).removeprefix("torch.")}
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder
