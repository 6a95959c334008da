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
import hashlib
import json
import math
import os
import shlex
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
from pydantic import BaseModel, ValidationError

from specserve_runtime.config import DEFAULT_DRAFTER_NAMES, RuntimeConfig
from specserve_runtime.processes import (LOOPBACK, READY_SECONDS, Child, ChildFailed, TimedOut, free_port, http_get,
                                        spawn, stop_children, wait_ready)

from . import api  # pydantic only: the decision and measurement modules are imported when a canary runs
from .render import READINESS_PATHS

SPEC_KEYS = ("method", "draftModel", "numSpeculativeTokens", "draftTree", "promptLookup", "engine")
SERVING = "canary"  # the `serving` series label of both revisions
SERVED_NAME = "canary"  # the OpenAI model name both runtimes answer to
# vLLM on a CPU: float32, no graph compilation (it starts in about a minute, not three), a short context, and a KV
# cache of 1 GiB (vLLM's own default takes a share of the machine's memory, for each of the two).
DEFAULT_VLLM_ARGS = f"--dtype float32 --enforce-eager --max-model-len 4096 --kv-cache-memory-bytes {1 << 30}"
REQUEST_TIMEOUT_SECONDS = 120  # one chat completion, at most
ERROR_BACKOFF_SECONDS = 0.5  # a client pauses after an error instead of spinning
MAX_CONCURRENCY = 16  # closed-loop clients per runtime
TICK_SECONDS = 1.0


class CanaryError(Exception):
    """Bad input: one line naming the field, exit status 2, nothing started."""


# ---- the speculators -----------------------------------------------------------------------


@dataclass(frozen=True)
class LocalSpeculator:
    """A CR speculator with a local drafter (a checkpoint folder, "random", or None: the bundled one), and the
    engine that runs it (the CR's runtime.engine)."""

    method: str
    draft_model: str | None = None
    num_speculative_tokens: int | None = None
    draft_tree: bool | None = None
    prompt_lookup: int | None = None
    engine: str = "embedded"

    def as_dict(self) -> dict:
        fields = {"method": self.method, "draftModel": self.draft_model,
                  "numSpeculativeTokens": self.num_speculative_tokens, "draftTree": self.draft_tree,
                  "promptLookup": self.prompt_lookup, "engine": None if self.engine == "embedded" else self.engine}
        return {key: value for key, value in fields.items() if value is not None}

    @property
    def revision(self) -> str:
        """A short hash of the speculator, like the operator's revision hashes."""
        return hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()[:8]

    def describe(self) -> str:
        extra = []
        if self.draft_model or self.method in ("eagle3", "dflash"):
            extra.append(f"drafter {self.draft_model}" if self.draft_model else "bundled drafter")
        if self.num_speculative_tokens:
            count = self.num_speculative_tokens
            extra.append(f"{count} draft{'s' if count > 1 else ''} per step")
        if self.draft_tree is not None:
            extra.append("a draft tree" if self.draft_tree else "a chain")
        if self.prompt_lookup is not None:
            extra.append(f"prompt lookup's copies of up to {self.prompt_lookup}" if self.prompt_lookup else "no copies")
        if self.engine != "embedded":
            extra.append(f"on {self.engine}")
        return self.method + (f" ({', '.join(extra)})" if extra else "")

    def runtime_config(self, model: str, port: int, engine_args: list[str]) -> RuntimeConfig:
        """The runtime configuration the operator would render for it (render.runtime_config), on loopback.
        Without a draftModel, eagle3 and dflash run the bundled drafter."""
        drafter = self.draft_model
        if drafter is None and self.method in DEFAULT_DRAFTER_NAMES:
            drafter = f"bundled://{DEFAULT_DRAFTER_NAMES[self.method]}"
        return RuntimeConfig(model=model, served_name=SERVED_NAME, method=self.method, drafter=drafter,
                             num_speculative_tokens=self.num_speculative_tokens, draft_tree=self.draft_tree,
                             prompt_lookup=self.prompt_lookup, engine=self.engine,
                             engine_args=engine_args if self.engine == "vllm" else [], host="127.0.0.1", port=port)

    def api_speculator(self) -> api.Speculator:
        """The CR's Speculator, checked by the API's own rules; the local drafter stands in as a pvc:// URI."""
        uri = None
        if self.method in ("eagle3", "dflash"):
            uri = f"pvc://local/{Path(self.draft_model).name if self.draft_model else 'bundled'}"
        fields = {key: value for key, value in self.as_dict().items() if key != "engine"}
        return api.Speculator.model_validate({**fields, "draftModel": uri})


