"""The operator's capacity prior (SPECSERVE_CAPACITY_PRIORS, the chart's capacityPriors): a performance block, the
same a scenario carries (specserve_runtime.performance), as the autoscaler's prior per speculator method and, where
it measured fixed draft lengths, what draft-length schedules are proposed from (schedule.py)."""

from pathlib import Path

from pydantic import ValidationError
from specserve_runtime.config import read_yaml
from specserve_runtime.performance import METHODS, Performance

from .autoscale import prior_points
from .capacity import Prior
from .validate import InputProblems, pydantic_problems


def capacity_priors(performance: Performance) -> dict[str, Prior]:
    """The autoscaler's capacity prior per method (render.Settings.capacity_priors) from performance tables, at
    the acceptance length a drafter's table states (the capacity model rescales it to what the revision accepts)."""
    return {method: prior_points([row.model_dump(by_alias=True) for row in table.curve], table.max_concurrency)
            .measured_at(stated_acceptance(method, table))
            for method in METHODS if (table := getattr(performance, method)) is not None}


def stated_acceptance(method: str, table) -> float | None:
    """The acceptance length a drafter's table was measured at; None for plain decoding, or where the table does
    not say (its default, 1, is no measurement)."""
    return table.acceptance_length if method != "none" and "acceptance_length" in table.model_fields_set else None


def load_performance(path: Path) -> Performance:
    """The operator's SPECSERVE_CAPACITY_PRIORS: a YAML `performance` block, as in a scenario.
    A file that cannot be used is an error naming it and the problem (the operator does not start)."""
    try:
        performance = Performance.model_validate(read_yaml(path))
    except ValidationError as exc:  # a subclass of ValueError: first
        raise InputProblems([f"{path}: {p.removeprefix('.')}" for p in pydantic_problems("", exc)]) from exc
    except ValueError as exc:
        raise InputProblems([str(exc)]) from exc
    return performance
