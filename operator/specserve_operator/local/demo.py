"""`specserve demo`: what the operator does, on one machine with no cluster, in a few minutes.

It is `specserve canary` (two real runtimes, a real Prometheus when installed, bounded closed-loop
load, the operator's measurement, analysis and rollout code) with an EAGLE-3 stable and a DFlash
candidate by default, plus the operator's autoscaler deciding on the same live windows at every
analysis, and a report: per revision acceptance length, tokens/s, p99 ITL and TTFT, tokens per
dollar at the given price, the verdict with its reasons, and PNG charts (acceptance by draft
position, latency over time, the candidate's step weight over time).
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

from .. import api, autoscale
from ..rollout import parse_time, timestamp
from .canary import CanaryError, Plan, add_rollout_flags, make_plan, run_to_the_end, say

DEFAULTS = {
    "stable": "method=eagle3",
    "candidate": "method=dflash",
    "steps": "50,100",
    # Six prompts of unequal acceptance, cycled: a window holds a few cycles and a partial one, and
    # the partial one's mix moves a window's tokens/$ by ~10% at 20 s (about ten requests on two
    # slow cores), as much as DFlash's measured lead. 40 s halves that share.
    "interval_seconds": 40,
    "max_new_tokens": 48,
    # The tokens-per-dollar gate is the CRD's default (at most 5% fewer), about one 40 s window's
    # spread here: a stricter one aborts the better drafter on noise (docs/benchmarks.md). The
    # candidate must not be much slower in the tail; the SLO is what two runtimes sharing two CPU
    # cores deliver (p99 inter-token latency ~300 ms measured).
    "max_p99_latency_ratio": 1.2,
    "slo_p99_itl_ms": 1000.0,
    "price_per_hour": 1.0,
}
MAX_REPLICAS = 8  # what the demo's autoscaler may recommend


class Autoscaler:
    """The operator's autoscaler on the demo's live windows: each revision is one local replica, the
    serving is sized as a whole, and only the recommendation is shown (nothing local is scaled)."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.spec = api.SpeculativeServingSpec.model_validate({
            "profile": "local", "model": {"name": plan.model, "uri": f"hf://{plan.model}", "servedName": "demo"},
            "replicas": {"min": 1, "max": MAX_REPLICAS},
            "autoscaling": {"enabled": True, "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 0},
        })
        self.profile = api.ServingProfileSpec.model_validate({
            "tenant": "local", "namespaceSelector": {}, "accelerator": {"pricePerHourUSD": plan.price_per_hour},
            "limits": {"maxReplicas": MAX_REPLICAS}})
        self.status = api.AutoscalingStatus()
        self.decisions: list[dict] = []

    def __call__(self, now, windows) -> None:
        revisions = [w.revision for w in windows]
        self.status, decision = autoscale.tick(self.status, windows, revisions, {}, self.spec, self.profile,
                                               self.plan.slo, len(windows), True, now, startup_seconds=0.0)
        self.decisions.append({"at": timestamp(now), "replicas": decision.replicas,
                               "reason": decision.reason})
        say(f"       autoscaler: {decision.replicas} replica(s) for this load: {decision.reason}")


def revision_report(analyses: list[dict], role: str) -> dict:
    """Medians over the analyses that measured the revision (None where none did)."""
    windows = [a[role] for a in analyses if a[role].get("missing") is None]

    def median(key):
        values = [w[key] for w in windows if w.get(key) is not None]
        return statistics.median(values) if values else None

    positions = [w["accepted_per_position"] for w in windows if w.get("accepted_per_position")]
    per_position = [statistics.mean(p[i] for p in positions if len(p) > i)
                    for i in range(max((len(p) for p in positions), default=0))]
    return {
        "acceptanceLength": median("acceptance_length"),
        "acceptedPerPosition": per_position,
        "tokensPerSecond": median("tokens_per_second"),
        "p99InterTokenLatencyMs": median("p99_inter_token_latency_ms"),
        "p99TimeToFirstTokenMs": median("p99_time_to_first_token_ms"),
        "tokensPerDollar": median("tokens_per_dollar"),
        "analyses": len(windows),
    }


def report(plan: Plan, outcome, autoscaler: Autoscaler, charts: list[str]) -> dict:
    last = outcome.analyses[-1] if outcome.analyses else None
    return {
        "decision": outcome.decision,
        "reason": outcome.reason,
        "lastAnalysis": {"verdict": last["verdict"], "reasons": last["reasons"]} if last else None,
        "pricePerHourUSD": plan.price_per_hour,
        "revisions": {role: {"revision": getattr(plan, role).revision, "speculator": getattr(plan, role).describe(),
                             **revision_report(outcome.analyses, role)} for role in ("stable", "candidate")},
        "autoscaler": autoscaler.decisions[-1] if autoscaler.decisions else None,
        "measuredThrough": "prometheus" if outcome.prometheus else "direct /metrics scrapes",
        "charts": charts,
    }


