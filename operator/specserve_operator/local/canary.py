"""`specserve canary`: the operator's canary analysis on this machine, with no cluster.

Two real runtimes (`specserve serve`, one per revision, on loopback), a real Prometheus that
scrapes them when the `prometheus` binary is on PATH (else their /metrics scraped directly), a
bounded closed-loop load generator, and then the operator's own decision code, unchanged:

    measure.PrometheusSource | measure.ScrapeSource  -> Window per revision
    analysis.analyse(stable, candidate, ...)         -> Pass | Fail | Inconclusive
    rollout.analysis_due / rollout.decide            -> next step, abort or promote

The rollout state travels between calls only in decision.canary and decision.last_rollout,
exactly as the operator carries it in status.canary and status.lastRollout.

Matched load. In the cluster a step's weight is the candidate's share of replicas (or of
HTTPRoute traffic), and the analysis compares the revisions at matched requests in flight per
replica. Locally each revision is one replica, so what must match is the per-replica load, and it
matches by construction: each runtime gets its own `--concurrency` closed-loop clients (each
sends its next request as soon as the previous one ends), cycling through the same prompts in
the same order. The weight is shown as the share the operator would route.

Nothing here imports torch: the runtimes are subprocesses.
"""

import contextlib
import datetime
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml
from specserve_runtime.cmdline import (
    LOOPBACK,
    READY_SECONDS,
    Child,
    ChildFailed,
    TimedOut,
    free_port,
    http_get,
    spawn,
    stop_children,
    wait_ready,
)

from ..render import READINESS_PATHS
from .canary_plan import SERVED_NAME, CanaryError, LocalSpeculator, Plan, add_rollout_flags, make_plan

SERVING = "canary"  # the `serving` series label of both revisions
REQUEST_TIMEOUT_SECONDS = 120  # one chat completion, at most
ERROR_BACKOFF_SECONDS = 0.5  # a client pauses after an error instead of spinning
TICK_SECONDS = 1.0


# ---- processes -----------------------------------------------------------------------------


def cores_of(role: str) -> str:
    """The cores a revision's vLLM binds its threads to: half the machine's each (both all of a single core)."""
    cores = sorted(os.sched_getaffinity(0))
    half = max(len(cores) // 2, 1)
    mine = cores[:half] if role == "stable" else cores[half:] or cores[:half]
    return ",".join(map(str, mine))


def start_runtime(role: str, speculator: LocalSpeculator, plan: Plan, port: int, work: Path) -> Child:
    """The revision's runtime configuration, as the operator renders it, run by `specserve launch` (vLLM) or
    `specserve serve --config` (the embedded engine, with the admission bound the load needs)."""
    from specserve_runtime.store import resolve_model  # no torch

    model = str(resolve_model(plan.model)) if speculator.engine == "vllm" else plan.model  # vLLM has no aliases
    config = work / f"{role}.yaml"
    config.write_text(speculator.runtime_config(model, port, list(plan.vllm_args)).to_yaml())
    cli = [sys.executable, "-m", "specserve_runtime.cli"]
    if speculator.engine == "vllm":
        command = [*cli, "launch", "--config", str(config)]
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": cores_of(role), "TOKENIZERS_PARALLELISM": "false"}
    else:
        command = [*cli, "serve", "--config", str(config), "--max-concurrency", str(2 * plan.concurrency + 2)]
        # Two runtimes share this machine's cores evenly: one thread each.
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return spawn(f"{role} runtime ({speculator.describe()}, revision {speculator.revision})", command,
                 work / f"{role}.log", env)



def prometheus_config(targets: dict[str, int]) -> dict:
    """Scrape every second; each target's series carry the labels the operator selects on."""
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{
            "job_name": "specserve-canary",
            "static_configs": [{"targets": [f"127.0.0.1:{port}"], "labels": {"serving": SERVING, "revision": revision}}
                               for revision, port in targets.items()],
        }],
    }


