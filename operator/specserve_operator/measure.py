"""Measurements: what each revision of a serving did over one analysis window (I/O lives here only).

Two sources produce the same `Window`:
- `PrometheusSource`: the Prometheus HTTP API (`/api/v1/query`) over the vLLM metric names the
  runtime exports, selected by the series labels `namespace`, `serving`, `revision` (the chart's
  PodMonitor maps the pod labels `specserve.io/serving` / `specserve.io/revision` onto them).
- `ScrapeSource`: no Prometheus configured; scrape the ready pods' /metrics directly and
  difference two scrapes of the same pods.

"No data" is a Window with `missing` set to a reason, never zeros: the analysis treats it as
Inconclusive and the autoscaler holds. A source that cannot be asked at all (Prometheus down)
raises MeasurementError instead.

Definitions, the same for both sources (increase = over the window, summed over the pods):
  tokens_per_second      increase(vllm:generation_tokens_total) / window
  p99_*_ms               histogram_quantile(0.99) of the increase of the histogram's buckets
  acceptance_length      1 + increase(accepted tokens) / increase(drafts); None without drafts
  accepted_per_position  increase(accepted at position i) / increase(drafts)
  error_rate             finished with reason abort or error / all finished; None when none finished
  arrived_requests       finished + the change in requests in the system (the running and waiting
                         gauges at the window's ends): what arrived, which exceeds what finished
                         while a queue grows. Prometheus: delta() of the gauges.
  in_flight_per_replica  requests in the system (running + waiting), time-averaged over the
                         window, per ready replica, by Little's law:
                         increase(vllm:e2e_request_latency_seconds_sum) / window / ready replicas
                         (exact for the requests that finished in the window). Not the average of
                         the vllm:num_requests_running/_waiting gauges: those are sampled once per
                         scrape (a handful per window at a 15-30 s interval, two for direct
                         scraping), and a scrape that times out on a busy pod drops a busy sample.
  waiting_per_replica    of those, the requests queued beyond the engine's batch, the same way:
                         increase(vllm:request_queue_time_seconds_sum) / window / ready replicas.
  within_slo             the share of the generated tokens served within the SLO (the target's
                         objectives): histogram_fraction of the inter-token gaps at the p99 ITL
                         objective x that of the first tokens at the p99 TTFT objective. vLLM's
                         histograms do not join a request's gaps to its first token, so the two
                         shares are taken as independent. Goodput is tokens_per_second x it.
`promql(target, seconds)` gives the exact queries PrometheusSource runs; `histogram_quantile` is
PromQL's own, so both sources compute latency quantiles identically, and `histogram_fraction` is its
inverse (Prometheus 2 has none for classic histograms: both sources read the buckets and call it).
Where the two differ: increase() extrapolates each series to the range's ends, by the same factor for
every bucket of a pod, but never below zero, so a bucket that starts the range near zero while it gains
many (a young pod's fastest bucket) grows less than the others, and the quantile reads high within its
bucket (18 ms direct, 22 ms via Prometheus, seen on a pod's first traffic); a scrape difference has no
extrapolation. The comparative gates' tolerances are far wider than that; an SLO met by a few ms is not.
"""

import base64
import http.client
import json
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, replace

from specserve_runtime.metric_names import (ACCEPTED, ACCEPTED_PER_POSITION, DRAFTS, E2E_LATENCY, ERROR_REASONS,
                                            GENERATION_TOKENS, IN_SYSTEM, INTER_TOKEN_LATENCY, KEY_LABEL, QUEUE_TIME,
                                            REQUEST_SUCCESS, TIME_TO_FIRST_TOKEN, WAITING, Key, parse_metrics)


@dataclass(frozen=True)
class Pricing:
    """What one replica costs: from the ServingProfile's accelerator block."""

    accelerators_per_replica: int = 0
    price_per_accelerator_hour_usd: float = 0.0

    @property
    def replica_hourly_usd(self) -> float:
        return self.accelerators_per_replica * self.price_per_accelerator_hour_usd


