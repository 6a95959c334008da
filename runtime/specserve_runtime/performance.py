"""The performance block: per speculator method, what a replica does at each concurrency. `specserve bench
--emit-performance` measures and writes it, `specserve simulate`'s scenarios read it (docs/simulator.md is the
contract), and the operator reads it as its capacity prior (SPECSERVE_CAPACITY_PRIORS). Torch-free pydantic models:
the operator imports them.
"""

from typing import get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from .config import RuntimeConfig


class Strict(BaseModel):
    """camelCase keys only, and an unknown key is an error naming its path."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=False, extra="forbid")


class CurvePoint(Strict):
    concurrency: float = Field(gt=0)
    tokens_per_second_per_request: float = Field(gt=0)
    ttft_ms: float = Field(ge=0)


class MeasuredCurve(Strict):
    curve: list[CurvePoint] = Field(min_length=1)

    @model_validator(mode="after")
    def _sorted(self):
        for index in range(1, len(self.curve)):
            if self.curve[index].concurrency <= self.curve[index - 1].concurrency:
                raise ValueError(f"curve[{index}].concurrency: {self.curve[index].concurrency:g} must be greater than "
                                 f"the previous row's ({self.curve[index - 1].concurrency:g})")
        return self


class DraftLengthPerformance(MeasuredCurve):
    """The method drafting a fixed numSpeculativeTokens a step: what a draft-length schedule is chosen from."""

    num_speculative_tokens: int = Field(ge=1, le=64)
    acceptance_length: float = Field(1.0, ge=1)


class MethodPerformance(MeasuredCurve):
    acceptance_length: float = Field(1.0, ge=1)
    error_rate: float = Field(0.0, ge=0, le=1)
    max_concurrency: int | None = Field(None, ge=1, description="the engine's batch: more requests wait (default: "
                                                                "the curve's highest concurrency)")
    draft_lengths: list[DraftLengthPerformance] = Field([], description="the method at fixed draft lengths "
                                                                         "(`specserve bench --propose-schedule`)")

    @model_validator(mode="after")
    def _one_row_per_length(self):
        lengths = [row.num_speculative_tokens for row in self.draft_lengths]
        if len(set(lengths)) < len(lengths):
            raise ValueError(f"draftLengths: each numSpeculativeTokens once, got {lengths}")
        return self


class Performance(Strict):
    none: MethodPerformance | None = None
    ngram: MethodPerformance | None = None
    eagle3: MethodPerformance | None = None
    dflash: MethodPerformance | None = None


METHODS: tuple[str, ...] = get_args(RuntimeConfig.model_fields["method"].annotation)


def draft_length_curves(performance: Performance, method: str) -> dict[int, list[CurvePoint]]:
    """The method's curves by fixed draft length, with plain decoding's (method none) as length 0 when measured."""
    table = getattr(performance, method)
    curves = {row.num_speculative_tokens: row.curve for row in table.draft_lengths} if table else {}
    if curves and performance.none is not None:
        curves[0] = performance.none.curve
    return curves