def _cell(value, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def text_report(result: dict) -> str:
    header = f"{'revision':<30} {'accept len':>10} {'tokens/s':>9} {'p99 ITL ms':>10} {'p99 TTFT ms':>11} {'tokens/$':>11}"
    rows = [header]
    for role, r in result["revisions"].items():
        rows.append(f"{role + ' ' + r['revision'] + ' (' + r['speculator'] + ')':<30.30} "
                    f"{_cell(r['acceptanceLength'], 2):>10} {_cell(r['tokensPerSecond'], 1):>9} "
                    f"{_cell(r['p99InterTokenLatencyMs'], 1):>10} {_cell(r['p99TimeToFirstTokenMs'], 0):>11} "
                    f"{_cell(r['tokensPerDollar'], 0):>11}")
    rows.append(f"(medians over the analyses; tokens/$ at ${result['pricePerHourUSD']:g} per replica-hour; "
                f"measured through {result['measuredThrough']})")
    rows.append(f"\nVerdict: {result['decision']}: {result['reason'] or 'no decision'}")
    if result["lastAnalysis"]:
        rows += [f"  {reason}" for reason in result["lastAnalysis"]["reasons"]]
    if result["autoscaler"]:
        rows.append(f"\nAutoscaler at the last analysis: {result['autoscaler']['replicas']} replica(s): "
                    f"{result['autoscaler']['reason']}")
    if result["charts"]:
        rows.append("\nCharts: " + ", ".join(result["charts"]))
    return "\n".join(rows)


def write_charts(plan: Plan, outcome, out: Path) -> list[str]:
    """Acceptance by draft position, p99 latencies over time, the candidate's weight over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    analyses, written = outcome.analyses, []
    roles = {"stable": plan.stable.describe(), "candidate": plan.candidate.describe()}

    figure, axis = plt.subplots(figsize=(7, 4))
    per_position = {role: revision_report(analyses, role)["acceptedPerPosition"] for role in roles}
    for offset, role in ((-0.2, "stable"), (0.2, "candidate")):
        axis.bar([i + 1 + offset for i in range(len(per_position[role]))], per_position[role], width=0.4,
                 label=f"{role}: {roles[role]}")
    axis.set_xticks(range(1, max(len(p) for p in per_position.values()) + 1))
    axis.set_xlabel("draft position")
    axis.set_ylabel("accepted / drafted")
    axis.set_title("Acceptance by draft position")
    axis.legend()
    written.append(_save(figure, out / "acceptance-by-position.png"))

    seconds = _seconds(analyses)
    figure, (itl, ttft) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for role in ("stable", "candidate"):
        itl.plot(seconds, [a[role].get("p99_inter_token_latency_ms") for a in analyses], marker="o", label=roles[role])
        ttft.plot(seconds, [a[role].get("p99_time_to_first_token_ms") for a in analyses], marker="o", label=roles[role])
    if plan.slo.p99_inter_token_latency_ms is not None:
        itl.axhline(plan.slo.p99_inter_token_latency_ms, color="red", linestyle="--", label="SLO")
    itl.set_ylabel("p99 ITL (ms)")
    ttft.set_ylabel("p99 TTFT (ms)")
    ttft.set_xlabel("seconds since the first analysis")
    itl.legend()
    written.append(_save(figure, out / "latency-over-time.png"))

    figure, axis = plt.subplots(figsize=(7, 3.5))
    axis.step(seconds, [a["weight"] for a in analyses], where="post", label="candidate weight")
    for second, analysis in zip(seconds, analyses):
        axis.annotate(analysis["verdict"][0], (second, analysis["weight"]), textcoords="offset points", xytext=(0, 6))
    axis.set_ylim(0, 105)
    axis.set_ylabel("candidate weight (%)")
    axis.set_xlabel("seconds since the first analysis (P/F/I: the analysis' verdict)")
    axis.set_title(f"Rollout: {outcome.decision}")
    written.append(_save(figure, out / "step-weight-over-time.png"))
    return written


def _seconds(analyses: list[dict]) -> list[float]:
    times = [parse_time(a["at"]) for a in analyses]
    return [(t - times[0]).total_seconds() for t in times]


def _save(figure, path: Path) -> str:
    import matplotlib.pyplot as plt

    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return str(path)


def cmd_demo(args) -> int:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("specserve demo: the charts need matplotlib: pip install 'specserve[demo]'", file=sys.stderr)
        return 2
    try:
        plan = make_plan(args)
    except CanaryError as exc:
        print(f"specserve demo: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        print(f"specserve demo: --out: {out} exists and is not a directory", file=sys.stderr)
        return 2
    autoscaler = Autoscaler(plan)
    say(f"specserve demo: stable {plan.stable.describe()} against candidate {plan.candidate.describe()}, "
        f"steps {[s.weight for s in plan.rollout.steps]} % every {plan.rollout.analysis.interval_seconds} s")
    outcome, code = run_to_the_end(plan, "demo", on_windows=autoscaler)
    if code == 1:
        return 1
    charts = write_charts(plan, outcome, out) if outcome.analyses else []
    result = report(plan, outcome, autoscaler, charts)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result) if args.json else text_report(result), flush=True)
    return code or 0


DESCRIPTION = """\
The project's main job on one machine: an EAGLE-3 stable and a DFlash candidate runtime (the
bundled drafters) on the default model, the operator's canary analysis and rollout deciding on
their live metrics (Prometheus when installed, else direct scrapes), the operator's autoscaler
recommending a replica count from the same windows at every analysis, a table row per analysis,
and at the end a report (per revision: acceptance length, tokens/s, p99 ITL and TTFT, tokens per
dollar; the verdict with its reasons) and PNG charts in --out. Every `specserve canary` flag
works here; only the defaults differ. About a minute on 2 CPU cores when the candidate loses
(53 s measured), three when it passes both steps. Exit status as canary."""


def add_commands(commands) -> None:
    demo = commands.add_parser("demo", help="the canary analysis and the autoscaler on two local runtimes, with charts",
                               description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_rollout_flags(demo, DEFAULTS)
    demo.add_argument("--out", default="specserve-demo", help="where the report and charts go (default %(default)s)")
    demo.set_defaults(run=cmd_demo)