@dataclass(frozen=True)
class Target:
    """One revision to measure."""

    namespace: str | None  # None or "": any namespace (the local `specserve canary` has none)
    serving: str
    revision: str
    ready_replicas: int
    pod_urls: tuple[str, ...] = ()  # http://IP:PORT of the ready pods (ScrapeSource only)
    itl_objective_ms: float | None = None  # the SLO the window's goodput counts against (None: not judged)
    ttft_objective_ms: float | None = None


@dataclass(frozen=True)
class Window:
    """One revision over one window, summed over its ready replicas.

    in_flight_per_replica is the time-averaged number of requests in the system (running or
    waiting) per ready replica: the load the analysis matches and the autoscaler plans for;
    waiting_per_replica is the part of it queued beyond the engine's batch.
    """

    revision: str
    seconds: float
    ready_replicas: int
    tokens_per_second: float | None = None
    generated_tokens: float | None = None
    p99_inter_token_latency_ms: float | None = None
    p99_time_to_first_token_ms: float | None = None
    acceptance_length: float | None = None  # 1 + accepted / drafts; None: no drafts in the window
    accepted_per_position: tuple[float, ...] = ()  # accepted / drafts at draft position 0, 1, ...
    finished_requests: float | None = None
    arrived_requests: float | None = None  # finished + growth of the requests in the system
    error_rate: float | None = None  # finished with reason abort or error / all finished
    in_flight_per_replica: float | None = None
    waiting_per_replica: float | None = None
    waiting_requests: float | None = None  # queued beyond the batch at the window's end, all replicas: the backlog
    hourly_cost_usd: float | None = None
    tokens_per_dollar: float | None = None
    within_slo: float | None = None  # share of the generated tokens served within the target's SLO objectives
    missing: str | None = None  # set: no data, and why

    @property
    def goodput_per_replica(self) -> float | None:
        """Tokens per second per ready replica served within the SLO (None: no objective, or no data)."""
        if self.within_slo is None or self.tokens_per_second is None or not self.ready_replicas:
            return None
        return self.tokens_per_second * self.within_slo / self.ready_replicas

    @property
    def ms_per_token(self) -> float | None:
        """Mean time a request spends in the system per token it generates (ms), by Little's law on
        the window: requests in flight over the rate they generate tokens at. The service time the
        autoscaler's queue model needs (a p99 is not a mean)."""
        return self._ms_per_token(self.in_flight_per_replica)

    @property
    def decoding_per_replica(self) -> float | None:
        """Requests in the engine's batch per replica: in flight less those queued beyond it."""
        if self.in_flight_per_replica is None:
            return None
        return self.in_flight_per_replica - (self.waiting_per_replica or 0.0)

    @property
    def decoding_ms_per_token(self) -> float | None:
        """Mean time per generated token of the requests in the batch (ms): ms_per_token without the queue's wait."""
        return self._ms_per_token(self.decoding_per_replica)

    def _ms_per_token(self, per_replica: float | None) -> float | None:
        if per_replica is None or not self.tokens_per_second:
            return None
        return 1000 * per_replica * self.ready_replicas / self.tokens_per_second

    @classmethod
    def no_data(cls, target: Target, seconds: float, reason: str) -> "Window":
        return cls(revision=target.revision, seconds=seconds, ready_replicas=target.ready_replicas, missing=reason)

    def priced(self, pricing: Pricing) -> "Window":
        """Hourly cost of the ready replicas and tokens per dollar at that cost."""
        hourly = self.ready_replicas * pricing.replica_hourly_usd
        per_dollar = None
        if self.tokens_per_second is not None and hourly > 0:
            per_dollar = self.tokens_per_second / (hourly / 3600)
        return replace(self, hourly_cost_usd=hourly, tokens_per_dollar=per_dollar)


class MeasurementError(Exception):
    """The source could not be asked at all (Prometheus unreachable, an HTTP error, a bad answer).

    Not "no data": the operator turns it into an Event and a condition. The message names the
    URL (without credentials) and the cause.
    """


