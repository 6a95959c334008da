"""Drafter checkpoints: a config.json and one safetensors file, in the layout the drafter's users expect."""

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from ..model import load_state_dict
from . import DrafterError


def read_config(folder: str | Path) -> dict:
    config_file = Path(folder) / "config.json"
    if not config_file.is_file():
        raise DrafterError(f"drafter {folder}: no config.json (expected a drafter checkpoint folder or 'random')")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise DrafterError(f"drafter {config_file}: invalid JSON ({exc})") from exc


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
