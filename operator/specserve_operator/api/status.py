"""The SpeculativeServing and ServingProfile status: what the operator writes, and resumes from."""

from typing import Literal

from pydantic import Field
from specserve_runtime.config import BatchSizeRange

from .spec import Model, Speculator


class Condition(Model):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    last_transition_time: str | None = None


class RevisionStatus(Model):
    revision: str
    speculator: Speculator | None = None
    replicas: int = 0
    ready_replicas: int = 0


class AnalysisResult(Model):
    """One analysis interval of a canary: the candidate's numbers, the comparison, the verdict."""

    at: str
    step: int = 0
    weight: int = 0
    acceptance_length: float | None = None
    p99_inter_token_latency_ms: float | None = None
    stable_p99_inter_token_latency_ms: float | None = None
    tokens_per_dollar_gain: float | None = None
    error_rate: float | None = None
    in_flight_per_replica: float | None = None
    stable_in_flight_per_replica: float | None = None
    verdict: Literal["Pass", "Fail", "Inconclusive"]
    reasons: list[str] = []


class CanaryStatus(RevisionStatus):
    """The rollout state machine's whole state: an operator restart resumes from it."""

    step: int = 0
    weight: int = 0
    step_started_at: str | None = None
    state: Literal["Progressing", "AwaitingPromotion"] = "Progressing"
    passed_checks: int = Field(0, description="passing analyses in this step since its last failed one (inconclusive ones neither count nor interrupt)")
    failed_checks: int = Field(0, description="failed analyses since the last passing one (inconclusive ones neither count nor interrupt)")
    inconclusive_checks: int = Field(0, description="consecutive inconclusive analyses")
    last_analysis: AnalysisResult | None = None
    history: list[AnalysisResult] = Field([], description="the last 20 analyses, oldest first")


class RolloutRecord(Model):
    """How the last rollout of a candidate revision ended. An aborted candidate is not retried until
    its spec changes or the annotation specserve.io/retry is set."""

    candidate_revision: str
    outcome: Literal["Promoted", "Aborted"]
    reason: Literal["AnalysisFailed", "Aborted"] | None = Field(
        None, description="why it was aborted: AnalysisFailed (failureLimit failed analyses in a row) or Aborted (by annotation)"
    )
    at: str
    message: str = ""


class MetricsStatus(Model):
    tokens_per_second: float | None = None
    goodput_tokens_per_second: float | None = Field(None, description="of those, the tokens served within the SLO "
                                                    "(measure.Window.within_slo)")
    p99_inter_token_latency_ms: float | None = None
    p99_time_to_first_token_ms: float | None = None
    acceptance_length: float | None = None
    hourly_cost_usd: float | None = Field(None, alias="hourlyCostUSD")
    tokens_per_dollar: float | None = None


class Recommendation(Model):
    at: str
    replicas: int
    revisions: list[str] = Field(
        [], description="the revisions whose capacity models sized it; only those sized for the same revisions stabilise a decision")
    backlog: bool = Field(
        False, description="sized for a backlog too; once a window measures none, it no longer stabilises a decision")


class CapacityObservation(Model):
    """One measured window of one revision: the load, the p99s and the mean time per token the capacity model is fitted to."""

    revision: str
    at: str
    in_flight_per_replica: float
    p99_inter_token_latency_ms: float
    p99_time_to_first_token_ms: float | None = None
    ms_per_token: float | None = Field(
        None, description="mean time a request spends in the system per generated token (Little's law on the window)")
    acceptance_length: float | None = Field(
        None, description="the window's mean acceptance length (None: no drafts): its time per token is rescaled "
                          "to the revision's latest acceptance when the capacity model is fitted")


class DemandPoint(Model):
    at: str
    requests_per_second: float


