"""The SpeculativeServing and ServingProfile specs: what tenants and platform teams write."""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel
from specserve_runtime.config import (BUNDLED_DRAFTERS, MAX_PROMPT_LOOKUP, RESERVED_ENGINE_FLAGS_RE, BatchSizeRange,
                                      refuse_reserved_flags, schedule_problems)

GROUP, VERSION = "specserve.io", "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
# The images `make images` builds from the Dockerfile's targets, at the project's version: a
# revision's runtime image unless it names one (tests/operator/test_images.py checks they agree).
RELEASE = "0.1.0"
RUNTIME_IMAGES = {"vllm": f"ghcr.io/specserve/runtime:{RELEASE}", "embedded": f"ghcr.io/specserve/runtime-cpu:{RELEASE}"}

Method = Literal["none", "ngram", "eagle3", "dflash"]
ALL_METHODS: list[Method] = ["none", "ngram", "eagle3", "dflash"]
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# hf://ORG/NAME (the engine's model id: its hub, or HF_HOME's cache) or pvc://CLAIM/PATH (the operator mounts the
# claim read-only). s3:// is not fetched: a bucket's folder goes on a volume first.
PVC_URI = r"pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/.*)?"
MODEL_URI = rf"^(hf://.+|{PVC_URI})$"
# A drafter may also be one the runtime carries: bundled://NAME.
DRAFT_MODEL_URI = rf"^(hf://.+|{PVC_URI}|bundled://({'|'.join(BUNDLED_DRAFTERS)}))$"
Quantity = int | str


def cel(rule: str, message: str, field_path: str | None = None) -> dict:
    validation = {"rule": rule, "message": message}
    if field_path:
        validation["fieldPath"] = field_path
    return validation


class Model(BaseModel):
    # Python code builds models by field name; a resource is read by its camelCase keys only (validate.py), as the
    # API server knows no others and would drop a snake_case key the operator had honoured.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class Toleration(Model):
    key: str | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


# Kubernetes' own rule for a label selector's requirement: a set test needs members, a presence test takes none.
SELECTOR_SET_NEEDS_VALUES = "values: required (non-empty) with operator In or NotIn"
SELECTOR_PRESENCE_TAKES_NO_VALUES = "values: must be empty with operator Exists or DoesNotExist"


class LabelSelectorRequirement(Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel("!(self.operator in ['In', 'NotIn']) || (has(self.values) && size(self.values) > 0)",
            SELECTOR_SET_NEEDS_VALUES, ".values"),
        cel("!(self.operator in ['Exists', 'DoesNotExist']) || !has(self.values) || size(self.values) == 0",
            SELECTOR_PRESENCE_TAKES_NO_VALUES, ".values"),
    ]})

    key: str = Field(min_length=1)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] = []

    @model_validator(mode="after")
    def values_match_operator(self):
        if self.operator in ("In", "NotIn") and not self.values:
            raise ValueError(SELECTOR_SET_NEEDS_VALUES)
        if self.operator in ("Exists", "DoesNotExist") and self.values:
            raise ValueError(SELECTOR_PRESENCE_TAKES_NO_VALUES)
        return self


class LabelSelector(Model):
    match_labels: dict[str, str] = {}
    match_expressions: list[LabelSelectorRequirement] = []


class Accelerator(Model):
    resource_name: str = Field("nvidia.com/gpu", min_length=1)
    count: int = Field(1, ge=0, le=16, description="accelerators per replica")
    price_per_hour_usd: float = Field(alias="pricePerHourUSD", ge=0, description="per accelerator")
    node_selector: dict[str, str] = {}
    tolerations: list[Toleration] = []


class Kueue(Model):
    local_queue: str | None = None
    priority_class: str | None = None


ImageRef = Annotated[str, Field(min_length=1, max_length=512, pattern=r"^[^\s]+$")]


def image_allowed(image: str, allowed: list[str]) -> bool:
    """An engine's default image always; another one where an entry names it exactly, or an entry ending in '/'
    (a registry or repository path) is its prefix."""
    return image in RUNTIME_IMAGES.values() or any(
        image.startswith(entry) if entry.endswith("/") else image == entry for entry in allowed)