def start_prometheus(binary: str, targets: dict[str, int], port: int, work: Path) -> Child:
    config = work / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_config(targets), sort_keys=False))
    command = [binary, f"--config.file={config}", f"--storage.tsdb.path={work / 'tsdb'}",
               f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"]
    return spawn("prometheus", command, work / "prometheus.log")


def wait_scraped(url: str, count: int, deadline: float) -> bool:
    """Until Prometheus has scraped all `count` targets successfully once (bounded)."""
    query = urllib.parse.urlencode({"query": f'count(up{{serving="{SERVING}"}} == 1)'})
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
            result = json.loads(http_get(f"{url}/api/v1/query?{query}"))["data"]["result"]
            if result and float(result[0]["value"][1]) >= count:
                return True
        time.sleep(0.5)
    return False


# ---- load ----------------------------------------------------------------------------------


class ClosedLoop:
    """`concurrency` clients of one runtime; each sends its next chat completion when the previous one ends.

    Client i sends prompts i, i + concurrency, ... (cycling), so every runtime sees the same prompts in
    the same order. Errors are counted, never raised; the clients stop when `stop` is set.
    """

    def __init__(self, base_url: str, prompts: list[str], concurrency: int, max_tokens: int, stop: threading.Event):
        self.url = base_url + "/v1/chat/completions"
        self.prompts, self.max_tokens, self.stop = prompts, max_tokens, stop
        self.lock = threading.Lock()
        self.requests = self.errors = 0
        self.last_error = ""
        self.threads = [threading.Thread(target=self._client, args=(i, concurrency), daemon=True, name=f"load-{i}")
                        for i in range(concurrency)]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def stats(self) -> dict:
        with self.lock:
            return {"requests": self.requests, "errors": self.errors, "last_error": self.last_error}

    def _send(self, prompt: str) -> None:
        body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
                "max_tokens": self.max_tokens}
        request = urllib.request.Request(self.url, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with LOOPBACK.open(request, timeout=REQUEST_TIMEOUT_SECONDS) as response:
            if not json.loads(response.read()).get("choices"):
                raise ValueError("a response with no choices")

    def _client(self, index: int, stride: int) -> None:
        while not self.stop.is_set():
            try:
                self._send(self.prompts[index % len(self.prompts)])
                with self.lock:
                    self.requests += 1
            except Exception as exc:  # counted, never fatal: the server's own metrics judge errors
                with self.lock:
                    self.requests += 1
                    self.errors += 1
                    self.last_error = f"{exc.__class__.__name__}: {exc}"[:200]
                self.stop.wait(ERROR_BACKOFF_SECONDS)
            index += stride


# ---- the canary loop -----------------------------------------------------------------------


@dataclass
class Outcome:
    """What the run found so far: complete at the end, partial when interrupted."""

    decision: str = "Inconclusive"
    reason: str = ""
    prometheus: bool = False
    analyses: list[dict] = field(default_factory=list)
    load: dict = field(default_factory=dict)
    urls: dict = field(default_factory=dict)  # where the runtimes (and Prometheus) listened
    started: float = field(default_factory=time.monotonic)


def _finite(value):
    """JSON has no NaN or infinity: such numbers become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def _number(value, digits: int = 1) -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else f"{value:.{digits}f}"


TABLE_HEADER = (f"{'time':>5} {'step':>4} {'weight':>6} | {'accept len s/c':>14} | {'p99 ITL ms s/c':>15} | "
                f"{'tokens/s s/c':>13} | {'in flight s/c':>13} | {'verdict':<12} reasons")


def table_row(elapsed: float, step: int, weight: int, report) -> str:
    s, c = report.stable, report.candidate
    reasons = [f"{gate.name}: {gate.reason}" for gate in report.gates if gate.verdict != "Pass"] or ["all gates pass"]
    return (f"{elapsed:>4.0f}s {step:>4} {weight:>5}% | "
            f"{_number(s.acceptance_length, 2):>6} {_number(c.acceptance_length, 2):>7} | "
            f"{_number(s.p99_inter_token_latency_ms):>7} {_number(c.p99_inter_token_latency_ms):>7} | "
            f"{_number(s.tokens_per_second):>6} {_number(c.tokens_per_second):>6} | "
            f"{_number(s.in_flight_per_replica, 2):>6} {_number(c.in_flight_per_replica, 2):>6} | "
            f"{report.verdict:<12} {'; '.join(reasons)}")


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(plan: Plan, outcome: Outcome, on_windows=None) -> None:
    """Start everything, run the rollout to its end (or the timeout), stop everything: fills `outcome`.
    `on_windows(now, windows)` sees each analysis' measured windows (the demo's autoscaler)."""
    from ..measure import MeasurementError, PrometheusSource, ScrapeSource, Target

    work = Path(tempfile.mkdtemp(prefix="specserve-canary-"))
    children: list[Child] = []
    stop = threading.Event()
    loads: dict[str, ClosedLoop] = {}
    overall = outcome.started + plan.timeout_seconds
    try:
        ports = {"stable": free_port(), "candidate": free_port()}
        speculators = {"stable": plan.stable, "candidate": plan.candidate}
        outcome.urls = {role: f"http://127.0.0.1:{port}" for role, port in ports.items()}
        for role in ("stable", "candidate"):
            children.append(start_runtime(role, speculators[role], plan, ports[role], work))
        prometheus_url = None
        if plan.prometheus:
            prometheus_port = free_port()
            prometheus_url = outcome.urls["prometheus"] = f"http://127.0.0.1:{prometheus_port}"
            scraped = {speculators[role].revision: ports[role] for role in ("stable", "candidate")}
            children.append(start_prometheus(plan.prometheus, scraped, prometheus_port, work))
        else:
            why = "--no-prometheus" if plan.no_prometheus else "no prometheus binary on PATH"
            say(f"{why}: measuring by scraping the runtimes' /metrics directly (measure.ScrapeSource)")
        outcome.prometheus = prometheus_url is not None
        say(f"starting {children[0].name} and {children[1].name} (half the cores each)")
        started = time.monotonic()
        for role, child in zip(("stable", "candidate"), children):
            path = READINESS_PATHS[speculators[role].engine]  # where the Deployment's readinessProbe asks
            wait_ready(f"http://127.0.0.1:{ports[role]}{path}", child, READY_SECONDS[speculators[role].engine], overall,
                       started)
        if prometheus_url:
            wait_ready(f"{prometheus_url}/-/ready", children[2], READY_SECONDS["embedded"], overall)
        for role in ("stable", "candidate"):
            loads[role] = ClosedLoop(f"http://127.0.0.1:{ports[role]}", plan.prompts, plan.concurrency,
                                     plan.max_new_tokens, stop)
            loads[role].start()
        targets = [Target(None, SERVING, speculators[role].revision, 1, (f"http://127.0.0.1:{ports[role]}",))
                   for role in ("stable", "candidate")]
        if prometheus_url:
            source = PrometheusSource(prometheus_url)
            if not wait_scraped(prometheus_url, len(targets), min(overall, time.monotonic() + 30)):
                say("prometheus has not scraped both runtimes yet; the first analysis may find no data")
        else:
            source = ScrapeSource()
            for target in targets:  # the first scrape is the baseline the first window differences against
                with contextlib.suppress(MeasurementError, OSError):
                    source.measure(target, plan.rollout.analysis.interval_seconds)
        say(f"load: {plan.concurrency} closed-loop client(s) per runtime, {len(plan.prompts)} prompts, "
            f"max_tokens {plan.max_new_tokens}; analysis every {plan.rollout.analysis.interval_seconds} s")
        outcome.decision, outcome.reason = rollout_loop(plan, source, targets, overall - time.monotonic(),
                                                        outcome.analyses, on_windows=on_windows)
    except TimedOut as exc:
        outcome.decision, outcome.reason = "Inconclusive", str(exc)
    finally:
        with _signals_ignored():  # a second Ctrl-C must not leave processes behind
            stop.set()
            stop_children(children)
            for load in loads.values():
                load.join(5)
            outcome.load = {role: load.stats() for role, load in loads.items()}
            shutil.rmtree(work, ignore_errors=True)


class WallClock:
    """The loop's clock; tests pass one that jumps instead of sleeping."""

    monotonic = staticmethod(time.monotonic)
    sleep = staticmethod(time.sleep)

    @staticmethod
    def now() -> datetime.datetime:
        return datetime.datetime.now(datetime.timezone.utc)


