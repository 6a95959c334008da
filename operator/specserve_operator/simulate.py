"""`specserve simulate`: one SpeculativeServing fleet in simulated time, decided by the operator's own code.

    scenario (load, performance curves, faults)
      -> Fleet: Poisson arrivals, replicas with continuous batching, start-up, drain     (simulated)
      -> SimulatedPrometheus: measure.Window per revision, as Prometheus would give it   (simulated)
      -> reconcile.reconcile on a SimulatedCluster, every tickSeconds                    (the operator's code)
      -> the Deployments it applies: their replica counts are the Fleet's               (simulated)

Nothing is decided here: the operator's own reconcile (measurement windows, analysis, the rollout
state machine, the autoscaler, rendering, deletions) runs on an in-memory cluster whose
Deployments are the simulated fleet. Its only memory between ticks is the serving's status, as in
the real operator, so an `operatorRestart` fault just stops the ticks while it is down, and a
`prometheusOutage` makes the measurement source fail as an unreachable Prometheus does.

The fleet model (docs/simulator.md says the same for users):
- Arrivals: non-homogeneous Poisson (thinning), drawn once per seed; the run and the baselines
  see the same requests (arrival time, prompt and output tokens, routing and error draws).
- Routing (one Service over all ready pods of all revisions, as ReplicaRatio does): `random`
  picks a ready pod uniformly (kube-proxy); `leastLoaded` the one with fewest requests in it.
- A replica runs at most the curve's highest concurrency at once (the engine's batch); more wait
  in its FIFO queue. An admitted request's first token comes after ttftMs(running) x its prompt
  tokens / the mean prompt tokens; the rest decode at tokensPerSecondPerRequest(running), both
  linearly interpolated and clamped at the curve's ends, re-evaluated at every change (event-driven
  processor sharing: exact, no time step). TTFT = queueing + that prefill time.
- Errors: each request draws once; with probability errorRate of the method that serves it, it
  fails at its first token (no tokens). A request that finds no ready replica is rejected.
- New replicas are billed from creation and ready `startupSeconds` later. A removed replica
  leaves the Service at once and drains: it finishes its requests (billed until it is empty).
- Measurement: per revision and second, tokens by inter-token latency (one observation per token,
  as vLLM's histogram), TTFTs, finished and failed requests, and the integral of requests in the
  system. A window is any whole number of seconds of that; its p99s are multiplied by a lognormal
  measurement noise (sigma NOISE_SIGMA, seeded), the rest is exact.
"""

import datetime
import heapq
import json
import math
import random
import statistics
import sys
import time
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from . import api, autoscale
from .measure import MeasurementError, Pricing, Target, Window
from .reconcile import effective_slo, reconcile
from .render import Profile, Settings, candidate_hash, replica_budget, revision_hash
from .rollout import Event, timestamp
from .scenario import MethodPerformance, Scenario, ScenarioError, capacity_priors, load, truncated_normal

NOISE_SIGMA = 0.05  # lognormal sigma of the measured p99s
EPOCH = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)  # simulated time 0
SERVING, NAMESPACE = "simulated", "simulation"  # the simulated SpeculativeServing
KUBEAI_SCALE_DOWN_DELAY = 30.0  # seconds a lower in-flight recommendation must hold (KubeAI's scaleDownDelaySeconds)
HPA_TOLERANCE = 0.1  # the HPA leaves the count alone within 10% of the target
HPA_PERIOD = 15.0  # the HPA's rate-limit period: up max(4 pods, 100%), down 100% per period
HPA_SCALE_DOWN_WINDOW = 300.0  # the HPA's default scale-down stabilisation


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

    def _at(self, ys: list[float], x: float) -> float:
        if x <= self.xs[0]:
            return ys[0]
        if x >= self.xs[-1]:
            return ys[-1]
        i = bisect_right(self.xs, x)
        x0, x1 = self.xs[i - 1], self.xs[i]
        return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - x0) / (x1 - x0)

    def speed(self, concurrency: float) -> float:
        """Tokens per second of each decoding request at this concurrency."""
        return self._at(self.tps, concurrency)

    def rate(self, running: int) -> float:
        """speed(running), cached: the simulation asks at whole numbers only."""
        value = self._rates.get(running)
        if value is None:
            value = self._rates[running] = self.speed(running)
        return value

    def ttft_ms(self, running: float) -> float:
        return self._at(self.ttfts, running)

    def itl_ms(self, concurrency: float) -> float:
        return 1000.0 / self.speed(concurrency)


@dataclass(frozen=True)
class RevisionModel:
    hash: str
    method: str
    curve: Curve
    acceptance_length: float | None
    error_rate: float


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

    __slots__ = ("arrivals", "errors", "finished", "in_system", "itl", "tokens", "ttfts", "waiting")

    def __init__(self):
        self.tokens = 0.0
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


# ---- the fleet ----------------------------------------------------------------------------------

ARRIVE, PREFILLED, DECODED, READY, NODE_BACK = range(5)


