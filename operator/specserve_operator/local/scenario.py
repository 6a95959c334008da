"""The scenario file of `specserve simulate`: typed models and loading (docs/simulator.md is the contract).

Every model forbids unknown keys, so a misspelt key is an error naming its path. `profile` and
`serving` are validated by the CRD's own models (api/), and the serving is checked against the
profile as the operator checks it (validate.check_against_profile), so a scenario the operator
would mark Invalid is refused before anything is simulated.
"""

from itertools import pairwise
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from specserve_runtime.config import read_yaml
from specserve_runtime.performance import MethodPerformance, Performance, Strict

from .. import api
from ..render import Profile, Serving
from ..validate import InputProblems, check_against_profile, pydantic_problems, speculators


class ScenarioError(InputProblems):
    """A scenario (or a capacity prior file) that cannot be used."""


class RatePoint(Strict):
    at_seconds: float = Field(ge=0)
    requests_per_second: float = Field(ge=0)


class Tokens(Strict):
    """Tokens per request: a normal distribution truncated at 1 (a plain number: stddev 0)."""

    mean: float = Field(ge=1)
    stddev: float = Field(0.0, ge=0)


class Load(Strict):
    requests_per_second: list[RatePoint] = Field(min_length=1)
    prompt_tokens: Tokens
    output_tokens: Tokens

    @field_validator("prompt_tokens", "output_tokens", mode="before")
    @classmethod
    def _number(cls, value):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return {"mean": value, "stddev": 0}
        return value

    @model_validator(mode="after")
    def _ordered(self):
        points = self.requests_per_second
        for index in range(1, len(points)):
            if points[index].at_seconds <= points[index - 1].at_seconds:
                raise ValueError(f"requestsPerSecond[{index}].atSeconds: {points[index].at_seconds:g} must be greater "
                                 f"than the previous point's ({points[index - 1].at_seconds:g})")
        return self

    def rate(self, t: float) -> float:
        """Requests per second at time t: linear between the points, held before the first and after the last."""
        points = self.requests_per_second
        if t <= points[0].at_seconds:
            return points[0].requests_per_second
        for before, after in pairwise(points):
            if t < after.at_seconds:
                share = (t - before.at_seconds) / (after.at_seconds - before.at_seconds)
                return before.requests_per_second + share * (after.requests_per_second - before.requests_per_second)
        return points[-1].requests_per_second

    def peak(self, duration: float) -> float:
        """The highest rate within [0, duration] (piecewise linear: at a point or at an end)."""
        times = [0.0, duration] + [p.at_seconds for p in self.requests_per_second if p.at_seconds <= duration]
        return max(self.rate(t) for t in times)


FaultKind = Literal["prometheusOutage", "operatorRestart", "nodeLoss", "drift"]


class Fault(Strict):
    """prometheusOutage, operatorRestart, nodeLoss: for duration_seconds. drift: the traffic moves and `method`
    comes to perform as `performance` says (its acceptance length and curve): at at_seconds, or over
    ramp_seconds from there (a new domain's share growing), and so to the end."""

    at_seconds: float = Field(ge=0)
    kind: FaultKind
    duration_seconds: float = Field(0.0, ge=0)
    method: api.Method | None = None
    performance: MethodPerformance | None = None
    ramp_seconds: float = Field(0.0, ge=0)

    @model_validator(mode="after")
    def _drift_names_what_drifts(self):
        drift = self.kind == "drift"
        for name in ("method", "performance"):
            if drift and getattr(self, name) is None:
                raise ValueError(f"{name}: required by a drift")
            if not drift and getattr(self, name) is not None:
                raise ValueError(f"{name}: only a drift takes it")
        if self.ramp_seconds and not drift:
            raise ValueError("rampSeconds: only a drift takes it")
        if self.ramp_seconds and self.performance.draft_lengths:
            raise ValueError("performance.draftLengths: a ramped drift interpolates acceptanceLength, errorRate and "
                             "curve only")
        return self

    def active(self, t: float) -> bool:
        return self.at_seconds <= t < self.at_seconds + self.duration_seconds

    def drifted(self, before: MethodPerformance, t: float) -> MethodPerformance:
        """What the drifting method performs at `t` >= at_seconds: `before` moved linearly (acceptance, error rate and
        each concurrency's tokens per second and time to first token) to `performance` over the ramp."""
        share = min((t - self.at_seconds) / self.ramp_seconds, 1.0) if self.ramp_seconds else 1.0
        if share >= 1.0:
            return self.performance

        def between(a: float, b: float) -> float:
            return a + share * (b - a)

        after = self.performance
        curve = [row.model_copy(update={
            "tokens_per_second_per_request": between(row.tokens_per_second_per_request, end.tokens_per_second_per_request),
            "ttft_ms": between(row.ttft_ms, end.ttft_ms)}) for row, end in zip(before.curve, after.curve)]
        return after.model_copy(update={"acceptance_length": between(before.acceptance_length, after.acceptance_length),
                                        "error_rate": between(before.error_rate, after.error_rate), "curve": curve})


