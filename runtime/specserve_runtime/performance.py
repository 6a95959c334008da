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


class MethodPerformance(Strict):
    acceptance_length: float = Field(1.0, ge=1)
    error_rate: float = Field(0.0, ge=0, le=1)
    curve: list[CurvePoint] = Field(min_length=1)
    max_concurrency: int | None = Field(None, ge=1, description="the engine's batch: more requests wait (default: "
                                                                "the curve's highest concurrency)")

    @model_validator(mode="after")
    def _sorted(self):
        for index in range(1, len(self.curve)):
            if self.curve[index].concurrency <= self.curve[index - 1].concurrency:
                raise ValueError(f"curve[{index}].concurrency: {self.curve[index].concurrency:g} must be greater than "
                                 f"the previous row's ({self.curve[index - 1].concurrency:g})")
        return self


class Performance(Strict):
    none: MethodPerformance | None = None
    ngram: MethodPerformance | None = None
    eagle3: MethodPerformance | None = None
    dflash: MethodPerformance | None = None


METHODS: tuple[str, ...] = get_args(RuntimeConfig.model_fields["method"].annotation)