# An allow-list is a set: the API server refuses an entry written twice (x-kubernetes-list-type: set), and so
# does the model, so that a second entry never looks like a second grant.
AS_A_SET = {"x-kubernetes-list-type": "set"}


def refuse_duplicates(entries: list[str]) -> list[str]:
    if twice := sorted({entry for entry in entries if entries.count(entry) > 1}):
        raise ValueError(f"listed more than once: {', '.join(twice)}")
    return entries


class ProfileLimits(Model):
    max_replicas: int = Field(8, ge=1, le=1000, description="per SpeculativeServing, all revisions together")
    max_hourly_cost_usd: float | None = Field(None, alias="maxHourlyCostUSD", gt=0)
    allowed_methods: list[Method] = Field(default_factory=lambda: list(ALL_METHODS), min_length=1,
                                          json_schema_extra=AS_A_SET)
    max_num_speculative_tokens: int | None = Field(
        None, ge=1, le=64, description="the most drafts a step a serving may run (numSpeculativeTokens and every "
        "numSpeculativeTokensPerBatchSize entry); a speculating serving must then name its numSpeculativeTokens")
    allowed_images: list[ImageRef] = Field(
        [], max_length=64, description="the runtime images a serving may name (runtime.image): an entry ending in '/' "
        "allows every image under that path, any other entry that image alone; the engines' default images are always "
        "allowed, and with no entry they are the only ones", json_schema_extra=AS_A_SET)
    allow_trust_remote_code: bool = Field(
        False, description="whether a serving's runtime.args may pass --trust-remote-code, which runs the Python "
        "that the model's repository ships in the serving's pods")

    _sets = field_validator("allowed_methods", "allowed_images")(refuse_duplicates)


class Slo(Model):
    p99_inter_token_latency_ms: float | None = Field(None, gt=0)
    p99_time_to_first_token_ms: float | None = Field(None, gt=0)


class ServingProfileSpec(Model):
    tenant: str = Field(pattern=DNS_LABEL, max_length=63)
    namespace_selector: LabelSelector = Field(
        description="which namespaces may use this profile; required, so that no profile serves every namespace by "
        "omission ({} selects every namespace)")
    accelerator: Accelerator
    kueue: Kueue | None = None
    limits: ProfileLimits = ProfileLimits()
    slo: Slo = Slo()


class ModelRef(Model):
    name: str = Field(min_length=1, description="target model id as the engine knows it")
    uri: str = Field(pattern=MODEL_URI, description="hf://ORG/NAME or pvc://CLAIM/PATH (mounted read-only)")
    served_name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$", max_length=128)


_SCHEDULE = "self.numSpeculativeTokensPerBatchSize"
SCHEDULE_COVERS = "numSpeculativeTokensPerBatchSize: ordered ranges cover every batch size from 1 once (no gap or overlap)"
SCHEDULE_RULES = [cel(f"!has({_SCHEDULE}) || {rule}", message, ".numSpeculativeTokensPerBatchSize") for rule, message in [
    ("self.method != 'none'", "numSpeculativeTokensPerBatchSize: method none drafts nothing"),
    (f"{_SCHEDULE}[0].minBatchSize == 1 && {_SCHEDULE}.map(r, r.minBatchSize).isSorted() && "
     f"{_SCHEDULE}.all(r, {_SCHEDULE}.exists_one(s, s.minBatchSize == r.minBatchSize)) && "
     f"{_SCHEDULE}.all(r, r.minBatchSize == 1 || "
     f"{_SCHEDULE}.exists(p, has(p.maxBatchSize) && p.maxBatchSize + 1 == r.minBatchSize)) && "
     f"{_SCHEDULE}.all(r, !has(r.maxBatchSize) || r.maxBatchSize >= r.minBatchSize) && "
     f"{_SCHEDULE}.all(r, has(r.maxBatchSize) || r.minBatchSize == {_SCHEDULE}[size({_SCHEDULE}) - 1].minBatchSize)",
     SCHEDULE_COVERS),
    (f"!has(self.numSpeculativeTokens) || {_SCHEDULE}.all(r, r.numSpeculativeTokens <= self.numSpeculativeTokens)",
     "numSpeculativeTokensPerBatchSize: no range drafts more than numSpeculativeTokens"),
]]


