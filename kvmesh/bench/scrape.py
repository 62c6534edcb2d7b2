"""Reading a server's Prometheus /metrics, as the benchmarks that count what a pod did (`bench transfer`, `bench
batch`) need: one parser for all of them."""

from __future__ import annotations

import httpx

Sample = tuple[str, dict[str, str], float]  # a sample's name (with its _total or _bucket suffix), labels, value


def read_metrics(client: httpx.Client, url: str) -> list[Sample]:
    """Every sample of `url`/metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    reply = client.get(url + "/metrics")
    reply.raise_for_status()
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(reply.text)
            for s in family.samples]


def metric(samples: list[Sample], name: str, **labels: str) -> float:
    """The first sample named `name` whose labels include `labels`; 0 when there is none yet."""
    for sample_name, sample_labels, value in samples:
        if sample_name == name and all(sample_labels.get(k) == v for k, v in labels.items()):
            return value
    return 0.0


def metric_sum(samples: list[Sample], name: str) -> float:
    """The sum of every sample named `name`, whatever its labels: a counter kept per label set, in all."""
    return sum(value for sample_name, _, value in samples if sample_name == name)
