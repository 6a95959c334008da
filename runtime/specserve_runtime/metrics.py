"""Prometheus metrics with vLLM's names, labels and histogram buckets: the only prometheus_client user
of the runtime, so dashboards, canary analysis and autoscaling read one vocabulary for both engines.

PromQL (the same against vLLM and specserve):
  acceptance length  1 + rate(vllm:spec_decode_num_accepted_tokens_total[1m])
                         / rate(vllm:spec_decode_num_drafts_total[1m])
  p99 inter-token    histogram_quantile(0.99, sum by (le) (rate(vllm:inter_token_latency_seconds_bucket[1m])))
  tokens per second  sum(rate(vllm:generation_tokens_total[1m]))
As in vLLM, an inter-token latency is observed once per engine step that emits tokens for a
request (a speculative step emits several tokens at once).
"""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, disable_created_metrics

disable_created_metrics()  # vLLM exports no *_created series

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0]
LABELS = ["model_name", "engine"]
# vLLM's finished_reason values, each a series from the start: "repetition" is vLLM's stop on a repeating output,
# which the embedded engine never gives (the operator counts only abort and error as failures: measure.py).
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")


class Metrics:
    def __init__(self, model_name: str, method: str, drafter: str | None, engine: str = "embedded"):
        self.registry = registry = CollectorRegistry()
        self.labels = {"model_name": model_name, "engine": engine}

        def counter(name, doc, extra=()):
            return Counter(name, doc, LABELS + list(extra), registry=registry)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, LABELS, buckets=buckets, registry=registry)

        self.drafts = counter("vllm:spec_decode_num_drafts", "Verify steps that carried draft tokens")
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed")
        self.accepted = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.accepted_per_pos = counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by position", ["position"]
        )
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefilled prompt tokens")
        self.success = counter("vllm:request_success", "Finished requests", ["finished_reason"])
        self.running = Gauge("vllm:num_requests_running", "Requests being generated", LABELS, registry=registry)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests queued", LABELS, registry=registry)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between token emissions", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to finish", REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Time spent waiting", REQUEST_LATENCY_BUCKETS)
        self.draft_length = Gauge("specserve_spec_decode_draft_length",
                                  "Draft tokens per sequence the adaptive rule chose for the last decode step",
                                  LABELS, registry=registry)
        # The gauge shows one step; the distribution over a window is what says whether speculation runs.
        self.draft_length_steps = counter("specserve_spec_decode_draft_length_steps",
                                          "Steps with decoding sequences, by the draft tokens per sequence the "
                                          "adaptive rule chose", ["draft_length"])
        self.rejected = Counter("specserve_requests_rejected", "Requests refused with 429 (reason queue_full)", LABELS + ["reason"],
                                registry=registry)
        Info("specserve_runtime", "What this runtime serves", registry=registry).info(
            {**self.labels, "method": method, "drafter": drafter or ""}
        )
        for gauge in (self.running, self.waiting):
            gauge.labels(**self.labels).set(0)
        # Create every series at zero now: Prometheus cannot see the first increment of a series
        # that appears with value 1, so a rate over the first window would miss it.
        for metric in (self.drafts, self.draft_tokens, self.accepted, self.generation_tokens, self.prompt_tokens,
                       self.ttft, self.itl, self.e2e, self.queue_time):
            self.of(metric)
        for reason in FINISHED_REASONS:
            self.of(self.success, finished_reason=reason)

    def of(self, metric, **extra):
        return metric.labels(**self.labels, **extra)

    def record_step(self, num_emitted: int, num_draft_tokens: int, num_accepted: int) -> None:
        self.of(self.generation_tokens).inc(num_emitted)
        if num_draft_tokens:
            self.of(self.drafts).inc()
            self.of(self.draft_tokens).inc(num_draft_tokens)
            self.of(self.accepted).inc(num_accepted)
            for position in range(num_accepted):
                self.of(self.accepted_per_pos, position=str(position)).inc()