class Speculator(Model):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("!(self.method in ['dflash', 'eagle3']) || has(self.draftModel)", "dflash and eagle3 need a draftModel",
                    ".draftModel"),
                cel("self.method != 'none' || !has(self.numSpeculativeTokens)", "method none takes no numSpeculativeTokens",
                    ".numSpeculativeTokens"),
                cel("self.method in ['dflash', 'eagle3'] || !has(self.draftTree)", "draftTree is for methods dflash and eagle3",
                    ".draftTree"),
                cel("self.method in ['dflash', 'eagle3'] || !has(self.promptLookup)",
                    "promptLookup is for methods dflash and eagle3", ".promptLookup"),
                *SCHEDULE_RULES,
            ]
        }
    )
    method: Method = "none"
    draft_model: str | None = Field(
        None, pattern=DRAFT_MODEL_URI, description="hf://, pvc://, or bundled://NAME: a drafter the runtime images embed"
    )
    num_speculative_tokens: int | None = Field(
        None, ge=1, le=64, description="drafts per step; default: the drafter's own (dflash: block size - 1)"
    )
    draft_tree: bool | None = Field(
        None, description="dflash, eagle3 on the embedded engine: verify a tree of the drafter's most likely "
        "continuations, numSpeculativeTokens drafts in all; default: the drafter's own operating point"
    )
    prompt_lookup: int | None = Field(
        None, ge=0, le=MAX_PROMPT_LOOKUP, description="dflash, eagle3 on the embedded engine: beside the drafts, verify up to this "
        "many tokens that prompt lookup copies from the sequence, 0 none; default: the drafter's own operating point"
    )
    num_speculative_tokens_per_batch_size: list[BatchSizeRange] | None = Field(
        None, min_length=1, max_length=32, description="drafts a step by how many requests decode together: ranges "
        "{minBatchSize, maxBatchSize (the last may be open), numSpeculativeTokens (0: none)} from batch size 1, in "
        "order, no gap or overlap; vLLM's option of this name, the embedded engine's draft length"
    )

    @model_validator(mode="after")
    def _draft_model_where_needed(self):
        if self.method in ("dflash", "eagle3") and not self.draft_model:
            raise ValueError(f"draftModel: required for method {self.method}")
        if self.method == "none" and self.num_speculative_tokens is not None:
            raise ValueError("numSpeculativeTokens: not allowed with method none")
        if self.method not in ("dflash", "eagle3") and self.draft_tree is not None:
            raise ValueError(f"draftTree: only a drafter model (dflash, eagle3) drafts a tree; method {self.method} drafts a chain")
        if self.method not in ("dflash", "eagle3") and self.prompt_lookup is not None:
            raise ValueError(f"promptLookup: a prompt-lookup branch joins a drafter model's drafts (dflash, eagle3), "
                             f"not method {self.method}'s")
        problems = schedule_problems(self.num_speculative_tokens_per_batch_size, self.method,
                                     self.num_speculative_tokens, "numSpeculativeTokensPerBatchSize")
        if problems:
            raise ValueError("\n".join(problems))  # validate.pydantic_problems reports each on its own
        return self

    def embedded_only(self) -> list[str]:
        """Its fields set to what only the embedded engine runs: a draft tree, a prompt-lookup branch."""
        return ["draftTree"] * bool(self.draft_tree) + ["promptLookup"] * bool(self.prompt_lookup)


# What a tenant may ask of a pod; accelerators (and their count, which the profile prices) come from the profile.
TENANT_RESOURCES = ("cpu", "memory", "ephemeral-storage")
TENANT_RESOURCES_ONLY = f"resources are {', '.join(TENANT_RESOURCES)}; accelerators come from the ServingProfile"
RESERVED_FLAG = "args may not set --model, --served-model-name, --host, --port, --speculative-config or --config"


def _tenant_resources():
    allowed = ", ".join(f"'{name}'" for name in TENANT_RESOURCES)
    return Field({}, max_length=len(TENANT_RESOURCES), json_schema_extra={"x-kubernetes-validations": [
        cel(f"self.all(name, name in [{allowed}])", TENANT_RESOURCES_ONLY)]})


