"""Canary rollouts, and the fallback a degraded drafter starts, through the real kopf operator against KMock.

Measurements come from a scripted source (the real sources are tested against a real Prometheus
in test_measure.py) and time from a clock the test advances, so a 60-second analysis interval
takes as long as one timer tick.
"""

import copy
import datetime

import pytest
from prometheus_client import REGISTRY

from specserve_operator.measure import MeasurementError, Window
from specserve_operator.rollout import timestamp

from .conftest import SERVINGS_RESOURCE, running_operator
from .test_kopf_kmock import DEPLOYMENTS, create, eventually, live, merge_patch, set_ready, status_of, with_uid

ROUTES = "gateway.networking.k8s.io/v1/httproutes"
GOOD = dict(seconds=30, ready_replicas=1, tokens_per_second=300.0, generated_tokens=9000, p99_inter_token_latency_ms=20.0,
            p99_time_to_first_token_ms=150.0, acceptance_length=3.5, finished_requests=40, error_rate=0.0,
            in_flight_per_replica=2.0)
STABLE = {**GOOD, "tokens_per_second": 200.0, "p99_inter_token_latency_ms": 30.0, "acceptance_length": 2.0}
UNTRAINED = {**GOOD, "acceptance_length": 1.05, "tokens_per_second": 150.0, "p99_inter_token_latency_ms": 45.0}


class ScriptedSource:
    """Windows by revision: the stable's numbers unless the test scripted the revision; or an outage."""

    name = "Prometheus"

    def __init__(self):
        self.by_revision: dict[str, dict] = {}
        self.outage = False
        self.calls = 0
        self.measured: list[str] = []  # the revisions asked for, in order
        self.targets = []

    def measure(self, target, seconds):
        self.calls += 1
        self.measured.append(target.revision)
        self.targets.append(target)
        if self.outage:
            raise MeasurementError("Prometheus http://prometheus.monitoring:9090 unreachable (connection refused)")
        fields = self.by_revision.get(target.revision, STABLE)
        return Window(revision=target.revision, **{**fields, "ready_replicas": target.ready_replicas})


class Clock:
    def __init__(self):
        self.now = datetime.datetime(2026, 11, 23, 10, 0, 0, tzinfo=datetime.timezone.utc)

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += datetime.timedelta(seconds=seconds)


@pytest.fixture
def source():
    return ScriptedSource()


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
async def operator(emulator, source, clock):
    async with running_operator(emulator, source=source, clock=clock):
        yield emulator


def with_rollout(serving, auto_promote=True, gateway=False):
    serving = copy.deepcopy(serving)
    serving["spec"]["replicas"] = {"min": 4, "max": 4}
    serving["spec"]["rollout"] = {
        "candidate": {"speculator": {"method": "dflash", "draftModel": "hf://z-lab/Qwen3-8B-DFlash-b16", "numSpeculativeTokens": 15}},
        "steps": [{"weight": 25, "analysisSeconds": 60}, {"weight": 50, "analysisSeconds": 60}],
        "analysis": {"intervalSeconds": 30, "minAcceptanceLength": 3.0, "maxP99LatencyRatio": 1.05,
                     "minTokensPerDollarGain": 1.1, "failureLimit": 2},
        "autoPromote": auto_promote,
    }
    if gateway:
        serving["spec"]["traffic"] = {"mode": "GatewayAPI", "gateway": {"parentRefs": [{"name": "gw", "namespace": "gateways"}]}}
    return serving


def deployment(emulator, revision, name="qwen3-8b"):
    return emulator.objects[DEPLOYMENTS, "team-a", f"{name}-{revision}"]


def events(emulator, reason):
    """Messages of the Events posted with this reason. Read from the requests: KMock ignores the
    generateName kopf posts Events with, so it stores only the first one per namespace."""
    found = []
    for request in list(emulator):
        if request.method.value == "POST" and request.resource is not None and request.resource.plural == "events":
            if (request.data or {}).get("reason") == reason:
                found.append(request.data["message"])
    return found