def _read_spec(text: str, flag: str) -> dict:
    path = Path(text)
    if path.is_file():
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise CanaryError(f"{flag} {text}: invalid YAML/JSON ({str(exc).splitlines()[0]})") from exc
        if not isinstance(data, dict):
            raise CanaryError(f"{flag} {text}: expected a mapping with {', '.join(SPEC_KEYS)}")
        return data
    if "=" not in text:
        raise CanaryError(f"{flag} {text!r}: no such file, and not KEY=VALUE,... "
                          "(e.g. method=dflash,numSpeculativeTokens=2)")
    data = {}
    for part in text.split(","):
        key, equals, value = (s.strip() for s in part.partition("="))
        if not equals or not key:
            raise CanaryError(f"{flag}: {part!r} is not KEY=VALUE")
        if key in data:
            raise CanaryError(f"{flag}: {key}: given twice")
        data[key] = value
    return data


def _integer(value) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        return int(value)
    return None


def _problems(exc: ValidationError, names: dict[str, str], prefix: str = "") -> str:
    """Pydantic's errors as `FIELD: message`, fields named by their command-line flag where there is one."""
    lines = []
    for error in exc.errors():
        location = ".".join(str(part) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        name = names.get(location, location)
        lines.append(f"{prefix}{name}: {message}" if name else f"{prefix}{message}")
    return "; ".join(lines)


def parse_speculator(text: str, flag: str) -> LocalSpeculator:
    """A SPEC (a YAML/JSON file, or inline method=..,draftModel=..,numSpeculativeTokens=..) -> a checked speculator."""
    data = _read_spec(text, flag)
    unknown = [key for key in data if key not in SPEC_KEYS]
    if unknown:
        raise CanaryError(f"{flag}: {unknown[0]}: unknown key (allowed: {', '.join(SPEC_KEYS)})")
    method = data.get("method")
    if method is None or method == "":
        raise CanaryError(f"{flag}: method: required ({' | '.join(api.ALL_METHODS)})")
    if method not in api.ALL_METHODS:
        raise CanaryError(f"{flag}: method: unknown method {method!r} (choose {' | '.join(api.ALL_METHODS)})")
    tokens = data.get("numSpeculativeTokens")
    if tokens is not None:
        if method == "none":
            raise CanaryError(f"{flag}: numSpeculativeTokens: not allowed with method none")
        if _integer(tokens) is None or _integer(tokens) < 1:
            raise CanaryError(f"{flag}: numSpeculativeTokens: must be an integer >= 1, got {tokens!r}")
        tokens = _integer(tokens)
    tree = data.get("draftTree")
    if isinstance(tree, str) and tree.lower() in ("true", "false"):  # inline specs are text
        tree = tree.lower() == "true"
    if tree is not None and not isinstance(tree, bool):
        raise CanaryError(f"{flag}: draftTree: must be true or false, got {tree!r}")
    lookup = data.get("promptLookup")
    if lookup is not None:
        if _integer(lookup) is None:
            raise CanaryError(f"{flag}: promptLookup: must be an integer, got {lookup!r}")
        lookup = _integer(lookup)  # its range and its method: the CR's own rules, below
    engine = data.get("engine", "embedded")
    if engine not in ("embedded", "vllm"):
        raise CanaryError(f"{flag}: engine: {engine!r} is neither embedded nor vllm")
    if engine == "vllm":
        for key, message in api.EMBEDDED_ONLY.items():
            if data.get(key) not in (None, False, 0, "false", "0"):
                raise CanaryError(f"{flag}: {key}: {message}")
        if data.get("draftModel") == "random":
            raise CanaryError(f"{flag}: draftModel: random is an untrained drafter of the embedded engine; "
                              "vLLM loads drafter folders")
    draft = data.get("draftModel")
    if draft is not None:
        if method not in ("eagle3", "dflash"):
            raise CanaryError(f"{flag}: draftModel: method {method} takes no draft model")
        draft = str(draft)
        if draft != "random":
            folder = Path(draft).expanduser()
            if not draft or not folder.is_dir():
                raise CanaryError(f"{flag}: draftModel: {draft!r}: no such folder "
                                  "(a drafter checkpoint folder, or random)")
            draft = str(folder.resolve())
    speculator = LocalSpeculator(method, draft, tokens, tree, lookup, engine)
    try:
        speculator.api_speculator()  # the CR's own rules too (e.g. numSpeculativeTokens <= 64)
    except ValidationError as exc:
        raise CanaryError(_problems(exc, {}, f"{flag}: ")) from None
    return speculator


# ---- the rollout ---------------------------------------------------------------------------

ANALYSIS_FLAGS = {
    "intervalSeconds": "--interval-seconds", "minAcceptanceLength": "--min-acceptance-length",
    "maxP99LatencyRatio": "--max-p99-latency-ratio", "minTokensPerDollarGain": "--min-tokens-per-dollar-gain",
    "maxErrorRate": "--max-error-rate", "failureLimit": "--failure-limit",
}
SLO_FLAGS = {"p99InterTokenLatencyMs": "--slo-p99-itl-ms", "p99TimeToFirstTokenMs": "--slo-p99-ttft-ms"}


def _validated(model: type[BaseModel], data: dict, names: dict[str, str], prefix: str = "") -> BaseModel:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise CanaryError(_problems(exc, names, prefix)) from None


def parse_steps(text: str) -> list[int]:
    weights = []
    for part in text.split(","):
        weight = _integer(part.strip())
        if weight is None:
            raise CanaryError(f"--steps: {part.strip()!r} is not an integer weight "
                              "(percent of traffic, e.g. 25,50,100)")
        weights.append(weight)
    return weights


def build_rollout(args, candidate: LocalSpeculator) -> tuple[api.Rollout, api.Slo]:
    """The flags as the CR's rollout and SLO, through the API's own validation."""
    flags = {"intervalSeconds": args.interval_seconds, "minAcceptanceLength": args.min_acceptance_length,
             "maxP99LatencyRatio": args.max_p99_latency_ratio, "minTokensPerDollarGain": args.min_tokens_per_dollar_gain,
             "maxErrorRate": args.max_error_rate, "failureLimit": args.failure_limit}
    # A gate left unset is the CRD's default, as in a SpeculativeServing that names no gate.
    analysis = _validated(api.Analysis, {key: value for key, value in flags.items() if value is not None}, ANALYSIS_FLAGS)
    seconds = args.interval_seconds if args.step_seconds is None else args.step_seconds
    steps = [_validated(api.RolloutStep, {"weight": weight, "analysisSeconds": seconds},
                        {"weight": f"--steps: steps[{index}].weight", "analysisSeconds": "--step-seconds"})
             for index, weight in enumerate(parse_steps(args.steps))]
    candidate_spec = api.Candidate(speculator=candidate.api_speculator())
    rollout = _validated(api.Rollout,
                         {"candidate": candidate_spec, "steps": steps, "analysis": analysis, "autoPromote": True},
                         {"": "--steps", "steps": "--steps"})
    slo = _validated(api.Slo,
                     {"p99InterTokenLatencyMs": args.slo_p99_itl_ms, "p99TimeToFirstTokenMs": args.slo_p99_ttft_ms},
                     SLO_FLAGS)
    return rollout, slo


def default_timeout(rollout: api.Rollout, start_seconds: float = READY_SECONDS["embedded"]) -> float:
    """Start-up, plus twice each step's planned time (its analysisSeconds, at least one interval, plus one)."""
    interval = rollout.analysis.interval_seconds
    return start_seconds + 2 * sum(max(step.analysis_seconds, interval) + interval for step in rollout.steps)


@dataclass(frozen=True)
class Plan:
    stable: LocalSpeculator
    candidate: LocalSpeculator
    rollout: api.Rollout
    slo: api.Slo
    prompts: list[str]
    model: str
    concurrency: int
    max_new_tokens: int
    price_per_hour: float
    timeout_seconds: float
    prometheus: str | None  # the binary, or None: scrape the runtimes directly
    no_prometheus: bool = False  # None above by request
    vllm_args: tuple[str, ...] = ()  # the engine arguments of a revision on vLLM (the CR's runtime.args)


def make_plan(args) -> Plan:
    """Every check of the input, before anything starts."""
    from specserve_runtime.cli import UsageError, read_prompts  # json and pathlib only: no torch

    stable, candidate = parse_speculator(args.stable, "--stable"), parse_speculator(args.candidate, "--candidate")
    if stable.revision == candidate.revision:
        raise CanaryError(f"--candidate: the same speculator as --stable (revision {stable.revision}): "
                          "nothing to compare")
    rollout, slo = build_rollout(args, candidate)
    if not 1 <= args.concurrency <= MAX_CONCURRENCY:
        raise CanaryError(f"--concurrency: must be within 1..{MAX_CONCURRENCY}, got {args.concurrency}")
    if not 1 <= args.max_new_tokens <= 4096:
        raise CanaryError(f"--max-new-tokens: must be within 1..4096, got {args.max_new_tokens}")
    if not (args.price_per_hour > 0 and math.isfinite(args.price_per_hour)):
        raise CanaryError(f"--price-per-hour: must be > 0, got {args.price_per_hour}")
    start_seconds = max(READY_SECONDS[stable.engine], READY_SECONDS[candidate.engine])
    timeout = default_timeout(rollout, start_seconds) if args.timeout_seconds is None else args.timeout_seconds
    if not (timeout > 0 and math.isfinite(timeout)):
        raise CanaryError(f"--timeout-seconds: must be > 0, got {args.timeout_seconds}")
    try:
        prompts = read_prompts(None, args.prompts_file)
    except UsageError as exc:
        raise CanaryError(str(exc)) from None
    binary = None if args.no_prometheus else shutil.which("prometheus")
    return Plan(stable, candidate, rollout, slo, prompts, args.model, args.concurrency, args.max_new_tokens,
                args.price_per_hour, timeout, binary, args.no_prometheus, tuple(shlex.split(args.vllm_args)))


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
    from .measure import MeasurementError, PrometheusSource, ScrapeSource, Target

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
    from .analysis import analyse
    from .measure import MeasurementError, Pricing, Window
    from .rollout import analysis_due, decide

    rollout, (stable, candidate) = plan.rollout, targets
    seconds = rollout.analysis.interval_seconds
    pricing = Pricing(accelerators_per_replica=1, price_per_accelerator_hour_usd=plan.price_per_hour)
    began = clock.monotonic()
    canary, last_rollout = None, None  # the whole state, as status.canary and status.lastRollout
    while True:
        tick = clock.monotonic()
        if tick - began >= seconds_left:
            raise TimedOut(f"--timeout-seconds {plan.timeout_seconds:g} reached before a decision")
        now = clock.now()
        report = None
        if analysis_due(rollout, canary, candidate.revision, now):
            try:
                windows = [source.measure(target, seconds).priced(pricing) for target in targets]
            except (MeasurementError, OSError) as exc:  # no data this interval: the same analysis decides
                say(f"measurement failed, this interval has no data: {exc}")
                windows = [Window.no_data(target, seconds, f"measurement failed: {exc}").priced(pricing)
                           for target in targets]
            report = analyse(windows[0], windows[1], rollout.analysis, plan.slo, rollout.candidate.speculator.method)
            if on_windows is not None:
                on_windows(now, windows)
        decision = decide(rollout, stable.revision, candidate.revision, canary, last_rollout, {}, report, now)
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


def add_canary_command(commands) -> None:
    import argparse

    canary = commands.add_parser("canary", help="run the operator's canary analysis locally on two real runtimes",
                                 description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_rollout_flags(canary)
    canary.set_defaults(run=cmd_canary)


def add_rollout_flags(parser, defaults: dict | None = None) -> None:
    """The flags of `specserve canary`; `defaults` (by dest) makes the required ones optional (the demo)."""
    from specserve_runtime.store import DEFAULT_MODEL  # stdlib only: no torch

    defaults = defaults or {}

    def flag(name, **kwargs):
        dest = name.removeprefix("--").replace("-", "_")
        if dest in defaults:
            if kwargs.pop("required", False):
                kwargs["help"] += " (default %(default)s)"
            kwargs["default"] = defaults[dest]
        parser.add_argument(name, **kwargs)

    flag("--stable", required=True, metavar="SPEC", help="what serves today")
    flag("--candidate", required=True, metavar="SPEC", help="what is rolled out")
    flag("--prompts-file", required=True, help='JSONL, one object with a "prompt" field per line')
    flag("--model", default=DEFAULT_MODEL, help="the target model of both runtimes (default %(default)s)")
    flag("--steps", default="25,50,100", help="candidate weights in percent, strictly increasing (default %(default)s)")
    flag("--step-seconds", type=int, help="each step's analysisSeconds (default: the interval)")
    flag("--interval-seconds", type=int, default=30, help="analysis interval, >= 10 (default %(default)s)")
    analysis = api.Analysis()  # the CRD's defaults, which a flag left out keeps
    flag("--min-acceptance-length", type=float,
         help=f"gate: candidate acceptance length at least this (default: {api.DEFAULT_MIN_ACCEPTANCE_LENGTH} for a "
              "speculating candidate)")
    flag("--max-p99-latency-ratio", type=float,
         help=f"gate: candidate p99 ITL / stable's at most this (default {analysis.max_p99_latency_ratio})")
    flag("--min-tokens-per-dollar-gain", type=float,
         help=f"gate: candidate tokens/$ / stable's at least this (default {analysis.min_tokens_per_dollar_gain})")
    flag("--max-error-rate", type=float, default=0.01, help="gate (default %(default)s)")
    flag("--failure-limit", type=int, default=2, help="failed analyses in a row that abort (default %(default)s)")
    flag("--slo-p99-itl-ms", type=float, help="SLO gate: candidate p99 inter-token latency")
    flag("--slo-p99-ttft-ms", type=float, help="SLO gate: candidate p99 time to first token")
    flag("--price-per-hour", type=float, default=1.0,
         help="USD per replica-hour, for tokens per dollar (default %(default)s)")
    flag("--concurrency", type=int, default=1,
         help=f"closed-loop clients PER RUNTIME, 1..{MAX_CONCURRENCY} (default %(default)s)")
    flag("--max-new-tokens", type=int, default=64, help="max_tokens per request (default %(default)s)")
    flag("--timeout-seconds", type=float,
         help=f"overall bound; reaching it decides Inconclusive (default: {READY_SECONDS['embedded']} s of "
              f"start-up, {READY_SECONDS['vllm']} with vLLM, "
              "plus twice the steps' planned time)")
    flag("--no-prometheus", action="store_true", help="scrape the runtimes' /metrics even if prometheus is installed")
    flag("--vllm-args", default=DEFAULT_VLLM_ARGS,
         help="vLLM's arguments for a revision with engine=vllm (the CR's runtime.args; default %(default)s; vLLM "
              "itself comes from SPECSERVE_VLLM, else `vllm serve`)")
    flag("--json", action="store_true", help="stdout is one JSON object (one line)")