class Resources(Model):
    requests: dict[str, Quantity] = _tenant_resources()
    limits: dict[str, Quantity] = _tenant_resources()

    @field_validator("requests", "limits")
    @classmethod
    def _tenant_only(cls, quantities: dict) -> dict:
        if others := sorted(set(quantities) - set(TENANT_RESOURCES)):
            raise ValueError(f"{', '.join(others)}: {TENANT_RESOURCES_ONLY}")
        return quantities


MAX_ENGINE_ARGS = 64
EngineArg = Annotated[str, Field(max_length=4096)]


def _engine_args(default):
    rule = cel(f"self.all(arg, !arg.matches('{RESERVED_ENGINE_FLAGS_RE}'))", RESERVED_FLAG)
    return Field(default, max_length=MAX_ENGINE_ARGS,  # bounded: the API server bounds a rule's cost
                 description="extra engine arguments, passed as a list, never through a shell; not the flags that "
                             "the serving's fields set",
                 json_schema_extra={"x-kubernetes-validations": [rule]})


class RuntimeSpec(Model):
    engine: Literal["vllm", "embedded"] = "vllm"
    image: str | None = Field(
        None, min_length=1, description=f"default: the engine's image ({RUNTIME_IMAGES['vllm']}, {RUNTIME_IMAGES['embedded']})"
    )
    args: list[EngineArg] = _engine_args([])
    resources: Resources = Resources()

    _args = field_validator("args")(refuse_reserved_flags)


class RuntimeOverride(Model):
    """What a canary may change in the runtime; unset fields keep the stable revision's."""

    engine: Literal["vllm", "embedded"] | None = None
    image: str | None = Field(None, min_length=1)
    args: list[EngineArg] | None = _engine_args(None)
    resources: Resources | None = None

    _args = field_validator("args")(refuse_reserved_flags)


class Replicas(Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [cel("self.min <= self.max", "min must be <= max", ".min")]})
    min: int = Field(1, ge=0, le=1000)
    max: int = Field(1, ge=1, le=1000)
    desired: int | None = Field(
        None, ge=0, le=1000, description="replicas when autoscaling is off (default min); the /scale subresource sets it"
    )

    @model_validator(mode="after")
    def _ordered(self):
        if self.min > self.max:
            raise ValueError(f"min: {self.min} must be <= max ({self.max})")
        return self


class Autoscaling(Model):
    enabled: bool = False
    objective: Literal["TokensPerDollar"] = "TokensPerDollar"
    slo: Slo | None = Field(None, description="overrides the profile's")
    scale_up_stabilization_seconds: int = Field(60, ge=0, le=3600)
    scale_down_stabilization_seconds: int = Field(300, ge=0, le=3600)


FALLBACK_IS_SIMPLE = "a fallback speculator drafts chains on its own: no draftTree, no promptLookup"
FALLBACK_DIFFERS = "the fallback speculator is spec.speculator itself: nothing to fall back to"


