"""The kopf handlers: the only module with kopf decorators. Each one delegates to reconcile.py."""

import asyncio
import collections
import contextlib
import datetime
import os
import threading
from pathlib import Path

import kopf
from kubernetes.client.rest import ApiException
from prometheus_client import Counter, Gauge
from specserve_runtime.performance import Performance

from . import api
from .apply import Cluster
from .measure import PrometheusSource, ScrapeSource
from .reconcile import Outcome, cleanup, condition_true, reconcile
from .render import Settings
from .priors import capacity_priors, load_performance
from .schedule import draft_lengths
from .validate import InputProblems


def seconds_from_env(name: str, default: float) -> float:
    """A duration setting from the environment; a value that is not a positive number is an error naming it."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise InputProblems([f"{name}={raw!r}: expected a positive number of seconds (default {default:g})"])
    return value


def settings_from_env() -> Settings:
    """The operator's settings from its environment (the chart sets them); a bad one is an error naming it."""
    priors = os.environ.get("SPECSERVE_CAPACITY_PRIORS")
    performance = load_performance(Path(priors)) if priors else Performance()
    return Settings(
        monitoring_namespace=os.environ.get("SPECSERVE_MONITORING_NAMESPACE", "monitoring"),
        operator_namespace=os.environ.get("SPECSERVE_OPERATOR_NAMESPACE", "specserve-system"),
        autoscale_interval_seconds=seconds_from_env("SPECSERVE_AUTOSCALE_INTERVAL_SECONDS", 30),
        capacity_priors=capacity_priors(performance),
        draft_lengths=draft_lengths(performance),
        replica_startup_seconds=seconds_from_env("SPECSERVE_REPLICA_STARTUP_SECONDS", 120),
    )


SERVINGS = (api.GROUP, api.VERSION, "speculativeservings")
PROFILES = (api.GROUP, api.VERSION, "servingprofiles")
RESYNC_SECONDS = seconds_from_env("SPECSERVE_RESYNC_SECONDS", 30)
# While a rollout runs or autoscaling is on, reconcile this often: an analysis is due every
# spec.rollout.analysis.intervalSeconds (at least 10 s), an autoscaling evaluation every
# SPECSERVE_AUTOSCALE_INTERVAL_SECONDS; this tick bounds how late they run and how soon an
# annotation is acted on.
DECISION_TICK_SECONDS = seconds_from_env("SPECSERVE_DECISION_TICK_SECONDS", 5)


RECONCILES = Counter("specserve_operator_reconciles", "Reconciliations of SpeculativeServings", ["result"])
ROLLOUTS = Counter("specserve_operator_rollouts", "Finished canary rollouts", ["outcome"])
ANALYSES = Counter("specserve_operator_analyses", "Canary analysis intervals by verdict", ["verdict"])
GATES = Counter("specserve_operator_analysis_gates", "Canary analysis gate results", ["gate", "verdict"])
STEP = Gauge("specserve_operator_rollout_step", "Current canary step (-1: no canary)", ["namespace", "serving"])
DESIRED = Gauge("specserve_operator_desired_replicas", "Replicas the autoscaler decided", ["namespace", "serving"])
TOKENS_PER_DOLLAR = Gauge("specserve_operator_tokens_per_dollar",
                          "Generated tokens per dollar of the serving's replicas over the last window (status.metrics)",
                          ["namespace", "serving"])
GOODPUT = Gauge("specserve_operator_goodput_tokens_per_second",
                "Generated tokens per second served within the SLO over the last autoscaling window (status.metrics)",
                ["namespace", "serving"])
SPECULATION_DEGRADED = Gauge("specserve_operator_speculation_degraded",
                             "1 while the live revision's speculation no longer pays (condition SpeculationDegraded)", ["namespace", "serving"])
ACCEPTANCE_RATIO = Gauge("specserve_operator_acceptance_ratio",
                         "The live revision's acceptance length over its baseline, last analysis", ["namespace", "serving"])
SLO_ITL = Gauge("specserve_operator_slo_p99_inter_token_latency_seconds",
                "The serving's SLO on p99 inter-token latency (spec.autoscaling.slo, else its profile's)", ["namespace", "serving"])
SLO_TTFT = Gauge("specserve_operator_slo_p99_time_to_first_token_seconds",
                 "The serving's SLO on p99 time to first token (spec.autoscaling.slo, else its profile's)", ["namespace", "serving"])