class Fleet:
    """The simulated pods of one serving, their requests, and what Prometheus would have recorded."""

    def __init__(self, scenario: Scenario, requests: list[Arrival], models: dict[str, RevisionModel], seed: int):
        self.scenario, self.models = scenario, models
        self.duration = scenario.duration_seconds
        self.startup = scenario.startup_seconds
        self.least_loaded = scenario.routing == "leastLoaded"
        accelerator = scenario.profile.accelerator
        self.pricing = Pricing(accelerator.count, accelerator.price_per_hour_usd)
        self.requests = requests
        self.next_arrival = 0
        self.events: list[tuple] = []
        self.seq = 0
        self.now = 0.0
        self.pods: list[Pod] = []  # every pod ever created, in creation order
        self.live: list[Pod] = []  # not gone
        self.ready_pods: list[Pod] = []  # in the Service, in creation order
        self.desired: dict[str, int] = {}
        self.blocked_until = 0.0  # node loss: no pod can be created before this
        self.billed = 0
        self.max_billed = 0
        self.nbins = math.ceil(self.duration) + 2
        self.bins: dict[str, list[Bin | None]] = {}
        self.rejected = [0] * self.nbins
        self.noise = random.Random(seed * 1_000_003 + 17)

    # -- events
    def push(self, t: float, kind: int, a=None, b=None) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, a, b))

    def advance_to(self, t: float) -> None:
        """Process everything that happens before t, then bring every pod's accounting to t."""
        requests, events = self.requests, self.events
        while True:
            next_request = requests[self.next_arrival].t if self.next_arrival < len(requests) else math.inf
            next_event = events[0][0] if events else math.inf
            if min(next_request, next_event) >= t:
                break
            if next_request < next_event:
                self.now = next_request
                self.arrive(requests[self.next_arrival])
                self.next_arrival += 1
                continue
            when, _, kind, a, b = heapq.heappop(events)
            self.now = when
            if kind == DECODED:
                if b == a.version and not a.gone:
                    self.decoded(a, when)
            elif kind == PREFILLED:
                if not a.dead:
                    self.prefilled(a, when)
            elif kind == READY:
                self.make_ready(a, when)
            elif kind == NODE_BACK:
                self.reconcile_pods(when)
        self.now = t
        for pod in self.live:
            self.account(pod, t)

    # -- accounting
    def bin(self, revision: str, t: float) -> Bin:
        row = self.bins.get(revision)
        if row is None:
            row = self.bins[revision] = [None] * self.nbins
        index = min(int(t), self.nbins - 1)
        found = row[index]
        if found is None:
            found = row[index] = Bin()
        return found

    def account(self, pod: Pod, t: float) -> None:
        """Bring a pod's served tokens and the bins up to t (its rate has been constant since t_last)."""
        t0 = pod.t_last
        if t <= t0:
            return
        pod.t_last = t
        in_system, waiting, decoding, rate = pod.in_system, len(pod.waiting), len(pod.decoding), pod.rate
        if decoding:
            pod.served += rate * (t - t0)
        if not in_system:
            return
        revision = pod.model.hash
        while t0 < t:
            edge = min(int(t0) + 1.0, t)
            span = edge - t0
            b = self.bin(revision, t0)
            b.in_system += in_system * span
            b.waiting += waiting * span
            if decoding:
                tokens = rate * span * decoding
                b.tokens += tokens
                b.itl[rate] = b.itl.get(rate, 0.0) + tokens
            t0 = edge

    def reschedule(self, pod: Pod, t: float) -> None:
        pod.rate = pod.model.curve.rate(pod.running) if pod.running else 0.0
        pod.version += 1
        if pod.decoding:
            mark = pod.decoding[0][0]
            self.push(t + max(0.0, (mark - pod.served) / pod.rate), DECODED, pod, pod.version)

    # -- requests
    def arrive(self, arrival: Arrival) -> None:
        t, pods = arrival.t, self.ready_pods
        if not pods:
            self.rejected[min(int(t), self.nbins - 1)] += 1
            return
        if self.least_loaded:
            pod = min(pods, key=lambda p: p.in_system)
        else:
            pod = pods[min(int(arrival.u_route * len(pods)), len(pods) - 1)]
        request = Request(arrival, arrival.u_error < pod.model.error_rate)
        request.pod = pod
        self.account(pod, t)
        self.bin(pod.model.hash, t).arrivals += 1
        if pod.running < pod.model.curve.max_running:
            self.admit(pod, request, t)
            self.reschedule(pod, t)
        else:
            pod.waiting.append(request)

    def admit(self, pod: Pod, request: Request, t: float) -> None:
        pod.running += 1
        pod.prefilling[id(request)] = request
        prefill = pod.model.curve.ttft_ms(pod.running) / 1000.0 * request.prompt_factor
        self.push(t + prefill, PREFILLED, request)

    def admit_waiting(self, pod: Pod, t: float) -> None:
        while pod.waiting and pod.running < pod.model.curve.max_running:
            self.admit(pod, pod.waiting.popleft(), t)

    def prefilled(self, request: Request, t: float) -> None:
        pod = request.pod
        self.account(pod, t)
        del pod.prefilling[id(request)]
        b = self.bin(pod.model.hash, t)
        if request.fails:
            pod.running -= 1
            b.finished += 1
            b.errors += 1
        else:
            b.ttfts.append(t - request.arrival)
            b.tokens += 1
            if request.output <= 1:
                pod.running -= 1
                b.finished += 1
            else:
                self.seq += 1
                heapq.heappush(pod.decoding, (pod.served + request.output - 1, self.seq, request))
        self.admit_waiting(pod, t)
        self.reschedule(pod, t)
        self.maybe_gone(pod, t)

    def decoded(self, pod: Pod, t: float) -> None:
        self.account(pod, t)
        b = self.bin(pod.model.hash, t)
        while pod.decoding and pod.decoding[0][0] <= pod.served + 1e-6:
            heapq.heappop(pod.decoding)
            pod.running -= 1
            b.finished += 1
        self.admit_waiting(pod, t)
        self.reschedule(pod, t)
        self.maybe_gone(pod, t)

    # -- pods
    def create(self, revision: str, t: float, ready: bool = False) -> None:
        pod = Pod(len(self.pods), self.models[revision], t)
        self.pods.append(pod)
        self.live.append(pod)
        self.billed += 1
        self.max_billed = max(self.max_billed, self.billed)
        if ready or self.startup == 0:
            self.make_ready(pod, t)
        else:
            self.push(t + self.startup, READY, pod)

    def make_ready(self, pod: Pod, t: float) -> None:
        if pod.gone or pod.draining:
            return
        pod.ready = True
        pod.t_last = t
        self.ready_pods.append(pod)
        self.ready_pods.sort(key=lambda p: p.id)

    def remove(self, pod: Pod, t: float) -> None:
        """Scale-down: out of the Service at once; gone when its requests are done."""
        self.account(pod, t)
        pod.draining, pod.drain_started = True, t
        if pod.ready:
            pod.ready = False
            self.ready_pods.remove(pod)
        self.maybe_gone(pod, t)

    def maybe_gone(self, pod: Pod, t: float) -> None:
        if pod.draining and not pod.gone and pod.in_system == 0:
            self.gone(pod, t)

    def gone(self, pod: Pod, t: float) -> None:
        pod.gone, pod.removed = True, t
        self.live.remove(pod)
        self.billed -= 1

    def lose(self, pod: Pod, t: float) -> None:
        """Node loss: the pod and every request in it are gone (the requests fail)."""
        self.account(pod, t)
        b = self.bin(pod.model.hash, t)
        for request in list(pod.prefilling.values()) + [r for _, _, r in pod.decoding] + list(pod.waiting):
            request.dead = True
            b.finished += 1
            b.errors += 1
        pod.prefilling, pod.decoding, pod.waiting, pod.running = {}, [], deque(), 0
        if pod.ready:
            pod.ready = False
            self.ready_pods.remove(pod)
        pod.draining = True
        self.gone(pod, t)

    def node_loss(self, t: float, seconds: float) -> None:
        """Half the pods (rounded up: every other one by creation, per revision) are lost; the
        Deployments recreate them once `seconds` have passed (a replacement node)."""
        for revision in sorted({p.model.hash for p in self.live}):
            pods = [p for p in self.live if p.model.hash == revision and not p.draining]
            for pod in pods[::2]:
                self.lose(pod, t)
        self.blocked_until = max(self.blocked_until, t + seconds)
        self.push(t + seconds, NODE_BACK)

    def set_desired(self, counts: dict[str, int], t: float) -> None:
        """The Deployments' replica counts (what the operator applies)."""
        self.desired = dict(counts)
        self.reconcile_pods(t)

    def reconcile_pods(self, t: float) -> None:
        """What the ReplicaSet controller does: create missing pods, delete surplus ones (pods not
        yet ready first, newest first; then ready ones with the fewest requests in them)."""
        for revision, wanted in self.desired.items():
            pods = [p for p in self.live if p.model.hash == revision and not p.draining]
            if len(pods) < wanted and t >= self.blocked_until:
                for _ in range(wanted - len(pods)):
                    self.create(revision, t)
            elif len(pods) > wanted:
                order = sorted(pods, key=lambda p: (p.ready, p.in_system if p.ready else 0, -p.id))
                for pod in order[: len(pods) - wanted]:
                    self.remove(pod, t)

    # -- what the operator sees
    def ready_count(self, revision: str) -> int:
        return sum(1 for p in self.ready_pods if p.model.hash == revision)

    def revisions_with_pods(self) -> list[str]:
        return sorted({p.model.hash for p in self.live} | {r for r, n in self.desired.items() if n})

    def span(self, start: float, end: float) -> range:
        b0 = max(0, round(start))
        b1 = max(b0 + 1, round(end))
        return range(b0, min(b1, self.nbins))

    def gather(self, revision_names: list[str], start: float, end: float) -> Bin:
        total = Bin()
        for revision in revision_names:
            row = self.bins.get(revision)
            if row is None:
                continue
            for index in self.span(start, end):
                b = row[index]
                if b is None:
                    continue
                total.tokens += b.tokens
                for speed, tokens in b.itl.items():
                    total.itl[speed] = total.itl.get(speed, 0.0) + tokens
                total.ttfts += b.ttfts
                total.finished += b.finished
                total.errors += b.errors
                total.arrivals += b.arrivals
                total.in_system += b.in_system
                total.waiting += b.waiting
        return total

    def window(self, revision: str, seconds: float, now: float, missing: str | None = None) -> Window:
        """One revision over the last `seconds` (whole seconds, as Prometheus' range selectors),
        as measure.PrometheusSource would return it (the operator prices it)."""
        ready = self.ready_count(revision)
        seconds = max(1, round(seconds))
        target = Target(None, SERVING, revision, ready)
        if missing is not None:
            return Window.no_data(target, seconds, missing)
        if ready <= 0:
            return Window.no_data(target, seconds, "no ready replicas")
        b = self.gather([revision], now - seconds, now)
        if b.tokens == 0 and b.finished == 0:
            return Window.no_data(target, seconds, "no traffic in the window")
        model = self.models[revision]
        itl, ttft = weighted_p99(b.itl), p99(b.ttfts)
        return Window(
            revision=revision,
            seconds=float(seconds),
            ready_replicas=ready,
            tokens_per_second=b.tokens / seconds,
            generated_tokens=b.tokens,
            p99_inter_token_latency_ms=None if itl is None else itl * self.measurement_noise(),
            p99_time_to_first_token_ms=None if ttft is None else 1000 * ttft * self.measurement_noise(),
            acceptance_length=model.acceptance_length,
            finished_requests=float(b.finished),
            arrived_requests=float(b.arrivals),
            error_rate=b.errors / b.finished if b.finished else None,
            in_flight_per_replica=b.in_system / seconds / ready,
            waiting_per_replica=b.waiting / seconds / ready,
            waiting_requests=float(sum(len(pod.waiting) for pod in self.live if pod.model.hash == revision)),
        )

    def measurement_noise(self) -> float:
        return self.noise.lognormvariate(0, NOISE_SIGMA)

    def truth(self, start: float, end: float) -> tuple[float | None, float | None, int, int]:
        """Fleet-wide over [start, end), without measurement noise: p99 ITL ms, p99 TTFT ms, arrivals, rejected."""
        b = self.gather(list(self.bins), start, end)
        ttft = p99(b.ttfts)
        rejected = sum(self.rejected[i] for i in self.span(start, end))
        return weighted_p99(b.itl), None if ttft is None else 1000 * ttft, b.arrivals + rejected, rejected

    def finish(self) -> None:
        self.advance_to(self.duration)

    def cost_usd(self) -> float:
        hourly = self.pricing.replica_hourly_usd
        seconds = sum((p.removed if p.removed is not None else self.duration) - p.created for p in self.pods)
        return seconds * hourly / 3600

    def generated_tokens(self) -> float:
        return sum(b.tokens for row in self.bins.values() for b in row if b is not None)

    def failed_requests(self) -> int:
        return sum(b.errors for row in self.bins.values() for b in row if b is not None) + sum(self.rejected)


