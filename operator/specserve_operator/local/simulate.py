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
- A revision's curve: its method's, its batch-size schedule's, or on the embedded engine without one the best
  draft length's at each batch size (adaptive speculation; fleet_model.speculator_model).
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

import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import api
from ..reconcile import effective_slo
from ..render import Profile
from ..replicas import candidate_hash, candidate_runtime, replica_budget, revision_hash
from .baselines import BASELINES
from .fleet import Fleet
from .fleet_model import Arrival, RevisionModel, arrivals, speculator_model
from .scenario import Scenario, ScenarioError, load
from .simulated_cluster import ROLLOUT_ENDS, Operator, TickRecord

# ---- runs ---------------------------------------------------------------------------------------


@dataclass
class Run:
    fleet: Fleet
    ticks: list[TickRecord] = field(default_factory=list)
    decision: str | None = None
    decision_at: float | None = None
    degraded_at: float | None = None  # the first SpeculationDegraded Event


def revision_models(scenario: Scenario) -> dict[str, RevisionModel]:
    """The models of the revisions the spec names; one the operator creates itself (a draft-length schedule it
    applies) is modelled from its runtime configuration when it appears (SimulatedCluster)."""
    spec = scenario.serving
    speculators = [(revision_hash(spec.model, spec.speculator, spec.runtime), spec.speculator, spec.runtime)]
    if spec.rollout is not None:
        speculators.append((candidate_hash(spec), spec.rollout.candidate.speculator, candidate_runtime(spec)))
    if spec.speculation_health.fallback is not None:  # a fallback runs on the runtime of the revision it replaces
        fallback = spec.speculation_health.fallback.speculator
        speculators += [(revision_hash(spec.model, fallback, runtime), fallback, runtime)
                        for runtime in (spec.runtime, candidate_runtime(spec))]
    return {revision: speculator_model(revision, s.method, s.num_speculative_tokens_per_batch_size, scenario.performance,
                                       runtime.engine, s.num_speculative_tokens)
            for revision, s, runtime in speculators}


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
    changes = sorted((f for f in scenario.faults if f.kind in ("nodeLoss", "drift")), key=lambda f: f.at_seconds)
    ramps = []  # (drift, its method's performance before it) while the drift ramps
    for now_s in tick_times(scenario):
        while changes and changes[0].at_seconds <= now_s:
            fault = changes.pop(0)
            fleet.advance_to(fault.at_seconds)
            if fault.kind == "nodeLoss":
                fleet.node_loss(fault.at_seconds, fault.duration_seconds)
            else:
                before = getattr(fleet.performance, fault.method)
                fleet.drift(fault.method, fault.drifted(before, fault.at_seconds), fault.at_seconds)
                if fault.ramp_seconds:
                    ramps.append((fault, before))
        fleet.advance_to(now_s)
        for fault, before in ramps:  # a ramp moves once a tick
            fleet.drift(fault.method, fault.drifted(before, now_s), now_s)
        ramps = [(fault, before) for fault, before in ramps if now_s < fault.at_seconds + fault.ramp_seconds]
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
                    if event.reason in ROLLOUT_ENDS:  # the last: a lost fallback can be retried
                        run.decision, run.decision_at = ROLLOUT_ENDS[event.reason], now_s
                    if event.reason == "SpeculationDegraded" and run.degraded_at is None:
                        run.degraded_at = now_s
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


def slo_met(run: Run, scenario: Scenario) -> list[bool]:
    """Per tick: did the fleet meet the SLO over it (no request rejected, fleet-wide p99s within it)?"""
    fleet, slo = run.fleet, effective_slo(scenario.serving, Profile(scenario.serving.profile, scenario.profile))
    met = []
    for record in run.ticks:
        itl, ttft, _, rejected = fleet.truth(record.t - scenario.tick_seconds, record.t)
        ok = rejected == 0
        if ok and itl is not None and slo.p99_inter_token_latency_ms is not None:
            ok = itl <= slo.p99_inter_token_latency_ms
        if ok and ttft is not None and slo.p99_time_to_first_token_ms is not None:
            ok = ttft <= slo.p99_time_to_first_token_ms
        met.append(ok)
    return met


def share(flags: list[bool]) -> float:
    """The fraction of ticks that met the SLO (1 without ticks)."""
    return round(sum(flags) / len(flags), 4) if flags else 1.0


def summary(run: Run, scenario: Scenario) -> dict:
    fleet, met = run.fleet, slo_met(run, scenario)
    unlimited = [ok for ok, record in zip(met, run.ticks) if not record.budget_limited]
    cost, tokens = fleet.cost_usd(), fleet.generated_tokens()
    return {
        "sloAttainment": share(met),
        # the ticks whose fleet the budget did not cap: what the autoscaler's choices alone answer for
        "sloAttainmentWithinBudget": share(unlimited),
        "costUSD": round(cost, 4),
        "tokensPerDollar": round(tokens / cost, 1) if cost > 0 else None,
        "maxHourlyCostUSD": round(fleet.max_billed * fleet.pricing.replica_hourly_usd, 4),
        "budgetLimitedSeconds": round(sum(scenario.tick_seconds for r in run.ticks if r.budget_limited), 3),
        "generatedTokens": round(tokens),
        "failedRequests": fleet.failed_requests(),
    }