SPEEDUP = Gauge("specserve_operator_speculation_speedup",
                "Plain decoding's predicted time per token at the load measured over the live revision's, last analysis",
                ["namespace", "serving"])


SERVING_GAUGES = (STEP, DESIRED, TOKENS_PER_DOLLAR, GOODPUT, SPECULATION_DEGRADED, ACCEPTANCE_RATIO, SLO_ITL, SLO_TTFT, SPEEDUP)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_):
    settings.persistence.finalizer = "specserve.io/cleanup"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="specserve.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="specserve.io", key="last-handled-configuration"
    )
    settings.posting.level = 20  # INFO and above become Kubernetes Events
    settings.watching.server_timeout = 300
    memo.cluster = memo.get("cluster") or Cluster()
    memo.settings = settings_from_env()
    # Canary measurements: Prometheus when configured, else the runtime pods' /metrics directly.
    prometheus = os.environ.get("SPECSERVE_PROMETHEUS_URL", "").strip()
    memo.source = memo.get("source") or (PrometheusSource(prometheus) if prometheus else ScrapeSource())
    # While Prometheus cannot be asked, the autoscaler measures the pods' /metrics directly.
    memo.fallback = memo.get("fallback") or (ScrapeSource() if prometheus else None)
    memo.clock = memo.get("clock") or (lambda: datetime.datetime.now(datetime.timezone.utc))
    # kopf runs a resource's timers concurrently with its event handlers: one reconcile at a time per object.
    memo.locks = collections.defaultdict(threading.Lock)


def _lock_key(namespace, name, uid) -> tuple:
    return namespace, name, uid


def _reconcile_blocking(namespace: str, name: str, uid: str | None, memo: kopf.Memo) -> tuple[dict, Outcome] | None:
    """Under the object's lock: re-read the object, reconcile it, write its status.

    The body a handler was called with can be older than what another handler already acted on
    (a resync timer that started before a spec change): acting on it would undo the newer work,
    e.g. delete the revision the change just created. So every reconcile reads the object afresh,
    and patches status before releasing the lock, so the next one sees the state it left. The
    status patch carries the resourceVersion it was computed from: a writer whose view went stale
    meanwhile (another operator process) gets a conflict instead of overwriting newer status.
    """
    cluster: Cluster = memo.cluster
    with memo.locks[_lock_key(namespace, name, uid)]:
        body = cluster.get(api.API_VERSION, "SpeculativeServing", namespace, name)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return None  # deleted meanwhile: the delete handler cleans up, nothing may be re-created
        outcome = reconcile(cluster, body, memo.settings, memo.source, memo.clock(), memo.fallback)
        version = (body.get("metadata") or {}).get("resourceVersion")
        try:
            cluster.patch_status(api.API_VERSION, "SpeculativeServing", namespace, name, outcome.status, version)
            if outcome.consumed_annotations:
                cluster.remove_annotations(api.API_VERSION, "SpeculativeServing", namespace, name, outcome.consumed_annotations)
        except ApiException as exc:
            if exc.status not in (404, 409):  # deleted, or changed meanwhile: the next reconcile decides afresh
                raise
            return None
    return body, outcome


async def _reconcile_and_report(namespace: str, name: str, uid: str | None, memo: kopf.Memo, logger) -> None:
    """Handlers are async so that kopf can cancel them on shutdown; the blocking client runs in a thread."""
    result = await asyncio.to_thread(_reconcile_blocking, namespace, name, uid, memo)
    if result is None:
        return
    body, outcome = result
    if outcome.problems:
        RECONCILES.labels("invalid").inc()
        kopf.warn(body, reason="InvalidSpec", message="; ".join(outcome.problems))
        logger.warning("invalid: %s", "; ".join(outcome.problems))
        return
    RECONCILES.labels("applied").inc()
    changed = {k: v for k, v in outcome.applied.items() if v != "unchanged"}
    if changed or outcome.deleted:
        kopf.info(body, reason="Reconciled", message=f"applied {sorted(changed)}; deleted {outcome.deleted}")
    for event in outcome.events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)
        if event.reason in ("Promoted", "RolloutAborted"):
            ROLLOUTS.labels(event.reason.removeprefix("Rollout")).inc()
    if outcome.report is not None:
        ANALYSES.labels(outcome.report.verdict).inc()
        for gate in outcome.report.gates:
            GATES.labels(gate.name, gate.verdict).inc()
    publish_status(namespace, name, outcome.status, outcome.slo)


