"""Canary analysis: one interval of measurements of the stable and the candidate -> Pass, Fail or Inconclusive.

Pure: no I/O, no clock. The operator, `specserve canary` and the simulator all call `analyse`.

Gates, each with its numbers and a one-line reason:
- data      either window has no data (Window.missing), or the candidate generated fewer than
            MIN_GENERATED_TOKENS in the window: every gate is Inconclusive.
- errorRate          candidate error rate <= analysis.maxErrorRate.
- acceptanceLength   candidate acceptance length >= analysis.minAcceptanceLength (when set).
- p99LatencyRatio    candidate p99 inter-token latency / stable's <= analysis.maxP99LatencyRatio.
- tokensPerDollarGain  candidate tokens/$ / stable's >= analysis.minTokensPerDollarGain.
- sloInterTokenLatency, sloTimeToFirstToken  candidate p99s within the SLO (when set).

Matched load. Speculative decoding's gains shrink as concurrency rises, so a lightly loaded
candidate would look fast only because it is lightly loaded. The two comparative gates
(p99LatencyRatio, tokensPerDollarGain) are valid only when the requests in flight per ready
replica of the two revisions differ by at most LOAD_TOLERANCE (relative to the larger); else
they are Inconclusive. Acceptance length, error rate and the SLO still count.

Tokens per dollar. Both revisions run on the profile's accelerators at the same price per
replica, so the ratio of their tokens per dollar is the ratio of their tokens/s per ready
replica; that is what is compared (it needs no price, and is exact when there is one).

Verdict: Fail if any gate failed; else Inconclusive if any gate was inconclusive; else Pass.
"""

import math
from dataclasses import dataclass
from typing import Literal

from . import api
from .measure import Window

Verdict = Literal["Pass", "Fail", "Inconclusive"]

MIN_GENERATED_TOKENS = 100  # per revision and window: fewer is too noisy to decide on
LOAD_TOLERANCE = 0.25  # in-flight requests per replica may differ by 25% of the larger


@dataclass(frozen=True)
class Gate:
    name: str
    verdict: Verdict
    reason: str
    value: float | None = None
    threshold: float | None = None


@dataclass(frozen=True)
class Report:
    verdict: Verdict
    gates: tuple[Gate, ...]
    stable: Window
    candidate: Window
    latency_ratio: float | None = None
    tokens_per_dollar_gain: float | None = None

    @property
    def reasons(self) -> list[str]:
        return [f"{gate.name}: {gate.verdict} ({gate.reason})" for gate in self.gates]


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def _per_replica(window: Window) -> float | None:
    return _ratio(window.tokens_per_second, window.ready_replicas)


def load_matched(stable: Window, candidate: Window) -> tuple[bool, str]:
    a, b = stable.in_flight_per_replica, candidate.in_flight_per_replica
    if a is None or b is None:
        return False, "in-flight requests per replica unknown"
    larger = max(a, b)
    difference = 0.0 if larger == 0 else abs(a - b) / larger
    text = f"in flight per replica: stable {a:.2f}, candidate {b:.2f}"
    if difference > LOAD_TOLERANCE:
        return False, f"{text} differ by {difference:.0%} > {LOAD_TOLERANCE:.0%}"
    return True, text


def _at_most(name: str, value: float | None, limit: float, unit: str = "") -> Gate:
    if value is None:
        return Gate(name, "Inconclusive", "not measured", None, limit)
    verdict: Verdict = "Pass" if value <= limit else "Fail"
    return Gate(name, verdict, f"{value:.3g}{unit} {'<=' if verdict == 'Pass' else '>'} {limit:.3g}{unit}", value, limit)


def _at_least(name: str, value: float | None, limit: float, unit: str = "") -> Gate:
    if value is None:
        return Gate(name, "Inconclusive", "not measured", None, limit)
    verdict: Verdict = "Pass" if value >= limit else "Fail"
    return Gate(name, verdict, f"{value:.3g}{unit} {'>=' if verdict == 'Pass' else '<'} {limit:.3g}{unit}", value, limit)


def _combine(gates: list[Gate]) -> Verdict:
    verdicts = {gate.verdict for gate in gates}
    if "Fail" in verdicts:
        return "Fail"
    return "Inconclusive" if "Inconclusive" in verdicts else "Pass"


def analyse(stable: Window, candidate: Window, analysis: api.Analysis, slo: api.Slo) -> Report:
    """One interval's verdict, from the two revisions' windows and the rollout's gates."""
    latency_ratio = _ratio(candidate.p99_inter_token_latency_ms, stable.p99_inter_token_latency_ms)
    gain = _ratio(_per_replica(candidate), _per_replica(stable))
    missing = [f"{role}: {w.missing}" for role, w in (("stable", stable), ("candidate", candidate)) if w.missing]
    if not missing:
        few = [f"{role} generated {math.floor(w.generated_tokens or 0)} tokens < {MIN_GENERATED_TOKENS}"
               for role, w in (("stable", stable), ("candidate", candidate))
               if (w.generated_tokens or 0) < MIN_GENERATED_TOKENS]
        missing = few
    if missing:
        gates = (Gate("data", "Inconclusive", "; ".join(missing)),)
        return Report("Inconclusive", gates, stable, candidate, latency_ratio, gain)

    gates = [_at_most("errorRate", candidate.error_rate, analysis.max_error_rate)]
    if analysis.min_acceptance_length is not None:
        gates.append(_at_least("acceptanceLength", candidate.acceptance_length, analysis.min_acceptance_length))
    matched, load_reason = load_matched(stable, candidate)
    comparative = []
    if analysis.max_p99_latency_ratio is not None:
        comparative.append(_at_most("p99LatencyRatio", latency_ratio, analysis.max_p99_latency_ratio, "x"))
    if analysis.min_tokens_per_dollar_gain is not None:
        comparative.append(_at_least("tokensPerDollarGain", gain, analysis.min_tokens_per_dollar_gain, "x"))
    for gate in comparative:
        if matched:
            gates.append(Gate(gate.name, gate.verdict, f"{gate.reason}; {load_reason}", gate.value, gate.threshold))
        else:
            gates.append(Gate(gate.name, "Inconclusive", f"load not matched: {load_reason}", gate.value, gate.threshold))
    if slo.p99_inter_token_latency_ms is not None:
        gates.append(_at_most("sloInterTokenLatency", candidate.p99_inter_token_latency_ms, slo.p99_inter_token_latency_ms, "ms"))
    if slo.p99_time_to_first_token_ms is not None:
        gates.append(_at_most("sloTimeToFirstToken", candidate.p99_time_to_first_token_ms, slo.p99_time_to_first_token_ms, "ms"))
    return Report(_combine(gates), tuple(gates), stable, candidate, latency_ratio, gain)
