"""`specserve launch`: run a revision's runtime configuration on its engine.

For `engine: vllm` the command line is derived from the configuration as an argument list
(never a shell string), with the `--speculative-config` JSON that matches the method.
"""

import json
from pathlib import Path

from .config import RuntimeConfig

DEFAULT_SPECULATIVE_TOKENS = {"ngram": 4, "eagle3": 3, "dflash": 15}  # dflash: a block of 16, z-lab's


def model_reference(uri_or_id: str) -> str:
    """hf://org/name -> org/name (what vLLM resolves); plain ids and local paths pass through."""
    if uri_or_id.startswith("hf://"):
        return uri_or_id.removeprefix("hf://")
    if "://" in uri_or_id:
        scheme = uri_or_id.split("://", 1)[0]
        raise ValueError(f"{uri_or_id}: the vLLM launcher cannot load {scheme}:// models yet (use hf:// or a local path)")
    return uri_or_id


def default_speculative_tokens(config: RuntimeConfig) -> int:
    """vLLM drafts a DFlash block whole: block size - 1 drafts. A local drafter folder (such as the
    images' bundled ones, blocks of 8) says its block size in its config.json."""
    local = config.method == "dflash" and config.drafter and "://" not in config.drafter
    config_file = Path(config.drafter) / "config.json" if local else None
    if not (config_file and config_file.is_file()):
        return DEFAULT_SPECULATIVE_TOKENS[config.method]
    try:
        return int(json.loads(config_file.read_text())["block_size"]) - 1
    except (ValueError, KeyError, TypeError):  # invalid JSON, no block_size, not a number
        raise ValueError(f"{config_file}: no DFlash block_size, a number (is it a DFlash drafter?)") from None


def speculative_config(config: RuntimeConfig) -> dict | None:
    if config.method == "none":
        return None
    if config.draft_tree:
        raise ValueError("draftTree: on vLLM specserve drafts chains; a draft tree runs on the embedded engine")
    if config.prompt_lookup:
        raise ValueError("promptLookup: on vLLM a drafter drafts alone; a prompt-lookup branch runs on the embedded engine")
    tokens = config.num_speculative_tokens or default_speculative_tokens(config)
    if config.method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": tokens, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    if not config.drafter:
        raise ValueError(f"method {config.method} needs a drafter in the runtime configuration")
    return {"method": config.method, "model": model_reference(config.drafter), "num_speculative_tokens": tokens}


def vllm_command(config: RuntimeConfig) -> list[str]:
    command = [
        "vllm", "serve", model_reference(config.model),
        "--served-model-name", config.served_name,
        "--host", "0.0.0.0",
        "--port", str(config.port),
    ]
    speculative = speculative_config(config)
    if speculative:
        command += ["--speculative-config", json.dumps(speculative, separators=(",", ":"))]
    return command + list(config.engine_args)
