"""/metrics over data-parallel replicas: each replica's registry (its series labelled
`engine="i"`, metrics.py) joined family by family, and the front's own series: requests routed
to each replica, its restarts, and the replicas serving."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.metrics_core import Metric


class FrontMetrics:
    """The front's series (`neffkit:` names: vLLM has none for these)."""

    def __init__(self, model_name: str, replicas: int) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        self.routed = Counter(
            "neffkit:replica_requests",
            "Requests routed to each replica.",
            labels,
            registry=self.registry,
        )
        self.restarts = Counter(
            "neffkit:replica_restarts",
            "Times each replica was restarted after it died.",
            labels,
            registry=self.registry,
        )
        self.up = Gauge(
            "neffkit:replicas_serving",
            "Replicas serving requests now.",
            ["model_name"],
            registry=self.registry,
        ).labels(model_name=model_name)
        self.up.set(replicas)
        self.model_name = model_name

    def engine(self, counter: Counter, replica: int) -> Counter:
        return counter.labels(model_name=self.model_name, engine=str(replica))


class JoinedMetrics:
    """Renders several registries as one exposition: a family's samples from every registry
    under its one name (`registries` is asked each time: a restarted replica keeps its own)."""

    def __init__(self, registries: Callable[[], list[CollectorRegistry]]) -> None:
        self.registries = registries

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for registry in self.registries():
            for family in registry.collect():
                joined = families.get(family.name)
                if joined is None:
                    joined = families[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                joined.samples += family.samples
        yield from families.values()

    def render(self) -> bytes:
        return generate_latest(self)