def _cumulative(buckets: list[tuple[float, float]]) -> list[list[float]] | None:
    """A classic histogram's (upper bound, cumulative count) pairs as PromQL reads them: sorted, bounds that
    occur twice merged, a count lower than the one below it raised to it (Prometheus' ensureMonotonic).
    None without a +Inf bucket or without a finite one."""
    ordered = sorted(buckets, key=lambda bucket: bucket[0])
    if not ordered or ordered[-1][0] != math.inf:
        return None
    merged: list[list[float]] = []  # [upper bound, cumulative count], one per distinct bound
    for bound, count in ordered:
        if merged and merged[-1][0] == bound:
            merged[-1][1] += count
        else:
            merged.append([bound, count])
    highest = merged[0][1]
    for bucket in merged[1:]:
        highest = max(highest, bucket[1])
        bucket[1] = highest
    return merged if len(merged) >= 2 else None


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The q-quantile of a classic histogram, exactly as PromQL's histogram_quantile computes it
    (Prometheus 2.42, promql/quantile.go `bucketQuantile`); None where Prometheus gives NaN.

    `buckets` are (upper bound `le`, cumulative count), +Inf included, in any order (_cumulative).
    The value is interpolated linearly inside the bucket holding rank q * total, from 0 (or the
    bound below) to its upper bound; in the +Inf bucket it is the highest finite bound, and in a
    first bucket whose upper bound is <= 0 it is that bound.
    """
    if math.isnan(q):
        return None
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    merged = _cumulative(buckets)
    if merged is None or merged[-1][1] == 0:
        return None
    rank = q * merged[-1][1]
    b = next((i for i, (_, count) in enumerate(merged[:-1]) if count >= rank), len(merged) - 1)
    if b == len(merged) - 1:
        return merged[-2][0]
    if b == 0 and merged[0][0] <= 0:
        return merged[0][0]
    start, end, count = 0.0, merged[b][0], merged[b][1]
    if b > 0:
        start = merged[b - 1][0]
        count -= merged[b - 1][1]
        rank -= merged[b - 1][1]
    if count == 0:  # 0/0: q == 0 with an empty first bucket
        return None
    value = start + (end - start) * (rank / count)
    return None if math.isnan(value) else value


def histogram_fraction(upper: float, buckets: list[tuple[float, float]]) -> float | None:
    """The share of a classic histogram's observations at or below `upper`: histogram_quantile's inverse, with
    the same linear interpolation inside a bucket (from 0, or the bound below). Past the highest finite bound it
    is the share at that bound: the +Inf bucket has no width to interpolate in, so what lies beyond counts as
    over. None without observations."""
    merged = _cumulative(buckets)
    if merged is None or merged[-1][1] == 0:
        return None
    total = merged[-1][1]
    lower, below = 0.0, 0.0  # the bucket's lower bound, the observations at or below it
    for bound, count in merged[:-1]:
        if upper < bound:
            if upper <= lower:
                return below / total
            return (below + (count - below) * (upper - lower) / (bound - lower)) / total
        lower, below = bound, count
    return below / total


def within_slo(target: Target, itl_buckets: list[tuple[float, float]],
               ttft_buckets: list[tuple[float, float]]) -> float | None:
    """The share of the tokens served within the target's objectives (Window.within_slo): the product of the
    shares of its inter-token gaps and of its first tokens within them. An objective whose histogram observed
    nothing in the window is not judged; None when none is."""
    shares = [histogram_fraction(objective_ms / 1000, buckets)
              for objective_ms, buckets in ((target.itl_objective_ms, itl_buckets), (target.ttft_objective_ms, ttft_buckets))
              if objective_ms is not None]
    judged = [share for share in shares if share is not None]
    return math.prod(judged) if judged else None


# ----- the pure core: two scrapes of a revision's pods -> Window -----------------------------------


@dataclass(frozen=True)
class Snapshot:
    """One scrape of a revision's pods: each pod's cumulative values, by pod (its URL).

    Pods are kept apart so that a counter reset on one pod is seen even when another pod's
    growth would hide it in the sum.
    """

    pods: dict[str, dict[Key, float]]

    @classmethod
    def from_text(cls, texts: dict[str, str]) -> "Snapshot":
        return cls({pod: parse_metrics(text) for pod, text in texts.items()})


def window_between(before: Snapshot, after: Snapshot, target: Target, seconds: float) -> Window:
    """What `target` did between two scrapes of the same pods taken `seconds` apart, summed over the pods."""
    if target.ready_replicas <= 0:
        return Window.no_data(target, seconds, "no ready replicas")
    if seconds <= 0:
        return Window.no_data(target, seconds, f"empty window ({seconds} s between the scrapes)")
    gone = sorted(before.pods.keys() - after.pods.keys())
    new = sorted(after.pods.keys() - before.pods.keys())
    if gone or new:
        return Window.no_data(target, seconds, f"pods changed between the two scrapes "
                                               f"(gone: {', '.join(gone) or 'none'}; new: {', '.join(new) or 'none'})")
    increase: dict[Key, float] = {}  # per key, summed over the pods (for the gauges: their change)
    for pod, values in after.pods.items():
        previous = before.pods[pod]
        for key in values.keys() | previous.keys():
            change = values.get(key, 0.0) - previous.get(key, 0.0)
            if change < 0 and key[0] not in IN_SYSTEM:  # a gauge may go down; a counter only by a reset
                name, label = key
                series = f'{name}{{{KEY_LABEL[name]}="{label}"}}' if label else name
                reason = f"counter reset on {pod}: {series} went down (the pod restarted)"
                return Window.no_data(target, seconds, reason)
            increase[key] = increase.get(key, 0.0) + change

    def total(name: str) -> float:
        return sum(value for (sample, _), value in increase.items() if sample == name)

    def by_label(name: str) -> dict[str, float]:
        return {label: value for (sample, label), value in increase.items() if sample == name}

    def buckets(histogram: str) -> list[tuple[float, float]]:
        return [(float(le), count) for le, count in by_label(histogram + "_bucket").items()]

    generated = total(GENERATION_TOKENS)
    itl, ttft = buckets(INTER_TOKEN_LATENCY), buckets(TIME_TO_FIRST_TOKEN)
    reasons = by_label(REQUEST_SUCCESS)
    finished = sum(reasons.values())
    if generated == 0 and finished == 0:
        return Window.no_data(target, seconds, "no traffic in the window")
    drafts = total(DRAFTS)

    def little(seconds_sum: str) -> float | None:
        """Little's law over the requests that finished in the window: their seconds / window / replicas."""
        if (seconds_sum, "") not in increase:
            return None
        return increase[seconds_sum, ""] / seconds / target.ready_replicas

    return Window(
        revision=target.revision,
        seconds=seconds,
        ready_replicas=target.ready_replicas,
        tokens_per_second=generated / seconds,
        generated_tokens=generated,
        p99_inter_token_latency_ms=_ms(histogram_quantile(0.99, itl)),
        p99_time_to_first_token_ms=_ms(histogram_quantile(0.99, ttft)),
        within_slo=within_slo(target, itl, ttft),
        acceptance_length=1 + total(ACCEPTED) / drafts if drafts else None,
        accepted_per_position=_per_position(by_label(ACCEPTED_PER_POSITION), drafts),
        finished_requests=finished,
        arrived_requests=finished + sum(total(gauge) for gauge in IN_SYSTEM),
        error_rate=sum(reasons.get(reason, 0.0) for reason in ERROR_REASONS) / finished if finished else None,
        in_flight_per_replica=little(E2E_LATENCY + "_sum"),
        waiting_per_replica=little(QUEUE_TIME + "_sum"),
        waiting_requests=sum(values.get((WAITING, ""), 0.0) for values in after.pods.values()),
    )


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None or not math.isfinite(seconds) else seconds * 1000