class AutoscalingStatus(Model):
    """The autoscaler's whole state: recommendations within the stabilisation windows and the
    capacity model's observations, so a restarted operator decides as the old one would have."""

    desired_replicas: int | None = None
    last_scale_time: str | None = None
    last_evaluation_time: str | None = None
    reason: str = ""
    demand_requests_per_second: float | None = Field(
        None, description="the requests per second the last decision sized for: the measured rate, or its rising trend's forecast"
    )
    demand_measured_requests_per_second: float | None = Field(None, description="requests finished per second, all revisions, at the last decision")
    demand_tokens_per_request: float | None = Field(None, description="generated tokens per finished request, at the last decision")
    backlog_requests: float | None = Field(None, description="requests queued beyond the batch at the last decision, "
                                                              "sized to drain within the SLO's time to first token")
    predicted_p99_inter_token_latency_ms: float | None = None
    predicted_p99_time_to_first_token_ms: float | None = None
    measured_by: Literal["Prometheus", "Pods", "None"] | None = Field(
        None, description="what measured the last decision: Prometheus, the pods' /metrics (no Prometheus "
        "configured, or it could not be asked), or nothing (no data: the count held)")
    recommendations: list[Recommendation] = []
    observations: list[CapacityObservation] = []
    demand_history: list[DemandPoint] = Field([], description="measured demand over the trend window, oldest first")


class SpeculationAnalysis(Model):
    """One interval of the live revision's continuous analysis (health.py)."""

    at: str
    verdict: Literal["Healthy", "Degraded", "Inconclusive"]
    acceptance_length: float | None = None
    acceptance_ratio: float | None = Field(None, description="acceptance length / the baseline")
    speedup: float | None = Field(None, description="plain decoding's predicted time per token at the load measured / the measured")
    in_flight_per_replica: float | None = None
    tokens_per_second_per_replica: float | None = None
    goodput_per_replica: float | None = Field(None, description="of those, the tokens per second served within the SLO")
    tokens_per_dollar: float | None = None
    reasons: list[str] = []


class SpeculationStatus(Model):
    """The live revision's continuous analysis: its baseline and its last analysis, so a restart resumes."""

    revision: str
    baseline_acceptance_length: float | None = Field(None, description="the mean over its first analyses with data")
    baseline_analyses: int = Field(0, description="analyses in the baseline so far")
    degraded_analyses: int = Field(0, description="degraded analyses in a row (inconclusive ones neither count nor interrupt)")
    severe: bool = Field(False, description="one of the degraded analyses in a row measured acceptance below "
                                           "severeAcceptanceRatio of the baseline: degraded without waiting for more")
    last_evaluation_time: str | None = None
    last_analysis: SpeculationAnalysis | None = None


class OperatorChange(Model):
    """A candidate the operator rolls out itself (a fallback, a draft-length schedule): it holds while the spec keeps
    this generation; any change of the spec ends it."""

    generation: int | None = Field(None, description="metadata.generation of the spec it was started for")
    from_revision: str = Field(description="the live revision it replaces")
    at: str


class FallbackStatus(OperatorChange):
    attempts: int = Field(1, ge=1, description="its canaries so far: one that lost is retried while the degraded "
                                              "revision measures slower than plain decoding, each time twice as late")


class AppliedSchedule(OperatorChange):
    schedule: list[BatchSizeRange] = Field(description="the schedule rolled out (later proposals do not change it)")


class DraftScheduleStatus(Model):
    """The draft-length schedule proposed for the live revision (schedule.py), and the one applied, if any."""

    revision: str = Field(description="the live revision it was proposed for")
    proposed: list[BatchSizeRange]
    predicted_gain: float | None = Field(None, description="the proposal's predicted tokens/s over the live "
                                                           "configuration's at the load measured")
    in_flight_per_replica: float | None = None
    reason: str = ""
    at: str
    applied: AppliedSchedule | None = Field(None, description="the schedule rolled out (schedule Apply), once per generation")


Phase = Literal["Pending", "Serving", "Progressing", "Promoting", "RollingBack", "Degraded", "Invalid"]


class SpeculativeServingStatus(Model):
    observed_generation: int | None = None
    phase: Phase = "Pending"
    conditions: list[Condition] = []
    stable: RevisionStatus | None = None
    canary: CanaryStatus | None = None
    last_rollout: RolloutRecord | None = None
    metrics: MetricsStatus | None = None
    autoscaling: AutoscalingStatus | None = None
    speculation: SpeculationStatus | None = None
    fallback: FallbackStatus | None = None
    draft_schedule: DraftScheduleStatus | None = None
    replicas: int = 0
    selector: str = ""


class ServingProfileStatus(Model):
    observed_generation: int | None = None
    conditions: list[Condition] = []
