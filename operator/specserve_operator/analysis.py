"""Canary analysis: one interval of measurements of the stable and the candidate -> Pass, Fail or Inconclusive.

Pure: no I/O, no clock. The operator, `specserve canary` and the simulator all call `analyse`.

Gates, each with its numbers and a one-line reason:
- data      either window has no data (Window.missing), or the candidate generated fewer than
            MIN_GENERATED_TOKENS in the window: every gate is Inconclusive.
- errorRate          candidate error rate <= analysis.maxErrorRate.
- acceptanceLength   candidate acceptance length >= analysis.minAcceptanceLength; unset, a candidate that
                     speculates must reach api.DEFAULT_MIN_ACCEPTANCE_LENGTH (a drafter whose drafts are
                     next to never accepted makes every step dearer).
- p99LatencyRatio    candidate p99 inter-token latency / stable's <= analysis.maxP99LatencyRatio.
- tokensPerDollarGain  candidate tokens/$ / stable's >= analysis.minTokensPerDollarGain.
- sloInterTokenLatency, sloTimeToFirstToken  candidate p99s within the SLO (when set).
The comparative gates have defaults (api.Analysis: at most 5% fewer tokens per dollar, load-normalised, so
no slower per token on average; a p99 inter-token latency at most 3x the stable's, a tail guard loose enough
for speculation's bursts), so a rollout that names no gate still never promotes a measurably worse candidate;
a user loosens or tightens a gate by setting it.

Matched load. Speculative decoding's gains shrink as concurrency rises, so a lightly loaded
candidate would look fast only because it is lightly loaded: the comparative gates
(p99LatencyRatio, tokensPerDollarGain) count only when the two revisions were offered the same
load per ready replica, and are Inconclusive otherwise (acceptance length, error rate and the SLO
still count). What is offered depends on how requests arrive:
- Open loop (users, a load balancer splitting one stream of requests): the offered load is the
  arrival rate per replica. Requests in flight are its outcome: at the same arrival rate the
  faster revision holds fewer (Little's law: in flight = arrival rate x time in the system), so
  matching on them would hold back exactly the candidates that are better.
- Closed loop (a fixed number of clients, each sending its next request when its answer comes,
  as `specserve canary` drives the runtimes): the offered load is the requests in flight, and
  the faster revision completes more of them.
So the load is matched when either the arrival rates or the requests in flight per replica agree:
within LOAD_TOLERANCE of the larger, or within the counting noise of the window's arrivals
(POISSON_SIGMAS standard deviations, for the few requests of a light window).

Tokens per dollar, load-normalised. Both revisions run on the profile's accelerators at the same
price per replica, so tokens per dollar compare as tokens/s per replica; but at the same arrival
rate both revisions serve the same tokens/s (all that arrives), and a faster revision's gain is
that each replica holds its requests for less time, which the autoscaler turns into fewer
replicas. So what is compared is the tokens/s a replica earns per request it holds: its tokens/s
over its requests in flight, the inverse of the mean time a request spends in the system per
token it generates (Window.ms_per_token). At the same requests in flight (closed loop) that is
exactly the ratio of tokens per dollar; at the same arrivals it is the ratio of requests a
replica can hold at the same cost. It needs no price.

Verdict: Fail if any gate failed; else Inconclusive if any gate was inconclusive; else Pass.
"""

import math
from dataclasses import dataclass
from typing import Literal

from . import api
from .measure import Window

Verdict = Literal["Pass", "Fail", "Inconclusive"]

MIN_GENERATED_TOKENS = 100  # per revision and window: fewer is too noisy to decide on
LOAD_TOLERANCE = 0.25  # offered load per replica may differ by 25% of the larger
POISSON_SIGMAS = 3.0  # ... or by less than this many standard deviations of the arrivals counted


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


def too_little_evidence(window: Window) -> str | None:
    """Why a window cannot be judged (no data, or fewer than MIN_GENERATED_TOKENS), None when it can."""
    if window.missing:
        return window.missing
    if (window.generated_tokens or 0) < MIN_GENERATED_TOKENS:
        return f"generated {math.floor(window.generated_tokens or 0)} tokens < {MIN_GENERATED_TOKENS}"
    return None


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def _arrivals_per_replica(window: Window) -> tuple[float, float] | None:
    """(arrivals per second per replica, its standard deviation) over the window, counting arrivals as a
    Poisson process does; None when they were not measured."""
    if window.arrived_requests is None or not window.ready_replicas or not window.seconds:
        return None
    scale = window.seconds * window.ready_replicas
    return window.arrived_requests / scale, math.sqrt(max(window.arrived_requests, 1.0)) / scale