def _per_position(accepted: dict[str, float], drafts: float) -> tuple[float, ...]:
    """accepted / drafts at positions 0, 1, ... (a position never accepted counts 0)."""
    if not drafts or not accepted:
        return ()
    by_position = {int(position): count for position, count in accepted.items()}
    return tuple(by_position.get(position, 0.0) / drafts for position in range(max(by_position) + 1))


def _cause(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code} {exc.reason}"
    if isinstance(exc, urllib.error.URLError):
        return str(exc.reason)
    return str(exc) or type(exc).__name__


# ----- ScrapeSource: the pods' /metrics directly -------------------------------------------------


class ScrapeSource:
    """No Prometheus configured: scrape every ready pod's /metrics and difference against an earlier
    scrape of the same revision's pods: the newest one at least `seconds` old, else the oldest kept
    (a shorter window). Several deciders measure one revision (the canary's analysis, the autoscaler,
    the speculation health), each over its own interval: a scrape for one must not shorten another's
    window, so the source keeps the scrapes that the longest window asked for a revision can still
    use, not just the last one. The window is the time actually elapsed between the two scrapes, so
    the first call per revision only records a baseline. Never raises: an unreachable pod is a window
    with no data naming the pod."""

    name = "Pods"

    def __init__(self, fetch: Callable[[str], str] | None = None, clock: Callable[[], float] = time.monotonic,
                 timeout: float = 3):
        self.fetch = fetch or (lambda url: _get(url, timeout))
        self.clock = clock
        self.scrapes: dict[tuple, list[tuple[float, Snapshot]]] = {}  # (namespace, serving, revision) -> oldest first
        self.longest: dict[tuple, float] = {}  # the longest window asked for, per revision

    def measure(self, target: Target, seconds: float) -> Window:
        key = (target.namespace, target.serving, target.revision)
        if target.ready_replicas <= 0 or not target.pod_urls:
            self.scrapes.pop(key, None)
            self.longest.pop(key, None)
            return Window.no_data(target, seconds, "no ready replicas")
        now = self.clock()
        values = {}
        for url in target.pod_urls:
            metrics_url = url.rstrip("/") + "/metrics"
            try:
                values[url] = parse_metrics(self.fetch(metrics_url))
            except (OSError, http.client.HTTPException, ValueError) as exc:  # the earlier scrapes stay
                return Window.no_data(target, seconds, f"cannot scrape {metrics_url}: {_cause(exc)}")
        kept = self.scrapes.setdefault(key, [])
        before = next(((t, snap) for t, snap in reversed(kept) if now - t >= seconds), kept[0] if kept else None)
        kept.append((now, Snapshot(values)))
        longest = self.longest[key] = max(self.longest.get(key, 0.0), seconds)
        while len(kept) > 1 and now - kept[1][0] >= longest:  # the newest scrape at least that old stays
            kept.pop(0)
        if before is None:
            return Window.no_data(target, seconds, "first scrape; a window needs two")
        then, previous = before
        return window_between(previous, kept[-1][1], target, now - then)