class ScenarioProfile(api.ServingProfileSpec):
    # The simulated serving lives in the simulator's own namespace, so a selector would select nothing of use.
    namespace_selector: api.LabelSelector = api.LabelSelector()


class Scenario(Strict):
    duration_seconds: float = Field(gt=0)
    seed: int = 0
    tick_seconds: float = Field(15.0, gt=0)
    startup_seconds: float = Field(120.0, ge=0)
    profile: ScenarioProfile
    serving: api.SpeculativeServingSpec
    load: Load
    performance: Performance
    faults: list[Fault] = []
    routing: Literal["random", "leastLoaded"] = "random"

    def methods_in_use(self) -> list[tuple[str, str]]:
        """(field path, method) of the serving's speculators: its own, a rollout candidate's, a fallback's."""
        return [(path.replace("spec.", "serving.", 1) + ".method", speculator.method) for path, speculator in speculators(self.serving)]

    def performance_of(self, method: str) -> MethodPerformance:
        return getattr(self.performance, method)


def problems(document: object) -> tuple[Scenario | None, list[str]]:
    """The validated scenario, or every problem as 'path: message'."""
    if not isinstance(document, dict):
        return None, [f"(top level): expected a mapping of keys, got {type(document).__name__}"]
    try:
        scenario = Scenario.model_validate(document, by_name=False, strict=True)  # as the operator reads its serving
    except ValidationError as exc:
        return None, [p.removeprefix(".") for p in pydantic_problems("", exc)]
    found = []
    for path, method in scenario.methods_in_use():
        if scenario.performance_of(method) is None:
            found.append(f"performance.{method}: required: {path} is {method}, and the simulator needs its "
                         f"acceptanceLength, errorRate and curve")
    for index, fault in enumerate(scenario.faults):
        if not fault.ramp_seconds:
            continue
        before = scenario.performance_of(fault.method)
        if before is None:
            found.append(f"performance.{fault.method}: required: faults[{index}] ramps its drift from it")
        elif [r.concurrency for r in before.curve] != [r.concurrency for r in fault.performance.curve]:
            found.append(f"faults[{index}].performance.curve: a ramped drift needs the concurrencies of "
                         f"performance.{fault.method}.curve ({', '.join(f'{r.concurrency:g}' for r in before.curve)})")
    # As the operator would check it against its profile (the namespace is the simulator's own).
    anywhere = scenario.profile.model_copy(update={"namespace_selector": api.LabelSelector()})
    profile = Profile(scenario.serving.profile, anywhere)
    for problem in check_against_profile(Serving("simulated", "default", None, scenario.serving), profile, {}):
        found.append("serving." + problem.removeprefix("spec.") if problem.startswith("spec.") else problem)
    return (None, found) if found else (scenario, [])


def load(path: Path) -> Scenario:
    """Read and validate a scenario file; ScenarioError names the file and every problem."""
    try:
        document = read_yaml(path)
    except ValueError as exc:
        raise ScenarioError([str(exc)]) from exc
    scenario, found = problems(document)
    if found:
        raise ScenarioError([f"{path}: {problem}" for problem in found])
    return scenario


def truncated_normal(rng, tokens: Tokens) -> int:
    """One draw, rounded to whole tokens, redrawn until >= 1 (a normal truncated at 1)."""
    if tokens.stddev == 0:
        return max(1, round(tokens.mean))
    for _ in range(100):
        value = round(rng.gauss(tokens.mean, tokens.stddev))
        if value >= 1:
            return value
    return 1

