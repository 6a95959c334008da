"""What `specserve canary` and `specserve demo` are asked, checked before anything starts: each revision's SPEC (a
speculator of the SpeculativeServing CR, a local drafter, an engine), the rollout's steps and gates and the SLO from
the flags (through the CR's own models, so the same rules and defaults), and the plan they make."""

import hashlib
import json
import math
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ValidationError
from specserve_runtime.cmdline import (
    READY_SECONDS,
)
from specserve_runtime.config import DEFAULT_DRAFTER_NAMES, RuntimeConfig, read_yaml

from .. import api  # pydantic only: the decision and measurement modules are imported when a canary runs

# Six prompts of unequal acceptance (chat, code, math), cycled by the closed-loop clients: package data, so the
# commands run from any directory.
DEFAULT_PROMPTS = Path(__file__).parent / "canary-prompts.jsonl"
SPEC_KEYS = ("method", "draftModel", "numSpeculativeTokens", "draftTree", "promptLookup", "engine")
SERVED_NAME = "canary"  # the OpenAI model name both runtimes answer to
# vLLM on a CPU: float32, no graph compilation (it starts in about a minute, not three), a short context, and a KV
# cache of 1 GiB (vLLM's own default takes a share of the machine's memory, for each of the two).
DEFAULT_VLLM_ARGS = f"--dtype float32 --enforce-eager --max-model-len 4096 --kv-cache-memory-bytes {1 << 30}"
MAX_CONCURRENCY = 16  # closed-loop clients per runtime


class CanaryError(Exception):
    """Bad input: one line naming the field, exit status 2, nothing started."""


# ---- the speculators -----------------------------------------------------------------------


@dataclass(frozen=True)
class LocalSpeculator:
    """A CR speculator with a local drafter (a checkpoint folder, "random", or None: the bundled one), and the
    engine that runs it (the CR's runtime.engine)."""

    method: str
    draft_model: str | None = None
    num_speculative_tokens: int | None = None
    draft_tree: bool | None = None
    prompt_lookup: int | None = None
    engine: str = "embedded"

    def as_dict(self) -> dict:
        fields = {"method": self.method, "draftModel": self.draft_model,
                  "numSpeculativeTokens": self.num_speculative_tokens, "draftTree": self.draft_tree,
                  "promptLookup": self.prompt_lookup, "engine": None if self.engine == "embedded" else self.engine}
        return {key: value for key, value in fields.items() if value is not None}

    @property
    def revision(self) -> str:
        """A short hash of the speculator, like the operator's revision hashes."""
        return hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()[:8]

    def describe(self) -> str:
        extra = []
        if self.draft_model or self.method in ("eagle3", "dflash"):
            extra.append(f"drafter {self.draft_model}" if self.draft_model else "bundled drafter")
        if self.num_speculative_tokens:
            count = self.num_speculative_tokens
            extra.append(f"{count} draft{'s' if count > 1 else ''} per step")
        if self.draft_tree is not None:
            extra.append("a draft tree" if self.draft_tree else "a chain")
        if self.prompt_lookup is not None:
            extra.append(f"prompt lookup's copies of up to {self.prompt_lookup}" if self.prompt_lookup else "no copies")
        if self.engine != "embedded":
            extra.append(f"on {self.engine}")
        return self.method + (f" ({', '.join(extra)})" if extra else "")

    def runtime_config(self, model: str, port: int, engine_args: list[str]) -> RuntimeConfig:
        """The runtime configuration the operator would render for it (render.runtime_config), on loopback.
        Without a draftModel, eagle3 and dflash run the bundled drafter."""
        drafter = self.draft_model
        if drafter is None and self.method in DEFAULT_DRAFTER_NAMES:
            drafter = f"bundled://{DEFAULT_DRAFTER_NAMES[self.method]}"
        return RuntimeConfig(model=model, served_name=SERVED_NAME, method=self.method, drafter=drafter,
                             num_speculative_tokens=self.num_speculative_tokens, draft_tree=self.draft_tree,
                             prompt_lookup=self.prompt_lookup, engine=self.engine,
                             engine_args=engine_args if self.engine == "vllm" else [], host="127.0.0.1", port=port)

    def api_speculator(self) -> api.Speculator:
        """The CR's Speculator, checked by the API's own rules; the local drafter stands in as a pvc:// URI."""
        uri = None
        if self.method in ("eagle3", "dflash"):
            uri = f"pvc://local/{Path(self.draft_model).name if self.draft_model else 'bundled'}"
        fields = {key: value for key, value in self.as_dict().items() if key != "engine"}
        return api.Speculator.model_validate({**fields, "draftModel": uri})


