"""The runtime configuration of one revision: what the operator renders into a ConfigMap and what
`specserve serve --config` / `specserve launch --config` read. Torch-free: the operator imports it."""

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

CONFIG_MOUNT = "/etc/specserve"
CONFIG_FILE = "runtime.yaml"
DEFAULT_PORT = 8000
# The drafters the runtime carries as package data, one folder each, in the `speculators` layout that both
# engines load: `draftModel: bundled://NAME` is this folder + NAME wherever the runtime is installed.
BUNDLED_DRAFTERS_DIR = Path(__file__).parent / "drafters" / "weights"
BUNDLED_DRAFTERS = ("smollm2-135m-instruct-dflash", "smollm2-135m-instruct-eagle3")
DEFAULT_DRAFTER_NAMES = {"dflash": "smollm2-135m-instruct-dflash", "eagle3": "smollm2-135m-instruct-eagle3"}
# Where the operator mounts the claim of a pvc://CLAIM/PATH model or drafter, read-only: the runtime reads
# PVC_MOUNT/CLAIM/PATH.
PVC_MOUNT = "/mnt/pvc"
# The schemes a model or drafter reference may use (s3:// is not fetched: put the folder on a volume, pvc://).
SCHEMES = ("hf", "pvc", "bundled")
# The embedded engine's batch: requests decoded together, and tokens per engine step (verify
# blocks first, then prompt chunks). vLLM's flags of the same names mean the same.
DEFAULT_MAX_NUM_SEQS = 8
DEFAULT_TOKEN_BUDGET = 512
# The longest prompt-lookup branch beside a drafter's tree: a longer copy is verified at the cost of its rows
# (the engine's caches keep room for it; drafters.propose_all).
MAX_PROMPT_LOOKUP = 16


def reference_scheme(uri: str) -> str | None:
    """hf, pvc, bundled or another scheme of SCHEME://REST; None for a plain id or a local path."""
    return uri.split("://", 1)[0] if "://" in uri else None


def pvc_claim(uri: str) -> tuple[str, str]:
    """pvc://CLAIM/PATH -> (CLAIM, PATH); PATH may be empty (the claim's root)."""
    claim, _, path = uri.removeprefix("pvc://").partition("/")
    return claim, path.strip("/")


def local_reference(uri: str) -> str:
    """What an engine loads for a model or drafter reference: hf://ORG/NAME is ORG/NAME (the engine's model id,
    from its hub or from HF_HOME's cache), pvc://CLAIM/PATH the folder where the operator mounts it, bundled://NAME
    the drafter the runtime carries; a plain id or a local path as written."""
    scheme = reference_scheme(uri)
    if scheme is None:
        return uri
    if scheme == "hf":
        return uri.removeprefix("hf://")
    if scheme == "pvc":
        claim, path = pvc_claim(uri)
        return "/".join(part for part in (PVC_MOUNT, claim, path) if part)
    if scheme == "bundled":
        return str(BUNDLED_DRAFTERS_DIR / uri.removeprefix("bundled://"))
    raise ValueError(f"{uri}: the runtime loads {', '.join(s + '://' for s in SCHEMES)} references or local paths, "
                     f"not {scheme}:// (put the folder on a PersistentVolumeClaim and use pvc://CLAIM/PATH)")


class BatchSizeRange(BaseModel):
    """numSpeculativeTokens drafts per step while minBatchSize..maxBatchSize requests decode together (inclusive;
    no maxBatchSize: every larger batch). 0: no drafts at those batch sizes."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    min_batch_size: int = Field(ge=1, le=65536)
    max_batch_size: int | None = Field(None, ge=1, le=65536)
    num_speculative_tokens: int = Field(ge=0, le=64)


def schedule_problems(schedule: list[BatchSizeRange] | None, method: str, max_tokens: int | None,
                      where: str) -> list[str]:
    """Why a batch-size schedule is invalid (empty: it is valid, or there is none): its ranges must cover every
    batch size once, in order, from 1 (the last may leave maxBatchSize open), and draft at most `max_tokens` (None:
    not known here), for a method that drafts."""
    if schedule is None:
        return []
    if method == "none":
        return [f"{where}: method none drafts nothing"]
    problems, expected_min = [], 1
    for i, entry in enumerate(schedule):
        at = f"{where}[{i}]"
        if entry.min_batch_size != expected_min:
            problems.append(f"{at}.minBatchSize: {entry.min_batch_size}, expected {expected_min} (the ranges are "
                            "ordered and cover every batch size from 1 once, with no gap or overlap)")
        if entry.max_batch_size is None and i < len(schedule) - 1:
            problems.append(f"{at}.maxBatchSize: only the last range may be open-ended")
        if entry.max_batch_size is not None and entry.max_batch_size < entry.min_batch_size:
            problems.append(f"{at}.maxBatchSize: {entry.max_batch_size} is below minBatchSize {entry.min_batch_size}")
        if max_tokens is not None and entry.num_speculative_tokens > max_tokens:
            problems.append(f"{at}.numSpeculativeTokens: {entry.num_speculative_tokens} exceeds the "
                            f"{max_tokens} drafts a step this speculator takes")
        expected_min = (entry.max_batch_size or entry.min_batch_size) + 1
    if not schedule:
        problems.append(f"{where}: at least one range, from minBatchSize 1")
    return problems


def parse_schedule(text: str) -> list[BatchSizeRange]:
    """The command line's schedule: MIN-MAX:TOKENS ranges, comma-separated, the last maybe MIN-:TOKENS (open), e.g.
    1-4:3,5-16:2,17-:0. Checked as a schedule by RuntimeConfig and the API (schedule_problems)."""
    ranges = []
    for part in text.split(","):
        bounds, colon, tokens = part.strip().partition(":")
        low, dash, high = bounds.partition("-")
        if not (colon and dash and low.isdigit() and tokens.isdigit() and (high.isdigit() or high == "")):
            raise ValueError(f"{part.strip()!r}: a range is MIN-MAX:TOKENS or, the last, MIN-:TOKENS (e.g. 1-4:3,5-:1)")
        ranges.append(BatchSizeRange(min_batch_size=int(low), max_batch_size=int(high) if high else None,
                                     num_speculative_tokens=int(tokens)))
    return ranges


def scheduled_tokens(schedule: list[BatchSizeRange], batch_size: int) -> int:
    """The drafts per step a (valid) schedule gives a batch of `batch_size` requests."""
    for entry in schedule:
        if entry.max_batch_size is None or batch_size <= entry.max_batch_size:
            return entry.num_speculative_tokens
    return schedule[-1].num_speculative_tokens


# The engine flags that the configuration sets (the model, its served name, the address, the speculation): extra
# engine arguments that set one would override what the operator checked against the tenant's profile. vLLM's
# parser reads --a_b as --a-b, --a.b=x as a key of --a's JSON, and, as argparse does, a unique prefix as the flag.
RESERVED_ENGINE_FLAGS = ("--model", "--served-model-name", "--host", "--port", "--speculative-config", "--config")
# Runs Python that the model's repository ships (vLLM's --trust-remote-code): only where the profile allows it.
REMOTE_CODE_FLAG = "--trust-remote-code"
# The same rule for the CRD's CEL (whole flags; the prefixes are caught by refuse_reserved_flags).
RESERVED_ENGINE_FLAGS_RE = f"^--({'|'.join(f[2:].replace('-', '[-_]') for f in RESERVED_ENGINE_FLAGS)})([=.].*)?$"


def flags_set(args: list[str] | None, flags: tuple[str, ...]) -> list[tuple[int, str, str]]:
    """(index, argument, flag) for each of the extra engine arguments that sets one of `flags`, in any spelling
    vLLM's parser reads as that flag."""
    found = []
    for index, arg in enumerate(args or []):
        name = arg.split("=", 1)[0].split(".", 1)[0].replace("_", "-")
        if len(name) > 2 and name.startswith("--"):
            flag = next((f for f in flags if f.startswith(name)), None)
            if flag:
                found.append((index, arg, flag))
    return found