class Fallback(Model):
    """What the operator rolls out when the live revision's speculation is degraded: a new revision with this
    speculator, through a canary like any other (spec.rollout's steps and analysis when it has them), once the
    revision measures slower than plain decoding. A fallback that does worse is rolled back in turn, and retried,
    each time twice as late, while the revision still calls for it. Any change of the spec ends it."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel("!has(self.speculator.draftTree) || self.speculator.draftTree == false", FALLBACK_IS_SIMPLE, ".speculator.draftTree"),
        cel("!has(self.speculator.promptLookup) || self.speculator.promptLookup == 0", FALLBACK_IS_SIMPLE,
            ".speculator.promptLookup"),
    ]})
    speculator: Speculator = Field(description="the fallback revision's speculator: ngram, none, or a shorter draft")
    auto_fallback: bool = Field(True, description="false: SpeculationDegraded is only reported")

    @model_validator(mode="after")
    def _simple(self):
        for field in self.speculator.embedded_only():
            raise ValueError(f"speculator.{field}: {FALLBACK_IS_SIMPLE}")
        return self


SEVERE_BELOW_MIN = "severeAcceptanceRatio must be below minAcceptanceRatio"


class SpeculationHealth(Model):
    """Continuous analysis of the live revision once no canary runs (health.py): each interval its acceptance
    length against the baseline recorded as it went live, and its time per token against what plain decoding
    would take at the load measured; a sustained fall, or a severe fall of acceptance, sets the condition
    SpeculationDegraded."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel("!has(self.severeAcceptanceRatio) || !has(self.minAcceptanceRatio) || "
            "self.severeAcceptanceRatio < self.minAcceptanceRatio", SEVERE_BELOW_MIN, ".severeAcceptanceRatio"),
    ]})
    enabled: bool = True
    interval_seconds: int = Field(60, ge=10, le=3600)
    min_acceptance_ratio: float = Field(0.8, gt=0, le=1, description="acceptance length / the revision's baseline at least this")
    severe_acceptance_ratio: float = Field(
        0.5, ge=0, lt=1, description="one degraded analysis whose acceptance ratio is below this (over 1000 generated "
        "tokens or more) sets SpeculationDegraded without waiting for sustainedAnalyses; 0: never")
    min_speedup: float = Field(1.0, gt=0, le=10, description="plain decoding's time per token at the load measured (the "
                               "capacity prior of method none) / the measured, at least this; not judged without that prior")
    sustained_analyses: int = Field(3, ge=1, le=100, description="degraded analyses in a row that set SpeculationDegraded")
    fallback: Fallback | None = None
    schedule: Literal["Off", "Propose", "Apply"] = Field(
        "Propose", description="a draft-length schedule (numSpeculativeTokensPerBatchSize) from the capacity prior's "
        "draftLengths and the live acceptance: Propose reports it in status.draftSchedule, Apply also rolls it out "
        "through the canary once per spec generation when it is predicted 5% faster; Off neither")

    @model_validator(mode="after")
    def _severe_below_min(self):
        if self.severe_acceptance_ratio >= self.min_acceptance_ratio:
            raise ValueError(f"severeAcceptanceRatio: {self.severe_acceptance_ratio:g} must be below minAcceptanceRatio "
                             f"({self.min_acceptance_ratio:g})")
        return self


class ParentRef(Model):
    name: str = Field(min_length=1)
    namespace: str | None = None
    section_name: str | None = None


class Gateway(Model):
    parent_refs: list[ParentRef] = Field(min_length=1)


class Traffic(Model):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [cel("self.mode != 'GatewayAPI' || has(self.gateway)", "GatewayAPI mode needs a gateway")]
        }
    )
    mode: Literal["ReplicaRatio", "GatewayAPI"] = "ReplicaRatio"
    gateway: Gateway | None = None

    @model_validator(mode="after")
    def _gateway_when_needed(self):
        if self.mode == "GatewayAPI" and self.gateway is None:
            raise ValueError("gateway: required for mode GatewayAPI (parentRefs of the Gateway to attach to)")
        return self


class Candidate(Model):
    speculator: Speculator
    runtime: RuntimeOverride | None = None


class RolloutStep(Model):
    weight: int = Field(ge=1, le=100, description="percent of traffic to the candidate")
    analysis_seconds: int = Field(300, ge=0, le=86400)


# A candidate that speculates, and whose rollout sets no minAcceptanceLength, must reach this many tokens per
# verify step: below it, drafts are next to never accepted and every step is dearer than plain decoding's.
DEFAULT_MIN_ACCEPTANCE_LENGTH = 1.2


class Analysis(Model):
    """The gates of each analysis interval. The comparative ones have defaults, so that a rollout naming no gate
    never promotes a measurably worse candidate; set a gate to loosen it (analysis.py)."""

    interval_seconds: int = Field(60, ge=10, le=3600)
    min_acceptance_length: float | None = Field(
        None, ge=1, description=f"candidate tokens per verify step at least this; unset, {DEFAULT_MIN_ACCEPTANCE_LENGTH} "
        "for a candidate that speculates (method other than none)")
    # A speculating revision streams in bursts: a verify step emits its accepted tokens together, so the gaps a
    # client sees are step times, a few plain steps long on a CPU (EAGLE-3 against plain decoding: 2.3-2.4x the p99
    # at 1.28x the tokens/s, measured). The default is a tail guard; the mean time per token is tokensPerDollarGain's.
    max_p99_latency_ratio: float = Field(3.0, gt=0, description="candidate p99 inter-token latency / stable's")
    min_tokens_per_dollar_gain: float = Field(0.95, gt=0, description="candidate tokens per dollar / stable's")
    max_error_rate: float = Field(0.01, ge=0, le=1)
    failure_limit: int = Field(2, ge=1, le=100)


