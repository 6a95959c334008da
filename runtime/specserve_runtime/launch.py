"""`specserve launch`: run a revision's runtime configuration on its engine.

For `engine: vllm` the command line is derived from the configuration as an argument list
(never a shell string), with the `--speculative-config` JSON that matches the method. Before vLLM
starts, a drafter folder it can see is checked for what vLLM needs to load it and to draft with it
(check_vllm_drafter): vLLM itself would refuse some of it only minutes later, and draft garbage from
the rest without a word.
"""

import json
import os
import shlex
import struct
from pathlib import Path

from .config import RuntimeConfig, reference_scheme

DEFAULT_SPECULATIVE_TOKENS = {"ngram": 4, "eagle3": 3, "dflash": 15}  # dflash: a block of 16, z-lab's
# How the launcher starts vLLM: the runtime image's `vllm` command, unless SPECSERVE_VLLM names another command
# line that takes vLLM's server flags (a vLLM in a virtual environment of its own: docs/images.md).
VLLM_ENV = "SPECSERVE_VLLM"
DEFAULT_VLLM = ("vllm", "serve")
# A schedule's open-ended last range, as vLLM's inclusive ranges need an end: more requests than any server runs.
OPEN_BATCH_END = 1 << 20


class DrafterLayoutError(ValueError):
    """A drafter folder vLLM cannot load, or would draft garbage from; the message names the file and the field."""


def vllm_program(environ=os.environ) -> list[str]:
    override = environ.get(VLLM_ENV, "").strip()
    return shlex.split(override) if override else list(DEFAULT_VLLM)


