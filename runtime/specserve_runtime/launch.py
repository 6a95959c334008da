"""`specserve launch`: run a revision's runtime configuration on its engine.

For `engine: vllm` the command line is derived from the configuration as an argument list
(never a shell string), with the `--speculative-config` JSON that matches the method.
"""

import json

from .config import RuntimeConfig

DEFAULT_SPECULATIVE_TOKENS = {"ngram": 4, "eagle3": 3, "dflash": 15}


def model_reference(uri_or_id: str) -> str:
    """hf://org/name -> org/name (what vLLM resolves); plain ids and local paths pass through."""
    if uri_or_id.startswith("hf://"):
        return uri_or_id.removeprefix("hf://")
    if "://" in uri_or_id:
        scheme = uri_or_id.split("://", 1)[0]
        raise ValueError(f"{uri_or_id}: the vLLM launcher cannot load {scheme}:// models yet (use hf:// or a local path)")
    return uri_or_id


def speculative_config(config: RuntimeConfig) -> dict | None:
    if config.method == "none":
        return None
    tokens = config.num_speculative_tokens or DEFAULT_SPECULATIVE_TOKENS[config.method]
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
