"""The runtime configuration of one revision: what the operator renders into a ConfigMap and what
`specserve serve --config` / `specserve launch --config` read. Torch-free: the operator imports it."""

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

CONFIG_MOUNT = "/etc/specserve"
CONFIG_FILE = "runtime.yaml"
DEFAULT_PORT = 8000
# The drafters the runtime images embed, and where (Dockerfile): the operator renders
# `draftModel: bundled://NAME` as this folder + NAME; the wheel carries them as package data.
BUNDLED_DRAFTERS_DIR = "/opt/specserve/drafters"
BUNDLED_DRAFTERS = ("smollm2-135m-instruct-dflash", "smollm2-135m-instruct-eagle3")
# The embedded engine's batch: requests decoded together, and tokens per engine step (verify
# blocks first, then prompt chunks). vLLM's flags of the same names mean the same.
DEFAULT_MAX_NUM_SEQS = 8
DEFAULT_TOKEN_BUDGET = 512
# The longest prompt-lookup branch beside a drafter's tree: a longer copy is verified at the cost of its rows
# (the engine's caches keep room for it; drafters.propose_all).
MAX_PROMPT_LOOKUP = 16


class RuntimeConfig(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    model: str = Field(min_length=1, description="model id (vllm) or folder / default model name (embedded)")
    model_uri: str | None = Field(None, description="where the model comes from: hf://, pvc://, s3://")
    served_name: str = Field(min_length=1)
    method: Literal["none", "ngram", "eagle3", "dflash"] = "none"
    drafter: str | None = None
    num_speculative_tokens: int | None = Field(None, ge=1, le=64)
    draft_tree: bool | None = Field(None, description="dflash or eagle3, embedded engine: a draft tree (None: the drafter's default)")
    prompt_lookup: int | None = Field(None, ge=0, le=MAX_PROMPT_LOOKUP, description="dflash or eagle3, embedded engine: the most tokens "
                                      "a prompt-lookup branch beside the drafts copies, 0 none (None: the drafter's default)")
    engine: Literal["vllm", "embedded"] = "embedded"
    engine_args: list[str] = []
    port: int = Field(DEFAULT_PORT, ge=1, le=65535)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(by_alias=True, exclude_none=True), sort_keys=False)


def read_config(path: str | Path) -> RuntimeConfig:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--config {path}: no such file")
    try:
        raw = yaml.safe_load(path.read_text())
        return RuntimeConfig.model_validate(raw or {})
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: invalid YAML ({exc})") from exc
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"{path}: {problems}") from exc