def rollout_loop(plan: Plan, source, targets: list, seconds_left: float, analyses: list[dict],
                 clock=WallClock(), on_windows=None) -> tuple[str, str]:
    """The operator's timer, locally: every tick decide, and first measure and analyse when an analysis
    is due, until the rollout is Promoted or Aborted -> (stage, why). Each analysis is appended to
    `analyses` as it happens; TimedOut after `seconds_left`."""
    from ..measure import MeasurementError, Pricing, Window
    from ..rollout import tick as rollout_tick

    rollout, (stable, candidate) = plan.rollout, targets
    by_revision = {target.revision: target for target in targets}
    seconds = rollout.analysis.interval_seconds
    pricing = Pricing(accelerators_per_replica=1, price_per_accelerator_hour_usd=plan.price_per_hour)
    began = clock.monotonic()
    canary, last_rollout = None, None  # the whole state, as status.canary and status.lastRollout
    while True:
        tick = clock.monotonic()
        if tick - began >= seconds_left:
            raise TimedOut(f"--timeout-seconds {plan.timeout_seconds:g} reached before a decision")
        now = clock.now()

        def measure(revisions: list[str]) -> list[Window]:  # the local runtime of each revision
            measured = [by_revision[revision] for revision in revisions]
            try:
                windows = [source.measure(target, seconds).priced(pricing) for target in measured]
            except (MeasurementError, OSError) as exc:  # no data this interval: the same analysis decides
                say(f"measurement failed, this interval has no data: {exc}")
                windows = [Window.no_data(target, seconds, f"measurement failed: {exc}").priced(pricing)
                           for target in measured]
            if on_windows is not None:
                on_windows(now, windows)
            return windows

        decision, report = rollout_tick(rollout, stable.revision, candidate.revision, canary, last_rollout, {}, plan.slo,
                                        now, measure)
        elapsed = clock.monotonic() - began
        if report is not None:
            analyses.append({
                "at": now.strftime("%Y-%m-%dT%H:%M:%SZ"), "step": canary.step, "weight": canary.weight,
                "stable": asdict(report.stable), "candidate": asdict(report.candidate),
                "verdict": report.verdict, "reasons": report.reasons,
                "latency_ratio": report.latency_ratio, "tokens_per_dollar_gain": report.tokens_per_dollar_gain,
            })
            say(table_row(elapsed, canary.step, canary.weight, report))
        for event in decision.events:
            say(f"[{elapsed:>4.0f}s] {event.reason}: {event.message}")
            if event.reason == "RolloutStarted":
                say(TABLE_HEADER)
        canary, last_rollout = decision.canary, decision.last_rollout
        if decision.stage in ("Promoted", "Aborted"):
            return decision.stage, last_rollout.message if last_rollout else ""
        clock.sleep(max(0.0, tick + TICK_SECONDS - clock.monotonic()))