class Rollout(Model):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.steps.map(s, s.weight).isSorted() && "
                    "self.steps.all(s, self.steps.exists_one(t, t.weight == s.weight))",
                    "step weights must strictly increase",
                    ".steps",
                )
            ]
        }
    )
    candidate: Candidate
    steps: list[RolloutStep] = Field(min_length=1, max_length=20)
    analysis: Analysis = Analysis()
    auto_promote: bool = True

    @model_validator(mode="after")
    def _weights_increase(self):
        for index in range(1, len(self.steps)):
            if self.steps[index].weight <= self.steps[index - 1].weight:
                raise ValueError(
                    f"steps[{index}].weight: {self.steps[index].weight} must be greater than the previous "
                    f"step's weight ({self.steps[index - 1].weight})"
                )
        return self


# The vLLM launcher drafts chains: a draft tree needs the embedded engine, for the stable revision
# (spec.runtime) and for a candidate (its runtime override, else spec.runtime).
def _embedded(runtime: str) -> str:
    return f"(has({runtime}) && has({runtime}.engine) && {runtime}.engine == 'embedded')"


_CANDIDATE = "self.rollout.candidate"
TREE_NEEDS_EMBEDDED = "a draftTree needs runtime.engine embedded (on vLLM specserve drafts chains)"
LOOKUP_NEEDS_EMBEDDED = "a promptLookup branch needs runtime.engine embedded (on vLLM a drafter drafts alone)"
EMBEDDED_ONLY = {"draftTree": TREE_NEEDS_EMBEDDED, "promptLookup": LOOKUP_NEEDS_EMBEDDED}


def _embedded_only_rules(field: str, off: str, message: str) -> list[dict]:
    """The stable revision's and a candidate's speculator `field` is `off` (false, 0) unless its engine is embedded."""
    stable, candidate = f"self.speculator.{field}", f"{_CANDIDATE}.speculator.{field}"
    return [
        cel(f"!has(self.speculator) || !has({stable}) || {stable} == {off} || {_embedded('self.runtime')}",
            message, f".speculator.{field}"),
        cel(f"!has(self.rollout) || !has({candidate}) || {candidate} == {off} || "
            f"(has({_CANDIDATE}.runtime) && has({_CANDIDATE}.runtime.engine) ? "
            f"{_CANDIDATE}.runtime.engine == 'embedded' : {_embedded('self.runtime')})",
            message, f".rollout.candidate.speculator.{field}"),
    ]


class SpeculativeServingSpec(Model):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": _embedded_only_rules("draftTree", "false", TREE_NEEDS_EMBEDDED)
            + _embedded_only_rules("promptLookup", "0", LOOKUP_NEEDS_EMBEDDED)
            + [cel("!has(self.speculationHealth) || !has(self.speculationHealth.fallback) || "
                   "self.speculationHealth.fallback.speculator != self.speculator", FALLBACK_DIFFERS,
                   ".speculationHealth.fallback.speculator")]
        }
    )
    profile: str = Field(min_length=1, description="a ServingProfile that selects this namespace")
    model: ModelRef
    speculator: Speculator = Speculator()
    runtime: RuntimeSpec = RuntimeSpec()
    replicas: Replicas = Replicas()
    autoscaling: Autoscaling = Autoscaling()
    traffic: Traffic = Traffic()
    rollout: Rollout | None = None
    speculation_health: SpeculationHealth = SpeculationHealth()

    @model_validator(mode="after")
    def _embedded_only_on_the_embedded_engine(self):
        if self.runtime.engine != "embedded":
            for field in self.speculator.embedded_only():
                raise ValueError(f"speculator.{field}: {EMBEDDED_ONLY[field]}")
        candidate = self.rollout.candidate if self.rollout else None
        if candidate and ((candidate.runtime.engine if candidate.runtime else None) or self.runtime.engine) != "embedded":
            for field in candidate.speculator.embedded_only():
                raise ValueError(f"rollout.candidate.speculator.{field}: {EMBEDDED_ONLY[field]}")
        fallback = self.speculation_health.fallback
        if fallback and fallback.speculator == self.speculator:
            raise ValueError(f"speculationHealth.fallback.speculator: {FALLBACK_DIFFERS}")
        return self
