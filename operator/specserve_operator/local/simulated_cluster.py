"""The operator on a simulated fleet: an in-memory cluster whose Deployments are the fleet, the measurement
sources (Prometheus, and the pods' own /metrics), and the operator's reconcile run on them every tick.
"""

import json
from dataclasses import dataclass

import yaml
from specserve_runtime.config import CONFIG_FILE, RuntimeConfig

from .. import api
from ..measure import MeasurementError, Target, Window
from ..priors import capacity_priors
from ..reconcile import reconcile
from ..render import Settings
from ..rollout import Event, timestamp
from ..schedule import draft_lengths
from .fleet import Fleet
from .fleet_model import NAMESPACE, SERVING, at
from .scenario import Scenario, ScenarioError

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
        """The ReplicaSet controller: the fleet runs what the Deployments say (a deleted one: nothing), each revision
        as its runtime configuration (its ConfigMap) says."""
        counts = {revision: 0 for revision in self.fleet.revisions_with_pods()}
        for (_, kind, _, name), obj in self.objects.items():
            if kind == "Deployment":
                revision = obj["metadata"]["labels"]["specserve.io/revision"]
                config = self.objects[self._key("v1", "ConfigMap", NAMESPACE, name)]["data"][CONFIG_FILE]
                self.fleet.add_revision(revision, RuntimeConfig.model_validate(yaml.safe_load(config)))
                counts[revision] = obj["spec"]["replicas"]
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
        return self.fleet.window(target.revision, seconds, self.fleet.now, itl_objective_ms=target.itl_objective_ms,
                                 ttft_objective_ms=target.ttft_objective_ms)


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
        return self.fleet.window(target.revision, now - last, now, itl_objective_ms=target.itl_objective_ms,
                                 ttft_objective_ms=target.ttft_objective_ms)


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
                                 draft_lengths=draft_lengths(scenario.performance),
                                 replica_startup_seconds=scenario.startup_seconds,
                                 inter_token_latency_per_step=False)
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
