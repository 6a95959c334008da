"""The simulated fleet of one serving: its pods, their requests (event-driven: arrivals, prefills, decodes,
starts), what Prometheus would have recorded of them, and the cost (simulate.py's docstring has the model).
"""

import heapq
import math
import random
from collections import deque

from specserve_runtime.config import RuntimeConfig
from specserve_runtime.performance import MethodPerformance

from ..measure import Pricing, Target, Window
from .fleet_model import SERVING, Arrival, Bin, Pod, Request, RevisionModel, p99, speculator_model, weighted_p99
from .scenario import Scenario

NOISE_SIGMA = 0.05  # lognormal sigma of the measured p99s


# ---- the fleet ----------------------------------------------------------------------------------

ARRIVE, PREFILLED, DECODED, READY, NODE_BACK = range(5)


class Fleet:
    """The simulated pods of one serving, their requests, and what Prometheus would have recorded."""

    def __init__(self, scenario: Scenario, requests: list[Arrival], models: dict[str, RevisionModel], seed: int):
        self.scenario, self.models = scenario, models
        self.performance = scenario.performance  # as drift faults leave it
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
                if pod.model.acceptance_length:
                    b.decoded += tokens
                    b.steps += tokens / pod.model.acceptance_length
            t0 = edge

    def drift(self, method: str, performance: MethodPerformance, t: float) -> None:
        """From `t` the revisions of `method` perform as `performance` says (a drift fault): their pods too, and
        revisions created later."""
        self.performance = self.performance.model_copy(update={method: performance})
        models = {m.hash: speculator_model(m.hash, method, list(m.schedule), self.performance, m.engine, m.drafts)
                  for m in self.models.values() if m.method == method}
        self.models.update(models)
        for pod in self.live:
            if pod.model.hash in models:
                self.account(pod, t)
                pod.model = models[pod.model.hash]
                self.reschedule(pod, t)

    def add_revision(self, revision: str, config: RuntimeConfig) -> None:
        """A revision the scenario does not name (the operator made it: a draft-length schedule), from its runtime
        configuration."""
        if revision not in self.models:
            self.models[revision] = speculator_model(revision, config.method, config.num_speculative_tokens_per_batch_size,
                                                     self.performance, config.engine, config.num_speculative_tokens)

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
                total.decoded += b.decoded
                total.steps += b.steps
                for speed, tokens in b.itl.items():
                    total.itl[speed] = total.itl.get(speed, 0.0) + tokens
                total.ttfts += b.ttfts
                total.finished += b.finished
                total.errors += b.errors
                total.arrivals += b.arrivals
                total.in_system += b.in_system
                total.waiting += b.waiting
        return total

    def window(self, revision: str, seconds: float, now: float, missing: str | None = None,
               itl_objective_ms: float | None = None, ttft_objective_ms: float | None = None) -> Window:
        """One revision over the last `seconds` (whole seconds, as Prometheus' range selectors),
        as measure.PrometheusSource would return it (the operator prices it); its share within the SLO
        is the product of its tokens' and its first tokens' shares within the objectives given."""
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
        itl, ttft = weighted_p99(b.itl), p99(b.ttfts)
        return Window(
            revision=revision,
            seconds=float(seconds),
            ready_replicas=ready,
            tokens_per_second=b.tokens / seconds,
            generated_tokens=b.tokens,
            p99_inter_token_latency_ms=None if itl is None else itl * self.measurement_noise(),
            p99_time_to_first_token_ms=None if ttft is None else 1000 * ttft * self.measurement_noise(),
            within_slo=within_objectives(b, itl_objective_ms, ttft_objective_ms),
            acceptance_length=b.decoded / b.steps if b.steps else None,
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

    def cost_usd(self, start: float = 0.0) -> float:
        """Billed from `start` to the end: each pod from its creation until it is removed (or the end)."""
        hourly = self.pricing.replica_hourly_usd
        seconds = sum(max(0.0, (p.removed if p.removed is not None else self.duration) - max(p.created, start))
                      for p in self.pods)
        return seconds * hourly / 3600

    def generated_tokens(self, start: float = 0.0) -> float:
        return self.gather(list(self.bins), start, self.nbins).tokens

    def failed_requests(self) -> int:
        return sum(b.errors for row in self.bins.values() for b in row if b is not None) + sum(self.rejected)


def within_objectives(b: Bin, itl_objective_ms: float | None, ttft_objective_ms: float | None) -> float | None:
    """measure.within_slo from the simulated requests themselves: the share of the tokens generated within the
    ITL objective times the share of first tokens within the TTFT objective; None when neither is judged."""
    shares = []
    if itl_objective_ms is not None and b.itl:
        shares.append(sum(tokens for speed, tokens in b.itl.items() if 1000.0 / speed <= itl_objective_ms) / sum(b.itl.values()))
    if ttft_objective_ms is not None and b.ttfts:
        shares.append(sum(1 for ttft in b.ttfts if 1000 * ttft <= ttft_objective_ms) / len(b.ttfts))
    return math.prod(shares) if shares else None
