"""Prometheus metrics for the server, named as vLLM names them where vLLM has the metric.

Dashboards and alerts written for vLLM (`vllm:time_to_first_token_seconds`,
`vllm:inter_token_latency_seconds`, `vllm:e2e_request_latency_seconds`, `vllm:num_requests_running`,
`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, `vllm:prefix_cache_queries` and
`vllm:prefix_cache_hits` (in tokens), token and request counters, `vllm:lora_requests_info`) work
against neffkit unchanged; every series carries `model_name`. One registry per server, not the
global one. `neffkit:lora_requests_total{lora_name}` counts each adapter's requests.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LORA_INFO_SERIES = 64  # vllm:lora_requests_info's label sets kept (the most recently seen)

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


class Exposition(Protocol):
    """What /metrics renders: one engine's metrics, or data-parallel replicas' joined."""

    def render(self) -> bytes: ...


class Metrics:
    """One engine's series; with `engine` (data-parallel replicas) every series also carries
    `engine="i"`, as vLLM's do."""

    def __init__(self, model_name: str, engine: str | None = None) -> None:
        self.registry = CollectorRegistry()
        self._label = {"model_name": model_name} | ({"engine": engine} if engine else {})
        self._names = list(self._label)
        self._add_latencies()
        self._add_engine_gauges()
        self._add_token_counters()
        self._add_spec_decode()
        self._seen: dict[str, int] = {}  # the last running total of each counter series
        self._add_lora()
        self._success = Counter(
            "vllm:request_success",
            "Finished requests by reason.",
            [*self._names, "finished_reason"],
            registry=self.registry,
        )

    def _add_latencies(self) -> None:
        """Per-request latency histograms, observed by the engine client as tokens arrive."""

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(
                name, doc, self._names, registry=self.registry, buckets=_LATENCY_BUCKETS
            ).labels(**self._label)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.")
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between streamed tokens.")
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Request arrival to last token.")

    def _add_engine_gauges(self) -> None:
        """The scheduler's state after each engine step (observe_stats)."""
        self.running = self._gauge("vllm:num_requests_running", "Sequences in the decode batch.")
        self.waiting = self._gauge(
            "vllm:num_requests_waiting", "Requests waiting for KV blocks or prefill."
        )
        self.kv_usage = self._gauge(
            "vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1)."
        )

    def _add_token_counters(self) -> None:
        """Tokens admitted and generated, and the prefix cache's lookups, in tokens."""
        self.prompt_tokens = self._counter("vllm:prompt_tokens", "Prompt tokens admitted.")
        self.generation_tokens = self._counter("vllm:generation_tokens", "Tokens generated.")
        self.cache_queries = self._counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in prompt tokens looked up."
        )
        self.cache_hits = self._counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in prompt tokens found cached."
        )
        self.preemptions = self._counter(
            "vllm:num_preemptions", "Requests preempted (blocks taken back, to recompute)."
        )

    def _add_spec_decode(self) -> None:
        """Speculative decoding: drafts proposed and accepted, in total and by draft position."""
        spec = [
            ("num_drafts", "Rows that proposed draft tokens, per verify step."),
            ("num_draft_tokens", "Draft tokens proposed."),
            ("num_accepted_tokens", "Draft tokens accepted."),
        ]
        self.spec = [self._counter(f"vllm:spec_decode_{name}", doc) for name, doc in spec]
        self.spec_per_position = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position.",
            [*self._names, "position"],
            registry=self.registry,
        )

    def _add_lora(self) -> None:
        """Adapters: vLLM's info gauge (its labels say which adapters run and wait; its value is
        when that was seen) and a request counter per adapter."""
        self.lora_info = Gauge(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            [*self._names, "max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=self.registry,
        )
        self._lora_series: OrderedDict[tuple[str, ...], None] = OrderedDict()  # last set last
        self.lora_requests = Counter(
            "neffkit:lora_requests",
            "Requests for each LoRA adapter.",
            [*self._names, "lora_name"],
            registry=self.registry,
        )

    def lora_request(self, name: str) -> None:
        self.lora_requests.labels(lora_name=name, **self._label).inc()

    def _observe_lora(self, running: list[str], waiting: list[str], max_loras: int) -> None:
        """The series of these adapters set to now: as vLLM, each set of adapters seen keeps its
        series at the time it was last seen (the newest is the state now); unlike vLLM, only the
        LORA_INFO_SERIES last seen are kept, so the label sets cannot grow without end."""
        labels = (*self._label.values(), str(max_loras), ",".join(waiting), ",".join(running))
        self._lora_series[labels] = None
        self._lora_series.move_to_end(labels)
        while len(self._lora_series) > LORA_INFO_SERIES:
            self.lora_info.remove(*self._lora_series.popitem(last=False)[0])
        self.lora_info.labels(*labels).set_to_current_time()

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, self._names, registry=self.registry).labels(**self._label)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, self._names, registry=self.registry).labels(**self._label)

    def observe_stats(
        self,
        running: int,
        waiting: int,
        kv_usage: float,
        queries: int = 0,
        hits: int = 0,
        preemptions: int = 0,
        spec: tuple = (0, 0, 0, ()),
        lora: tuple[list[str], list[str], int] | None = None,
    ) -> None:
        """The scheduler's state after an engine step (sent by the engine core); the prefix
        cache's queries and hits, and the preemptions, come as running totals; `lora`
        (bundles with adapter slots): the adapters running and waiting, and max_loras."""
        if lora is not None:
            self._observe_lora(*lora)
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)
        *spec_totals, positions = spec
        totals = [
            ("queries", self.cache_queries, queries),
            ("hits", self.cache_hits, hits),
            ("preemptions", self.preemptions, preemptions),
        ]
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

    def restarted(self) -> None:
        """Its engine was started again: the running totals it sends begin at zero."""
        self._seen.clear()
