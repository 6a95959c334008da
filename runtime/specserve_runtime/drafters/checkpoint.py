"""Drafter checkpoints: a config.json and one safetensors file, in the layout the drafter's users expect.

Two layouts load: the drafter's own (z-lab's for DFlash, training's output) and the `speculators` layout
that vLLM loads, which the bundled drafters ship in. The weight names are the same in both; the speculators
layout adds the LM head's rows of a reduced draft vocabulary (lm_head.weight), and the drafter scores with
them wherever they are present (vLLM too: without them it would score with the target's whole head).
"""

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from ..config import MAX_PROMPT_LOOKUP
from ..model import load_state_dict
from . import DrafterError, OperatingPoint, ProposerOptions
from .vocab import draft_token_ids


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


def load_weights(module: nn.Module, folder: str | Path, state: dict[str, torch.Tensor]) -> None:
    """Load every weight of `module` from the folder's `state`; missing, extra or misshapen tensors are errors."""
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


def seeded(build: Callable[[], nn.Module], seed: int) -> nn.Module:
    """The drafter `build` makes with weights drawn from `seed` (a random drafter), frozen; the caller's
    random state is left as it was."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        module = build()
    return module.eval().requires_grad_(False)


def load(folder: str | Path, build: Callable[[dict], nn.Module]) -> nn.Module:
    """The drafter `build` makes from the folder's config.json, with the folder's weights, frozen."""
    module = build(read_config(folder))
    state = load_state_dict(Path(folder))
    if "lm_head.weight" in state:  # its own rows of the LM head (the speculators layout): it scores with them
        rows, width = state["lm_head.weight"].shape
        module.lm_head = nn.Linear(width, rows, bias=False)
    load_weights(module, folder, state)
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


SPECULATORS_KEY = "speculators_model_type"
SPECULATORS_ARCHITECTURES = {"dflash": "DFlashSpeculator", "eagle3": "Eagle3Speculator"}


def is_speculators(raw: dict) -> bool:
    return SPECULATORS_KEY in raw


def drafter_method(folder: str | Path) -> str:
    """dflash or eagle3: what a drafter folder's config.json says it is, in either layout."""
    raw = read_config(folder)
    architecture = (raw.get("architectures") or [None])[0]
    method = raw.get(SPECULATORS_KEY) or {"DFlashDraftModel": "dflash", "Eagle3DraftModel": "eagle3"}.get(architecture)
    if method not in ("dflash", "eagle3"):
        raise DrafterError(f"drafter {folder}: config.json is neither a DFlash nor an EAGLE-3 drafter "
                           f"(architectures={raw.get('architectures')}, {SPECULATORS_KEY}={raw.get(SPECULATORS_KEY)})")
    return method


def speculators_layout(algorithm: str, layer_config: dict, speculative_tokens: int, verifier_name_or_path: str,
                       verifier_architectures: list[str], fields: dict) -> dict:
    """config.json in the `speculators` layout (what vLLM loads): the drafter's layers as a transformers config,
    the algorithm's own `fields`, and one greedy proposal of `speculative_tokens` drafts for `verifier`."""
    return {
        "architectures": [SPECULATORS_ARCHITECTURES[algorithm]],
        SPECULATORS_KEY: algorithm,
        "transformer_layer_config": layer_config,
        **fields,
        "speculators_config": {
            "algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name_or_path, "architectures": verifier_architectures},
        },
    }


LAYER_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "rms_norm_eps", "vocab_size")


def speculators_layer(raw: dict, algorithm: str, required: tuple[str, ...]) -> dict:
    """A speculators-layout config.json of `algorithm` -> its transformer_layer_config, head_dim and rope_theta
    filled in; DrafterError names what is missing there or among the `required` top-level fields."""
    if raw.get(SPECULATORS_KEY) != algorithm:
        raise DrafterError(f"not a {algorithm} drafter: {SPECULATORS_KEY}={raw.get(SPECULATORS_KEY)!r}")
    layer = dict(raw.get("transformer_layer_config") or {})
    layer.setdefault("head_dim", layer.get("hidden_size", 0) // max(layer.get("num_attention_heads", 1), 1))
    layer.setdefault("rope_theta", (layer.get("rope_parameters") or {}).get("rope_theta", 1e6))
    missing = [f"transformer_layer_config.{name}" for name in LAYER_FIELDS if name not in layer]
    missing += [name for name in required if name not in raw]
    if missing:
        raise DrafterError(f"{algorithm} config.json (speculators layout) lacks {', '.join(missing)}")
    return layer


def export_speculators(drafter: nn.Module, folder: str | Path, verifier_name_or_path: str,
                       verifier_architectures: list[str], target=None, source: str | None = None,
                       dtype: torch.dtype | None = None, speculative_tokens: int | None = None) -> Path:
    """Write a DFlash or EAGLE-3 drafter in the speculators layout (its config's to_speculators, with vLLM's
    drafts a step), its weights cast to `dtype`: the same weight names, and for a reduced draft vocabulary the LM
    head's rows of it (its own, else the `target`'s). The operating point a `source` folder records travels
    with it."""
    config = drafter.config.to_speculators(verifier_name_or_path, verifier_architectures, speculative_tokens)
    recorded = read_config(source).get(OPERATING_POINT_KEY) if source else None
    if recorded is not None:
        config = {**config, OPERATING_POINT_KEY: recorded}
    token_ids = draft_token_ids(drafter)
    if token_ids is None or hasattr(drafter, "lm_head"):
        return save(drafter, config, folder, dtype)
    if target is None:
        raise DrafterError("exporting a reduced-vocabulary drafter needs the target model (its LM head rows)")
    return save(drafter, config, folder, dtype, {"lm_head.weight": target.lm_head.weight.detach()[token_ids]})