def publish_status(namespace: str, name: str, status: dict, slo: api.Slo | None) -> None:
    """The serving's gauges from the status just written and the SLO it is held to (what the dashboard and the
    alerts read)."""
    for gauge, ms in ((SLO_ITL, slo and slo.p99_inter_token_latency_ms), (SLO_TTFT, slo and slo.p99_time_to_first_token_ms)):
        if ms is not None:
            gauge.labels(namespace, name).set(ms / 1000)
    canary = status.get("canary")
    STEP.labels(namespace, name).set(canary["step"] if canary else -1)
    if status.get("autoscaling"):
        DESIRED.labels(namespace, name).set(status["autoscaling"].get("desiredReplicas") or 0)
    for gauge, key in ((TOKENS_PER_DOLLAR, "tokensPerDollar"), (GOODPUT, "goodputTokensPerSecond")):
        if (status.get("metrics") or {}).get(key) is not None:
            gauge.labels(namespace, name).set(status["metrics"][key])
    SPECULATION_DEGRADED.labels(namespace, name).set(condition_true(status, "SpeculationDegraded"))
    last = (status.get("speculation") or {}).get("lastAnalysis") or {}
    for gauge, key in ((ACCEPTANCE_RATIO, "acceptanceRatio"), (SPEEDUP, "speedup")):
        if key in last:
            gauge.labels(namespace, name).set(last[key])


@kopf.on.resume(*SERVINGS)
@kopf.on.create(*SERVINGS)
@kopf.on.update(*SERVINGS, field="spec")
async def serving_changed(namespace, name, uid, memo: kopf.Memo, logger, **_):
    await _reconcile_and_report(namespace, name, uid, memo, logger)


@kopf.timer(*SERVINGS, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS, idle=RESYNC_SECONDS)
async def serving_resync(namespace, name, uid, memo: kopf.Memo, logger, **_):
    """Picks up what no event announces: Deployments becoming ready, drift of children."""
    await _reconcile_and_report(namespace, name, uid, memo, logger)


def _decides(spec, status, **_) -> bool:
    """A rollout (the spec's, a fallback's or an applied draft-length schedule's) or autoscaling to decide on."""
    return bool(spec.get("rollout")) or bool((spec.get("autoscaling") or {}).get("enabled")) or \
        bool(status.get("fallback")) or bool((status.get("draftSchedule") or {}).get("applied"))


@kopf.timer(*SERVINGS, interval=DECISION_TICK_SECONDS, when=_decides)
async def decision_tick(namespace, name, uid, memo: kopf.Memo, logger, **_):
    """Analyses and autoscaling evaluations when due, step advances, the promote / abort / retry annotations."""
    await _reconcile_and_report(namespace, name, uid, memo, logger)


@kopf.on.delete(*SERVINGS)
async def serving_deleted(namespace, name, uid, memo: kopf.Memo, logger, **_):
    deleted = await asyncio.to_thread(_cleanup_blocking, namespace, name, uid, memo)
    for gauge in SERVING_GAUGES:  # a deleted serving's series end: its alerts resolve, its panels empty
        with contextlib.suppress(KeyError):  # a gauge never set for it
            gauge.remove(namespace, name)
    logger.info("deleted %s", deleted)


def _cleanup_blocking(namespace, name, uid, memo: kopf.Memo) -> list[str]:
    """Under the object's lock, so that a resync in flight cannot re-apply children behind the cleanup."""
    with memo.locks[_lock_key(namespace, name, uid)]:
        deleted = cleanup(memo.cluster, name, namespace)
    memo.locks.pop(_lock_key(namespace, name, uid), None)
    return deleted


@kopf.index(*SERVINGS)
def servings_by_profile(namespace, name, uid, spec, **_):
    """The servings kopf watches (only the operator's namespaces), by the profile they reference."""
    return {spec.get("profile"): (namespace, name, uid)}


@kopf.on.create(*PROFILES)
@kopf.on.update(*PROFILES, field="spec")
async def profile_changed(name, servings_by_profile: kopf.Index, memo: kopf.Memo, logger, **_):
    """A profile change (price, limits, selector) re-renders every serving that references it, in the namespaces
    the operator watches: a profile is cluster-scoped, the operator's scope may not be."""
    for namespace, serving, uid in list(servings_by_profile.get(name, [])):
        await _reconcile_and_report(namespace, serving, uid, memo, logger)
