"""Simpler autoscalers on the same requests, for comparison: a fleet sized for the peak, KubeAI's requests in
flight, and the HorizontalPodAutoscaler on requests per second.
"""

import math

from .. import api, autoscale
from ..replicas import replica_budget
from .fleet import Fleet
from .fleet_model import Curve, RevisionModel
from .scenario import Scenario

KUBEAI_SCALE_DOWN_DELAY = 30.0  # seconds a lower in-flight recommendation must hold (KubeAI's scaleDownDelaySeconds)
HPA_TOLERANCE = 0.1  # the HPA leaves the count alone within 10% of the target
HPA_PERIOD = 15.0  # the HPA's rate-limit period: up max(4 pods, 100%), down 100% per period
HPA_SCALE_DOWN_WINDOW = 300.0  # the HPA's default scale-down stabilisation


def little_concurrency(curve: Curve, per_replica_rps: float, output_tokens: float) -> float | None:
    """Requests in flight per replica at an arrival rate, by Little's law on the curve
    (c = rate x (TTFT(c) + (output - 1) / speed(c))); None when the rate exceeds what the batch serves."""
    def excess(c: float) -> float:
        return per_replica_rps * (curve.ttft_ms(c) / 1000 + (output_tokens - 1) / curve.speed(c)) - c

    top = float(curve.max_running)
    if per_replica_rps <= 0:
        return 0.0
    if excess(top) > 0:
        return None
    low, high = 0.0, top
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if excess(middle) > 0 else (low, middle)
    return high


def meets_slo(curve: Curve, c: float, slo: api.Slo) -> bool:
    if slo.p99_inter_token_latency_ms is not None and curve.itl_ms(c) > slo.p99_inter_token_latency_ms:
        return False
    return slo.p99_time_to_first_token_ms is None or curve.ttft_ms(c) <= slo.p99_time_to_first_token_ms


def target_concurrency(curve: Curve, slo: api.Slo) -> float:
    """The highest concurrency (up to the engine's batch) at which the curve still meets the SLO."""
    best = curve.xs[0]
    steps = 2000
    for i in range(steps + 1):
        c = curve.xs[0] + (curve.max_running - curve.xs[0]) * i / steps
        if meets_slo(curve, c, slo):
            best = c
    return best


class Baseline:
    """A simpler autoscaler on the same fleet and requests: stable revision only, same bounds."""

    name = ""

    def __init__(self, scenario: Scenario, model: RevisionModel, slo: api.Slo):
        self.scenario, self.model, self.slo = scenario, model, slo
        self.bounds = autoscale.limits(scenario.serving, scenario.profile, canary=False)
        self.output = scenario.load.output_tokens.mean
        # the highest concurrency meeting the SLO, with the operator's own headroom (autoscale.HEADROOM)
        self.target = max(1.0, target_concurrency(model.curve, slo) / autoscale.HEADROOM)

    def clamp(self, wanted: int) -> tuple[int, bool]:
        bounds = self.bounds
        limited = wanted > bounds.high and bounds.budget_cap is not None and bounds.high == bounds.budget_cap
        return min(max(wanted, self.bounds.low), self.bounds.high), limited

    def initial(self) -> int:
        return replica_budget(self.scenario.serving, self.scenario.profile)

    def tick(self, fleet: Fleet, now_s: float, current: int) -> tuple[int, bool]:
        raise NotImplementedError


class StaticPeak(Baseline):
    """Provisioned for the peak: the fewest replicas at which the curve meets the SLO at the
    scenario's peak rate x autoscale.HEADROOM (Little's law, exact curve, no confidence margin)."""

    name = "staticPeak"

    def __init__(self, scenario, model, slo):
        super().__init__(scenario, model, slo)
        peak = scenario.load.peak(scenario.duration_seconds) * autoscale.HEADROOM
        self.count, self.limited = self.clamp(self.bounds.high + 1)
        for n in range(max(self.bounds.low, 1), self.bounds.high + 1):
            c = little_concurrency(model.curve, peak / n, self.output)
            if c is not None and meets_slo(model.curve, c, slo):
                self.count, self.limited = n, False
                break

    def initial(self) -> int:
        return self.count

    def tick(self, fleet, now_s, current):
        return self.count, self.limited


class InFlight(Baseline):
    """KubeAI's: ceil(requests in flight / target per replica), the target being the highest
    concurrency at which the curve meets the SLO; a lower count must hold KUBEAI_SCALE_DOWN_DELAY."""

    name = "inFlight"

    def __init__(self, scenario, model, slo):
        super().__init__(scenario, model, slo)
        self.history: list[tuple[float, int]] = []

    def tick(self, fleet, now_s, current):
        w = fleet.window(self.model.hash, self.scenario.tick_seconds, now_s)
        if w.missing is not None:
            return current, False
        wanted = math.ceil(w.in_flight_per_replica * w.ready_replicas / self.target - 1e-9)
        self.history = [(t, n) for t, n in self.history if now_s - t < KUBEAI_SCALE_DOWN_DELAY] + [(now_s, wanted)]
        if wanted < current:
            wanted = min(max(n for _, n in self.history), current)
        return self.clamp(wanted)


class HpaRequestRate(Baseline):
    """The HorizontalPodAutoscaler on requests per second per replica with its default behaviour:
    10% tolerance; up at once, by at most max(4 pods, 100%) per 15 s; down to the highest
    recommendation of the last 300 s, by at most 100% per 15 s. Target: the rate per replica at
    which the curve serves the SLO's concurrency (Little's law)."""

    name = "hpaRequestRate"

    def __init__(self, scenario, model, slo):
        super().__init__(scenario, model, slo)
        c = self.target
        self.rps_target = c / (model.curve.ttft_ms(c) / 1000 + (self.output - 1) / model.curve.speed(c))
        self.recommendations: list[tuple[float, int]] = []
        self.counts: list[tuple[float, int]] = []

    def tick(self, fleet, now_s, current):
        self.counts = [(t, n) for t, n in self.counts if now_s - t <= HPA_PERIOD] + [(now_s, current)]
        seconds, ready = max(1, round(self.scenario.tick_seconds)), fleet.ready_count(self.model.hash)
        if not ready:
            return current, False
        rps = fleet.gather([self.model.hash], now_s - seconds, now_s).arrivals / seconds  # requests received
        ratio = rps / (self.rps_target * ready)
        wanted = current if abs(ratio - 1) <= HPA_TOLERANCE else math.ceil(ratio * ready - 1e-9)
        self.recommendations = [(t, n) for t, n in self.recommendations if now_s - t < HPA_SCALE_DOWN_WINDOW]
        self.recommendations.append((now_s, wanted))
        if wanted < current:
            wanted = min(max(n for _, n in self.recommendations), current)
        base = self.counts[0][1]  # the count at the start of the rate-limit period
        wanted = min(wanted, max(base + 4, 2 * base))
        return self.clamp(wanted)


BASELINES = (StaticPeak, InFlight, HpaRequestRate)
