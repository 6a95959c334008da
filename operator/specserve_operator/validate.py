"""Validation of SpeculativeServings and ServingProfiles: every problem as 'field.path: message'.

A resource is read as the API server reads it: by its camelCase keys only, and strictly ("7" is no integer and
"true" no boolean), so what `specserve render` accepts from a file is what the cluster would accept.
"""

import re
import sys

from pydantic import ValidationError
from specserve_runtime.config import REMOTE_CODE_FLAG, flags_set, local_reference
from specserve_runtime.errors import field_location
from specserve_runtime.launch import DrafterLayoutError, check_vllm_drafter

from . import api
from .render import Profile, Serving

class InputProblems(Exception):
    """Input that cannot be used: one problem per line, each naming its file or field path."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems

    def report(self) -> int:
        """For a command: every problem on stderr, and exit status 2."""
        for problem in self.problems:
            print(problem, file=sys.stderr)
        return 2


_SUBPATH = re.compile(r"^([A-Za-z][\w.\[\]]*): (.*)$")


def field_path(prefix: str, loc: tuple) -> str:
    return prefix + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in field_location(loc))


def pydantic_problems(prefix: str, error: ValidationError) -> list[str]:
    problems = []
    for item in error.errors():
        path, message = field_path(prefix, item["loc"]), item["msg"].removeprefix("Value error, ")
        if item["type"] != "value_error":
            problems.append(f"{path}: {message}")
            continue
        for line in message.split("\n"):  # a validator may name several problems, one a line
            nested = _SUBPATH.match(line)  # a model validator naming a field below it
            problems.append(f"{path}.{nested.group(1)}: {nested.group(2)}" if nested else f"{path}: {line}")
    return problems


# A serving's Services and revisions are named <name>-stable, <name>-<8-digit revision hash>: a Service's name is a
# DNS-1035 label (at most 63 characters), and the name is also a label value (as many).
SERVING_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MAX_SERVING_NAME = 63 - len("-12345678")


def parse_serving(obj: dict) -> tuple[Serving | None, list[str]]:
    meta = obj.get("metadata") or {}
    if not isinstance(meta, dict):
        return None, ["metadata: must be an object"]
    problems = []
    if not meta.get("name"):
        problems.append("metadata.name: required")
    elif not SERVING_NAME.match(meta["name"]) or len(meta["name"]) > MAX_SERVING_NAME:
        problems.append(f"metadata.name: {meta['name']!r} must be lower-case letters, digits and '-', start with a letter, "
                        f"and be at most {MAX_SERVING_NAME} characters: its Services and revisions are named after it")
    try:
        spec = api.SpeculativeServingSpec.model_validate(obj.get("spec") or {}, by_name=False, strict=True)
    except ValidationError as exc:
        return None, problems + pydantic_problems("spec", exc)
    problems += bundled_drafter_problems(spec)
    if problems:
        return None, problems
    return Serving(meta["name"], meta.get("namespace") or "default", meta.get("uid"), spec), []


def speculators(spec: api.SpeculativeServingSpec) -> list[tuple[str, api.Speculator]]:
    """The stable revision's speculator, a rollout candidate's and a fallback's, each with its field path."""
    found = [("spec.speculator", spec.speculator)]
    if spec.rollout:
        found.append(("spec.rollout.candidate.speculator", spec.rollout.candidate.speculator))
    if spec.speculation_health.fallback:
        found.append(("spec.speculationHealth.fallback.speculator", spec.speculation_health.fallback.speculator))
    return found


def runtimes(spec: api.SpeculativeServingSpec) -> list[tuple[str, api.RuntimeSpec | api.RuntimeOverride]]:
    """The stable revision's runtime and a rollout candidate's override of it, each with its field path."""
    found = [("spec.runtime", spec.runtime)]
    if spec.rollout is not None and spec.rollout.candidate.runtime is not None:
        found.append(("spec.rollout.candidate.runtime", spec.rollout.candidate.runtime))
    return found


def bundled_drafter_problems(spec: api.SpeculativeServingSpec) -> list[str]:
    """A bundled:// drafter is a folder the operator can see (the runtime's package data): what vLLM needs of
    it, and its method, are checked before any pod starts. Other references are checked by the runtime."""
    problems = []
    for path, speculator in speculators(spec):
        if speculator.method in ("dflash", "eagle3") and (speculator.draft_model or "").startswith("bundled://"):
            try:
                check_vllm_drafter(local_reference(speculator.draft_model), speculator.method)
            except DrafterLayoutError as exc:
                problems.append(f"{path}.draftModel: {exc}")
    return problems