def _get(url: str, timeout: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


# ----- PrometheusSource: the Prometheus HTTP API ---------------------------------------------------


def selector(target: Target, *matchers: str) -> str:
    """The series of one revision: {namespace="..",serving="..",revision=".."} (no namespace when
    the target has none, as for the local `specserve canary`), plus any extra matchers."""
    labels = {"namespace": target.namespace, "serving": target.serving, "revision": target.revision}
    # json.dumps quotes and escapes as a PromQL string literal needs
    parts = [f"{name}={json.dumps(value)}" for name, value in labels.items() if value]
    return "{" + ",".join(parts + list(matchers)) + "}"


def window_seconds(seconds: float) -> int:
    """The range PrometheusSource asks for: whole seconds, at least 1."""
    return max(1, round(seconds))


def promql(target: Target, seconds: float) -> dict[str, str]:
    """The instant queries PrometheusSource runs for one revision over the last `seconds`, by name."""
    series = selector(target)
    errors = selector(target, f'finished_reason=~"{"|".join(ERROR_REASONS)}"')
    w = f"[{window_seconds(seconds)}s]"

    def p99(histogram: str) -> str:
        return f"histogram_quantile(0.99, sum by (le) (rate({histogram}_bucket{series}{w})))"

    def buckets(histogram: str) -> str:
        return f"sum by (le) (increase({histogram}_bucket{series}{w}))"

    def little(histogram: str) -> str:
        return f"sum(increase({histogram}_sum{series}{w})) / {window_seconds(seconds)} / {target.ready_replicas}"

    return {
        "samples": f"count_over_time({GENERATION_TOKENS}{series}{w})",
        "tokens_per_second": f"sum(rate({GENERATION_TOKENS}{series}{w}))",
        "generated_tokens": f"sum(increase({GENERATION_TOKENS}{series}{w}))",
        "p99_inter_token_latency": p99(INTER_TOKEN_LATENCY),
        "p99_time_to_first_token": p99(TIME_TO_FIRST_TOKEN),
        "inter_token_latency_buckets": buckets(INTER_TOKEN_LATENCY),
        "time_to_first_token_buckets": buckets(TIME_TO_FIRST_TOKEN),
        "acceptance_length": f"1 + sum(rate({ACCEPTED}{series}{w})) / sum(rate({DRAFTS}{series}{w}))",
        "drafts": f"sum(increase({DRAFTS}{series}{w}))",
        "accepted_per_position": f"sum by (position) (increase({ACCEPTED_PER_POSITION}{series}{w}))",
        "finished_requests": f"sum(increase({REQUEST_SUCCESS}{series}{w}))",
        "failed_requests": f"sum(increase({REQUEST_SUCCESS}{errors}{w}))",
        "in_system_change": " + ".join(f"sum(delta({gauge}{series}{w}))" for gauge in IN_SYSTEM),
        "in_flight_per_replica": little(E2E_LATENCY),
        "waiting_per_replica": little(QUEUE_TIME),
        "waiting_requests": f"sum({WAITING}{series})",
    }


class PrometheusSource:
    """Measure through the Prometheus HTTP API: instant queries (at now) over the last `seconds`.

    Generated tokens must be present with at least two samples per series in the window, else
    the window has no data, naming what was absent; latency quantiles, acceptance and in-flight
    are None where Prometheus has no value (NaN or no series). A Prometheus that cannot be asked
    raises MeasurementError. Credentials in the URL (http://user:password@host) are sent as
    basic auth and never appear in messages.
    """

    name = "Prometheus"

    def __init__(self, url: str, timeout: float = 5):
        parts = urllib.parse.urlsplit(url.rstrip("/"))
        self.headers = {}
        if parts.username is not None:
            login = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
            self.headers["Authorization"] = "Basic " + base64.b64encode(login.encode()).decode()
            parts = parts._replace(netloc=parts.netloc.rpartition("@")[2])
        self.url = urllib.parse.urlunsplit(parts)
        self.timeout = timeout

    def measure(self, target: Target, seconds: float) -> Window:
        w = window_seconds(seconds)
        if target.ready_replicas <= 0:
            return Window.no_data(target, w, "no ready replicas")
        queries = promql(target, seconds)
        samples = self.query(queries["samples"])
        if not samples:
            return Window.no_data(target, w, f"no {GENERATION_TOKENS} series for {selector(target)} in the last {w} s")
        fewest_labels, fewest = min(samples, key=lambda sample: sample[1])
        if fewest < 2:
            instance = fewest_labels.get("instance") or fewest_labels.get("pod") or json.dumps(fewest_labels)
            return Window.no_data(target, w, f"too few samples: {GENERATION_TOKENS} of {instance} has {fewest:g} "
                                             f"in the last {w} s; a rate needs 2")
        numbers = {}
        for name in ("tokens_per_second", "generated_tokens"):
            numbers[name] = self.value(queries[name])
            if numbers[name] is None:
                return Window.no_data(target, w, f"no value for {name} ({queries[name]})")
        finished = self.value(queries["finished_requests"]) or 0.0  # no series: no request ever finished
        if numbers["generated_tokens"] == 0 and finished == 0:
            return Window.no_data(target, w, "no traffic in the window")
        drafts = self.value(queries["drafts"])
        accepted = {labels.get("position", ""): value for labels, value in self.query(queries["accepted_per_position"])}
        failed = self.value(queries["failed_requests"]) or 0.0
        in_system_change = self.value(queries["in_system_change"])
        served_within = None
        if target.itl_objective_ms is not None or target.ttft_objective_ms is not None:
            served_within = within_slo(target, self.buckets(queries["inter_token_latency_buckets"]),
                                       self.buckets(queries["time_to_first_token_buckets"]))
        return Window(
            revision=target.revision,
            seconds=float(w),
            ready_replicas=target.ready_replicas,
            tokens_per_second=numbers["tokens_per_second"],
            generated_tokens=numbers["generated_tokens"],
            p99_inter_token_latency_ms=_ms(self.value(queries["p99_inter_token_latency"])),
            p99_time_to_first_token_ms=_ms(self.value(queries["p99_time_to_first_token"])),
            within_slo=served_within,
            acceptance_length=self.value(queries["acceptance_length"]) if drafts else None,
            accepted_per_position=_per_position(accepted, drafts or 0.0),
            finished_requests=finished,
            arrived_requests=None if in_system_change is None else finished + in_system_change,
            error_rate=failed / finished if finished else None,
            in_flight_per_replica=self.value(queries["in_flight_per_replica"]),
            waiting_per_replica=self.value(queries["waiting_per_replica"]),
            waiting_requests=self.value(queries["waiting_requests"]),
        )

    def value(self, query: str) -> float | None:
        """The single value of an aggregating query; None when there is no series or it is NaN or infinite."""
        samples = self.query(query)
        if not samples:
            return None
        value = samples[0][1]
        return value if math.isfinite(value) else None

    def buckets(self, query: str) -> list[tuple[float, float]]:
        """A histogram's (le, count) pairs from a `sum by (le)` query."""
        return [(float(labels["le"]), value) for labels, value in self.query(query) if "le" in labels]

    def query(self, query: str) -> list[tuple[dict[str, str], float]]:
        """An instant query at now: (labels, value) per series of the resulting vector."""
        endpoint = f"{self.url}/api/v1/query"
        request = urllib.request.Request(f"{endpoint}?{urllib.parse.urlencode({'query': query})}", headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise MeasurementError(f"Prometheus at {endpoint} answered {_cause(exc)}{_api_error(exc)} "
                                   f"to the query {query}") from None
        except (OSError, http.client.HTTPException) as exc:
            raise MeasurementError(f"cannot reach Prometheus at {endpoint}: {_cause(exc)}") from None
        except ValueError as exc:
            raise MeasurementError(f"Prometheus at {endpoint} answered with invalid JSON ({exc}) "
                                   f"to the query {query}") from None
        try:
            if answer["status"] != "success":
                raise MeasurementError(f"Prometheus at {endpoint} answered {answer.get('errorType')}: "
                                       f"{answer.get('error')} to the query {query}")
            return [(series["metric"], float(series["value"][1])) for series in answer["data"]["result"]]
        except (KeyError, TypeError, IndexError, ValueError) as exc:
            raise MeasurementError(f"Prometheus at {endpoint} answered an unexpected shape "
                                   f"({type(exc).__name__}: {exc}) to the query {query}") from None


def _api_error(exc: urllib.error.HTTPError) -> str:
    """Prometheus' own error text from an HTTP error's JSON body, if it has one."""
    try:
        return f" ({json.loads(exc.read())['error']})"
    except Exception:  # noqa: BLE001 - any body at all; the status is reported either way
        return ""
