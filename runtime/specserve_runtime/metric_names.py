"""vLLM's metric names, as the runtime exports them (metrics.py) and the operator reads them (its measurements,
PromQL and alerts), and a parser of one /metrics page into the samples a measurement window needs. Torch-free: the
operator imports it.
"""

from prometheus_client.parser import text_string_to_metric_families

GENERATION_TOKENS = "vllm:generation_tokens_total"
DRAFTS = "vllm:spec_decode_num_drafts_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
ACCEPTED_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
REQUEST_SUCCESS = "vllm:request_success_total"
INTER_TOKEN_LATENCY = "vllm:inter_token_latency_seconds"
TIME_TO_FIRST_TOKEN = "vllm:time_to_first_token_seconds"
E2E_LATENCY = "vllm:e2e_request_latency_seconds"
QUEUE_TIME = "vllm:request_queue_time_seconds"
WAITING = "vllm:num_requests_waiting"  # a gauge: requests queued beyond the batch
IN_SYSTEM = ("vllm:num_requests_running", WAITING)  # gauges
# finished_reason values that count as errors; vLLM's others (stop, length, repetition) are requests served
ERROR_REASONS = ("abort", "error")

# The samples a window needs, each with the one label that tells its series apart; every other
# label (model_name, engine) is summed away.
KEY_LABEL = {
    GENERATION_TOKENS: "",
    DRAFTS: "",
    ACCEPTED: "",
    ACCEPTED_PER_POSITION: "position",
    REQUEST_SUCCESS: "finished_reason",
    INTER_TOKEN_LATENCY + "_bucket": "le",
    TIME_TO_FIRST_TOKEN + "_bucket": "le",
    E2E_LATENCY + "_sum": "",
    QUEUE_TIME + "_sum": "",
    **{gauge: "" for gauge in IN_SYSTEM},
}

Key = tuple[str, str]  # (sample name, value of its KEY_LABEL or "")



def parse_metrics(text: str) -> dict[Key, float]:
    """The samples a window needs from one pod's /metrics text (Prometheus text format)."""
    values: dict[Key, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            label = KEY_LABEL.get(sample.name)
            if label is None:
                continue
            key = (sample.name, sample.labels.get(label, "") if label else "")
            values[key] = values.get(key, 0.0) + sample.value
    return values