def parse_profile(obj: dict) -> tuple[Profile | None, list[str]]:
    meta = obj.get("metadata") or {}
    if not isinstance(meta, dict):
        return None, ["metadata: must be an object"]
    name = meta.get("name")
    try:
        spec = api.ServingProfileSpec.model_validate(obj.get("spec") or {}, by_name=False, strict=True)
    except ValidationError as exc:
        return None, pydantic_problems("spec", exc)
    if not name:
        return None, ["metadata.name: required"]
    return Profile(name, spec), []


def selects(selector: api.LabelSelector, labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.match_labels.items()):
        return False
    for requirement in selector.match_expressions:
        present, value = requirement.key in labels, labels.get(requirement.key)
        ok = {
            "In": present and value in requirement.values,
            "NotIn": not present or value not in requirement.values,
            "Exists": present,
            "DoesNotExist": not present,
        }[requirement.operator]
        if not ok:
            return False
    return True


def check_against_profile(serving: Serving, profile: Profile | None, namespace_labels: dict[str, str] | None) -> list[str]:
    """The tenant's request against what the platform team's profile allows."""
    spec = serving.spec
    if profile is None:
        return [f"spec.profile: ServingProfile {spec.profile!r} not found"]
    limits = profile.spec.limits
    problems = []
    if namespace_labels is None:
        problems.append(f"metadata.namespace: namespace {serving.namespace!r} not found")
    elif not selects(profile.spec.namespace_selector, namespace_labels):
        problems.append(f"spec.profile: ServingProfile {profile.name!r} does not select namespace {serving.namespace!r}")
    for path, speculator in speculators(spec):
        if speculator.method not in limits.allowed_methods:
            problems.append(
                f"{path}.method: method {speculator.method} is not allowed by ServingProfile {profile.name!r} "
                f"(allowed: {', '.join(limits.allowed_methods)})"
            )
    if limits.max_num_speculative_tokens is not None:
        problems += speculative_tokens_problems(spec, profile)
    for path, runtime in runtimes(spec):
        if runtime.image is not None and not api.image_allowed(runtime.image, limits.allowed_images):
            allowed = ", ".join(limits.allowed_images) or "none besides the engines' defaults"
            problems.append(f"{path}.image: image {runtime.image!r} is not allowed by ServingProfile {profile.name!r} "
                            f"(limits.allowedImages: {allowed})")
    if not limits.allow_trust_remote_code:
        problems += remote_code_problems(spec, profile)
    if spec.replicas.max > limits.max_replicas:
        problems.append(
            f"spec.replicas.max: {spec.replicas.max} exceeds ServingProfile {profile.name!r} limits.maxReplicas "
            f"({limits.max_replicas})"
        )
    cost = spec.replicas.min * profile.spec.accelerator.count * profile.spec.accelerator.price_per_hour_usd
    if limits.max_hourly_cost_usd is not None and cost > limits.max_hourly_cost_usd:
        problems.append(
            f"spec.replicas.min: {spec.replicas.min} replicas cost ${cost:.2f}/h, above ServingProfile "
            f"{profile.name!r} limits.maxHourlyCostUSD (${limits.max_hourly_cost_usd:.2f}/h)"
        )
    return problems


def remote_code_problems(spec: api.SpeculativeServingSpec, profile: Profile) -> list[str]:
    """Engine arguments that would run the model repository's own code, which the profile has not allowed."""
    return [f"{path}.args[{index}]: {arg!r} runs the Python that the model's repository ships, which ServingProfile "
            f"{profile.name!r} does not allow (limits.allowTrustRemoteCode)"
            for path, runtime in runtimes(spec) for index, arg, _ in flags_set(runtime.args, (REMOTE_CODE_FLAG,))]


def speculative_tokens_problems(spec: api.SpeculativeServingSpec, profile: Profile) -> list[str]:
    """Every revision's drafts a step within the profile's limits.maxNumSpeculativeTokens; named, not left to the
    drafter's default, which the operator cannot see (an hf:// or pvc:// drafter)."""
    limit = profile.spec.limits.max_num_speculative_tokens
    problems = []
    for path, speculator in speculators(spec):
        if speculator.method == "none":
            continue
        if speculator.num_speculative_tokens is None:
            problems.append(f"{path}.numSpeculativeTokens: required, ServingProfile {profile.name!r} limits drafts "
                            f"a step to {limit} (limits.maxNumSpeculativeTokens)")
        counts = [("numSpeculativeTokens", speculator.num_speculative_tokens)] + [
            (f"numSpeculativeTokensPerBatchSize[{i}].numSpeculativeTokens", entry.num_speculative_tokens)
            for i, entry in enumerate(speculator.num_speculative_tokens_per_batch_size or [])]
        problems += [f"{path}.{name}: {count} exceeds ServingProfile {profile.name!r} limits.maxNumSpeculativeTokens "
                     f"({limit})" for name, count in counts if count is not None and count > limit]
    return problems
