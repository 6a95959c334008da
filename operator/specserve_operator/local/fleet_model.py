"""The simulated fleet's parts: a revision's performance curve, the requests and their Poisson arrivals, the
replicas, and the per-second bins of what they did (simulate.py's docstring has the model).
"""

import datetime
import math
import random
from collections import deque
from dataclasses import dataclass

from specserve_runtime.adaptive import EXPLORE_BUDGET
from specserve_runtime.config import BatchSizeRange, scheduled_tokens
from specserve_runtime.draft_schedule import linear, propose, scheduled_curve
from specserve_runtime.performance import MethodPerformance, Performance, draft_length_curves

from .scenario import Scenario, truncated_normal

EPOCH = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)  # simulated time 0
SERVING, NAMESPACE = "simulated", "simulation"  # the simulated SpeculativeServing


def at(seconds: float) -> datetime.datetime:
    return EPOCH + datetime.timedelta(seconds=seconds)


# ---- performance of one revision ---------------------------------------------------------------


class Curve:
    """tokensPerSecondPerRequest and ttftMs against concurrency: linear, clamped at the ends."""

    def __init__(self, performance: MethodPerformance):
        self.xs = [row.concurrency for row in performance.curve]
        self.tps = [row.tokens_per_second_per_request for row in performance.curve]
        self.ttfts = [row.ttft_ms for row in performance.curve]
        self.max_running = performance.max_concurrency or max(1, math.floor(self.xs[-1]))  # more requests wait
        self._rates: dict[int, float] = {}

    def speed(self, concurrency: float) -> float:
        """Tokens per second of each decoding request at this concurrency."""
        return linear(self.xs, self.tps, concurrency)

    def rate(self, running: int) -> float:
        """speed(running), cached: the simulation asks at whole numbers only."""
        value = self._rates.get(running)
        if value is None:
            value = self._rates[running] = self.speed(running)
        return value

    def ttft_ms(self, running: float) -> float:
        return linear(self.xs, self.ttfts, running)

    def itl_ms(self, concurrency: float) -> float:
        return 1000.0 / self.speed(concurrency)


@dataclass(frozen=True)
class RevisionModel:
    hash: str
    method: str
    curve: Curve
    acceptance_length: float | None
    error_rate: float
    schedule: tuple[BatchSizeRange, ...] = ()  # drafts by batch size (numSpeculativeTokensPerBatchSize)
    engine: str = "vllm"  # the revision's runtime.engine
    drafts: int | None = None  # numSpeculativeTokens, where the revision sets it


def drafts_adaptively(engine: str, method: str, schedule: list[BatchSizeRange] | None) -> bool:
    """Whether a revision's pods choose their draft length each step: the embedded engine does, from its measured
    acceptance and step costs (the runtime's adaptive.py), unless a batch-size schedule sets it; vLLM drafts what it
    is configured to."""
    return engine == "embedded" and method != "none" and not schedule


def speculator_model(revision: str, method: str, schedule: list[BatchSizeRange] | None, performance: Performance,
                     engine: str = "vllm", drafts: int | None = None) -> RevisionModel:
    """A revision of `method` on `engine`: its performance table's curve; or, drafting by a batch-size schedule, at
    each batch size the curve of the draft length the schedule gives it there (the method's draftLengths; 0: method
    none's); or, drafting adaptively (drafts_adaptively), the schedule the engine's measurements converge to: at each
    batch size the best of plain decoding, the revision's own length (`drafts`, the table's curve) and the measured
    shorter ones, less what exploring the others costs (EXPLORE_BUDGET). The acceptance length is that of the length
    drafted at batch size 1 (the method's own where that is none: the engine's exploring steps measure it)."""
    table = getattr(performance, method)
    adaptive = drafts_adaptively(engine, method, schedule) and performance.none is not None
    if not schedule and not adaptive:
        return RevisionModel(revision, method, Curve(table), None if method == "none" else table.acceptance_length,
                             table.error_rate, engine=engine, drafts=drafts)
    tables = {row.num_speculative_tokens: row for row in table.draft_lengths}
    curves = draft_length_curves(performance, method)
    if adaptive:
        curves = {k: curve for k, curve in curves.items() if drafts is None or k <= drafts}
        own = drafts if drafts is not None else max(curves, default=0) + 1
        curves.update({own: table.curve, 0: performance.none.curve})
        tables[own] = table
        schedule = propose(curves)
    try:
        rows = scheduled_curve(curves, schedule)
    except ValueError as exc:
        raise ValueError(f"performance.{method}.draftLengths: revision {revision}: {exc}") from None
    if adaptive:
        rows = [row.model_copy(update={"tokens_per_second_per_request": row.tokens_per_second_per_request
                                       * (1 - EXPLORE_BUDGET)}) for row in rows]
    at_one = scheduled_tokens(schedule, 1)
    acceptance = tables[at_one].acceptance_length if at_one else table.acceptance_length
    scheduled = table.model_copy(update={"curve": rows, "draft_lengths": []})
    return RevisionModel(revision, method, Curve(scheduled), acceptance, table.error_rate,
                         () if adaptive else tuple(schedule), engine, drafts)


