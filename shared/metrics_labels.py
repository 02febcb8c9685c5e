"""Labels every series of an actor carries, such as vLLM's ``model_name``.

``prometheus_client`` has no constant labels, so an actor's metrics live in a
registry of their own and the registry it serves wraps it: each scrape copies
the families with the constant labels added to every sample (and a family
keeps its name, type and help). Nothing changes on the paths that record.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector


class _WithLabels(Collector):
    """``inner``'s families, each sample with ``labels`` added."""

    def __init__(self, inner: CollectorRegistry, labels: Mapping[str, str]) -> None:
        self._inner = inner
        self._labels = dict(labels)

    def collect(self) -> Iterator[Metric]:
        for family in self._inner.collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            labelled.samples = [
                sample._replace(labels={**sample.labels, **self._labels})
                for sample in family.samples
            ]
            yield labelled


def labelled_registry(inner: CollectorRegistry, labels: Mapping[str, str]) -> CollectorRegistry:
    """A registry serving ``inner`` with ``labels`` on every sample."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_WithLabels(inner, labels))
    return registry