def _read_spec(text: str, flag: str) -> dict:
    path = Path(text)
    if path.is_file():
        try:
            data = read_yaml(path)
        except ValueError as exc:
            raise CanaryError(f"{flag} {exc}") from exc
        if not isinstance(data, dict):
            raise CanaryError(f"{flag} {text}: expected a mapping with {', '.join(SPEC_KEYS)}")
        return data
    if "=" not in text:
        raise CanaryError(f"{flag} {text!r}: no such file, and not KEY=VALUE,... "
                          "(e.g. method=dflash,numSpeculativeTokens=2)")
    data = {}
    for part in text.split(","):
        key, equals, value = (s.strip() for s in part.partition("="))
        if not equals or not key:
            raise CanaryError(f"{flag}: {part!r} is not KEY=VALUE")
        if key in data:
            raise CanaryError(f"{flag}: {key}: given twice")
        data[key] = value
    return data


def _integer(value) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        return int(value)
    return None


def _problems(exc: ValidationError, names: dict[str, str], prefix: str = "") -> str:
    """Pydantic's errors as `FIELD: message`, fields named by their command-line flag where there is one."""
    lines = []
    for error in exc.errors():
        location = ".".join(str(part) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        name = names.get(location, location)
        lines.append(f"{prefix}{name}: {message}" if name else f"{prefix}{message}")
    return "; ".join(lines)


def parse_speculator(text: str, flag: str) -> LocalSpeculator:
    """A SPEC (a YAML/JSON file, or inline method=..,draftModel=..,numSpeculativeTokens=..) -> a checked speculator."""
    data = _read_spec(text, flag)
    unknown = [key for key in data if key not in SPEC_KEYS]
    if unknown:
        raise CanaryError(f"{flag}: {unknown[0]}: unknown key (allowed: {', '.join(SPEC_KEYS)})")
    method = data.get("method")
    if method is None or method == "":
        raise CanaryError(f"{flag}: method: required ({' | '.join(api.ALL_METHODS)})")
    if method not in api.ALL_METHODS:
        raise CanaryError(f"{flag}: method: unknown method {method!r} (choose {' | '.join(api.ALL_METHODS)})")
    tokens = data.get("numSpeculativeTokens")
    if tokens is not None:
        if method == "none":
            raise CanaryError(f"{flag}: numSpeculativeTokens: not allowed with method none")
        if _integer(tokens) is None or _integer(tokens) < 1:
            raise CanaryError(f"{flag}: numSpeculativeTokens: must be an integer >= 1, got {tokens!r}")
        tokens = _integer(tokens)
    tree = data.get("draftTree")
    if isinstance(tree, str) and tree.lower() in ("true", "false"):  # inline specs are text
        tree = tree.lower() == "true"
    if tree is not None and not isinstance(tree, bool):
        raise CanaryError(f"{flag}: draftTree: must be true or false, got {tree!r}")
    lookup = data.get("promptLookup")
    if lookup is not None:
        if _integer(lookup) is None:
            raise CanaryError(f"{flag}: promptLookup: must be an integer, got {lookup!r}")
        lookup = _integer(lookup)  # its range and its method: the CR's own rules, below
    engine = data.get("engine", "embedded")
    if engine not in ("embedded", "vllm"):
        raise CanaryError(f"{flag}: engine: {engine!r} is neither embedded nor vllm")
    if engine == "vllm":
        for key, message in api.EMBEDDED_ONLY.items():
            if data.get(key) not in (None, False, 0, "false", "0"):
                raise CanaryError(f"{flag}: {key}: {message}")
        if data.get("draftModel") == "random":
            raise CanaryError(f"{flag}: draftModel: random is an untrained drafter of the embedded engine; "
                              "vLLM loads drafter folders")
    draft = data.get("draftModel")
    if draft is not None:
        if method not in ("eagle3", "dflash"):
            raise CanaryError(f"{flag}: draftModel: method {method} takes no draft model")
        draft = str(draft)
        if draft != "random":
            folder = Path(draft).expanduser()
            if not draft or not folder.is_dir():
                raise CanaryError(f"{flag}: draftModel: {draft!r}: no such folder "
                                  "(a drafter checkpoint folder, or random)")
            draft = str(folder.resolve())
    speculator = LocalSpeculator(method, draft, tokens, tree, lookup, engine)
    try:
        speculator.api_speculator()  # the CR's own rules too (e.g. numSpeculativeTokens <= 64)
    except ValidationError as exc:
        raise CanaryError(_problems(exc, {}, f"{flag}: ")) from None
    return speculator


# ---- the rollout ---------------------------------------------------------------------------

ANALYSIS_FLAGS = {
    "intervalSeconds": "--interval-seconds", "minAcceptanceLength": "--min-acceptance-length",
    "maxP99LatencyRatio": "--max-p99-latency-ratio", "minTokensPerDollarGain": "--min-tokens-per-dollar-gain",
    "maxErrorRate": "--max-error-rate", "failureLimit": "--failure-limit",
}
SLO_FLAGS = {"p99InterTokenLatencyMs": "--slo-p99-itl-ms", "p99TimeToFirstTokenMs": "--slo-p99-ttft-ms"}


def _validated(model: type[BaseModel], data: dict, names: dict[str, str], prefix: str = "") -> BaseModel:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise CanaryError(_problems(exc, names, prefix)) from None


def parse_steps(text: str) -> list[int]:
    weights = []
    for part in text.split(","):
        weight = _integer(part.strip())
        if weight is None:
            raise CanaryError(f"--steps: {part.strip()!r} is not an integer weight "
                              "(percent of traffic, e.g. 25,50,100)")
        weights.append(weight)
    return weights


def build_rollout(args, candidate: LocalSpeculator) -> tuple[api.Rollout, api.Slo]:
    """The flags as the CR's rollout and SLO, through the API's own validation."""
    flags = {"intervalSeconds": args.interval_seconds, "minAcceptanceLength": args.min_acceptance_length,
             "maxP99LatencyRatio": args.max_p99_latency_ratio, "minTokensPerDollarGain": args.min_tokens_per_dollar_gain,
             "maxErrorRate": args.max_error_rate, "failureLimit": args.failure_limit}
    # A gate left unset is the CRD's default, as in a SpeculativeServing that names no gate.
    analysis = _validated(api.Analysis, {key: value for key, value in flags.items() if value is not None}, ANALYSIS_FLAGS)
    seconds = args.interval_seconds if args.step_seconds is None else args.step_seconds
    steps = [_validated(api.RolloutStep, {"weight": weight, "analysisSeconds": seconds},
                        {"weight": f"--steps: steps[{index}].weight", "analysisSeconds": "--step-seconds"})
             for index, weight in enumerate(parse_steps(args.steps))]
    candidate_spec = api.Candidate(speculator=candidate.api_speculator())
    rollout = _validated(api.Rollout,
                         {"candidate": candidate_spec, "steps": steps, "analysis": analysis, "autoPromote": True},
                         {"": "--steps", "steps": "--steps"})
    slo = _validated(api.Slo,
                     {"p99InterTokenLatencyMs": args.slo_p99_itl_ms, "p99TimeToFirstTokenMs": args.slo_p99_ttft_ms},
                     SLO_FLAGS)
    return rollout, slo


def default_timeout(rollout: api.Rollout, start_seconds: float = READY_SECONDS["embedded"]) -> float:
    """Start-up, plus twice each step's planned time (its analysisSeconds, at least one interval, plus one)."""
    interval = rollout.analysis.interval_seconds
    return start_seconds + 2 * sum(max(step.analysis_seconds, interval) + interval for step in rollout.steps)


@dataclass(frozen=True)
class Plan:
    stable: LocalSpeculator
    candidate: LocalSpeculator
    rollout: api.Rollout
    slo: api.Slo
    prompts: list[str]
    model: str
    concurrency: int
    max_new_tokens: int
    price_per_hour: float
    timeout_seconds: float
    prometheus: str | None  # the binary, or None: scrape the runtimes directly
    no_prometheus: bool = False  # None above by request
    vllm_args: tuple[str, ...] = ()  # the engine arguments of a revision on vLLM (the CR's runtime.args)


def make_plan(args) -> Plan:
    """Every check of the input, before anything starts."""
    from specserve_runtime.cmdline import UsageError, read_prompts

    stable, candidate = parse_speculator(args.stable, "--stable"), parse_speculator(args.candidate, "--candidate")
    if stable.revision == candidate.revision:
        raise CanaryError(f"--candidate: the same speculator as --stable (revision {stable.revision}): "
                          "nothing to compare")
    rollout, slo = build_rollout(args, candidate)
    if not 1 <= args.concurrency <= MAX_CONCURRENCY:
        raise CanaryError(f"--concurrency: must be within 1..{MAX_CONCURRENCY}, got {args.concurrency}")
    if not 1 <= args.max_new_tokens <= 4096:
        raise CanaryError(f"--max-new-tokens: must be within 1..4096, got {args.max_new_tokens}")
    if not (args.price_per_hour > 0 and math.isfinite(args.price_per_hour)):
        raise CanaryError(f"--price-per-hour: must be > 0, got {args.price_per_hour}")
    start_seconds = max(READY_SECONDS[stable.engine], READY_SECONDS[candidate.engine])
    timeout = default_timeout(rollout, start_seconds) if args.timeout_seconds is None else args.timeout_seconds
    if not (timeout > 0 and math.isfinite(timeout)):
        raise CanaryError(f"--timeout-seconds: must be > 0, got {args.timeout_seconds}")
    try:
        prompts = read_prompts(None, args.prompts_file)
    except UsageError as exc:
        raise CanaryError(str(exc)) from None
    binary = None if args.no_prometheus else shutil.which("prometheus")
    return Plan(stable, candidate, rollout, slo, prompts, args.model, args.concurrency, args.max_new_tokens,
                args.price_per_hour, timeout, binary, args.no_prometheus, tuple(shlex.split(args.vllm_args)))


def add_rollout_flags(parser, defaults: dict | None = None) -> None:
    """The flags of `specserve canary`; `defaults` (by dest) makes the required ones optional (the demo)."""
    from specserve_runtime.store import DEFAULT_MODEL  # stdlib only: no torch

    defaults = defaults or {}

    def flag(name, **kwargs):
        dest = name.removeprefix("--").replace("-", "_")
        if dest in defaults:
            if kwargs.pop("required", False):
                kwargs["help"] += " (default %(default)s)"
            kwargs["default"] = defaults[dest]
        parser.add_argument(name, **kwargs)

    flag("--stable", required=True, metavar="SPEC", help="what serves today")
    flag("--candidate", required=True, metavar="SPEC", help="what is rolled out")
    flag("--prompts-file", default=str(DEFAULT_PROMPTS),
         help='JSONL, one object with a "prompt" field per line (default: six prompts of unequal acceptance, '
              'the package\'s canary-prompts.jsonl)')
    flag("--model", default=DEFAULT_MODEL, help="the target model of both runtimes (default %(default)s)")
    flag("--steps", default="25,50,100", help="candidate weights in percent, strictly increasing (default %(default)s)")
    flag("--step-seconds", type=int, help="each step's analysisSeconds (default: the interval)")
    flag("--interval-seconds", type=int, default=30, help="analysis interval, >= 10 (default %(default)s)")
    analysis = api.Analysis()  # the CRD's defaults, which a flag left out keeps
    flag("--min-acceptance-length", type=float,
         help=f"gate: candidate acceptance length at least this (default: {api.DEFAULT_MIN_ACCEPTANCE_LENGTH} for a "
              "speculating candidate)")
    flag("--max-p99-latency-ratio", type=float,
         help=f"gate: candidate p99 ITL / stable's at most this (default {analysis.max_p99_latency_ratio})")
    flag("--min-tokens-per-dollar-gain", type=float,
         help=f"gate: candidate tokens/$ / stable's at least this (default {analysis.min_tokens_per_dollar_gain})")
    flag("--max-error-rate", type=float, default=0.01, help="gate (default %(default)s)")
    flag("--failure-limit", type=int, default=2, help="failed analyses in a row that abort (default %(default)s)")
    flag("--slo-p99-itl-ms", type=float, help="SLO gate: candidate p99 inter-token latency")
    flag("--slo-p99-ttft-ms", type=float, help="SLO gate: candidate p99 time to first token")
    flag("--price-per-hour", type=float, default=1.0,
         help="USD per replica-hour, for tokens per dollar (default %(default)s)")
    flag("--concurrency", type=int, default=1,
         help=f"closed-loop clients PER RUNTIME, 1..{MAX_CONCURRENCY} (default %(default)s)")
    flag("--max-new-tokens", type=int, default=64, help="max_tokens per request (default %(default)s)")
    flag("--timeout-seconds", type=float,
         help=f"overall bound; reaching it decides Inconclusive (default: {READY_SECONDS['embedded']} s of "
              f"start-up, {READY_SECONDS['vllm']} with vLLM, "
              "plus twice the steps' planned time)")
    flag("--no-prometheus", action="store_true", help="scrape the runtimes' /metrics even if prometheus is installed")
    flag("--vllm-args", default=DEFAULT_VLLM_ARGS,
         help="vLLM's arguments for a revision with engine=vllm (the CR's runtime.args; default %(default)s; vLLM "
              "itself comes from SPECSERVE_VLLM, else `vllm serve`)")
    flag("--json", action="store_true", help="stdout is one JSON object (one line)")