async def start_canary(emulator, serving, profile, source, candidate_numbers=GOOD):
    """Create the serving, wait for both revisions, script the candidate's numbers, make the pods ready."""
    await create(emulator, profile)
    await create(emulator, with_uid(serving))
    canary = await eventually(lambda: (status_of(emulator).get("canary") or {}).get("revision"))
    source.by_revision[canary] = candidate_numbers
    stable = status_of(emulator)["stable"]["revision"]
    await eventually(lambda: len(live(emulator, DEPLOYMENTS)) == 2)
    await set_ready(emulator, f"qwen3-8b-{stable}", 3)
    await set_ready(emulator, f"qwen3-8b-{canary}", 1)
    return stable, canary


def canary_field(emulator, key):
    return (status_of(emulator).get("canary") or {}).get(key)


async def test_passing_analyses_walk_the_steps_and_promote_without_restarting_pods(operator, serving, profile, source, clock):
    stable, canary = await start_canary(operator, with_rollout(serving), profile, source)
    assert status_of(operator)["phase"] == "Progressing" and canary_field(operator, "weight") == 25
    assert [deployment(operator, r)["spec"]["replicas"] for r in (stable, canary)] == [3, 1]
    template = copy.deepcopy(deployment(operator, canary)["spec"]["template"])

    clock.advance(30)  # first analysis: passes, but step 0 holds for 60 s
    assert await eventually(lambda: len(canary_field(operator, "history") or []) == 1)
    assert canary_field(operator, "step") == 0 and canary_field(operator, "lastAnalysis")["verdict"] == "Pass"
    clock.advance(30)
    assert await eventually(lambda: canary_field(operator, "step") == 1)
    assert canary_field(operator, "weight") == 50
    assert await eventually(lambda: [deployment(operator, r)["spec"]["replicas"] for r in (stable, canary)] == [2, 2])
    assert await eventually(lambda: events(operator, "StepAdvanced"))

    clock.advance(30)  # step 1 needs one passing analysis per interval: two
    assert await eventually(lambda: canary_field(operator, "passedChecks") == 1)
    clock.advance(30)
    assert await eventually(lambda: status_of(operator).get("phase") == "Promoting")
    promoted = deployment(operator, canary)
    assert promoted["metadata"]["labels"]["specserve.io/role"] == "stable"
    assert promoted["spec"]["template"] == template  # same pods: promotion restarts nothing
    # maxReplicas (4) is a wall for the handover too: beside the old stable's 2 pods, the promoted
    # revision keeps its 2 until they are ready; then the old one makes way one pod at a time
    assert deployment(operator, canary)["spec"]["replicas"] == 2
    assert stable in [name.removeprefix("qwen3-8b-") for name in live(operator, DEPLOYMENTS)]  # old serves until ready
    await set_ready(operator, f"qwen3-8b-{canary}", 2)
    assert await eventually(lambda: [deployment(operator, r)["spec"]["replicas"] for r in (stable, canary)] == [1, 3])
    await set_ready(operator, f"qwen3-8b-{canary}", 3)
    assert await eventually(lambda: [deployment(operator, r)["spec"]["replicas"] for r in (stable, canary)] == [0, 4])
    await set_ready(operator, f"qwen3-8b-{canary}", 4)
    assert await eventually(lambda: live(operator, DEPLOYMENTS) == [f"qwen3-8b-{canary}"])
    assert await eventually(lambda: status_of(operator).get("phase") == "Serving")
    status = status_of(operator)
    assert status["stable"]["revision"] == canary and status["lastRollout"]["outcome"] == "Promoted"
    assert status.get("canary") is None
    assert events(operator, "Promoted")