def read_drafter_config(folder: Path) -> dict:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise DrafterLayoutError(f"{config_file}: no such file (a drafter folder holds config.json and its weights)")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise DrafterLayoutError(f"{config_file}: invalid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise DrafterLayoutError(f"{config_file}: a JSON object is expected")
    return config


def safetensors_names(folder: Path) -> set[str]:
    """The tensor names of a folder's safetensors files, read from their headers (an 8-byte length, then JSON)."""
    names = set()
    for weights in sorted(folder.glob("*.safetensors")):
        with open(weights, "rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            names |= set(json.loads(file.read(length))) - {"__metadata__"}
    return names


def field(config: dict, path: str):
    """config's value at a dotted path (a number indexes a list), or None where it is absent."""
    value = config
    for key in path.split("."):
        if isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        elif isinstance(value, dict) and key in value:
            value = value[key]
        else:
            return None
    return value


# What vLLM reads from a speculators-layout config.json, by algorithm (vllm/transformers_utils/configs/speculators):
# without the aux layer ids an EAGLE-3 drafter would read vLLM's default layers, not the ones it was trained on.
SPECULATORS_FIELDS = ("transformer_layer_config.num_hidden_layers", "transformer_layer_config.hidden_size",
                      "speculators_config.proposal_methods.0.speculative_tokens", "speculators_config.verifier.name_or_path")
ALGORITHM_FIELDS = {"eagle3": ("eagle_aux_hidden_state_layer_ids", "draft_vocab_size"),
                    "dflash": ("aux_hidden_state_layer_ids", "mask_token_id", "draft_vocab_size")}


def check_vllm_drafter(folder: str | Path, method: str) -> dict:
    """A drafter folder's config.json, if vLLM can load it for `method` and draft with its own vocabulary; else
    DrafterLayoutError naming the file and the missing field. vLLM loads the `speculators` layout (what
    `specserve export-drafter` writes, and the bundled drafters are in) and a few others by their model_type; a
    draft vocabulary smaller than the target's needs its own lm_head and d2t in the weights, or vLLM scores the
    drafts with the target's head and accepts none."""
    folder = Path(folder)
    config = read_drafter_config(folder)
    config_file = folder / "config.json"
    algorithm = config.get("speculators_model_type")
    if algorithm is None and "model_type" not in config:
        raise DrafterLayoutError(f"{config_file}: no speculators_model_type (nor model_type): vLLM cannot load it; "
                                 "`specserve export-drafter` writes the speculators layout")
    if algorithm is not None:
        if algorithm != method:
            raise DrafterLayoutError(f"{config_file}: speculators_model_type is {algorithm!r}, the method {method!r}")
        for name in SPECULATORS_FIELDS + ALGORITHM_FIELDS.get(method, ()):
            if field(config, name) is None:
                raise DrafterLayoutError(f"{config_file}: no {name} (vLLM needs it to load a {method} drafter)")
    vocab_size = field(config, "transformer_layer_config.vocab_size") or config.get("vocab_size")
    draft_vocab_size = config.get("draft_vocab_size")
    if draft_vocab_size and vocab_size and draft_vocab_size < vocab_size:
        missing = sorted({"lm_head.weight", "d2t"} - safetensors_names(folder))
        if missing:
            raise DrafterLayoutError(
                f"{folder}/model.safetensors: no {' or '.join(missing)} for the {draft_vocab_size}-token draft "
                "vocabulary: vLLM would score the drafts with the target's LM head and accept none "
                "(`specserve export-drafter` writes them)")
    return config


def drafts_per_step(config: RuntimeConfig) -> int:
    """The drafts per step vLLM runs when the configuration names none: what a local drafter's folder says (a
    speculators layout's proposal, a z-lab DFlash block - 1), else the method's default."""
    folder = config.drafter_source if config.method in ("eagle3", "dflash") else None
    if folder is None or not Path(folder).is_dir():
        return DEFAULT_SPECULATIVE_TOKENS[config.method]
    drafter = read_drafter_config(Path(folder))
    proposed = field(drafter, "speculators_config.proposal_methods.0.speculative_tokens")
    if proposed is not None:
        return int(proposed)
    if config.method == "dflash":
        if not isinstance(drafter.get("block_size"), int):
            raise DrafterLayoutError(f"{folder}/config.json: no DFlash block_size, a number (is it a DFlash drafter?)")
        return drafter["block_size"] - 1
    return DEFAULT_SPECULATIVE_TOKENS[config.method]


def speculative_config(config: RuntimeConfig) -> dict | None:
    if config.method == "none":
        return None
    if config.draft_tree:
        raise ValueError("draftTree: on vLLM specserve drafts chains; a draft tree runs on the embedded engine")
    if config.prompt_lookup:
        raise ValueError("promptLookup: on vLLM a drafter drafts alone; a prompt-lookup branch runs on the embedded engine")
    tokens = config.num_speculative_tokens or drafts_per_step(config)
    if config.method == "ngram":
        speculative = {"method": "ngram", "num_speculative_tokens": tokens, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    elif not config.drafter:
        raise ValueError(f"method {config.method} needs a drafter in the runtime configuration")
    else:
        speculative = {"method": config.method, "model": config.drafter_source, "num_speculative_tokens": tokens}
    schedule = config.num_speculative_tokens_per_batch_size
    if schedule:
        longest = max(entry.num_speculative_tokens for entry in schedule)
        if longest > tokens:
            raise ValueError(f"numSpeculativeTokensPerBatchSize: {longest} drafts exceed the {tokens} a step this "
                             "drafter takes")
        speculative["num_speculative_tokens_per_batch_size"] = [
            [entry.min_batch_size, entry.max_batch_size or OPEN_BATCH_END, entry.num_speculative_tokens]
            for entry in schedule]
    return speculative


def vllm_command(config: RuntimeConfig, program: list[str] | None = None) -> list[str]:
    """vLLM's command line for the configuration. A drafter in a folder (a path, bundled://, a mounted pvc://; not
    an hf:// id, which vLLM fetches) is checked first (check_vllm_drafter)."""
    if config.method in ("eagle3", "dflash") and config.drafter and reference_scheme(config.drafter) != "hf":
        check_vllm_drafter(config.drafter_source, config.method)
    command = [
        *(program or vllm_program()),
        "--model", config.model_source,
        "--served-model-name", config.served_name,
        "--host", config.host,
        "--port", str(config.port),
    ]
    speculative = speculative_config(config)
    if speculative:
        command += ["--speculative-config", json.dumps(speculative, separators=(",", ":"))]
    return command + list(config.engine_args)