# ---- requests and replicas ------------------------------------------------------------------------


@dataclass(frozen=True)
class Arrival:
    t: float
    prompt_factor: float  # prompt tokens / the mean: scales the prefill time
    output: int
    u_route: float
    u_error: float


def arrivals(scenario: Scenario, seed: int) -> list[Arrival]:
    """Non-homogeneous Poisson arrivals by thinning; the same seed gives the same requests."""
    rng = random.Random(seed)
    load_ = scenario.load
    peak = load_.peak(scenario.duration_seconds)
    found: list[Arrival] = []
    if peak <= 0:
        return found
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= scenario.duration_seconds:
            return found
        if rng.random() * peak < load_.rate(t):
            prompt = truncated_normal(rng, load_.prompt_tokens)
            output = truncated_normal(rng, load_.output_tokens)
            found.append(Arrival(t, prompt / load_.prompt_tokens.mean, output, rng.random(), rng.random()))


class Request:
    __slots__ = ("arrival", "dead", "fails", "output", "pod", "prompt_factor")

    def __init__(self, arrival: Arrival, fails: bool):
        self.arrival, self.output, self.prompt_factor = arrival.t, arrival.output, arrival.prompt_factor
        self.fails = fails
        self.pod: Pod | None = None
        self.dead = False  # its replica was lost


class Pod:
    __slots__ = (
        "created",
        "decoding",
        "drain_started",
        "draining",
        "gone",
        "id",
        "model",
        "prefilling",
        "rate",
        "ready",
        "removed",
        "running",
        "served",
        "t_last",
        "version",
        "waiting",
    )

    def __init__(self, pod_id: int, model: RevisionModel, created: float):
        self.id, self.model, self.created = pod_id, model, created
        self.removed: float | None = None
        self.drain_started: float | None = None
        self.ready = self.draining = self.gone = False
        self.running = 0  # admitted: prefilling or decoding
        self.prefilling: dict[int, Request] = {}
        self.waiting: deque[Request] = deque()  # FIFO beyond the engine's batch
        self.decoding: list[tuple[float, int, Request]] = []  # heap: (`served` when it ends, seq, request)
        self.served = 0.0  # tokens each decoding request has received since the pod started (processor sharing)
        self.t_last = created
        self.rate = 0.0
        self.version = 0  # invalidates scheduled completions when the rate changes

    @property
    def in_system(self) -> int:
        return self.running + len(self.waiting)


class Bin:
    """One revision over one second of simulated time."""

    __slots__ = ("arrivals", "decoded", "errors", "finished", "in_system", "itl", "steps", "tokens", "ttfts", "waiting")

    def __init__(self):
        self.tokens = 0.0
        self.decoded = self.steps = 0.0  # tokens of verify steps, and the steps (a speculating revision's acceptance)
        self.itl: dict[float, float] = {}  # tokens/s per request -> tokens generated at that speed
        self.ttfts: list[float] = []  # seconds
        self.finished = self.errors = self.arrivals = 0
        self.in_system = 0.0  # integral of requests in the system (request-seconds)
        self.waiting = 0.0  # the part of it queued beyond the batch


def weighted_p99(weights: dict[float, float]) -> float | None:
    """p99 inter-token latency (ms) of tokens generated at the given speeds, weighted by count."""
    total = sum(weights.values())
    if total <= 0:
        return None
    rank, seen = 0.99 * total, 0.0
    for speed in sorted(weights, reverse=True):  # fastest first: ascending latency
        seen += weights[speed]
        if seen >= rank - 1e-9:
            return 1000.0 / speed
    return 1000.0 / min(weights)


def p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]