async def test_a_failing_candidate_rolls_back_within_the_failure_limit(operator, serving, profile, source, clock, reconciles):
    stable, canary = await start_canary(operator, with_rollout(serving), profile, source, UNTRAINED)

    clock.advance(30)
    assert await eventually(lambda: canary_field(operator, "failedChecks") == 1)
    assert status_of(operator)["phase"] == "Progressing"
    clock.advance(30)
    assert await eventually(lambda: (status_of(operator).get("lastRollout") or {}).get("outcome") == "Aborted")
    status = status_of(operator)
    aborted = next(c for c in status["conditions"] if c["type"] == "RolloutAborted")
    assert aborted["status"] == "True" and "acceptanceLength: Fail (1.05 < 3)" in aborted["message"]
    assert await eventually(lambda: deployment(operator, canary)["spec"]["replicas"] == 0)  # kept, for inspection
    assert await eventually(lambda: deployment(operator, stable)["spec"]["replicas"] == 4)
    assert status_of(operator)["phase"] == "RollingBack"  # the candidate's pod is still ready
    await set_ready(operator, f"qwen3-8b-{canary}", 0)
    await set_ready(operator, f"qwen3-8b-{stable}", 4)
    assert await eventually(lambda: status_of(operator).get("phase") == "Serving")
    assert any("p99LatencyRatio: Fail" in message for message in await eventually(lambda: events(operator, "RolloutAborted")))

    clock.advance(600)  # no retry while the candidate is unchanged
    calls = source.calls
    await reconciles.more()  # several passes: the candidate is not measured again, nothing restarts
    # The stable alone may be (its speculation health, once per minute of the clock).
    assert set(source.measured[calls:]) <= {stable} and status_of(operator)["lastRollout"]["outcome"] == "Aborted"
    assert deployment(operator, canary)["spec"]["replicas"] == 0


async def test_abort_then_retry_annotations(operator, serving, profile, source):
    stable, canary = await start_canary(operator, with_rollout(serving), profile, source)
    await merge_patch(operator, serving, {"metadata": {"annotations": {"specserve.io/abort": "true"}}})
    assert await eventually(lambda: (status_of(operator).get("lastRollout") or {}).get("outcome") == "Aborted")
    assert await eventually(lambda: "specserve.io/abort" not in (operator.objects[SERVINGS_RESOURCE, "team-a", "qwen3-8b"]["metadata"].get("annotations") or {}))
    assert "aborted by annotation" in status_of(operator)["lastRollout"]["message"]

    await merge_patch(operator, serving, {"metadata": {"annotations": {"specserve.io/retry": "true"}}})
    assert await eventually(lambda: status_of(operator).get("lastRollout") is None and canary_field(operator, "step") == 0)
    assert await eventually(lambda: deployment(operator, canary)["spec"]["replicas"] == 1)
    assert status_of(operator)["phase"] == "Progressing"


async def test_without_auto_promote_the_last_step_waits_for_the_promote_annotation(operator, serving, profile, source, clock):
    stable, canary = await start_canary(operator, with_rollout(serving, auto_promote=False), profile, source)
    for _ in range(4):
        clock.advance(30)
        history = len(canary_field(operator, "history") or [])
        assert await eventually(lambda: len(canary_field(operator, "history") or []) > history)
    assert await eventually(lambda: canary_field(operator, "state") == "AwaitingPromotion")
    assert status_of(operator)["phase"] == "Progressing"
    await merge_patch(operator, serving, {"metadata": {"annotations": {"specserve.io/promote": "true"}}})
    assert await eventually(lambda: (status_of(operator).get("lastRollout") or {}).get("outcome") == "Promoted")


async def test_an_operator_restart_mid_step_resumes_without_replaying_or_skipping(emulator, serving, profile, source, clock,
                                                                                  reconciles):
    async with running_operator(emulator, source=source, clock=clock):
        stable, canary = await start_canary(emulator, with_rollout(serving), profile, source)
        clock.advance(30)
        assert await eventually(lambda: len(canary_field(emulator, "history") or []) == 1)
        clock.advance(30)
        assert await eventually(lambda: canary_field(emulator, "step") == 1)
        before = copy.deepcopy(status_of(emulator)["canary"])
    clock.advance(10)  # the new operator starts 10 s into step 1: nothing is due yet
    async with running_operator(emulator, source=source, clock=clock):
        calls = source.calls
        await reconciles.more()  # several passes of the new operator
        assert source.calls == calls  # nothing was due: no interval replayed
        after = status_of(emulator)["canary"]
        assert (after["step"], after["stepStartedAt"], after["history"]) == (before["step"], before["stepStartedAt"], before["history"])
        clock.advance(20)  # the interval since the last analysis is complete: exactly one more analysis
        assert await eventually(lambda: len(canary_field(emulator, "history")) == len(before["history"]) + 1), \
            (before["history"], status_of(emulator)["canary"]["history"], clock.now)
        assert canary_field(emulator, "step") == 1