# ---- after a drift ------------------------------------------------------------------------------

RECOVERY_INTERVALS = 3  # analysis intervals after a drift (its ramp's end) within which the fleet should recover


def recovery_deadline(scenario: Scenario) -> float | None:
    """RECOVERY_INTERVALS analysis intervals after the last drift ends; None without a drift."""
    ends = [f.at_seconds + f.ramp_seconds for f in scenario.faults if f.kind == "drift"]
    if not ends:
        return None
    return max(ends) + RECOVERY_INTERVALS * scenario.serving.speculation_health.interval_seconds


def best_after_drift(scenario: Scenario) -> Scenario | None:
    """The fleet the drifted traffic is best served by, to compare with: the same serving running its fallback's
    speculator (else plain decoding) from the start, so no drift touches it. None when there is neither."""
    fallback = scenario.serving.speculation_health.fallback
    speculator = fallback.speculator if fallback is not None else api.Speculator(method="none")
    if getattr(scenario.performance, speculator.method) is None or speculator == scenario.serving.speculator:
        return None
    health = scenario.serving.speculation_health.model_copy(update={"fallback": None})
    serving = scenario.serving.model_copy(update={"speculator": speculator, "speculation_health": health})
    return scenario.model_copy(update={"serving": serving})


def after(run: Run, scenario: Scenario, start: float) -> dict:
    """SLO met and tokens per dollar over the ticks from `start` to the end."""
    met = [ok for ok, record in zip(slo_met(run, scenario), run.ticks) if record.t > start]
    cost, tokens = run.fleet.cost_usd(start), run.fleet.generated_tokens(start)
    return {"fromSeconds": start, "sloAttainment": share(met),
            "tokensPerDollar": round(tokens / cost, 1) if cost > 0 else None}


def run_all(scenario: Scenario, seed: int, on_tick=None) -> tuple[dict, Run]:
    requests = arrivals(scenario, seed)
    main = simulate(scenario, requests, seed, on_tick=on_tick)
    result = summary(main, scenario)
    result["decision"] = main.decision
    result["decisionAtSeconds"] = main.decision_at
    result["speculationDegradedAtSeconds"] = main.degraded_at
    result["seed"] = seed
    models = revision_models(scenario)
    stable = models[revision_hash(scenario.serving.model, scenario.serving.speculator, scenario.serving.runtime)]
    slo = effective_slo(scenario.serving, Profile(scenario.serving.profile, scenario.profile))
    result["baselines"] = {cls.name: summary(simulate(scenario, requests, seed, cls(scenario, stable, slo)), scenario)
                           for cls in BASELINES}
    deadline, best = recovery_deadline(scenario), best_after_drift(scenario)
    if deadline is not None:
        result["afterDrift"] = after(main, scenario, deadline)
        if best is not None:  # the same requests: their tokens per dollar compare directly
            reference = after(simulate(best, requests, seed), best, deadline)
            result["afterDrift"]["best"] = {"speculator": best.serving.speculator.method, **reference}
            result["afterDrift"]["tokensPerDollarVsBest"] = round(
                (result["afterDrift"]["tokensPerDollar"] or 0) / (reference["tokensPerDollar"] or 1), 4)
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
    degraded = [r["speculationDegradedAtSeconds"] for r in results if r["speculationDegradedAtSeconds"] is not None]
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
        "speculationDegradedAtSeconds": {"seeds": len(degraded), "min": min(degraded), "max": max(degraded)} if degraded else None,
        "baselineSloAttainment": {name: median_of([r["baselines"][name]["sloAttainment"] for r in results])
                                  for name in results[0]["baselines"]},
    } | ({"afterDrift": after_drift_across(results)} if "afterDrift" in results[0] else {})


def after_drift_across(results: list[dict]) -> dict:
    """Over the seeds, from RECOVERY_INTERVALS after the drift: SLO met, tokens per dollar against the best fleet's."""
    after = [r["afterDrift"] for r in results]
    aggregate = {"fromSeconds": after[0]["fromSeconds"],
                 "sloAttainment": {"min": min(a["sloAttainment"] for a in after),
                                   "median": round(statistics.median(a["sloAttainment"] for a in after), 4)}}
    if "best" in after[0]:
        ratios = [a["tokensPerDollarVsBest"] for a in after]
        aggregate["best"] = {"speculator": after[0]["best"]["speculator"],
                             "sloAttainmentMin": min(a["best"]["sloAttainment"] for a in after)}
        aggregate["tokensPerDollarVsBest"] = {"min": min(ratios), "median": round(statistics.median(ratios), 4)}
    return aggregate


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


def add_commands(commands) -> None:
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