# ---- controllers: who decides the replica counts --------------------------------------------------


@dataclass
class TickRecord:
    t: float
    stage: str
    weight: int | None
    desired: dict[str, int]
    ready: dict[str, int]
    hourly_usd: float
    budget_limited: bool = False


class SimulatedCluster:
    """The Kubernetes API as reconcile.reconcile uses it (get, list, apply, delete, patch_status),
    in memory. The Deployments it holds are the fleet's: their spec.replicas are what the fleet
    runs, and their status.readyReplicas is read from the fleet's pods."""

    def __init__(self, fleet: Fleet, scenario: Scenario, spec: api.SpeculativeServingSpec):
        self.fleet = fleet
        self.objects: dict[tuple, dict] = {}
        # The profile may select any namespace: the serving lives in the simulator's own.
        profile = scenario.profile.model_copy(update={"namespace_selector": api.LabelSelector()})
        for obj in (
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
            {"apiVersion": api.API_VERSION, "kind": "ServingProfile", "metadata": {"name": scenario.serving.profile},
             "spec": profile.model_dump(by_alias=True, exclude_none=True, mode="json")},
            {"apiVersion": api.API_VERSION, "kind": "SpeculativeServing",
             "metadata": {"name": SERVING, "namespace": NAMESPACE, "generation": 1},
             "spec": spec.model_dump(by_alias=True, exclude_none=True, mode="json"), "status": {}},
        ):
            self.objects[self._key(obj["apiVersion"], obj["kind"], obj["metadata"].get("namespace"),
                                   obj["metadata"]["name"])] = obj

    @staticmethod
    def _key(api_version, kind, namespace, name) -> tuple:
        return api_version, kind, namespace, name

    def _view(self, obj: dict) -> dict:
        """A copy, as a GET returns it; a Deployment's status is the fleet's."""
        obj = json.loads(json.dumps(obj))
        if obj["kind"] == "Deployment":
            revision = obj["metadata"]["labels"]["specserve.io/revision"]
            obj["status"] = {"replicas": obj["spec"]["replicas"], "readyReplicas": self.fleet.ready_count(revision)}
        return obj

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict | None:
        obj = self.objects.get(self._key(api_version, kind, namespace, name))
        return None if obj is None else self._view(obj)

    def pods(self) -> list[dict]:
        """The fleet's pods as the API lists them: a draining one (scaled down, finishing its
        requests) has a deletionTimestamp; no podIP (the simulated Prometheus measures them)."""
        return [{"apiVersion": "v1", "kind": "Pod",
                 "metadata": {"name": f"{SERVING}-{pod.model.hash}-{pod.id}", "namespace": NAMESPACE,
                              "labels": {"specserve.io/serving": SERVING, "specserve.io/revision": pod.model.hash},
                              **({"deletionTimestamp": timestamp(at(pod.drain_started))} if pod.draining else {})},
                 "status": {"conditions": [{"type": "Ready", "status": str(pod.ready)}]}}
                for pod in self.fleet.live]

    def list(self, api_version: str, kind: str, namespace: str | None, label_selector: str = "") -> list[dict]:
        wanted = dict(term.split("=", 1) for term in label_selector.split(",") if term)
        objects = self.pods() if (api_version, kind) == ("v1", "Pod") else [
            self._view(obj) for (v, k, _, _), obj in self.objects.items() if (v, k) == (api_version, kind)]
        return [obj for obj in objects if namespace in (None, obj["metadata"].get("namespace"))
                and wanted.items() <= (obj["metadata"].get("labels") or {}).items()]

    def apply(self, obj: dict) -> str:
        key = self._key(obj["apiVersion"], obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"])
        current = self.objects.get(key)
        self.objects[key] = json.loads(json.dumps(obj))
        if obj["kind"] == "Deployment":
            self._sync()
        return "created" if current is None else "unchanged" if current == self.objects[key] else "patched"

    def scale(self, api_version: str, kind: str, namespace: str, name: str, replicas: int) -> None:
        self.objects[self._key(api_version, kind, namespace, name)]["spec"]["replicas"] = replicas
        self._sync()

    def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> bool:
        found = self.objects.pop(self._key(api_version, kind, namespace, name), None) is not None
        if kind == "Deployment":
            self._sync()
        return found

    def update_spec(self, spec: api.SpeculativeServingSpec) -> None:
        """`kubectl apply` of a changed spec: a new generation."""
        serving = self.objects[self._key(api.API_VERSION, "SpeculativeServing", NAMESPACE, SERVING)]
        serving["spec"] = spec.model_dump(by_alias=True, exclude_none=True, mode="json")
        serving["metadata"]["generation"] += 1

    def patch_status(self, status: dict) -> None:
        """The serving's status subresource: a JSON round trip, as through the API server."""
        serving = self.objects[self._key(api.API_VERSION, "SpeculativeServing", NAMESPACE, SERVING)]
        serving["status"] = json.loads(json.dumps(status))

    def status(self) -> dict:
        return self.objects[self._key(api.API_VERSION, "SpeculativeServing", NAMESPACE, SERVING)]["status"]

    def _sync(self) -> None:
        """The ReplicaSet controller: the fleet runs what the Deployments say (a deleted one: nothing)."""
        counts = {revision: 0 for revision in self.fleet.revisions_with_pods()}
        for (_, kind, _, _), obj in self.objects.items():
            if kind == "Deployment":
                counts[obj["metadata"]["labels"]["specserve.io/revision"]] = obj["spec"]["replicas"]
        self.fleet.set_desired(counts, self.fleet.now)


class SimulatedPrometheus:
    """measure.PrometheusSource's interface over the fleet's records; during a `prometheusOutage`
    it fails as an unreachable Prometheus does (MeasurementError), so the operator's own handling
    of that (an Event, condition MetricsAvailable, analysis Inconclusive, replicas held) runs."""

    name = "Prometheus"

    def __init__(self, fleet: Fleet):
        self.fleet = fleet
        self.outage = False

    def measure(self, target: Target, seconds: float) -> Window:
        if self.outage:
            raise MeasurementError("Prometheus unreachable (simulated prometheusOutage)")
        return self.fleet.window(target.revision, seconds, self.fleet.now)


class SimulatedPods:
    """measure.ScrapeSource's interface over the fleet: the pods' own /metrics, which a Prometheus outage does not
    reach. As a ScrapeSource, it differences two scrapes: a revision's first scrape is a baseline (no window
    yet), and each later window spans the time since its previous scrape."""

    name = "Pods"

    def __init__(self, fleet: Fleet):
        self.fleet = fleet
        self.previous: dict[str, float] = {}  # revision -> when it was last scraped

    def measure(self, target: Target, seconds: float) -> Window:
        now = self.fleet.now
        last = self.previous.get(target.revision)
        self.previous[target.revision] = now
        if last is None:
            return Window.no_data(target, seconds, "first scrape; a window needs two")
        return self.fleet.window(target.revision, now - last, now)


class Operator:
    """The operator's reconcile loop for the one serving: reconcile.reconcile itself, on the
    simulated cluster, every tick. It keeps no state of its own: everything it knows between ticks
    is the serving's status in the cluster, exactly as in the real operator, so an
    `operatorRestart` fault only has to stop the ticks while the operator is down."""

    def __init__(self, scenario: Scenario, fleet: Fleet):
        """The serving as it ran before the scenario starts: its spec without the rollout, reconciled
        once (its Deployment is the fleet's initial replicas); then the rollout is applied."""
        self.cluster = SimulatedCluster(fleet, scenario, scenario.serving.model_copy(update={"rollout": None}))
        self.source = SimulatedPrometheus(fleet)
        self.pods = SimulatedPods(fleet)  # what the operator measures while Prometheus cannot be asked
        self.settings = Settings(autoscale_interval_seconds=scenario.tick_seconds,
                                 capacity_priors=capacity_priors(scenario.performance),
                                 replica_startup_seconds=scenario.startup_seconds)
        self.tick(0.0, outage=False)
        if scenario.serving.rollout is not None:
            self.cluster.update_spec(scenario.serving)
            self.tick(0.0, outage=False)  # the rollout's first step

    def tick(self, now_s: float, outage: bool) -> tuple[TickRecord, list[Event]]:
        self.source.outage = outage
        body = self.cluster.get(api.API_VERSION, "SpeculativeServing", NAMESPACE, SERVING)
        outcome = reconcile(self.cluster, body, self.settings, self.source, at(now_s), self.pods)
        if outcome.problems:  # scenario.load refuses such a serving before anything runs
            raise ScenarioError(outcome.problems)
        self.cluster.patch_status(outcome.status)
        status = outcome.status
        canary, conditions = status.get("canary") or {}, {c["type"]: c for c in status["conditions"]}
        budget = conditions.get("BudgetLimited", {})
        weight = canary.get("weight") if status["phase"] == "Progressing" else None
        record = TickRecord(now_s, status["phase"], weight, dict(self.cluster.fleet.desired), {}, 0.0,
                            budget.get("status") == "True")
        return record, outcome.events


ROLLOUT_ENDS = {"Promoted": "Promoted", "RolloutAborted": "Aborted"}  # the Event that ends a rollout -> decision


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


# ---- runs ---------------------------------------------------------------------------------------


@dataclass
class Run:
    fleet: Fleet
    ticks: list[TickRecord] = field(default_factory=list)
    decision: str | None = None
    decision_at: float | None = None


def revision_models(scenario: Scenario) -> dict[str, RevisionModel]:
    spec = scenario.serving
    pairs = [(revision_hash(spec.model, spec.speculator, spec.runtime), spec.speculator.method)]
    if spec.rollout is not None:
        pairs.append((candidate_hash(spec), spec.rollout.candidate.speculator.method))
    models = {}
    for revision, method in pairs:
        performance = scenario.performance_of(method)
        models[revision] = RevisionModel(revision, method, Curve(performance),
                                         None if method == "none" else performance.acceptance_length,
                                         performance.error_rate)
    return models


def tick_times(scenario: Scenario) -> list[float]:
    step, times, k = scenario.tick_seconds, [], 1
    while k * step <= scenario.duration_seconds + 1e-9:
        times.append(k * step)
        k += 1
    return times


def simulate(scenario: Scenario, requests: list[Arrival], seed: int, controller=None, on_tick=None) -> Run:
    """One run over the whole duration: the operator (controller None) or a Baseline."""
    models = revision_models(scenario)
    fleet = Fleet(scenario, requests, models, seed)
    spec, profile = scenario.serving, scenario.profile
    stable = revision_hash(spec.model, spec.speculator, spec.runtime)
    start = controller.initial() if controller else replica_budget(spec, profile)
    for _ in range(start):
        fleet.create(stable, 0.0, ready=True)  # the serving has been up before the scenario starts
    fleet.desired = {stable: start}
    run = Run(fleet)
    operator = None
    if controller is None:
        operator = Operator(scenario, fleet)
    losses = sorted((f for f in scenario.faults if f.kind == "nodeLoss"), key=lambda f: f.at_seconds)
    for now_s in tick_times(scenario):
        while losses and losses[0].at_seconds <= now_s:
            fault = losses.pop(0)
            fleet.advance_to(fault.at_seconds)
            fleet.node_loss(fault.at_seconds, fault.duration_seconds)
        fleet.advance_to(now_s)
        if operator is not None:
            if any(f.kind == "operatorRestart" and f.active(now_s) for f in scenario.faults):
                # Down: nothing reconciles. What comes back knows only the serving's status.
                last = run.ticks[-1] if run.ticks else None
                record = TickRecord(now_s, last.stage if last else "Serving", last.weight if last else None,
                                    dict(fleet.desired), {}, 0.0, last.budget_limited if last else False)
            else:
                outage = any(f.kind == "prometheusOutage" and f.active(now_s) for f in scenario.faults)
                record, events = operator.tick(now_s, outage)
                for event in events:
                    if event.reason in ROLLOUT_ENDS and run.decision is None:
                        run.decision, run.decision_at = ROLLOUT_ENDS[event.reason], now_s
        else:
            current = sum(fleet.desired.values())
            wanted, limited = controller.tick(fleet, now_s, current)
            fleet.set_desired({stable: wanted}, now_s)
            record = TickRecord(now_s, "Stable", None, {stable: wanted}, {}, 0.0, limited)
        record.ready = {r: fleet.ready_count(r) for r in fleet.revisions_with_pods()}
        record.hourly_usd = fleet.billed * fleet.pricing.replica_hourly_usd
        run.ticks.append(record)
        if on_tick is not None:
            on_tick(run, record)
    fleet.finish()
    if controller is None and run.decision is None and candidate_hash(spec) not in (None, stable):
        run.decision = "Inconclusive"
    return run


def summary(run: Run, scenario: Scenario) -> dict:
    fleet, slo = run.fleet, effective_slo(scenario.serving, Profile(scenario.serving.profile, scenario.profile))
    met = met_unlimited = unlimited = 0
    for record in run.ticks:
        itl, ttft, _, rejected = fleet.truth(record.t - scenario.tick_seconds, record.t)
        ok = rejected == 0
        if ok and itl is not None and slo.p99_inter_token_latency_ms is not None:
            ok = itl <= slo.p99_inter_token_latency_ms
        if ok and ttft is not None and slo.p99_time_to_first_token_ms is not None:
            ok = ttft <= slo.p99_time_to_first_token_ms
        met += ok
        if not record.budget_limited:
            unlimited += 1
            met_unlimited += ok
    cost, tokens = fleet.cost_usd(), fleet.generated_tokens()
    return {
        "sloAttainment": round(met / len(run.ticks), 4) if run.ticks else 1.0,
        # the ticks whose fleet the budget did not cap: what the autoscaler's choices alone answer for
        "sloAttainmentWithinBudget": round(met_unlimited / unlimited, 4) if unlimited else 1.0,
        "costUSD": round(cost, 4),
        "tokensPerDollar": round(tokens / cost, 1) if cost > 0 else None,
        "maxHourlyCostUSD": round(fleet.max_billed * fleet.pricing.replica_hourly_usd, 4),
        "budgetLimitedSeconds": round(sum(scenario.tick_seconds for r in run.ticks if r.budget_limited), 3),
        "generatedTokens": round(tokens),
        "failedRequests": fleet.failed_requests(),
    }


def run_all(scenario: Scenario, seed: int, on_tick=None) -> tuple[dict, Run]:
    requests = arrivals(scenario, seed)
    main = simulate(scenario, requests, seed, on_tick=on_tick)
    result = summary(main, scenario)
    result["decision"] = main.decision
    result["decisionAtSeconds"] = main.decision_at
    result["seed"] = seed
    models = revision_models(scenario)
    stable = models[revision_hash(scenario.serving.model, scenario.serving.speculator, scenario.serving.runtime)]
    slo = effective_slo(scenario.serving, Profile(scenario.serving.profile, scenario.profile))
    result["baselines"] = {cls.name: summary(simulate(scenario, requests, seed, cls(scenario, stable, slo)), scenario)
                           for cls in BASELINES}
    return result, main


# ---- output ------------------------------------------------------------------------------------


class Table:
    """One stderr row per simulated minute."""

    def __init__(self, scenario: Scenario, models: dict[str, RevisionModel], out=None):
        self.scenario, self.models, self.out = scenario, models, out or sys.stderr
        self.minute = 0
        methods = [m.method for m in models.values()]
        self.labels = {revision: model.method if methods.count(model.method) == 1 else f"{model.method}@{revision[:4]}"
                       for revision, model in models.items()}
        self.stable = next(iter(models))
        print(f"{'time':>6}  {'replicas ready/desired':<28} {'weight':>6} {'rps':>6} {'p99 ITL':>8} {'p99 TTFT':>9} "
              f"{'$/h':>7}  stage", file=self.out)

    def __call__(self, run: Run, record: TickRecord) -> None:
        minute = int(record.t // 60)
        if minute <= self.minute and record.t < self.scenario.duration_seconds:
            return
        start = self.minute * 60
        self.minute = minute
        itl, ttft, requests, _ = run.fleet.truth(start, record.t)
        replicas = " ".join(f"{self.labels.get(r, r)} {record.ready.get(r, 0)}/{record.desired.get(r, 0)}"
                            for r in sorted(set(record.desired) | set(record.ready), key=lambda r: r != self.stable))
        weight = f"{record.weight}%" if record.weight is not None else "-"
        rps = requests / max(record.t - start, 1e-9)
        print(f"{int(record.t // 60):>3}:{int(record.t % 60):02d}  {replicas:<28} {weight:>6} {rps:>6.2f} "
              f"{_ms(itl):>8} {_ms(ttft):>9} {record.hourly_usd:>7.2f}  {record.stage}", file=self.out)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}ms"


def plot(run: Run, scenario: Scenario, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fleet, slo = run.fleet, effective_slo(scenario.serving, Profile(scenario.serving.profile, scenario.profile))
    times = [r.t for r in run.ticks]
    figure, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    for revision, model in fleet.models.items():
        axes[0].step(times, [r.ready.get(revision, 0) for r in run.ticks], where="post", label=f"{model.method} ready")
        axes[0].step(times, [r.desired.get(revision, 0) for r in run.ticks], where="post", linestyle=":",
                     label=f"{model.method} desired")
    axes[0].set_ylabel("replicas")
    axes[0].legend(loc="upper left", fontsize=8)
    step = scenario.tick_seconds
    truths = [fleet.truth(t - step, t) for t in times]
    axes[1].plot(times, [scenario.load.rate(t) for t in times], label="offered")
    axes[1].plot(times, [truth[2] / step for truth in truths], label="arrived", alpha=0.6)
    axes[1].set_ylabel("requests/s")
    axes[1].legend(loc="upper left", fontsize=8)
    axes[2].plot(times, [truth[0] if truth[0] is not None else float("nan") for truth in truths], label="p99 ITL")
    if slo.p99_inter_token_latency_ms is not None:
        axes[2].axhline(slo.p99_inter_token_latency_ms, color="red", linestyle="--", label="SLO")
    axes[2].set_ylabel("ms")
    axes[2].legend(loc="upper left", fontsize=8)
    axes[3].step(times, [r.hourly_usd for r in run.ticks], where="post", label="hourly cost")
    budget = scenario.profile.limits.max_hourly_cost_usd
    if budget is not None:
        axes[3].axhline(budget, color="red", linestyle="--", label="maxHourlyCostUSD")
    axes[3].set_ylabel("USD/h")
    axes[3].set_xlabel("simulated seconds")
    axes[3].legend(loc="upper left", fontsize=8)
    for record in run.ticks:
        if record.stage == "Progressing":
            for axis in axes:
                axis.axvspan(record.t - step, record.t, color="orange", alpha=0.08, linewidth=0)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def across_seeds(scenario: Scenario, seeds: int, out=None) -> dict:
    """Seeds 1..N of one scenario: one stderr row per seed, and the aggregate docs/benchmarks.md reports."""
    out = out or sys.stderr
    print(f"{'seed':>4} {'SLO met':>8} {'cost $':>8} {'vs static':>9} {'tokens/$':>10} {'vs inFlight':>11} "
          f"{'max $/h':>8}  decision", file=out)
    results = []
    for seed in range(1, seeds + 1):
        result, _ = run_all(scenario, seed)
        baselines = result["baselines"]
        results.append(result)
        decision = f"{result['decision']} at {result['decisionAtSeconds']:g} s" if result["decisionAtSeconds"] else \
            str(result["decision"] or "-")
        print(f"{seed:>4} {result['sloAttainment']:>8.1%} {result['costUSD']:>8.2f} "
              f"{result['costUSD'] / baselines['staticPeak']['costUSD']:>9.2f} {result['tokensPerDollar'] or 0:>10.0f} "
              f"{(result['tokensPerDollar'] or 0) / (baselines['inFlight']['tokensPerDollar'] or 1):>11.2f} "
              f"{result['maxHourlyCostUSD']:>8.2f}  {decision}", file=out, flush=True)

    def median_of(values):
        return round(statistics.median(values), 4)

    decisions = [r["decision"] for r in results]
    times = [r["decisionAtSeconds"] for r in results if r["decisionAtSeconds"] is not None]
    return {
        "seeds": seeds,
        "sloAttainment": {"min": min(r["sloAttainment"] for r in results),
                          "median": median_of([r["sloAttainment"] for r in results])},
        "sloAttainmentWithinBudget": {"min": min(r["sloAttainmentWithinBudget"] for r in results),
                                      "median": median_of([r["sloAttainmentWithinBudget"] for r in results])},
        "budgetLimitedSeconds": {"max": max(r["budgetLimitedSeconds"] for r in results)},
        "costVsStaticPeak": median_of([r["costUSD"] / r["baselines"]["staticPeak"]["costUSD"] for r in results]),
        "tokensPerDollarVsInFlight": median_of([(r["tokensPerDollar"] or 0) / (r["baselines"]["inFlight"]["tokensPerDollar"] or 1)
                                                for r in results]),
        "maxHourlyCostUSD": max(r["maxHourlyCostUSD"] for r in results),
        "decisions": {str(d): decisions.count(d) for d in sorted(set(decisions), key=str)},
        "decisionAtSeconds": {"min": min(times), "max": max(times)} if times else None,
        "baselineSloAttainment": {name: median_of([r["baselines"][name]["sloAttainment"] for r in results])
                                  for name in results[0]["baselines"]},
    }


def cmd_simulate(args) -> int:
    try:
        scenario = load(Path(args.scenario))
    except ScenarioError as exc:
        return exc.report()
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("--plot needs matplotlib: pip install matplotlib", file=sys.stderr)
            return 2
    if args.seeds is not None:
        if args.seeds < 1:
            print(f"--seeds: {args.seeds} must be at least 1", file=sys.stderr)
            return 2
        print(json.dumps(across_seeds(scenario, args.seeds)))
        return 0
    seed = scenario.seed if args.seed is None else args.seed
    started = time.perf_counter()
    table = Table(scenario, revision_models(scenario))
    result, run = run_all(scenario, seed, on_tick=table)
    if args.plot:
        plot(run, scenario, Path(args.plot))
    print(f"simulated {scenario.duration_seconds:g} s in {time.perf_counter() - started:.2f} s", file=sys.stderr)
    if not args.json:
        rows = [("specserve", result)] + list(result["baselines"].items())
        print(f"{'':<16}{'SLO met':>8} {'cost $':>9} {'tokens/$':>11} {'max $/h':>8}")
        for name, row in rows:
            print(f"{name:<16}{row['sloAttainment']:>8.1%} {row['costUSD']:>9.2f} {row['tokensPerDollar'] or 0:>11.0f} "
                  f"{row['maxHourlyCostUSD']:>8.2f}")
        if result["decision"] is not None:
            when = result["decisionAtSeconds"]
            print(f"rollout: {result['decision']}" + (f" at {when:g} s" if when is not None else ""))
    print(json.dumps(result))
    return 0


def add_simulate_command(commands) -> None:
    simulate_ = commands.add_parser("simulate", description=__doc__.split("\n\n")[0],
                                    help="simulate one SpeculativeServing fleet, decided by the operator's own code")
    simulate_.add_argument("--scenario", required=True, help="the scenario YAML (docs/simulator.md)")
    simulate_.add_argument("--json", action="store_true", help="stdout: only the JSON result line")
    simulate_.add_argument("--seed", type=int, help="overrides the scenario's seed")
    simulate_.add_argument("--seeds", type=int, metavar="N",
                           help="run seeds 1..N: a row per seed on stderr, the aggregate as the last stdout line")
    simulate_.add_argument("--plot", metavar="PNG",
                           help="write replicas, load, p99 ITL and hourly cost over time (needs matplotlib)")
    simulate_.set_defaults(run=cmd_simulate)
