"""/metrics over data-parallel replicas: each replica's registry (its series labelled
`engine="i"`, metrics.py) joined family by family, and the front's own series: requests routed
to each replica, its restarts, and the replicas serving."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

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


@dataclass(frozen=True)
class _Collected:
    """Families as prometheus_client's exposition reads a registry."""

    families: list[Metric]

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def render_joined(families: Iterable[Metric]) -> bytes:
    """One exposition of families from several sources: each name's samples under one family
    (new ones: the sources' are left as they are)."""
    joined: dict[str, Metric] = {}
    for family in families:
        into = joined.get(family.name)
        if into is None:
            into = joined[family.name] = Metric(
                family.name, family.documentation, family.type, family.unit
            )
        into.samples += family.samples
    return generate_latest(_Collected(list(joined.values())))


class JoinedMetrics:
    """Renders several registries as one exposition (`registries` is asked each time: a
    restarted replica keeps its own)."""

    def __init__(self, registries: Callable[[], list[CollectorRegistry]]) -> None:
        self.registries = registries

    def render(self) -> bytes:
        return render_joined(f for registry in self.registries() for f in registry.collect())