def _close(a: float, b: float, noise: float = 0.0) -> bool:
    return abs(a - b) <= max(LOAD_TOLERANCE * max(a, b), POISSON_SIGMAS * noise)


def load_matched(stable: Window, candidate: Window) -> tuple[bool, str]:
    """Whether the revisions were offered the same load per replica (open loop: arrivals; closed loop: requests
    in flight), and the figures that say so."""
    reasons = []
    arrivals = [_arrivals_per_replica(w) for w in (stable, candidate)]
    if None not in arrivals:
        (a, noise_a), (b, noise_b) = arrivals
        text = f"arrivals per replica: stable {a:.3g}/s, candidate {b:.3g}/s"
        if _close(a, b, math.hypot(noise_a, noise_b)):
            return True, text
        reasons.append(text)
    a, b = stable.in_flight_per_replica, candidate.in_flight_per_replica
    if a is not None and b is not None:
        text = f"in flight per replica: stable {a:.2f}, candidate {b:.2f}"
        if _close(a, b):
            return True, text
        reasons.append(text)
    if not reasons:
        return False, "neither arrivals nor requests in flight per replica measured"
    return False, "; ".join(reasons) + f" differ by more than {LOAD_TOLERANCE:.0%}"


def _figure(value: float) -> str:
    """Three significant figures, whole numbers from 1000 up (an SLO of 1500 ms reads 1500ms, not 1.5e+03ms)."""
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def _bound(name: str, value: float | None, limit: float, unit: str, at_least: bool) -> Gate:
    if value is None:
        return Gate(name, "Inconclusive", "not measured", None, limit)
    passed = value >= limit if at_least else value <= limit
    sign = (">=" if passed else "<") if at_least else ("<=" if passed else ">")
    return Gate(name, "Pass" if passed else "Fail", f"{_figure(value)}{unit} {sign} {_figure(limit)}{unit}", value, limit)


def _at_most(name: str, value: float | None, limit: float, unit: str = "") -> Gate:
    return _bound(name, value, limit, unit, at_least=False)


def _at_least(name: str, value: float | None, limit: float, unit: str = "") -> Gate:
    return _bound(name, value, limit, unit, at_least=True)


def _combine(gates: list[Gate]) -> Verdict:
    verdicts = {gate.verdict for gate in gates}
    if "Fail" in verdicts:
        return "Fail"
    return "Inconclusive" if "Inconclusive" in verdicts else "Pass"


def analyse(stable: Window, candidate: Window, analysis: api.Analysis, slo: api.Slo, candidate_method: str) -> Report:
    """One interval's verdict, from the two revisions' windows, the rollout's gates and the candidate's method."""
    latency_ratio = _ratio(candidate.p99_inter_token_latency_ms, stable.p99_inter_token_latency_ms)
    gain = _ratio(stable.ms_per_token, candidate.ms_per_token)  # tokens/s per request held, candidate / stable
    missing = [f"{role}: {problem}" for role, w in (("stable", stable), ("candidate", candidate))
               if (problem := too_little_evidence(w))]
    if missing:
        gates = (Gate("data", "Inconclusive", "; ".join(missing)),)
        return Report("Inconclusive", gates, stable, candidate, latency_ratio, gain)

    gates = [_at_most("errorRate", candidate.error_rate, analysis.max_error_rate)]
    floor = analysis.min_acceptance_length
    if floor is None and candidate_method != "none":
        floor = api.DEFAULT_MIN_ACCEPTANCE_LENGTH
    if floor is not None:
        gates.append(_at_least("acceptanceLength", candidate.acceptance_length, floor))
    matched, load_reason = load_matched(stable, candidate)
    comparative = [_at_most("p99LatencyRatio", latency_ratio, analysis.max_p99_latency_ratio, "x"),
                   _at_least("tokensPerDollarGain", gain, analysis.min_tokens_per_dollar_gain, "x")]
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
