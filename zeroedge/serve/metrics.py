"""The server's Prometheus metrics (prometheus_client, a registry of its own), served on /metrics."""
from __future__ import annotations


class ServeMetrics:
    def __init__(self, engine_load, kv_stats):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        p = "zeroedge_serve_"
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Submit to first token", registry=r,
                              buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
        self.step_s = Histogram(p + "step_seconds", "One engine step (a batched forward)", registry=r,
                                buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5))
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter(p + "prompt_tokens_cached", "Prompt tokens of finished requests taken from "
                                     "the prefix cache", registry=r)
        self.completion_tokens = Counter(p + "completion_tokens", "Tokens generated", registry=r)
        self.requests = Counter(p + "requests", "Finished requests by finish reason", ["reason"], registry=r)
        self.rejected = Counter(p + "rejected_requests", "Requests refused before they ran, by HTTP status",
                                ["status"], registry=r)
        self.drafted = Counter(p + "speculative_draft_tokens", "Draft tokens checked (finished requests)", registry=r)
        self.accepted = Counter(p + "speculative_accepted_tokens", "Draft tokens the model agreed with", registry=r)
        self.verify_steps = Counter(p + "speculative_verify_steps", "Model steps that checked a draft", registry=r)
        self.thermal_requests = Counter(p + "thermal_kv_requests", "Requests whose decode steps read thermal KV's "
                                        "choice of their prompt (--kv-budget)", registry=r)
        self.tokens_per_s = Gauge(p + "decode_tokens_per_second", "Tokens a second over the last step", registry=r)
        self.batch = Gauge(p + "batch_size", "Sequences in the last step", registry=r)
        queue = Gauge(p + "queue_depth", "Requests waiting for admission", registry=r)
        queue.set_function(lambda: engine_load()["waiting"])
        running = Gauge(p + "running_requests", "Requests in the running batch", registry=r)
        running.set_function(lambda: engine_load()["running"])
        pages = Gauge(p + "kv_pages", "KV pages: in use (device) and free", ["where"], registry=r)
        pages.labels("device").set_function(lambda: kv_stats()["pages_used"])
        pages.labels("free").set_function(lambda: kv_stats()["pages_total"] - kv_stats()["pages_used"])

    def step(self, seconds: float, decoded: int, batch: int):
        self.step_s.observe(seconds)
        self.batch.set(batch)
        if seconds > 0:
            self.tokens_per_s.set(decoded / seconds)

    def first_token(self, seconds: float):
        self.ttft.observe(seconds)

    def finished(self, reason: str, usage: dict, spec=None):
        """spec: the request's zeroedge.speculative.SpecStats (None: it did not speculate)."""
        self.requests.labels(reason).inc()
        if spec is not None:
            self.drafted.inc(spec.drafted)
            self.accepted.inc(spec.accepted)
            self.verify_steps.inc(spec.verify_steps)
        self.prompt_tokens.inc(usage["prompt_tokens"])
        self.cached_tokens.inc(usage["prompt_tokens_details"]["cached_tokens"])
        self.completion_tokens.inc(usage["completion_tokens"])

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
