"""Prometheus metrics for the server, named as vLLM names them where vLLM has the metric.

Dashboards and alerts written for vLLM (`vllm:time_to_first_token_seconds`,
`vllm:inter_token_latency_seconds`, `vllm:e2e_request_latency_seconds`, `vllm:num_requests_running`,
`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, `vllm:prefix_cache_queries` and
`vllm:prefix_cache_hits` (in tokens), token and request counters) work against
neffkit unchanged; every series carries `model_name`. One registry per server, not the global one.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, label = self.registry, {"model_name": model_name}

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(
                name, doc, ["model_name"], registry=r, buckets=_LATENCY_BUCKETS
            ).labels(**label)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.")
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between streamed tokens.")
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Request arrival to last token.")
        self.running = Gauge(
            "vllm:num_requests_running",
            "Sequences in the decode batch.",
            ["model_name"],
            registry=r,
        ).labels(**label)
        self.waiting = Gauge(
            "vllm:num_requests_waiting",
            "Requests waiting for KV blocks or prefill.",
            ["model_name"],
            registry=r,
        ).labels(**label)
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "Fraction of KV-cache blocks in use (0-1).",
            ["model_name"],
            registry=r,
        ).labels(**label)
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens admitted.", ["model_name"], registry=r
        ).labels(**label)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Tokens generated.", ["model_name"], registry=r
        ).labels(**label)
        self.cache_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in prompt tokens looked up.",
            ["model_name"],
            registry=r,
        ).labels(**label)
        self.cache_hits = Counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in prompt tokens found cached.",
            ["model_name"],
            registry=r,
        ).labels(**label)
        spec = [
            ("num_drafts", "Rows that proposed draft tokens, per verify step."),
            ("num_draft_tokens", "Draft tokens proposed."),
            ("num_accepted_tokens", "Draft tokens accepted."),
        ]
        self.spec = [
            Counter(f"vllm:spec_decode_{name}", doc, ["model_name"], registry=r).labels(**label)
            for name, doc in spec
        ]
        self.spec_per_position = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position.",
            ["model_name", "position"],
            registry=r,
        )
        self._seen: dict[str, int] = {}  # the last running total of each counter series
        self._success = Counter(
            "vllm:request_success",
            "Finished requests by reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self._label = label

    def observe_stats(
        self,
        running: int,
        waiting: int,
        kv_usage: float,
        queries: int = 0,
        hits: int = 0,
        spec: tuple = (0, 0, 0, ()),
    ) -> None:
        """The scheduler's state after an engine step (sent by the engine core); the prefix
        cache's queries and hits come as running totals."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)
        *spec_totals, positions = spec
        totals = [("queries", self.cache_queries, queries), ("hits", self.cache_hits, hits)]
        pairs = enumerate(zip(self.spec, spec_totals, strict=True))
        totals += [(f"spec{i}", counter, total) for i, (counter, total) in pairs]
        totals += [
            (f"pos{i}", self.spec_per_position.labels(position=str(i), **self._label), total)
            for i, total in enumerate(positions)
        ]
        for key, counter, total in totals:  # running totals in, increments out
            counter.inc(total - self._seen.get(key, 0))
            self._seen[key] = total

    def finished(self, reason: str, e2e_seconds: float) -> None:
        self._success.labels(finished_reason=reason, **self._label).inc()
        if reason != "abort":
            self.e2e.observe(e2e_seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
