"""Capacity model: a revision's predicted latencies as a function of its load. Pure.

Form. With c = requests in flight per ready replica, three lines
    p99 inter-token latency (c) = itl0 + itl_slope * c      p99 time to first token (c) = ttft0 + ttft_slope * c
    mean time in the system per generated token (c) = s0 + s1 * c
fitted by least squares over the revision's recent measurement windows (the autoscaler keeps the
last OBSERVATIONS in status, so a restart keeps the fit; it leaves out saturated windows, whose
requests spent more than a tenth of their time queued beyond the engine's batch: those measure
the backlog, not the replica, and a backlog of hundreds per replica would drag the lines long
after it is served, until its windows age out) together with a prior: points from a
performance table (the operator's SPECSERVE_CAPACITY_PRIORS, a scenario's `performance` curves),
each weighted as one window. A drafter's points are read at its latest acceptance length (rescaled), so a
window measured before its acceptance fell does not overstate the replica. The p99 lines are what
the SLO is checked against; the mean line is
the service time with which the autoscaler predicts c from an arrival rate (Little's law needs a
mean: sizing the queue on the p99 over-predicts c, and more so the busier the replica). When the
points do not spread over load (all at one concurrency), the slope cannot be estimated and the
model assumes the replica's token throughput is fixed: latencies proportional to load, and the
mean time in the system proportional to c + 1 (the request and those it finds; Little's law then
gives the processor-sharing queue's u / (1 - u)), the conservative case of a one-sequence-at-a-time
engine. Confidence: the p99 predictions are raised by 2 residual standard deviations and a
relative margin of 0.1 + 0.4 / sqrt(1 + n) for n measured windows (0.5 with only the prior, 0.2 at
15 windows), so decisions on little evidence keep more headroom. Batch: an engine decodes at most
so many requests at once (vLLM's max_num_seqs) and queues the rest, a wait that grows without
bound as the load nears the batch and that no line through the measured points foresees; where the
prior's table says how many (its maxConcurrency, else its highest concurrency), the model carries it.
"""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

OBSERVATIONS = 30  # measured windows kept per revision
MIN_SPREAD = 0.25  # in-flight requests per replica: less spread than this cannot estimate a slope


@dataclass(frozen=True)
class Point:
    in_flight_per_replica: float
    p99_inter_token_latency_ms: float
    p99_time_to_first_token_ms: float | None = None
    ms_per_token: float | None = None  # mean time in the system per generated token (measure.Window.ms_per_token)
    acceptance_length: float | None = None  # the speculative acceptance it was measured at; None: not drafting


@dataclass(frozen=True)
class Line:
    intercept: float
    slope: float
    residual: float  # standard deviation of the residuals

    def at(self, x: float) -> float:
        return self.intercept + self.slope * x


def fit_line(xs: Sequence[float], ys: Sequence[float], zero_at: float = 0.0) -> Line:
    """Least squares; without spread in x, the fixed-throughput line through the mean that is 0 at
    x = `zero_at`."""
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    if max(xs) - min(xs) < MIN_SPREAD or sxx == 0:
        slope = mean_y / max(mean_x - zero_at, 1e-9)
        intercept = -slope * zero_at
    else:
        slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx)  # latency never falls with load
        intercept = mean_y - slope * mean_x
    residuals = [y - (intercept + slope * x) for x, y in zip(xs, ys)]
    residual = math.sqrt(sum(r * r for r in residuals) / max(n - 2, 1)) if n > 2 else 0.0
    return Line(intercept, slope, residual)


@dataclass(frozen=True)
class Prior:
    """What a performance table says of a method before anything is measured: its points, and the
    engine's batch (the most requests a replica decodes at once; more wait), when the table knows it."""

    points: Sequence[Point] = ()
    batch: float | None = None

    def measured_at(self, acceptance_length: float | None) -> "Prior":
        """The table's points, labelled with the acceptance length it measured them at (None: it says none)."""
        return Prior(tuple(replace(p, acceptance_length=acceptance_length) for p in self.points), self.batch)

    def step_gaps(self, tokens_per_step: Callable[[Point], float]) -> "Prior":
        """The table's inter-token latencies as the gaps between a request's verify steps: vLLM and the runtime
        observe one gap per step and request, and a step that yields n tokens comes n times its time per token
        after the last. Measured windows carry that gap; a prior left per token would under-predict a drafter's
        p99 inter-token latency n-fold until the windows outweigh it."""
        return Prior(tuple(replace(p, p99_inter_token_latency_ms=p.p99_inter_token_latency_ms * tokens_per_step(p))
                           for p in self.points), self.batch)


@dataclass(frozen=True)
class Capacity:
    itl: Line
    ttft: Line | None
    service: Line  # mean ms in the system per generated token: Little's law's service time, no margin
    measured: int  # windows behind the fit (the prior's points not counted)
    batch: float | None = None  # Prior.batch: past it requests queue, which the lines do not model

    @property
    def margin(self) -> float:
        return 0.1 + 0.4 / math.sqrt(1 + self.measured)

    def p99_inter_token_latency_ms(self, in_flight_per_replica: float) -> float:
        return (self.itl.at(in_flight_per_replica) + 2 * self.itl.residual) * (1 + self.margin)

    def p99_time_to_first_token_ms(self, in_flight_per_replica: float) -> float | None:
        if self.ttft is None:
            return None
        return (self.ttft.at(in_flight_per_replica) + 2 * self.ttft.residual) * (1 + self.margin)


def rescaled(point: Point, acceptance_length: float | None) -> Point:
    """The point as if measured at `acceptance_length`. A speculative step costs what the load and the draft
    length make it cost, however much of the draft is accepted, and yields acceptance-length tokens on average,
    so the time per generated token scales as 1 / acceptance length: a window from before the drafter's
    acceptance fell would otherwise overstate the replica's capacity for as long as it is kept. (The p99
    inter-token latency is not rescaled: vLLM observes it per step, one step per emission of tokens, and a
    prior is converted to that gap (Prior.step_gaps).)"""
    if acceptance_length is None or point.acceptance_length is None or point.ms_per_token is None:
        return point
    return replace(point, ms_per_token=point.ms_per_token * point.acceptance_length / acceptance_length,
                   acceptance_length=acceptance_length)


def fit(measured: Sequence[Point], prior: Prior = Prior(), acceptance_length: float | None = None) -> Capacity | None:
    """The model from measured points and the prior's, their times per token at `acceptance_length` (the
    revision's latest; None leaves them as measured); None when there are no points."""
    points = [rescaled(p, acceptance_length) for p in list(prior.points) + list(measured)]
    if not points:
        return None
    itl = fit_line([p.in_flight_per_replica for p in points], [p.p99_inter_token_latency_ms for p in points])
    with_ttft = [p for p in points if p.p99_time_to_first_token_ms is not None]
    ttft = None
    if with_ttft:
        ttft = fit_line([p.in_flight_per_replica for p in with_ttft], [p.p99_time_to_first_token_ms for p in with_ttft])
    timed = [p for p in points if p.ms_per_token is not None]
    service = itl  # without a mean, the p99 stands in for it: more time per request, more in flight (conservative)
    if timed:
        # At fixed throughput a request's time in the system is the service of itself and the c it
        # finds (processor sharing: T = (c + 1) / mu), so that line is 0 at c = -1, not at 0.
        service = fit_line([p.in_flight_per_replica for p in timed], [p.ms_per_token for p in timed], zero_at=-1.0)
    return Capacity(itl, ttft, service, len(measured), prior.batch)