async def test_a_prometheus_outage_holds_the_step_and_says_so(operator, serving, profile, source, clock):
    stable, canary = await start_canary(operator, with_rollout(serving), profile, source)
    source.outage = True
    for count in range(1, 4):
        clock.advance(60)
        assert await eventually(lambda: canary_field(operator, "inconclusiveChecks") == count)
    status = status_of(operator)
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["MetricsAvailable"]["status"] == "False" and "unreachable" in conditions["MetricsAvailable"]["message"]
    assert conditions["AnalysisInconclusive"]["status"] == "True"
    assert status["phase"] == "Progressing" and canary_field(operator, "step") == 0  # held, never promoted
    assert await eventually(lambda: events(operator, "MeasurementFailed"))
    source.outage = False
    clock.advance(30)  # the outage lost no step, and its time completed nothing: two passes still needed
    assert await eventually(lambda: canary_field(operator, "passedChecks") == 1)
    assert canary_field(operator, "step") == 0
    clock.advance(30)
    assert await eventually(lambda: canary_field(operator, "step") == 1)
    conditions = {c["type"]: c for c in status_of(operator)["conditions"]}
    assert conditions["MetricsAvailable"]["status"] == "True" and conditions["AnalysisInconclusive"]["status"] == "False"


async def test_the_autoscaler_sizes_the_serving_from_measurements(operator, serving, profile, source, clock):
    """Autoscaling on: every SPECSERVE_AUTOSCALE_INTERVAL_SECONDS (30 s) the operator measures, decides
    and applies; status and Events carry the numbers; no data holds the count."""
    serving = copy.deepcopy(serving)
    serving["spec"]["replicas"] = {"min": 1, "max": 4}
    serving["spec"]["autoscaling"] = {"enabled": True, "slo": {"p99InterTokenLatencyMs": 8},
                                      "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 0}
    await create(operator, profile)
    await create(operator, with_uid(serving))
    name = (await eventually(lambda: live(operator, DEPLOYMENTS)))[0]
    await set_ready(operator, name, 2)  # replicas.min is 1; 2 ready pods
    # One window: 40 requests finished in 30 s (1.33/s, 225 tokens each), 500 tokens/s, 4 in flight
    # per replica at p99 ITL 20 ms: 16 ms in the system per token (4 x 2 / 500). One window has no
    # spread in load, so the model takes throughput as fixed: p99 ITL 5 ms x c, and the time in the
    # system the service of c + 1 requests, T(c) = 225 x 3.2 ms x (c + 1). With 20% headroom a
    # replica of n gets 1.6/n requests/s: utilisation u = 1.152/n, past the 0.85 limit at n = 1;
    # c = u / (1 - u) in flight: 1.36 at n = 2, p99 ITL 5 ms x 1.36 x (1 + 0.38 margin) = 9.4 ms,
    # over the 8 ms SLO; 0.62 at n = 3, 4.3 ms, within it.
    source.by_revision[name.removeprefix("qwen3-8b-")] = {**STABLE, "tokens_per_second": 500.0, "in_flight_per_replica": 4.0,
                                                          "p99_inter_token_latency_ms": 20.0, "within_slo": 0.9}
    clock.advance(30)
    assert await eventually(lambda: (status_of(operator).get("autoscaling") or {}).get("desiredReplicas") == 3)
    assert await eventually(lambda: deployment(operator, name.removeprefix("qwen3-8b-"))["spec"]["replicas"] == 3)
    scaling = status_of(operator)["autoscaling"]
    assert scaling["demandRequestsPerSecond"] == pytest.approx(40 / 30) and scaling["demandTokensPerRequest"] == 225
    assert "demand 1.33 req/s x 225 tokens (x1.2 headroom): 3 replicas predict p99 ITL 4.3ms" in scaling["reason"]
    assert scaling["observations"][-1]["msPerToken"] == pytest.approx(16.0)
    assert status_of(operator)["metrics"]["tokensPerSecond"] == 500.0
    assert status_of(operator)["metrics"]["goodputTokensPerSecond"] == pytest.approx(450.0)  # 90% within the SLO
    assert (source.targets[-1].itl_objective_ms, source.targets[-1].ttft_objective_ms) == (8, None)  # measured against it
    assert await eventually(lambda: any("1 -> 3 replicas" in m for m in events(operator, "Scaled")))

    source.outage = True
    clock.advance(30)
    assert await eventually(lambda: "no data" in (status_of(operator).get("autoscaling") or {}).get("reason", ""))
    conditions = {c["type"]: c for c in status_of(operator)["conditions"]}
    assert conditions["ScalingActive"]["status"] == "False"
    assert deployment(operator, name.removeprefix("qwen3-8b-"))["spec"]["replicas"] == 3  # held, not scaled to zero or max


async def test_gateway_api_weights_follow_the_steps(operator, serving, profile, source, clock):
    stable, canary = await start_canary(operator, with_rollout(serving, gateway=True), profile, source)

    def weights():
        route = operator.objects[ROUTES, "team-a", "qwen3-8b"]
        return [(b["name"], b["weight"]) for b in route["spec"]["rules"][0]["backendRefs"]]

    assert await eventually(lambda: weights() == [("qwen3-8b-stable", 75), ("qwen3-8b-canary", 25)])
    clock.advance(30)
    assert await eventually(lambda: canary_field(operator, "passedChecks") == 1)
    clock.advance(30)
    assert await eventually(lambda: weights() == [("qwen3-8b-stable", 50), ("qwen3-8b-canary", 50)])
    clock.advance(30)
    assert await eventually(lambda: (canary_field(operator, "step"), canary_field(operator, "passedChecks")) == (1, 1))
    clock.advance(30)
    assert await eventually(lambda: weights() == [("qwen3-8b-stable", 100)])

    def stable_selector():
        return operator.objects["v1/services", "team-a", "qwen3-8b-stable"]["spec"]["selector"]["specserve.io/revision"]

    assert stable_selector() == stable  # the promoted revision is not ready with all replicas yet
    await set_ready(operator, f"qwen3-8b-{canary}", 4)
    assert await eventually(lambda: stable_selector() == canary)


def speculation_of(emulator):
    return status_of(emulator).get("speculation") or {}


def condition(emulator, kind):
    return next((c for c in status_of(emulator).get("conditions") or [] if c["type"] == kind), {})


# Acceptance at 0.6 of the baseline below: degraded, above severeAcceptanceRatio (0.5), so it waits for sustainedAnalyses.
DEGRADED = {**GOOD, "acceptance_length": 2.1, "tokens_per_second": 150.0, "p99_inter_token_latency_ms": 45.0}


async def analysed(emulator, clock):
    """One more interval (30 s) of the live revision's continuous analysis."""
    clock.advance(30)
    assert await eventually(lambda: speculation_of(emulator).get("lastEvaluationTime") == timestamp(clock.now))


async def serve_drafter_with_a_baseline(emulator, serving, profile, source, clock) -> str:
    """A DFlash serving of 2 replicas whose fallback is plain decoding, live with its acceptance baseline (3.5)."""
    serving = copy.deepcopy(serving)
    serving["spec"]["speculator"] = {"method": "dflash", "draftModel": "hf://z-lab/Qwen3-8B-DFlash-b16", "numSpeculativeTokens": 15}
    serving["spec"]["replicas"] = {"min": 2, "max": 2}
    serving["spec"]["speculationHealth"] = {"intervalSeconds": 30, "sustainedAnalyses": 2,
                                            "fallback": {"speculator": {"method": "none"}}}
    await create(emulator, profile)
    await create(emulator, with_uid(serving))
    drafter = (await eventually(lambda: live(emulator, DEPLOYMENTS)))[0].removeprefix("qwen3-8b-")
    source.by_revision[drafter] = GOOD
    await set_ready(emulator, f"qwen3-8b-{drafter}", 2)
    while speculation_of(emulator).get("baselineAnalyses", 0) < 3:  # the first analysis may have seen no ready pod
        await analysed(emulator, clock)
    assert speculation_of(emulator)["baselineAcceptanceLength"] == pytest.approx(3.5)
    assert condition(emulator, "SpeculationDegraded")["status"] == "False"
    return drafter


async def test_a_degraded_drafter_falls_back_through_a_canary_and_says_so(operator, serving, profile, source, clock):
    """A live DFlash revision whose acceptance falls: the operator measures it every interval, sets
    SpeculationDegraded (condition, Event, gauge) once the fall is sustained (a Prometheus outage meanwhile
    neither counts nor clears), rolls the fallback out
    as a canary candidate, and promotes it once it wins its analyses; plain decoding then serves."""
    def degraded_gauge():
        return REGISTRY.get_sample_value("specserve_operator_speculation_degraded", {"namespace": "team-a", "serving": "qwen3-8b"})

    drafter = await serve_drafter_with_a_baseline(operator, serving, profile, source, clock)
    source.by_revision[drafter] = DEGRADED
    await analysed(operator, clock)  # one degraded analysis is not a sustained fall
    assert speculation_of(operator)["degradedAnalyses"] == 1
    assert condition(operator, "SpeculationDegraded")["reason"] == "NotSustained"
    assert not status_of(operator).get("fallback")
    source.outage = True  # Prometheus down: the analysis holds, and neither counts nor clears
    for _ in range(3):
        await analysed(operator, clock)
        assert speculation_of(operator)["lastAnalysis"]["verdict"] == "Inconclusive"
    assert speculation_of(operator)["degradedAnalyses"] == 1 and not status_of(operator).get("fallback")
    source.outage = False
    await analysed(operator, clock)
    assert await eventually(lambda: condition(operator, "SpeculationDegraded").get("status") == "True")
    assert "acceptanceRatio: 0.60 < 0.8 (acceptance length 2.10, baseline 3.50)" in condition(operator, "SpeculationDegraded")["message"]
    assert await eventually(lambda: degraded_gauge() == 1)  # set after the status is written
    assert any("2 degraded analyses in a row" in m for m in await eventually(lambda: events(operator, "SpeculationDegraded")))
    assert await eventually(lambda: events(operator, "FallbackStarted"))

    fallback = await eventually(lambda: canary_field(operator, "revision"))
    config = operator.objects["v1/configmaps", "team-a", f"qwen3-8b-{fallback}"]["data"]
    assert "method: none" in next(iter(config.values()))
    assert status_of(operator)["fallback"]["fromRevision"] == drafter
    source.by_revision[fallback] = {**GOOD, "acceptance_length": None, "tokens_per_second": 200.0, "p99_inter_token_latency_ms": 25.0}
    await set_ready(operator, f"qwen3-8b-{fallback}", 1)
    assert await eventually(lambda: [deployment(operator, r)["spec"]["replicas"] for r in (drafter, fallback)] == [1, 1])
    await set_ready(operator, f"qwen3-8b-{drafter}", 1)
    for passed in (1, 2):  # the fallback's canary: 50% for 120 s, an analysis each 60 s
        clock.advance(60)
        assert await eventually(lambda: canary_field(operator, "passedChecks") == passed or
                                (status_of(operator).get("lastRollout") or {}).get("outcome") == "Promoted")
    assert await eventually(lambda: (status_of(operator).get("lastRollout") or {}).get("outcome") == "Promoted")
    await set_ready(operator, f"qwen3-8b-{fallback}", 2)
    assert await eventually(lambda: live(operator, DEPLOYMENTS) == [f"qwen3-8b-{fallback}"])
    assert await eventually(lambda: status_of(operator).get("phase") == "Serving")
    assert status_of(operator)["stable"]["revision"] == fallback
    clock.advance(30)  # plain decoding has no speculation to judge: the condition clears, and the gauge with it
    assert await eventually(lambda: condition(operator, "SpeculationDegraded").get("reason") == "NotSpeculating")
    assert condition(operator, "SpeculationDegraded")["status"] == "False"
    assert await eventually(lambda: degraded_gauge() == 0)


async def test_a_severe_fall_of_acceptance_degrades_at_its_first_analysis(operator, serving, profile, source, clock):
    """Acceptance at 0.4 of the baseline is below severeAcceptanceRatio (0.5): SpeculationDegraded and the fallback
    without waiting for sustainedAnalyses, the Event saying why."""
    drafter = await serve_drafter_with_a_baseline(operator, serving, profile, source, clock)
    source.by_revision[drafter] = {**DEGRADED, "acceptance_length": 1.4}
    await analysed(operator, clock)
    assert await eventually(lambda: condition(operator, "SpeculationDegraded").get("status") == "True")
    assert speculation_of(operator)["degradedAnalyses"] == 1 and speculation_of(operator)["severe"] is True
    assert any(m.startswith("acceptance below 0.5 of its baseline, revision") and "acceptanceRatio: 0.40 < 0.8" in m
               for m in await eventually(lambda: events(operator, "SpeculationDegraded")))
    assert await eventually(lambda: events(operator, "FallbackStarted"))


async def test_a_fallback_that_loses_its_canary_is_rolled_back_and_retried_twice_as_late(operator, serving, profile, source, clock):
    """The fallback is a candidate like any other: worse than the degraded drafter, it is rolled back and the
    drafter keeps serving; while the drafter still calls for it, it is retried, sustainedAnalyses x interval x 2
    (120 s) after the loss."""
    drafter = await serve_drafter_with_a_baseline(operator, serving, profile, source, clock)
    source.by_revision[drafter] = DEGRADED
    await analysed(operator, clock)
    await analysed(operator, clock)
    fallback = await eventually(lambda: canary_field(operator, "revision"))
    source.by_revision[fallback] = {**GOOD, "acceptance_length": None, "error_rate": 0.05}  # fails its errorRate gate
    await set_ready(operator, f"qwen3-8b-{fallback}", 1)
    for failed in (1, 2):  # failureLimit 2
        clock.advance(60)
        assert await eventually(lambda: canary_field(operator, "failedChecks") == failed or
                                (status_of(operator).get("lastRollout") or {}).get("outcome") == "Aborted")
    lost = await eventually(lambda: status_of(operator).get("lastRollout"))
    assert (lost["outcome"], lost["reason"]) == ("Aborted", "AnalysisFailed")
    assert status_of(operator)["stable"]["revision"] == drafter
    assert await eventually(lambda: deployment(operator, fallback)["spec"]["replicas"] == 0)
    await set_ready(operator, f"qwen3-8b-{fallback}", 0)

    def since_the_loss(at: str) -> float:
        return (datetime.datetime.fromisoformat(at) - datetime.datetime.fromisoformat(lost["at"])).total_seconds()

    # A reconcile decides a retry on the last analysis before it analyses again: once an analysis has followed,
    # the one before it has been decided on. No analysis less than 120 s after the loss may retry.
    await analysed(operator, clock)
    while since_the_loss(speculation_of(operator)["lastAnalysis"]["at"]) < 120:
        assert status_of(operator)["fallback"]["attempts"] == 1 and status_of(operator)["lastRollout"] == lost
        await analysed(operator, clock)
    assert await eventually(lambda: status_of(operator)["fallback"]["attempts"] == 2)
    assert 120 <= since_the_loss(status_of(operator)["fallback"]["at"]) < 150
    assert "rolling the fallback out again (attempt 2)" in (await eventually(lambda: events(operator, "FallbackRetried")))[0]
    assert await eventually(lambda: canary_field(operator, "revision") == fallback and canary_field(operator, "step") == 0)
    assert await eventually(lambda: deployment(operator, fallback)["spec"]["replicas"] == 1)