def refuse_reserved_flags(args: list[str] | None) -> list[str] | None:
    """A field validator for extra engine arguments: every one that sets a reserved flag, named."""
    problems = [f"[{index}] {arg!r}: {flag} is set from the serving's own fields, never from extra arguments"
                for index, arg, flag in flags_set(args, RESERVED_ENGINE_FLAGS)]
    if problems:
        raise ValueError("; ".join(problems))
    return args


class RuntimeConfig(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    model: str = Field(min_length=1, description="model id (vllm) or folder / default model name (embedded)")
    model_uri: str | None = Field(None, description="where the model comes from: hf:// or pvc://")
    served_name: str = Field(min_length=1)
    method: Literal["none", "ngram", "eagle3", "dflash"] = "none"
    drafter: str | None = None
    num_speculative_tokens: int | None = Field(None, ge=1, le=64)
    draft_tree: bool | None = Field(None, description="dflash or eagle3, embedded engine: a draft tree (None: the drafter's default)")
    prompt_lookup: int | None = Field(None, ge=0, le=MAX_PROMPT_LOOKUP, description="dflash or eagle3, embedded engine: the most tokens "
                                      "a prompt-lookup branch beside the drafts copies, 0 none (None: the drafter's default)")
    num_speculative_tokens_per_batch_size: list[BatchSizeRange] | None = Field(
        None, description="drafts per step by the number of requests decoding together (vLLM's option of this name; "
        "the embedded engine's draft length)")
    engine: Literal["vllm", "embedded"] = "embedded"
    engine_args: list[str] = []
    # Every interface: in a pod, the kubelet's probes and the Service reach the pod's own address.
    host: str = Field("0.0.0.0", min_length=1)
    port: int = Field(DEFAULT_PORT, ge=1, le=65535)

    _engine_args = field_validator("engine_args")(refuse_reserved_flags)

    @field_validator("model_uri", "drafter")
    @classmethod
    def _loadable(cls, uri: str | None) -> str | None:
        if uri is not None:
            local_reference(uri)  # raises for a scheme the runtime cannot load
        return uri

    @model_validator(mode="after")
    def _schedule(self):
        problems = schedule_problems(self.num_speculative_tokens_per_batch_size, self.method,
                                     self.num_speculative_tokens, "numSpeculativeTokensPerBatchSize")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def model_source(self) -> str:
        """What the engine loads: the model's URI where one is given (hf://, pvc://), else its name."""
        return local_reference(self.model_uri) if self.model_uri else self.model

    @property
    def drafter_source(self) -> str | None:
        return local_reference(self.drafter) if self.drafter else None

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(by_alias=True, exclude_none=True), sort_keys=False)


def read_yaml(path: Path, all_documents: bool = False):
    """A YAML (or JSON) file's document, or its list of documents; a ValueError naming the file and the problem,
    on one line, when it cannot be read or parsed (every command that reads a file says it the same way)."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read ({getattr(exc, 'strerror', None) or exc})") from exc
    try:
        return list(yaml.safe_load_all(text)) if all_documents else yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        what = ", ".join(filter(None, (getattr(exc, "context", None), getattr(exc, "problem", None))))
        raise ValueError(f"{path}: invalid YAML ({where}{what or ' '.join(str(exc).split())})") from exc


def read_config(path: str | Path) -> RuntimeConfig:
    path = Path(path)
    raw = read_yaml(path)
    try:
        return RuntimeConfig.model_validate(raw or {})
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"{path}: {problems}") from exc