_received: list[int] = []


def _raise_interrupt(signum, frame):
    _received.append(signum)
    raise KeyboardInterrupt


@contextlib.contextmanager
def _signals(handler):
    """Set the SIGINT/SIGTERM handlers for a while (only the main thread may)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, handler) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def _signals_ignored():
    return _signals(signal.SIG_IGN)


# ---- the command ---------------------------------------------------------------------------


def result_json(plan: Plan, outcome: Outcome) -> dict:
    return _finite({
        "decision": outcome.decision,
        "reason": outcome.reason,
        "stable": {"revision": plan.stable.revision, "speculator": plan.stable.as_dict()},
        "candidate": {"revision": plan.candidate.revision, "speculator": plan.candidate.as_dict()},
        "steps": [{"weight": step.weight, "analysisSeconds": step.analysis_seconds} for step in plan.rollout.steps],
        "analyses": outcome.analyses,
        "prometheus": outcome.prometheus,
        "load": outcome.load,
        "urls": outcome.urls,
        "seconds": round(time.monotonic() - outcome.started, 1),
    })


def summary(plan: Plan, outcome: Outcome) -> str:
    verdicts = [analysis["verdict"] for analysis in outcome.analyses]
    counts = ", ".join(f"{verdicts.count(v)} {v.lower()}" for v in ("Pass", "Fail", "Inconclusive"))
    source = "a local Prometheus" if outcome.prometheus else "direct /metrics scrapes"
    return (f"{outcome.decision}: {outcome.reason or 'no decision'}. Stable {plan.stable.revision} "
            f"({plan.stable.describe()}) against candidate {plan.candidate.revision} ({plan.candidate.describe()}): "
            f"{len(verdicts)} analyses ({counts}) in {time.monotonic() - outcome.started:.0f} s, measured through "
            f"{source}. Run with --json for every window's numbers.")


def run_to_the_end(plan: Plan, command: str, on_windows=None) -> tuple[Outcome, int | None]:
    """`run` with Ctrl-C and SIGTERM handled: (outcome, exit status so far: None for 0, 128 + signal
    when interrupted, 1 when something it started failed, with the message said)."""
    outcome, code = Outcome(), None
    _received.clear()
    try:
        with _signals(_raise_interrupt):
            run(plan, outcome, on_windows)
    except KeyboardInterrupt:
        signum = _received[-1] if _received else signal.SIGINT
        outcome.decision, outcome.reason = "Inconclusive", f"interrupted ({signal.Signals(signum).name})"
        say(f"specserve {command}: interrupted; stopped every process it started")
        code = 128 + signum
    except ChildFailed as exc:
        say(f"specserve {command}: {exc}")
        code = 1
    return outcome, code


def cmd_canary(args) -> int:
    try:
        plan = make_plan(args)
    except CanaryError as exc:
        print(f"specserve canary: {exc}", file=sys.stderr)
        return 2
    outcome, code = run_to_the_end(plan, "canary")
    if code == 1:
        return 1
    if args.json:
        print(json.dumps(result_json(plan, outcome)), flush=True)
    else:
        print(summary(plan, outcome), flush=True)
    return code or 0


DESCRIPTION = """\
Run the operator's canary analysis locally, with no cluster: start the stable and the candidate
runtime (`specserve serve`, one per revision, on free loopback ports, each with OMP_NUM_THREADS=1
so the two share the machine's cores evenly), a real Prometheus scraping them every second (the
`prometheus` binary; without it, the runtimes' /metrics are scraped directly, said on stderr),
and a closed-loop load. Then, every interval, measure both revisions, analyse and decide with
the very code the operator runs (measure, analysis.analyse, rollout.decide), until the rollout
is Promoted or Aborted, or --timeout-seconds ends it as Inconclusive.

SPEC is a speculator as in the SpeculativeServing CR: a YAML/JSON file with method, draftModel,
numSpeculativeTokens, draftTree, promptLookup, or inline, e.g. method=dflash,draftModel=PATH,numSpeculativeTokens=3.
Locally draftModel is a drafter checkpoint folder or `random` (an untrained drafter), and may be
left out for eagle3/dflash (the bundled trained drafter). method none is plain decoding.
engine=vllm (the CR's runtime.engine; default embedded) runs that revision on vLLM, started by
`specserve launch` as in a pod, with --vllm-args; e.g. --stable engine=vllm,method=eagle3
--candidate engine=vllm,method=dflash.

Load: locally each revision is one replica. The step weight is the share of traffic the
operator would route to the candidate (by replicas), shown in the table; what the analysis
needs matched is the load per replica, and it is matched by construction: each runtime gets
--concurrency closed-loop clients cycling through the same prompts (chat completions,
temperature 0, --max-new-tokens each, every request bounded by a timeout; errors are counted).

Output: a table row per analysis on stderr. With --json, stdout is exactly one line: a JSON
object {decision, reason, stable, candidate, steps, analyses[{step, weight, stable, candidate,
verdict, reasons, ...}], prometheus, load, seconds}; without it, a one-paragraph summary.

Exit status: 0 when the run reached a decision (Promoted, Aborted, or Inconclusive at the
timeout; the decision is in the output), 2 for bad input (one line naming the field; nothing
started), 1 when something it started failed (a runtime exited or never became ready), 130 on
Ctrl-C and 143 on SIGTERM (the partial result is still printed). Every process it started is
stopped on the way out."""


def add_commands(commands) -> None:
    import argparse

    canary = commands.add_parser("canary", help="run the operator's canary analysis locally on two real runtimes",
                                 description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_rollout_flags(canary)
    canary.set_defaults(run=cmd_canary)
