"""The engine's /metrics text before any request: every series a reader may chart exists from the start."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvmesh.engine.metrics import (
    REQUEST_LATENCY_BUCKETS,
    STEP_LATENCY_BUCKETS,
    TOKEN_BUCKETS,
    EngineMetrics,
    EngineState,
)
from kvmesh.engine.protocol import MODEL_LABEL, Metric, VllmMetric


def fresh_text(model: str = "m") -> str:
    return EngineMetrics(model, EngineState).render().decode()


def test_a_fresh_engine_exports_the_model_histograms_buckets_at_0() -> None:
    """TTFT, ITL, end-to-end latency and output tokens per request have their buckets, count and sum at 0 before
    the first request ends, so that a panel or alert over them has a series from the start."""
    text = fresh_text()
    histograms = {VllmMetric.TTFT: REQUEST_LATENCY_BUCKETS, VllmMetric.ITL: STEP_LATENCY_BUCKETS,
                  VllmMetric.E2E: REQUEST_LATENCY_BUCKETS, VllmMetric.REQUEST_GENERATION_TOKENS: TOKEN_BUCKETS}
    samples = {(s.name, s.labels.get("le")): s for f in text_string_to_metric_families(text) for s in f.samples}
    for name, buckets in histograms.items():
        assert f'{name}_bucket{{le="+Inf",{MODEL_LABEL}="m"}} 0.0' in text, name
        for le in (*buckets, float("inf")):
            sample = samples[(f"{name}_bucket", str(float(le)) if le != float("inf") else "+Inf")]
            assert sample.value == 0 and sample.labels[MODEL_LABEL] == "m", (name, le)
        assert samples[(f"{name}_count", None)].value == 0 and samples[(f"{name}_sum", None)].value == 0, name


def test_every_vllm_series_but_the_info_ones_carries_the_model_label() -> None:
    """docs/metrics.md: `model_name` on every vllm: series except vllm:cache_config_info and vllm:lora_requests_info."""
    info = {VllmMetric.CACHE_CONFIG, VllmMetric.LORA_REQUESTS_INFO}
    for family in text_string_to_metric_families(fresh_text("tiny")):
        if not family.name.startswith("vllm:"):
            continue
        for sample in family.samples:
            if family.name in info:
                assert MODEL_LABEL not in sample.labels, sample
            else:
                assert sample.labels.get(MODEL_LABEL) == "tiny", sample


def test_the_forecast_s_peak_within_the_horizon_reaches_the_operator() -> None:
    """The engine exports the peak of its own requests' usage within the horizon beside the usage at the horizon;
    the operator's reading of a pod takes it as the pod's peak (a floor of the window's demand), so requests that
    grow and end inside the horizon are not invisible to the sizing."""
    from kvmesh.engine.forecast import Forecast
    from kvmesh.operator.forecast import parse_pod

    forecast = Forecast(10.0, {"p50": 0.3, "p90": 0.4, "p99": 0.5}, 0.0, float("inf"),
                        {"p50": 0.6, "p90": 0.8, "p99": 0.9})
    text = EngineMetrics("m", lambda: EngineState(forecast=forecast)).render().decode()
    assert 'kvmesh_kv_forecast_peak_usage_ratio{level="p90"} 0.8' in text
    pod = parse_pod("p0", "both", text).observation
    assert pod.peak == {"p50": 0.6, "p90": 0.8, "p99": 0.9} and pod.forecast["p90"] == 0.4


def bucket_counts(text: str, name: str) -> dict[float, float]:
    """A histogram's cumulative bucket counts by upper bound, summed over its other labels."""
    counts: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == f"{name}_bucket":
                le = float(s.labels["le"])
                counts[le] = counts.get(le, 0.0) + s.value
    return counts


def test_request_latencies_have_buckets_up_to_an_hour() -> None:
    """A 200 s generation or a 50-minute wait in the queue lands in a bucket of its own, not in +Inf over a last
    bound of 80 s, where every quantile above it read 80 (the review's 120-300 s requests read p50 = 80)."""
    metrics = EngineMetrics("m", EngineState)
    metrics.e2e.labels("m").observe(200.0)
    metrics.ttft.labels("m").observe(3000.0)
    for histogram in (metrics.queue_time, metrics.prefill_time, metrics.decode_time):
        histogram.observe(3000.0)
    text = metrics.render().decode()
    e2e = bucket_counts(text, VllmMetric.E2E)
    assert e2e[180.0] == 0 and e2e[300.0] == 1
    for name in (VllmMetric.TTFT, Metric.QUEUE_TIME, Metric.PREFILL_TIME, Metric.DECODE_TIME):
        counts = bucket_counts(text, name)
        assert max(le for le in counts if le != float("inf")) == 3600.0, name
        assert counts[2700.0] == 0 and counts[3600.0] == 1, name


def test_step_latencies_have_millisecond_buckets() -> None:
    """A CPU decode step of 1-5 ms and GPU steps of 10-16 ms spread over buckets of their own instead of sharing
    (0, 5 ms] and (10 ms, 25 ms]."""
    metrics = EngineMetrics("m", EngineState)
    for seconds in (0.0008, 0.002, 0.004, 0.011, 0.014, 0.016, 0.019):
        metrics.itl.labels("m").observe(seconds)
        metrics.tpot.observe(seconds)
        metrics.transfer_seconds.labels("handoff").observe(seconds)
    text = metrics.render().decode()
    for name in (VllmMetric.ITL, Metric.TPOT, Metric.KV_TRANSFER_SECONDS):
        counts = bucket_counts(text, name)
        assert [counts[le] for le in (0.001, 0.0025, 0.005, 0.01, 0.0125, 0.015, 0.0175, 0.02)] == [
            1, 2, 3, 3, 4, 5, 6, 7], name


def test_no_counter_or_histogram_exports_a_created_series() -> None:
    """docs/metrics.md lists no `_created` series and nothing reads them: the engine, the router and the operator
    export none (engine/protocol.py turns them off for every component)."""
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    import kvmesh.operator.metrics
    import kvmesh.router.app

    assert kvmesh.operator.metrics and kvmesh.router.app  # as their processes load them

    registry = CollectorRegistry()
    Counter("kvmesh_test_things", "A counter as any component registers one.", registry=registry).inc()
    assert "_created" not in generate_latest(registry).decode()
    metrics = EngineMetrics("m", EngineState)
    metrics.e2e.labels("m").observe(1.0)
    metrics.requests.labels("stop").inc()
    assert "_created" not in metrics.render().decode()
