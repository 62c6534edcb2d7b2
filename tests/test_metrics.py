"""The engine's /metrics text before any request: every series a reader may chart exists from the start."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvmesh.engine.metrics import LATENCY_BUCKETS, TOKEN_BUCKETS, EngineMetrics, EngineState
from kvmesh.engine.protocol import MODEL_LABEL, VllmMetric


def fresh_text(model: str = "m") -> str:
    return EngineMetrics(model, EngineState).render().decode()


def test_a_fresh_engine_exports_the_model_histograms_buckets_at_0() -> None:
    """TTFT, ITL, end-to-end latency and output tokens per request have their buckets, count and sum at 0 before
    the first request ends, so that a panel or alert over them has a series from the start."""
    text = fresh_text()
    histograms = {VllmMetric.TTFT: LATENCY_BUCKETS, VllmMetric.ITL: LATENCY_BUCKETS, VllmMetric.E2E: LATENCY_BUCKETS,
                  VllmMetric.REQUEST_GENERATION_TOKENS: TOKEN_BUCKETS}
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
